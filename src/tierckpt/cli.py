"""The ``tierckpt`` command line.

Commands::

    tierckpt demo [--root DIR] [--steps N] [--quiet]   train, checkpoint, resume on 3 ranks and 1 (see tierckpt.demo.run)
    tierckpt inspect URI [--json] [--pieces]          what a checkpoint holds
    tierckpt --version

Exit codes:

== ===========================================================================
0  success
1  any other tierckpt error (storage failure, permission denied...)
2  usage error, including a URI no storage backend handles
3  no checkpoint at the URI
4  incomplete checkpoint: data without a COMMIT record (interrupted or running save)
5  corrupt checkpoint: metadata or data fails validation
6  ``demo``: the resumed losses diverged from the uninterrupted run
== ===========================================================================

Errors print one line to stderr. To add a command, write ``_add_<name>(subparsers)`` that registers
its parser and sets ``handler``, and list it in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from . import __version__, layout
from .backends import open_backend
from .errors import (
    CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError, UnsupportedURIError,
)
from .io.scheduler import get_scheduler
from .loader import Checkpoint, read_checkpoint
from .metadata import PieceMeta, decode_pieces
from .regions import Box

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INCOMPLETE = 4
EXIT_CORRUPT = 5
EXIT_DIVERGED = 6

#: Most specific first: the first matching class decides the exit code.
ERROR_EXIT_CODES: tuple[tuple[type[CheckpointError], int], ...] = (
    (UnsupportedURIError, EXIT_USAGE),
    (CheckpointNotFoundError, EXIT_NOT_FOUND),
    (IncompleteCheckpointError, EXIT_INCOMPLETE),
    (CorruptCheckpointError, EXIT_CORRUPT),
    (CheckpointError, EXIT_ERROR),
)


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
    from .demo.run import run_demo

    report = run_demo(root=args.root, steps=args.steps, quiet=args.quiet)
    print(report.render())
    return EXIT_OK if report.ok else EXIT_DIVERGED


# -- inspect -------------------------------------------------------------------------------------------
def _add_inspect(subparsers: Any) -> None:
    """Register ``inspect``."""
    p = subparsers.add_parser(
        "inspect", help="list the tensors and objects of a checkpoint",
        description="Show what a committed checkpoint holds: tensors, objects, who saved it, and totals.",
    )
    p.add_argument("uri", help="checkpoint root: a path, file://, memory://, s3://, or any fsspec URI")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--pieces", action="store_true", help="also list every saved piece of every tensor")
    p.set_defaults(handler=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a checkpoint's contents as a table or as JSON."""
    backend = open_backend(args.uri)
    ckpt = read_checkpoint(backend)
    pieces = _read_all_pieces(backend, ckpt)
    summary = describe(args.uri, ckpt, pieces, with_pieces=args.pieces)
    print(json.dumps(summary, indent=1) if args.json else render_inspect(summary))
    return EXIT_OK


def _read_all_pieces(backend: Any, ckpt: Checkpoint) -> dict[str, list[PieceMeta]]:
    """Every piece of every tensor, validated; a missing pieces table means a corrupt checkpoint."""
    try:
        data = get_scheduler().run(backend.get(layout.pieces_key(ckpt.meta.generation)))
    except CheckpointNotFoundError as exc:
        raise CorruptCheckpointError(f"checkpoint {backend.root_uri!r} has no pieces table: {exc}") from exc
    return decode_pieces(pa.BufferReader(data), ckpt.tensors)


def _region_doc(piece: PieceMeta) -> dict[str, Any]:
    if isinstance(piece.region, Box):
        return {"kind": "box", "offsets": list(piece.region.offsets), "lengths": list(piece.region.lengths)}
    return {"kind": "flat", "start": piece.region.start, "stop": piece.region.stop}


