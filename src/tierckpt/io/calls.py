"""The calls to stores in flight on the I/O loop, and what a long wait says on stderr.

:meth:`tierckpt.io.scheduler.IOScheduler.slotted` registers each call here for as long as it runs (its
attempts and their backoff). A call still unanswered after :data:`NOTE_AFTER_S` prints one line on stderr
naming the store, the call, its attempt and last error, and the operation's deadline (or how to set
one); then again each time its wait has doubled (5, 10, 20, 40 s ...), at most one line per store in
:data:`NOTE_AFTER_S` however many calls wait on it. Polling waits (for uploads, write-downs) say what they
wait for the same way through :class:`Waiting`. Stderr, not only :mod:`logging`: a job that has not
configured logging still learns why it stands still. When an operation's deadline passes,
:meth:`CallsInFlight.oldest` names what it was waiting for.

Touched on the I/O loop's thread only.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierckpt import deadline

NOTE_AFTER_S = 5.0
"""A call unanswered this long says so on stderr (then at doubling waits)."""


@dataclass(eq=False)
class Call:
    """One call in flight: ``what`` (e.g. ``get s3://b/run/COMMIT``) to ``service``."""

    what: str
    service: str
    attempts: int
    started: float
    attempt: int = 0
    last_error: str | None = None
    timer: asyncio.TimerHandle | None = None


class CallsInFlight:
    """See the module docstring."""

    def __init__(self) -> None:
        self._calls: dict[int, Call] = {}
        self._noted: dict[str, float] = {}
        """Service -> when a note about it was last printed (monotonic seconds)."""

    def start(self, what: str, service: str, attempts: int, *, noted: bool = True) -> Call:
        """Register a call starting now (on the loop); :meth:`end` it whatever its outcome. ``noted=False``
        (background work: an upload, whose waiters say what they wait for themselves): no notes."""
        call = Call(what, service, attempts, time.monotonic())
        self._calls[id(call)] = call
        if noted:
            call.timer = asyncio.get_running_loop().call_later(NOTE_AFTER_S, self._note, call)
        return call

    def end(self, call: Call, *, cancelled: bool = False) -> None:
        """``call`` is over; ``cancelled``: it was cancelled (by a deadline, say) while it waited."""
        if call.timer is not None:
            call.timer.cancel()
        self._calls.pop(id(call), None)
        if cancelled:
            self._cancelled = call

    _cancelled: Call | None = None
    """The call cancelled last: what an operation whose deadline cancelled it was waiting for."""

    def oldest(self) -> str | None:
        """What the longest-waiting call waits for, else what the call cancelled last waited for (``None``:
        neither)."""
        call = min(self._calls.values(), key=lambda c: c.started) if self._calls else self._cancelled
        if call is None:
            return None
        error = f"; last error: {call.last_error}" if call.last_error else ""
        return f"{call.service} to answer {call.what} (attempt {call.attempt} of {call.attempts}{error})"

    def _note(self, call: Call) -> None:
        """Print what ``call`` waits for (unless a note about its store was just printed); plan the next."""
        now = time.monotonic()
        waited = now - call.started
        last = self._noted.get(call.service)
        if last is None or now - last >= NOTE_AFTER_S:
            self._noted[call.service] = now
            error = f"; last error: {call.last_error}" if call.last_error else ""
            # The callback runs in the context of the call that planned it: the operation's deadline is there.
            say(waited, f"{call.service} to answer {call.what} (attempt {call.attempt} of {call.attempts}{error})")
        call.timer = asyncio.get_running_loop().call_later(waited, self._note, call)


class Waiting:
    """The notes of one long wait that polls (for uploads, for a write-down): :meth:`note` prints what it
    waits for once the wait is :data:`NOTE_AFTER_S` old, then each time it has doubled."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._next = NOTE_AFTER_S

    def note(self, what: Callable[[], str]) -> None:
        """Call at each poll; ``what()`` (only called when a note is due) says what the wait waits for."""
        waited = time.monotonic() - self.started
        if waited >= self._next:
            self._next = 2 * waited
            say(waited, what())


def say(waited: float, what: str) -> None:
    """One line on stderr: waiting ``waited`` seconds so far for ``what``, and the deadline (or how to set one)."""
    bound = deadline.current()
    limit = (f"the {bound.operation} deadline passes in {max(0.0, bound.remaining()):.0f} s ({bound.setting})"
             if bound is not None else f"no overall deadline: {deadline.ENV} or a command's --timeout sets one")
    sys.stderr.write(f"tierckpt: waiting {waited:.0f} s so far for {what}; {limit}\n")
    sys.stderr.flush()
