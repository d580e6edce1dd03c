"""The CLI's deadlines: each command's ``--timeout`` bounds the whole process, the exit drain included.

Commands that take ``--timeout`` register it with :func:`add_timeout`; :func:`bounded` runs a command as
one operation of :mod:`tierckpt.deadline` with it (else ``TIERCKPT_TIMEOUT_S``, else the command's
default: :data:`tierckpt.deadline.CLI_DEFAULT_S` for the commands that read metadata only) and makes it
the process's deadline, so the exit drain (which waits for uploads the command left) ends at it too.
A command that passes its deadline exits 7 (:class:`~tierckpt.errors.DeadlineExceededError`).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

from . import deadline

METADATA_COMMANDS = frozenset({"ls", "status", "inspect", "stats"})
"""Commands that read metadata only: without a deadline of their own they stop after ``CLI_DEFAULT_S``."""


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
    default = (f"${deadline.ENV}, else {deadline.CLI_DEFAULT_S:g} s" if command in METADATA_COMMANDS
               else f"${deadline.ENV}, else none")
    parser.add_argument("--timeout", type=_seconds, default=None, metavar="S",
                        help=f"give up after S seconds, waiting for uploads at exit included (exit 7); default {default}")


@contextlib.contextmanager
def bounded(args: argparse.Namespace) -> Iterator[None]:
    """Run the body as the command ``args.command`` under its deadline, which also bounds the process."""
    seconds, setting = getattr(args, "timeout", None), "--timeout"
    if seconds is None:
        seconds, setting = deadline.from_env(), deadline.ENV
    if seconds is None and args.command in METADATA_COMMANDS:
        seconds, setting = deadline.CLI_DEFAULT_S, f"--timeout (default {deadline.CLI_DEFAULT_S:g} s)"
    target = getattr(args, "uri", None) or getattr(args, "root", None) or ""
    with deadline.operation(f"tierckpt {args.command}", target, seconds, setting) as bound:
        deadline.bound_process(bound)
        yield
