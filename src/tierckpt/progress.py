"""Progress bars on stderr for long calls, driven by the bytes the call moves.

One :class:`ByteProgress` is shown at a time per process (:func:`shown`). It is fed by:

* a :class:`~tierckpt.monitor.Monitor`: the counters in :data:`MOVED_COUNTERS` (a load's ``bytes_read``)
  and a save's data file chunks as they are written; a monitor created while a bar is shown reports to
  it, so a command that saves or loads through several calls (``tierckpt convert``) gets one bar without
  passing it around;
* the node cache's durability waits (``wait``/``sync``, and a synchronous save's wait for its upload), which
  report the bytes still pending upload (:meth:`ByteProgress.remaining`).

Every bar has a total: each call announces what it will move before moving it (:meth:`ByteProgress.expect`: a
load the bytes this rank reads, once planned; a save this rank's data file; ``convert`` the tensor bytes it
reads), and a wait for uploads adds what is pending. A command made of several calls (``tierckpt convert``)
draws one bar whose total is the sum of theirs.

The terminal is redrawn at most every :data:`REFRESH_S` seconds, so a hot loop pays a lock and a clock
read per call. Whether a bar is wanted (:func:`wanted`): an explicit flag wins; otherwise
``TIERCKPT_PROGRESS=1``/``0`` forces it on/off; otherwise it is on only when stderr is a terminal.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PROGRESS_ENV = "TIERCKPT_PROGRESS"
REFRESH_S = 0.25
"""Least time between two redraws of a bar."""
MOVED_COUNTERS = frozenset({"bytes_read"})
"""Monitor counters that are bytes a call moved (a load's reads); a save's data file reports each chunk
as it is written instead (``FileStream(on_written=...)``), so its bar moves during the write."""

_CURRENT: ByteProgress | None = None


def wanted(flag: bool | None = None) -> bool:
    """Whether to show a bar: ``flag`` when given, else ``$TIERCKPT_PROGRESS`` (1/0), else stderr is a terminal."""
    if flag is not None:
        return flag
    env = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if env in ("1", "on", "true", "yes"):
        return True
    if env in ("0", "off", "false", "no"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class ByteProgress:
    """A byte counter with a throttled tqdm bar on stderr (``enabled=False``: counts only, draws nothing).

    ``done`` is exact at all times; the bar shows it within :data:`REFRESH_S` and exactly once closed."""

    def __init__(self, desc: str, total: int | None = None, *, enabled: bool = True) -> None:
        self.desc = desc
        self.total = total
        self.done = 0
        self._moved = 0  # bytes counted by add()
        self._expected = total  # bytes announced by expect() (None: nothing announced)
        self._lock = threading.Lock()
        self._next = 0.0
        self._pending: dict[str, tuple[int, int]] = {}  # store -> (bytes pending when first seen, now)
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                             file=sys.stderr, dynamic_ncols=True, mininterval=REFRESH_S)

    @property
    def shown(self) -> bool:
        """Whether a bar is drawn."""
        return self._bar is not None

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more moved."""
        with self._lock:
            self._moved += nbytes
            self._recount()

    def expect(self, nbytes: int) -> None:
        """A call will move ``nbytes`` more: they join the total (the calls of one command add up)."""
        with self._lock:
            self._expected = (self._expected or 0) + nbytes
            self._recount()

    def remaining(self, store: str, nbytes: int) -> None:
        """``store`` has ``nbytes`` left to move (an upload queue): the first report of a store adds to the
        total; every later one counts the difference as done."""
        with self._lock:
            first, _ = self._pending.get(store, (nbytes, nbytes))
            first = max(first, nbytes)  # new writes joined the queue: more to move
            self._pending[store] = (first, nbytes)
            self._recount()

    def _recount(self) -> None:
        """``done`` and ``total`` from what was added, announced and reported pending (lock held)."""
        queued = sum(f for f, _ in self._pending.values())
        self.done = self._moved + sum(f - n for f, n in self._pending.values())
        self.total = None if self._expected is None and not self._pending else (self._expected or 0) + queued
        if self._bar is not None and self._bar.total != self.total:
            self._bar.total = self.total
        self._maybe_draw()

    def _maybe_draw(self, force: bool = False) -> None:
        if self._bar is None:
            return
        now = time.monotonic()
        if force or now >= self._next:
            self._next = now + REFRESH_S
            self._bar.update(self.done - self._bar.n)

    def close(self) -> None:
        """Draw the final count and release the terminal line."""
        with self._lock:
            if self._bar is not None:
                self._maybe_draw(force=True)
                self._bar.close()
                self._bar = None

    # tqdm's name, for code that takes a tqdm-like bar
    update = add


def current() -> ByteProgress | None:
    """The bar shown now in this process (:func:`shown`), if any."""
    return _CURRENT


@contextmanager
def shown(desc: str, enabled: bool, total: int | None = None) -> Iterator[ByteProgress]:
    """Make a :class:`ByteProgress` the process's current bar for the block (drawn only if ``enabled``);
    an enclosing bar stays current (the outer call owns the terminal line) and is yielded instead."""
    global _CURRENT
    if _CURRENT is not None:
        yield _CURRENT
        return
    bar = ByteProgress(desc, total, enabled=enabled)
    _CURRENT = bar
    try:
        yield bar
    finally:
        _CURRENT = None
        bar.close()


@contextmanager
def attached(monitor: Any, desc: str, flag: bool | None, rank: int, total: int | None = None) -> Iterator[None]:
    """For one save or load called with ``progress=flag`` (``True``: a bar; ``None``: a bar when stderr is a
    terminal; ``False``: none): feed ``monitor``'s moved bytes to a bar drawn on rank 0 only. ``total``: the
    bytes the call will move when known now (else it calls ``monitor.progress.expect`` once it knows); with no
    bar of its own the call still announces it to the bar of the command it runs in (``tierckpt convert``)."""
    if flag is False:
        if total is not None and monitor.progress is not None:
            monitor.progress.expect(total)
        yield
        return
    with shown(desc, enabled=rank == 0 and wanted(flag)) as bar:
        if total is not None:
            bar.expect(total)
        previous, monitor.progress = monitor.progress, bar
        try:
            yield
        finally:
            monitor.progress = previous


def add_flags(parser: Any, what: str | None) -> None:
    """Give a CLI command ``-q/--quiet`` and ``--progress``; ``what`` (e.g. ``"convert"``) names the bar that
    :func:`for_command` shows around the whole command (``None``: the command draws its own)."""
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--progress", action="store_true",
                        help="draw the progress bar on stderr even when it is not a terminal")
    parser.set_defaults(progress_what=what)


def command_wants(args: Any) -> bool:
    """Whether a command parsed with :func:`add_flags` draws its bar: ``--quiet`` off, ``--progress`` on,
    else :func:`wanted` (``$TIERCKPT_PROGRESS``, else stderr is a terminal)."""
    if getattr(args, "quiet", False):
        return False
    return wanted(True if getattr(args, "progress", False) else None)


@contextmanager
def for_command(args: Any) -> Iterator[ByteProgress | None]:
    """The bar around a command registered with :func:`add_flags` and a name; nothing for the others."""
    what = getattr(args, "progress_what", None)
    if what is None:
        yield None
        return
    target = getattr(args, "uri", None) or getattr(args, "src", None) or ""
    with shown(f"{what} {target}".strip(), enabled=command_wants(args)) as bar:
        yield bar
