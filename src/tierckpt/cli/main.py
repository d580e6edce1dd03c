"""The ``tierckpt`` command line.

Commands::

    tierckpt demo [--root DIR] [--steps N] [--quiet]   train, checkpoint, resume on 3 ranks and 1 (see tierckpt.demo.run)
    tierckpt inspect URI [--json] [--pieces]          what a checkpoint holds
    tierckpt verify URI [--json] [--progress]         completeness and every checksum (exit 5 when corrupt)
    tierckpt stats URI [--json]                       per-rank save timings, stragglers, throughput
    tierckpt ls ROOT [--json]                         the checkpoints under a root (CheckpointManager steps...)
    tierckpt convert SRC OUT --to FMT [--from FMT]    tierckpt <-> safetensors, tierckpt <-> DCP (see docs/cli.md)
    tierckpt status|wait|prefetch URI, sync [URI], gc ROOT   the node cache (see tierckpt.cli.cache)
    tierckpt bench [--gib G]                          a quick save/load timing beside torch DCP
    tierckpt --version                                answered without importing torch

convert, verify, wait, sync and prefetch draw a progress bar on stderr when it is a terminal (``-q`` off,
``--progress`` on a pipe too; :mod:`tierckpt.progress`).

Exit codes:

== ===========================================================================
0  success
1  any other tierckpt error (storage failure, permission denied...)
2  usage error, including a URI no storage backend handles
3  no checkpoint at the URI
4  incomplete checkpoint: data without a COMMIT record (interrupted or running save)
5  corrupt checkpoint: metadata or data fails validation
6  ``demo``: the resumed losses diverged from the uninterrupted run
7  the store cannot be reached: connection refused or timed out, or the command's deadline passed
   (``--timeout``, ``TIERCKPT_TIMEOUT_S``); the message names the endpoint and what to check
== ===========================================================================

Errors print one line to stderr. This module wires the commands (argparse); the reports they print are
built in :mod:`tierckpt.reports`, the exit codes live in :mod:`tierckpt.cli.exit`. To add a command,
write ``_add_<name>(subparsers)`` that registers its parser and sets ``handler``, and list it in
:data:`COMMANDS` (or in the ``COMMANDS`` of a ``cli_*`` module that :func:`build_parser` reads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

# Only light modules here: ``tierckpt --version`` must not pay for torch. Each command imports what it uses.
from tierckpt import __version__, progress
from tierckpt.cli.deadline import add_timeout, bounded
from tierckpt.cli.exit import (
    ERROR_EXIT_CODES, EXIT_CORRUPT, EXIT_DIVERGED, EXIT_ERROR, EXIT_INCOMPLETE, EXIT_NOT_FOUND, EXIT_OK,
    EXIT_UNREACHABLE, EXIT_USAGE, exit_code,
)
from tierckpt.reports import describe, inspect, list_checkpoints, render_inspect, render_ls, render_stats, save_stats
from tierckpt.errors import CheckpointError

__all__ = [
    "COMMANDS", "ERROR_EXIT_CODES", "EXIT_CORRUPT", "EXIT_DIVERGED", "EXIT_ERROR", "EXIT_INCOMPLETE", "EXIT_NOT_FOUND",
    "EXIT_OK", "EXIT_UNREACHABLE", "EXIT_USAGE", "build_parser", "describe", "exit_code", "list_checkpoints", "main",
    "render_inspect", "render_ls", "render_stats", "save_stats",
]
# -- demo --------------------------------------------------------------------------------------------
def _add_demo(subparsers: Any) -> None:
    """Register ``demo``."""
    p = subparsers.add_parser(
        "demo", help="train with FSDP2 on 2 ranks, checkpoint, resume on 3 ranks and on 1, compare losses",
        description="Train a tiny transformer with FSDP2 on 2 local processes, save a checkpoint, resume it "
        "resharded on 3 processes and in 1, and compare the losses with the uninterrupted run.",
    )
    p.add_argument("--root", help="directory for the checkpoint (default: $TIERCKPT_DEMO_DIR or ./tierckpt-demo)")
    p.add_argument("--steps", type=_positive_int, default=4, help="steps before and after the checkpoint (default 4)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=cmd_demo)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo, print its report; exit 6 if the resumed losses diverged."""
    from tierckpt.demo.run import run_demo

    report = run_demo(root=args.root, steps=args.steps, quiet=args.quiet)
    print(report.render())
    return EXIT_OK if report.ok else EXIT_DIVERGED


