"""A preemption notice (SIGTERM) turned into a checkpoint at the next step (Orbax's ``reached_preemption``).

Schedulers (Slurm, Kubernetes, cloud spot instances) send SIGTERM some seconds before they kill a job.
:class:`PreemptionWatch` records the signal instead of letting it end the process; the
:class:`~tierckpt.CheckpointManager` then asks every rank at its next ``save``/``should_save`` whether any
received it (one small all-gather, so all ranks decide alike) and saves that step, whatever ``save_every``
says. Lifecycle:

1. ``start()`` (the manager's constructor, main thread only: Python runs signal handlers there) installs
   the handler; a handler installed before it is still called on each signal.
2. ``signalled`` is set by the handler; ``reached(comm)`` agrees on it across the group, once set it stays.
3. ``stop()`` (the manager's ``close()``) puts the previous handler back.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from tierckpt.comm import Comm
from tierckpt.errors import CheckpointError


class PreemptionWatch:
    """Records SIGTERM for the manager (see the module docstring)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.signalled = False
        """Whether this process received the signal since :meth:`start`."""
        self._agreed = False
        self._previous: Any = None
        self._installed = False

    def start(self) -> None:
        """Install the handler (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError(
                "CheckpointManager(save_on_preemption=True) must be made in the main thread: Python delivers "
                "signals only there. Make the manager in the main thread, or leave save_on_preemption off"
            )
        self._previous = signal.signal(self.signum, self._handle)
        self._installed = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True
        if callable(self._previous):
            self._previous(signum, frame)

    def reached(self, comm: Comm) -> bool:
        """Whether any rank of ``comm`` received the signal (a collective: every rank calls it at the same step)."""
        if not self._agreed:
            self._agreed = any(comm.all_gather_object(self.signalled))
        return self._agreed

    def stop(self) -> None:
        """Put back the handler that was installed before :meth:`start`."""
        if self._installed:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
