"""The CLI's deadlines: each command's ``--timeout`` bounds the whole process, the exit drain included.

Commands that take ``--timeout`` register it with :func:`add_timeout`; :func:`bounded` runs a command as
one operation of :mod:`tierckpt.deadline` with it, else ``TIERCKPT_TIMEOUT_S``, else the command's
default (:func:`default_s`), and makes it the process's deadline, so the exit drain (which waits for
uploads the command left) ends at it too. No command that talks to a store runs unbounded by default:

* the commands that read metadata only (``ls``, ``status``, ``inspect``, ``stats``) stop after
  :data:`tierckpt.deadline.CLI_DEFAULT_S`;
* the commands that read or move every byte of a checkpoint (``verify``, ``sync``, ``wait``,
  ``prefetch``, ``gc``, ``convert``) stop after :data:`DATA_DEFAULT_S`.

A command that passes its deadline exits 7 (:class:`~tierckpt.errors.DeadlineExceededError`); the message
names the command, its URI, what it waited for and the setting that raises the limit.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

from tierckpt import deadline

METADATA_COMMANDS = frozenset({"ls", "status", "inspect", "stats"})
"""Commands that read metadata only: without a deadline of their own they stop after ``CLI_DEFAULT_S``."""

DATA_COMMANDS = frozenset({"verify", "sync", "wait", "prefetch", "gc", "convert"})
"""Commands that read or move a checkpoint's data: without a deadline of their own they stop after
:data:`DATA_DEFAULT_S` (a store that stopped answering, e.g. a tarpit, would hold them for good)."""

DATA_DEFAULT_S = 3600.0
"""The deadline of the :data:`DATA_COMMANDS` without ``--timeout`` or ``TIERCKPT_TIMEOUT_S``: an hour moves
hundreds of GB on any link a checkpoint store is used over; a larger checkpoint passes ``--timeout``."""


def default_s(command: str) -> float | None:
    """The deadline of ``command`` when neither ``--timeout`` nor ``TIERCKPT_TIMEOUT_S`` gives one."""
    if command in METADATA_COMMANDS:
        return deadline.CLI_DEFAULT_S
    if command in DATA_COMMANDS:
        return DATA_DEFAULT_S
    return None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_timeout(parser: Any, command: str) -> None:
    """Give ``parser`` (of ``command``) the ``--timeout`` option."""
    seconds = default_s(command)
    default = f"${deadline.ENV}, else " + (f"{seconds:g} s" if seconds is not None else "none")
    parser.add_argument("--timeout", type=_seconds, default=None, metavar="S",
                        help=f"give up after S seconds, waiting for uploads at exit included (exit 7); default {default}")


@contextlib.contextmanager
def bounded(args: argparse.Namespace) -> Iterator[None]:
    """Run the body as the command ``args.command`` under its deadline, which also bounds the process."""
    seconds, setting = getattr(args, "timeout", None), "--timeout"
    if seconds is None:
        seconds, setting = deadline.from_env(), deadline.ENV
    if seconds is None and (default := default_s(args.command)) is not None:
        seconds, setting = default, f"--timeout, default {default:g} s; or {deadline.ENV}"
    target = getattr(args, "uri", None) or getattr(args, "root", None) or getattr(args, "src", None) or ""
    with deadline.operation(f"tierckpt {args.command}", target, seconds, setting) as bound:
        deadline.bound_process(bound)
        yield
