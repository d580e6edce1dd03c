"""The OS priority of the memory tier's own background threads.

The threads that only the memory tier runs — peer replication's send and receive threads (which move
every replicated byte through their data streams, :mod:`.transfer`), the I/O thread of the side group's
replication device (:mod:`.sidegroup`: headers and answers), the thread that prepares the next save's
spare file — compete with training for the node's cores. They run at a
lower priority (``nice``), so the scheduler gives training the cores first and the tier's copies the
time training leaves (while it waits in a collective, or between steps); on an idle core they run at
full speed. ``TIERCKPT_BACKGROUND_NICE`` sets the niceness (default 10: about a tenth of a core's
share against a busy training thread; 0 leaves them at training's priority; at most 19).
Threads shared with other work (the I/O scheduler's loop and workers) keep their priority: a thread
cannot raise its priority again without privileges.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from tierckpt.errors import CheckpointError

log = logging.getLogger(__name__)

NICE_ENV = "TIERCKPT_BACKGROUND_NICE"
DEFAULT_NICE = 10


def background_nice() -> int:
    """The niceness of the tier's background threads, from ``TIERCKPT_BACKGROUND_NICE``."""
    raw = os.environ.get(NICE_ENV, "").strip()
    if not raw:
        return DEFAULT_NICE
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise CheckpointError(f"{NICE_ENV}={raw!r}: use a whole number from 0 (training's priority) to 19 (lowest)")
    return value


def lower_priority() -> None:
    """Lower the calling thread's priority to :func:`background_nice` (Linux: per thread). Call it
    first thing in a thread the tier owns; elsewhere, or where refused, it changes nothing."""
    if sys.platform.startswith("linux"):  # elsewhere a thread id is no process id
        _lower(threading.get_native_id())


def started_threads() -> set[int]:
    """This process's thread ids (Linux; elsewhere empty): compare before and after a call that
    starts threads of the tier's own (a gloo group's) with :func:`lower_priority_of_new`."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")} if sys.platform.startswith("linux") else set()
    except OSError:
        return set()


_GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")
"""The names gloo gives the threads of a process group (its socket loop, its work threads)."""


def lower_priority_of_new(before: set[int], wait_s: float = 0.2) -> None:
    """Lower the priority of the gloo threads started since ``before`` (:func:`started_threads`): those
    of a gloo group the tier just created for itself, which serve nothing else. A thread names itself
    once running, so one still unnamed is looked at again, for up to ``wait_s``."""
    unnamed = _comm(threading.get_native_id())
    left = started_threads() - before
    deadline = time.monotonic() + wait_s
    while left:
        for tid in sorted(left):
            name = _comm(tid)
            if name in _GLOO_THREADS:
                _lower(tid)
            if name != unnamed:
                left.discard(tid)
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def _comm(tid: int) -> str | None:
    """The name of thread ``tid`` of this process (``None``: gone)."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _lower(tid: int) -> None:
    try:
        nice = background_nice()
    except CheckpointError as exc:
        log.warning("%s; the tier's background threads keep training's priority", exc)
        return
    if nice == 0:
        return
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if current < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:
        log.debug("cannot lower the priority of thread %d: %s", tid, exc)
