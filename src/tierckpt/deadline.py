"""Operation deadlines: how long one operation (a save, a load, a CLI command) may take in all.

A request timeout (S3's ``timeout_s``) bounds one request, but a request retried five times, an endpoint
that answers a few bytes at a time, or a wait for uploads while the remote is down are not bounded by
it. An operation that runs inside :func:`operation` has a deadline, kept in a context variable (it
follows the operation onto the I/O loop, and into the threads it starts with :func:`carried`):

* every synchronous wait on the I/O loop (:meth:`tierckpt.io.scheduler.IOScheduler.run`) ends at the
  deadline, cancelling the work it waits for, and raises :class:`~tierckpt.errors.DeadlineExceededError`
  naming the operation, its URI, the store that did not answer and the setting to raise;
* retry loops (:func:`tierckpt.backends.retry.retry_transient`) do not start a backoff that would end past it.

Background work (uploads, write-downs, sweeps) outlives the operation that started it: it has no
deadline (:func:`tierckpt.io.scheduled.set_background` drops it); the exit drain that waits for it is
bounded by the process's deadline when a CLI command set one (``--timeout`` bounds the whole process).

Settings: ``TIERCKPT_TIMEOUT_S`` (seconds) is the deadline of every ``save``, ``load``, ``verify``,
``SaveHandle.wait_durable`` and CLI command of the process that sets none of its own; a CLI command's ``--timeout`` is its own. Unset, a library
operation has no overall deadline (each request is still bounded: ``timeout_s``, plus time to move
its bytes at :data:`tierckpt.io.scheduler.MIN_BYTES_PER_S`), ``ls``, ``status``, ``inspect`` and
``stats`` stop after :data:`CLI_DEFAULT_S`, and the CLI commands that move a checkpoint's data after
:data:`tierckpt.cli.deadline.DATA_DEFAULT_S`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from tierckpt.errors import CheckpointError, DeadlineExceededError

_T = TypeVar("_T")

ENV = "TIERCKPT_TIMEOUT_S"
"""Environment variable: the deadline (seconds) of every operation that sets none of its own."""

CLI_DEFAULT_S = 120.0
"""The deadline of ``tierckpt ls``, ``status``, ``inspect`` and ``stats`` without ``--timeout`` (they read
metadata only; a store that has not answered them in two minutes will not)."""


@dataclass(frozen=True)
class Deadline:
    """One operation's deadline: ``operation`` on ``target`` may run ``seconds`` in all (until ``expires``,
    monotonic seconds); ``setting`` is what the user changes to give it more."""

    operation: str
    target: str
    seconds: float
    setting: str
    expires: float

    def remaining(self) -> float:
        return self.expires - time.monotonic()

    def exceeded(self, waiting_for: str | None = None) -> DeadlineExceededError:
        """The error raised when the deadline passed while waiting for ``waiting_for``."""
        what = f" waiting for {waiting_for}" if waiting_for else ""
        return DeadlineExceededError(
            f"{self.operation} {self.target} did not finish within {self.seconds:g} s ({self.setting}){what}; "
            f"check that the store answers (its endpoint, the network), or raise {self.setting}"
        )


_CURRENT: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("tierckpt_deadline", default=None)
_PROCESS: Deadline | None = None
"""The whole process's deadline (a CLI command's ``--timeout``): the exit drain stops waiting at it."""


def current() -> Deadline | None:
    """The deadline of the operation running in this context (``None``: none)."""
    return _CURRENT.get()


def remaining() -> float | None:
    """Seconds left to the current operation (negative once passed; ``None``: no deadline)."""
    deadline = _CURRENT.get()
    return None if deadline is None else deadline.remaining()


def from_env() -> float | None:
    """``TIERCKPT_TIMEOUT_S`` as seconds (``None`` when unset)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise CheckpointError(f"{ENV}={text!r}: give the deadline of each operation in seconds (e.g. 300), or unset it")
    return seconds


@contextlib.contextmanager
def operation(name: str, target: str, seconds: float | None = None, setting: str = ENV) -> Iterator[Deadline | None]:
    """Run the body as operation ``name`` on ``target`` with a deadline of ``seconds`` (``None``:
    ``TIERCKPT_TIMEOUT_S``, else none). An operation inside another keeps the nearer deadline."""
    if seconds is None:
        seconds, setting = from_env(), ENV
    outer = _CURRENT.get()
    if seconds is None or (outer is not None and outer.expires <= time.monotonic() + seconds):
        yield outer
        return
    if seconds <= 0:
        raise CheckpointError(f"{setting}={seconds!r}: a deadline must be a positive number of seconds")
    token = _CURRENT.set(Deadline(name, target, seconds, setting, time.monotonic() + seconds))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def bounded(name: str) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """Decorate a public operation taking its URI first (``save``, ``load``): run it as operation ``name`` on
    that URI, with the deadline ``TIERCKPT_TIMEOUT_S`` sets (or the one of an operation it runs in)."""

    def wrap(fn: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(fn)
        def run(uri: Any, *args: Any, **kwargs: Any) -> _T:
            with operation(name, str(uri)):
                return fn(uri, *args, **kwargs)

        return run

    return wrap


def drop() -> None:
    """Background work from here on in this context has no deadline (see the module docstring)."""
    _CURRENT.set(None)


def carried(fn: Callable[..., _T]) -> Callable[..., _T]:
    """``fn`` to run in another thread with this context's deadline (threads do not inherit it)."""
    deadline = _CURRENT.get()

    def run(*args: Any, **kwargs: Any) -> _T:
        token = _CURRENT.set(deadline)
        try:
            return fn(*args, **kwargs)
        finally:
            _CURRENT.reset(token)

    return run


def bound_process(deadline: Deadline | None) -> None:
    """Make ``deadline`` the whole process's (a CLI command: its exit drain ends at it too)."""
    global _PROCESS
    _PROCESS = deadline


def process_left(wait_s: float) -> float:
    """``wait_s``, or less when the process's deadline comes first (at least 0)."""
    if _PROCESS is None:
        return wait_s
    return max(0.0, min(wait_s, _PROCESS.remaining()))


os.register_at_fork(after_in_child=lambda: bound_process(None))  # a forked child is not the parent's command