# -- inspect -------------------------------------------------------------------------------------------
def _add_inspect(subparsers: Any) -> None:
    """Register ``inspect``."""
    p = subparsers.add_parser(
        "inspect", help="list the tensors and objects of a checkpoint",
        description="Show what a committed checkpoint holds: tensors, objects, who saved it, and totals. "
        "A torch DCP checkpoint directory is shown too (read in place: where each chunk's raw bytes are).",
    )
    p.add_argument("uri", help="checkpoint root (or torch DCP directory): a path, file://, memory://, s3://, or any fsspec URI")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--pieces", action="store_true", help="also list every saved piece of every tensor")
    add_timeout(p, "inspect")
    p.set_defaults(handler=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a checkpoint's contents as a table or as JSON."""
    summary = inspect(args.uri, pieces=args.pieces)
    print(json.dumps(summary, indent=1) if args.json else render_inspect(summary))
    return EXIT_OK


# -- verify --------------------------------------------------------------------------------------------
def _add_verify(subparsers: Any) -> None:
    """Register ``verify``."""
    p = subparsers.add_parser(
        "verify", help="check a checkpoint's completeness and every checksum",
        description="Check that a committed checkpoint is complete (metadata, every file with its listed size, "
        "pieces covering every tensor exactly) and read every piece and object to check its CRC-32C, streaming. "
        "Every problem is listed with its file, tensor or object, and byte offset. A remote checkpoint is read "
        "from the remote itself, past this node's cache (--node: this node's copy), except on the node that saved "
        "it while its upload is pending. Exit 0 when sound, 5 when corrupt, 4 when incomplete (also: committed in "
        "this node's cache but not on the remote), 3 when there is no checkpoint, 7 when the remote is unreachable.",
    )
    p.add_argument("uri", help="checkpoint root: a path, file://, memory://, s3://, or any fsspec URI")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--node", action="store_true",
                   help="check this node's copy (its cache and memory tier) instead of the remote's")
    progress.add_flags(p, None)  # verify draws its own bar (its total is known)
    add_timeout(p, "verify")
    p.set_defaults(handler=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify a checkpoint; exit 5 with the problems listed when it is corrupt."""
    from tierckpt.formats.verify import verify

    report = verify(args.uri, progress=progress.command_wants(args), node=args.node)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.render())
    if report.problems:
        return EXIT_CORRUPT
    return EXIT_INCOMPLETE if report.node_only else EXIT_OK  # node only: the remote lacks its COMMIT


# -- stats ---------------------------------------------------------------------------------------------
def _add_stats(subparsers: Any) -> None:
    """Register ``stats``."""
    p = subparsers.add_parser(
        "stats", help="per-rank timings, counters, stragglers and throughput of the save",
        description="Show how the save of a checkpoint went, from the timings stored in its header: every rank's "
        "phases (seconds) and counters, the slowest rank and skew (max / mean) of each phase, totals, and write "
        "throughput (bytes written / seconds in the stage and write phases; the group's rate divides by the "
        "slowest rank's seconds).",
    )
    p.add_argument("uri", help="checkpoint root: a path, file://, memory://, s3://, or any fsspec URI")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_timeout(p, "stats")
    p.set_defaults(handler=cmd_stats)


def cmd_stats(args: argparse.Namespace) -> int:
    """Print the save statistics of a checkpoint."""
    from tierckpt.store import open_store
    from tierckpt.loading.api import read_checkpoint

    ckpt = read_checkpoint(open_store(args.uri))
    doc = save_stats(args.uri, ckpt)
    print(json.dumps(doc, indent=1) if args.json else render_stats(doc))
    return EXIT_OK


# -- ls ------------------------------------------------------------------------------------------------
def _add_ls(subparsers: Any) -> None:
    """Register ``ls``."""
    p = subparsers.add_parser(
        "ls", help="list the checkpoints under a root",
        description="List the checkpoints under ROOT: ROOT itself, the step-N checkpoints of a "
        "CheckpointManager root (the latest marked), or any directory of checkpoints. For each: step, status "
        "(committed, node-only: committed in this node's cache but not on the remote, unreachable: the remote did not "
        "answer, incomplete or corrupt), generation, creation time, tensor bytes and world size.",
    )
    p.add_argument("root", help="a checkpoint or a directory of checkpoints: a path or URI")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_timeout(p, "ls")
    p.set_defaults(handler=cmd_ls)


def cmd_ls(args: argparse.Namespace) -> int:
    """List the checkpoints under a root; exit 3 when there are none, 7 when the remote did not answer (the
    listing then holds only what this node's tiers have)."""
    doc = list_checkpoints(args.root)
    print(json.dumps(doc, indent=1) if args.json else render_ls(doc))
    return EXIT_UNREACHABLE if "remote_unreachable" in doc else EXIT_OK



# -- entry point ------------------------------------------------------------------------------------------
COMMANDS: tuple[Callable[[Any], None], ...] = (_add_demo, _add_inspect, _add_verify, _add_stats, _add_ls)
"""Each registers one subcommand whose parser sets ``handler(args) -> exit code``; :func:`build_parser`
adds those of :mod:`tierckpt.cli.convert`, :mod:`tierckpt.cli.cache` and :mod:`tierckpt.cli.bench`."""

VERSION_TEXT = f"tierckpt {__version__}"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command of :data:`COMMANDS`, ``cli_convert``, ``cli_cache`` and ``cli_bench``."""
    from tierckpt.cli import bench as cli_bench
    from tierckpt.cli import cache as cli_cache
    from tierckpt.cli import convert as cli_convert

    parser = argparse.ArgumentParser(
        prog="tierckpt", description="PyTorch checkpointing with load-time resharding.",
        epilog="exit codes: 0 ok, 1 other error, 2 usage or unsupported URI, 3 not found, 4 incomplete, "
        "5 corrupt, 6 demo losses diverged, 7 store unreachable or --timeout passed",
    )
    parser.add_argument("--version", action="version", version=VERSION_TEXT)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (*COMMANDS, *cli_convert.COMMANDS, *cli_cache.COMMANDS, *cli_bench.COMMANDS):
        add(subparsers)
    return parser



def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, and return its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # answered before registering the commands, which import torch
        print(VERSION_TEXT)
        return EXIT_OK
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits for --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        with bounded(args), progress.for_command(args):  # --timeout bounds the whole process, the exit drain included
            return args.handler(args)
    except CheckpointError as exc:
        print(f"tierckpt {args.command}: error: {exc}", file=sys.stderr)
        return exit_code(exc)
    except BrokenPipeError:  # the reader went away (``tierckpt inspect URI | head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush stays silent
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