def describe(uri: str, ckpt: Checkpoint, pieces: dict[str, list[PieceMeta]], with_pieces: bool = False) -> dict[str, Any]:
    """A JSON-ready summary of a checkpoint (the ``inspect --json`` document)."""
    meta = ckpt.meta
    tensors = []
    for fqn in sorted(ckpt.tensors):
        t = ckpt.tensors[fqn]
        doc: dict[str, Any] = {"fqn": fqn, "dtype": t.dtype, "shape": list(t.shape), "pieces": len(pieces.get(fqn, [])), "bytes": t.nbytes}
        if with_pieces:
            doc["piece_list"] = [
                {**_region_doc(p), "file": p.file, "byte_offset": p.byte_offset, "byte_length": p.byte_length, "crc32c": p.crc32c}
                for p in pieces.get(fqn, [])
            ]
        tensors.append(doc)
    objects = [
        {"key": o.key, "scope": "shared" if o.rank is None else "per-rank", "rank": o.rank, "codec": o.codec, "bytes": o.byte_length}
        for o in sorted(meta.objects, key=lambda o: (o.key, -1 if o.rank is None else o.rank))
    ]
    return {
        "uri": uri,
        "generation": meta.generation,
        "format_version": meta.format_version,
        "created_unix": meta.created_unix,
        "created": datetime.datetime.fromtimestamp(meta.created_unix, datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": meta.world_size,
        "frameworks": list(meta.frameworks),
        "tags": dict(meta.tags),
        "totals": {
            "tensors": meta.num_tensors,
            "pieces": meta.num_pieces,
            "tensor_bytes": meta.tensor_bytes,
            "objects": len(meta.objects),
            "object_bytes": sum(o.byte_length for o in meta.objects),
            "files": len(meta.files),
            "file_bytes": sum(f.size for f in meta.files),
        },
        "files": [{"key": f.key, "size": f.size} for f in meta.files],
        "tensors": tensors,
        "objects": objects,
    }


def render_inspect(summary: dict[str, Any]) -> str:
    """The ``inspect`` document as aligned text tables."""
    totals = summary["totals"]
    lines = [
        f"checkpoint {summary['uri']}",
        f"  generation {summary['generation']} (format {summary['format_version']}), created {summary['created']}",
        f"  saved by {summary['world_size']} rank(s): {', '.join(summary['frameworks']) or 'plain state'}",
    ]
    if summary["tags"]:
        lines.append("  tags: " + ", ".join(f"{k}={v}" for k, v in sorted(summary["tags"].items())))
    lines.append("")
    rows = [(t["fqn"], t["dtype"], _shape_text(t["shape"]), str(t["pieces"]), str(t["bytes"])) for t in summary["tensors"]]
    lines += _table(("tensor", "dtype", "shape", "pieces", "bytes"), rows, right=(3, 4))
    for t in summary["tensors"]:
        for p in t.get("piece_list", []):
            lines.append(f"    {t['fqn']}: {_piece_text(p)}")
    lines.append("")
    rows = [(o["key"], o["scope"] if o["rank"] is None else f"rank {o['rank']}", o["codec"], str(o["bytes"])) for o in summary["objects"]]
    lines += _table(("object", "scope", "codec", "bytes"), rows, right=(3,))
    lines.append("")
    lines.append(
        f"totals: {totals['tensors']} tensors in {totals['pieces']} pieces ({totals['tensor_bytes']} bytes), "
        f"{totals['objects']} objects ({totals['object_bytes']} bytes), {totals['files']} files ({totals['file_bytes']} bytes)"
    )
    return "\n".join(lines)


def _piece_text(piece: dict[str, Any]) -> str:
    """One piece as ``box offsets [..] lengths [..] in FILE @ OFFSET +LENGTH``."""
    if piece["kind"] == "box":
        region = f"box offsets {piece['offsets']} lengths {piece['lengths']}"
    else:
        region = f"flat elements [{piece['start']}, {piece['stop']})"
    return f"{region} in {piece['file']} @ {piece['byte_offset']} +{piece['byte_length']}"


def _shape_text(shape: list[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _table(header: Sequence[str], rows: list[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """Rows padded to aligned columns (columns in ``right`` right-aligned)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def fmt(row: Sequence[str]) -> str:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  " + "  ".join(cells).rstrip()

    return [fmt(header)] + [fmt(r) for r in rows]


# -- entry point ------------------------------------------------------------------------------------------
COMMANDS: tuple[Callable[[Any], None], ...] = (_add_demo, _add_inspect)
"""Each registers one subcommand whose parser sets ``handler(args) -> exit code``."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="tierckpt", description="PyTorch checkpointing with load-time resharding.",
        epilog="exit codes: 0 ok, 1 other error, 2 usage or unsupported URI, 3 not found, 4 incomplete, "
        "5 corrupt, 6 demo losses diverged",
    )
    parser.add_argument("--version", action="version", version=f"tierckpt {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser


def exit_code(error: CheckpointError) -> int:
    """The documented exit code for a tierckpt error."""
    return next(code for cls, code in ERROR_EXIT_CODES if isinstance(error, cls))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, and return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits for --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return args.handler(args)
    except CheckpointError as exc:
        print(f"tierckpt {args.command}: error: {exc}", file=sys.stderr)
        return exit_code(exc)
    except BrokenPipeError:  # the reader went away (``tierckpt inspect URI | head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush stays silent
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
