"""The ``tierckpt`` command line.

Commands::

    tierckpt demo [--root DIR] [--steps N] [--quiet]   train, checkpoint, resume on 3 ranks and 1 (see tierckpt.demo.run)
    tierckpt inspect URI [--json] [--pieces]          what a checkpoint holds
    tierckpt verify URI [--json] [--progress]         completeness and every checksum (exit 5 when corrupt)
    tierckpt stats URI [--json]                       per-rank save timings, stragglers, throughput
    tierckpt ls ROOT [--json]                         the checkpoints under a root (CheckpointManager steps...)
    tierckpt convert SRC OUT --to FMT [--from FMT]    tierckpt <-> safetensors, tierckpt <-> DCP (see docs/cli.md)
    tierckpt status|wait|prefetch URI, sync [URI], gc ROOT   the node cache (see tierckpt.cli_cache)
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

Errors print one line to stderr. To add a command, write ``_add_<name>(subparsers)`` that registers
its parser and sets ``handler``, and list it in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

# Only light modules here: ``tierckpt --version`` must not pay for torch. Each command imports what it uses.
from . import __version__, layout, progress
from .cli_deadline import add_timeout, bounded
from .errors import (
    CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError, StorageUnreachableError,
    UnsupportedURIError,
)
from .layout import Found
from .monitor import ranks_from_timings, straggler_report
from .units import parse_bytes

if TYPE_CHECKING:
    from .loader import Checkpoint
    from .metadata import PieceMeta

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INCOMPLETE = 4
EXIT_CORRUPT = 5
EXIT_DIVERGED = 6
EXIT_UNREACHABLE = 7

#: Most specific first: the first matching class decides the exit code.
ERROR_EXIT_CODES: tuple[tuple[type[CheckpointError], int], ...] = (
    (UnsupportedURIError, EXIT_USAGE),
    (StorageUnreachableError, EXIT_UNREACHABLE),
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
    from .store import open_store
    from .loader import read_checkpoint, read_pieces

    backend = open_store(args.uri)
    ckpt = read_checkpoint(backend, accept_dcp=True)
    pieces = read_pieces(backend, ckpt)
    summary = describe(args.uri, ckpt, pieces, with_pieces=args.pieces)
    print(json.dumps(summary, indent=1) if args.json else render_inspect(summary))
    return EXIT_OK


def _region_doc(piece: PieceMeta) -> dict[str, Any]:
    from .regions import Box

    if isinstance(piece.region, Box):
        return {"kind": "box", "offsets": list(piece.region.offsets), "lengths": list(piece.region.lengths)}
    return {"kind": "flat", "start": piece.region.start, "stop": piece.region.stop}


def describe(uri: str, ckpt: Checkpoint, pieces: dict[str, list[PieceMeta]], with_pieces: bool = False) -> dict[str, Any]:
    """A JSON-ready summary of a checkpoint (the ``inspect --json`` document)."""
    from . import dcp_format, safetensors_format

    meta = ckpt.meta
    dcp = dcp_format.FORMAT_TAG in meta.tags  # a torch DCP directory: no generation, no creation time
    hf = safetensors_format.FORMAT_TAG in meta.tags  # a save_pretrained folder: neither
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
        "format": "torch DCP" if dcp else "safetensors" if hf else "tierckpt",
        "generation": meta.generation,
        "format_version": meta.format_version,
        "created_unix": meta.created_unix,
        "created": None if dcp or hf else datetime.datetime.fromtimestamp(meta.created_unix, datetime.timezone.utc).isoformat(timespec="seconds"),
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
    from . import dcp_format

    totals = summary["totals"]
    if summary["format"] == "torch DCP":
        about = (f"  torch DCP checkpoint (metadata version {summary['tags'][dcp_format.FORMAT_TAG]}), read in place: "
                 "no generations, no checksums")
    elif summary["format"] == "safetensors":
        about = "  Hugging Face safetensors folder, read in place: tensors under 'model', no generations, no checksums"
    else:
        about = f"  generation {summary['generation']} (format {summary['format_version']}), created {summary['created']}"
    lines = [
        f"checkpoint {summary['uri']}",
        about,
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


# -- verify --------------------------------------------------------------------------------------------
def _add_verify(subparsers: Any) -> None:
    """Register ``verify``."""
    p = subparsers.add_parser(
        "verify", help="check a checkpoint's completeness and every checksum",
        description="Check that a committed checkpoint is complete (metadata, every file with its listed size, "
        "pieces covering every tensor exactly) and read every piece and object to check its CRC-32C, streaming. "
        "Every problem is listed with its file, tensor or object, and byte offset. Exit 0 when sound, "
        "5 when corrupt, 4 when incomplete (also: committed in this node's cache but not on the remote), "
        "3 when there is no checkpoint.",
    )
    p.add_argument("uri", help="checkpoint root: a path, file://, memory://, s3://, or any fsspec URI")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    progress.add_flags(p, None)  # verify draws its own bar (its total is known)
    add_timeout(p, "verify")
    p.set_defaults(handler=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify a checkpoint; exit 5 with the problems listed when it is corrupt."""
    from .verify import verify

    report = verify(args.uri, progress=progress.command_wants(args))
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


WRITE_PHASES = ("stage", "write")
"""Phases in which a save moves bytes to storage (a synchronous save streams during ``stage``)."""


def cmd_stats(args: argparse.Namespace) -> int:
    """Print the save statistics of a checkpoint."""
    from .store import open_store
    from .loader import read_checkpoint

    ckpt = read_checkpoint(open_store(args.uri))
    doc = save_stats(args.uri, ckpt)
    print(json.dumps(doc, indent=1) if args.json else render_stats(doc))
    return EXIT_OK


def save_stats(uri: str, ckpt: Checkpoint) -> dict[str, Any]:
    """The ``stats --json`` document: per-rank phases and counters, stragglers, totals, throughput."""
    ranks = ranks_from_timings(ckpt.meta.timings)
    rank_docs = []
    for rank, summary in enumerate(ranks):
        phases = {k.removesuffix("_s"): v for k, v in sorted(summary.items()) if k.endswith("_s")}
        counters = {k: int(v) for k, v in sorted(summary.items()) if not k.endswith("_s")}
        write_s = sum(phases.get(name, 0.0) for name in WRITE_PHASES)
        rank_docs.append({
            "rank": rank, "phases_s": phases, "counters": counters, "write_s": write_s,
            "write_bytes_per_s": _rate(counters.get("bytes_written", 0), write_s),
        })
    counters: dict[str, int] = {}
    for r in rank_docs:
        for k, v in r["counters"].items():
            counters[k] = counters.get(k, 0) + v
    write_s = max((r["write_s"] for r in rank_docs), default=0.0)
    return {
        "uri": uri,
        "generation": ckpt.meta.generation,
        "world_size": ckpt.meta.world_size,
        "created": _utc(ckpt.meta.created_unix),
        "ranks": rank_docs,
        "stragglers": straggler_report(ranks) if ranks else {},
        "totals": {
            "tensor_bytes": ckpt.meta.tensor_bytes,
            "file_bytes": sum(f.size for f in ckpt.meta.files),
            "counters": counters,
            "write_s": write_s,
            "write_bytes_per_s": _rate(counters.get("bytes_written", 0), write_s),
        },
    }


def _rate(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds if seconds > 0 else None


def _utc(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.timezone.utc).isoformat(timespec="seconds")


def render_stats(doc: dict[str, Any]) -> str:
    """The ``stats`` document as text tables."""
    lines = [f"checkpoint {doc['uri']}", f"  generation {doc['generation']}, saved by {doc['world_size']} rank(s) at {doc['created']}", ""]
    if not doc["ranks"]:
        return "\n".join(lines + ["no timings were recorded for this save"])
    phases = sorted({p for r in doc["ranks"] for p in r["phases_s"]})
    counters = sorted({c for r in doc["ranks"] for c in r["counters"]})
    rows = [
        (str(r["rank"]), *(f"{r['phases_s'].get(p, 0.0):.3f}" for p in phases), *(str(r["counters"].get(c, 0)) for c in counters), _rate_text(r["write_bytes_per_s"]))
        for r in doc["ranks"]
    ]
    header = ("rank", *(f"{p} s" for p in phases), *counters, "write rate")
    lines += _table(header, rows, right=tuple(range(len(header))))
    lines += ["", "stragglers (slowest rank per phase; skew = max / mean):"]
    rows = [
        (phase, str(int(s["slowest_rank"])), f"{s['max_s']:.3f}", f"{s['mean_s']:.3f}", f"{s['min_s']:.3f}", f"{s['skew']:.2f}")
        for phase, s in doc["stragglers"].items()
    ]
    lines += _table(("phase", "slowest", "max s", "mean s", "min s", "skew"), rows, right=(1, 2, 3, 4, 5))
    totals = doc["totals"]
    lines += [
        "",
        f"totals: {totals['tensor_bytes']} tensor bytes, {totals['file_bytes']} file bytes, "
        + ", ".join(f"{k} {v}" for k, v in totals["counters"].items()),
        f"write: {totals['write_s']:.3f} s (slowest rank), {_rate_text(totals['write_bytes_per_s'])}",
    ]
    return "\n".join(lines)


def _rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate / 2**20:.1f} MiB/s"


# -- ls ------------------------------------------------------------------------------------------------
def _add_ls(subparsers: Any) -> None:
    """Register ``ls``."""
    p = subparsers.add_parser(
        "ls", help="list the checkpoints under a root",
        description="List the checkpoints under ROOT: ROOT itself, the step-N checkpoints of a "
        "CheckpointManager root (the latest marked), or any directory of checkpoints. For each: step, status "
        "(committed, node-only: committed in this node's cache but not on the remote, incomplete or corrupt), generation, creation time, tensor bytes and world size.",
    )
    p.add_argument("root", help="a checkpoint or a directory of checkpoints: a path or URI")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_timeout(p, "ls")
    p.set_defaults(handler=cmd_ls)


def cmd_ls(args: argparse.Namespace) -> int:
    """List the checkpoints under a root; exit 3 when there are none."""
    doc = list_checkpoints(args.root)
    print(json.dumps(doc, indent=1) if args.json else render_ls(doc))
    return EXIT_OK


def list_checkpoints(root: str) -> dict[str, Any]:
    """The ``ls --json`` document: every checkpoint under ``root``, sorted by step then path."""
    from .errors import TransientStorageError
    from .store import memory_keys_under, open_store
    from .io.scheduler import get_scheduler

    in_memory = memory_keys_under(root)  # checkpoints committed in this node's memory tier (when it is on)
    try:
        keys = get_scheduler().run(open_store(root).list(""))
    except TransientStorageError:
        if not in_memory:
            raise
        keys = []  # the remote is unreachable: what the memory tier holds is still listed
    found = layout.find_checkpoints(sorted(set(keys) | set(in_memory)))
    if not found:
        raise CheckpointNotFoundError(f"no checkpoints under {root!r}")
    latest = _latest_steps(root, found)
    entries = [_describe_entry(root, prefix, committed, gens, latest) for prefix, (committed, gens) in found.items()]
    entries.sort(key=lambda e: (e["step"] is None, e["step"] or 0, e["path"]))
    return {"root": root, "checkpoints": entries}


def _latest_steps(root: str, found: Mapping[str, Found]) -> set[str]:
    """Prefixes of the latest step of each directory holding ``step-*`` checkpoints (CheckpointManager's rule)."""
    from .manager import CheckpointManager

    by_dir: dict[str, list[str]] = {}
    for prefix, (committed, _) in found.items():
        if committed:
            by_dir.setdefault(prefix.rpartition("/")[0], []).append(prefix)
    latest = set()
    for d, prefixes in by_dir.items():
        steps = layout.by_step(prefixes)
        step = CheckpointManager(_join(root, d)).latest() if steps else None
        if step in steps:
            latest.add(steps[step])
    return latest


def _join(root: str, prefix: str) -> str:
    return f"{root.rstrip('/')}/{prefix}" if prefix else root


def _describe_entry(root: str, prefix: str, committed: bool, gens: frozenset[str], latest: set[str]) -> dict[str, Any]:
    """One row of ``ls``: a committed checkpoint's header facts, or what an uncommitted one left.

    ``status``: ``committed`` (where the URI points), ``node-only`` (committed in this node's cache, not on
    the remote: ``node_only`` says why), ``incomplete``, ``corrupt`` or ``unreachable`` (its metadata could
    not be read: the store did not answer; ``error`` says which)."""
    from .store import memory_levels, node_only_reason, open_store
    from .loader import read_checkpoint

    entry: dict[str, Any] = {
        "path": prefix or ".", "uri": _join(root, prefix), "step": layout.step_of(prefix),
        "latest": prefix in latest, "status": "incomplete", "generation": None, "created_unix": None, "created": None,
        "tensor_bytes": None, "world_size": None, "num_tensors": None, "uncommitted_generations": len(gens),
    }
    if not committed:
        newest = max(gens)
        entry["generation"] = newest
        millis = newest.split("-")[1]
        if millis.isdigit():
            entry["created_unix"] = int(millis) / 1000
            entry["created"] = _utc(entry["created_unix"])
        return entry
    store = open_store(entry["uri"])
    try:
        meta = read_checkpoint(store).meta
    except StorageUnreachableError as exc:  # the store did not answer: nothing is known about its metadata
        return {**entry, "status": "unreachable", "error": str(exc)}
    except CheckpointError as exc:
        return {**entry, "status": "corrupt", "error": str(exc)}
    gens = gens - {meta.generation}
    node_only = node_only_reason(store)
    if node_only is not None:
        entry["node_only"] = node_only
    levels = memory_levels(store)
    if levels is not None:
        entry["levels"] = levels
    entry.update(
        status="committed" if node_only is None else "node-only", generation=meta.generation, created_unix=meta.created_unix, created=_utc(meta.created_unix),
        tensor_bytes=meta.tensor_bytes, world_size=meta.world_size, num_tensors=meta.num_tensors,
        uncommitted_generations=len(gens),
    )
    return entry


def render_ls(doc: dict[str, Any]) -> str:
    """The ``ls`` document as a table; ``*`` marks the latest step."""
    rows = [
        (
            "" if e["step"] is None else str(e["step"]), "*" if e["latest"] else "", e["status"], e["generation"] or "-",
            e["created"] or "-", "-" if e["tensor_bytes"] is None else str(e["tensor_bytes"]),
            "-" if e["world_size"] is None else str(e["world_size"]), e["path"],
        )
        for e in doc["checkpoints"]
    ]
    header = ("step", "", "status", "generation", "created", "tensor bytes", "world", "path")
    if any("levels" in e for e in doc["checkpoints"]):  # the node memory tier is on: the levels reached
        header += ("levels",)
        rows = [r + (",".join(k for k, v in e.get("levels", {}).items() if v) or "-",)
                for r, e in zip(rows, doc["checkpoints"])]
    lines = [f"checkpoints under {doc['root']} (* = latest):"]
    lines += _table(header, rows, right=(0, 5, 6))
    return "\n".join(lines)


# -- convert -------------------------------------------------------------------------------------------
CONVERSIONS = {("tierckpt", "safetensors"), ("tierckpt", "dcp"), ("dcp", "tierckpt"), ("dcp", "safetensors"), ("safetensors", "tierckpt")}
CONVERSIONS |= {("deepspeed", "tierckpt"), ("ucp", "tierckpt")}  # DeepSpeed ZeRO (1, 2, 3) and universal checkpoints


def _add_convert(subparsers: Any) -> None:
    """Register ``convert``."""
    from . import convert

    p = subparsers.add_parser(
        "convert", help="convert between tierckpt, safetensors and torch.distributed.checkpoint (DCP)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Convert a checkpoint to another format, in this process.\n\n"
        "  tierckpt -> safetensors  streams: one slab of one tensor at a time, so a model larger than RAM converts.\n"
        "                           Writes model.safetensors, or model-0000K-of-0000N.safetensors shards plus\n"
        "                           model.safetensors.index.json; objects are skipped. Writes config.json (and\n"
        "                           generation_config.json) from --config DIR or the saved 'hf_config' object, so\n"
        "                           transformers' from_pretrained loads the folder; drops lm_head.weight when tied.\n"
        "  dcp -> safetensors       the same, reading the DCP directory in place.\n"
        "  safetensors -> tierckpt  holds the whole model in memory; restores lm_head.weight when config.json ties it.\n"
        "  dcp -> tierckpt          holds the whole model in memory. DCP metadata is a pickle: importing a DCP\n"
        "                           checkpoint unpickles it, so convert only DCP checkpoints you trust.\n"
        "  tierckpt -> dcp          holds the whole model in memory (full CPU tensors); objects included. Optimizer\n"
        "                           param groups are written by group number (optim.param_groups.0.lr), as torch's\n"
        "                           default get_state_dict names them; --flatten-optimizer writes them by parameter.",
    )
    p.add_argument("src", help="source checkpoint (a tierckpt URI, a DCP directory, or a safetensors file or folder)")
    p.add_argument("out", help="output (a directory for safetensors and DCP, a URI for tierckpt)")
    p.add_argument("--to", required=True, choices=("safetensors", "dcp", "tierckpt"), help="output format")
    p.add_argument("--from", dest="source_format", default="tierckpt", choices=("tierckpt", "dcp", "safetensors", "deepspeed", "ucp"), help="source format (default tierckpt; deepspeed: a ZeRO folder, ucp: a universal checkpoint)")
    p.add_argument("--max-shard-bytes", type=_byte_size, default=convert.DEFAULT_MAX_SHARD_BYTES, help="safetensors shard size, e.g. 5GB, 500MiB, 1000000 (default 5GB)")
    p.add_argument("--prefix", default="", help="safetensors: export only tensors whose fqn starts with P, with P stripped (e.g. 'model.'); import: prepend P")
    p.add_argument("--config", metavar="DIR", help="to safetensors: copy config.json (and generation_config.json) from DIR, a folder with the model's Hugging Face config")
    p.add_argument("--allow-pickle", action="store_true", help="to dcp: include objects that need full unpickling (trusted checkpoints only)")
    p.add_argument("--flatten-optimizer", action="store_true", help="to dcp: optimizer param group settings by parameter (optim.param_groups.<fqn>.lr), for get_state_dict with StateDictOptions(flatten_optimizer_state_dict=True); default: by group number, as get_state_dict's default")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    progress.add_flags(p, "convert")
    p.set_defaults(handler=cmd_convert)


def _byte_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1000"`` -> bytes (at least 1), by :func:`tierckpt.units.parse_bytes`."""
    try:
        return parse_bytes(text, "the byte size", minimum=1)
    except CheckpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def cmd_convert(args: argparse.Namespace) -> int:
    """Run one conversion and print what it wrote (and skipped)."""
    from . import convert

    pair = (args.source_format, args.to)
    if pair not in CONVERSIONS:
        supported = ", ".join(f"{a} -> {b}" for a, b in sorted(CONVERSIONS))
        print(f"tierckpt convert: error: cannot convert {pair[0]} to {pair[1]}; supported: {supported}", file=sys.stderr)
        return EXIT_USAGE
    if args.flatten_optimizer and pair[1] != "dcp":
        print("tierckpt convert: error: --flatten-optimizer is for --to dcp (it names the optimizer's param group settings)", file=sys.stderr)
        return EXIT_USAGE
    if args.config is not None and pair[1] != "safetensors":
        print("tierckpt convert: error: --config is for --to safetensors (it writes config.json next to the weights)", file=sys.stderr)
        return EXIT_USAGE
    if pair[1] == "safetensors":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report's warnings are printed below, one line each
            report = convert.to_safetensors(args.src, args.out, max_shard_bytes=args.max_shard_bytes, prefix=args.prefix, config_dir=args.config)
    elif pair == ("tierckpt", "dcp"):
        report = convert.to_dcp(args.src, args.out, allow_pickle=args.allow_pickle, flatten_optimizer=args.flatten_optimizer)
    elif pair == ("dcp", "tierckpt"):
        report = convert.from_dcp(args.src, args.out)
    elif pair[0] in ("deepspeed", "ucp"):
        from .convert_deepspeed import from_deepspeed

        report = from_deepspeed(args.src, args.out, source=pair[0])
    else:
        report = convert.from_safetensors(args.src, args.out, prefix=args.prefix)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.render())
    for warning in report.warnings:
        print(f"tierckpt convert: warning: {warning}", file=sys.stderr)
    return EXIT_OK


# -- entry point ------------------------------------------------------------------------------------------
COMMANDS: tuple[Callable[[Any], None], ...] = (_add_demo, _add_inspect, _add_verify, _add_stats, _add_ls, _add_convert)
"""Each registers one subcommand whose parser sets ``handler(args) -> exit code``; :func:`build_parser`
adds those of :mod:`tierckpt.cli_cache` and :mod:`tierckpt.cli_bench`."""

VERSION_TEXT = f"tierckpt {__version__}"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command of :data:`COMMANDS`, ``cli_cache`` and ``cli_bench``."""
    from . import cli_bench, cli_cache

    parser = argparse.ArgumentParser(
        prog="tierckpt", description="PyTorch checkpointing with load-time resharding.",
        epilog="exit codes: 0 ok, 1 other error, 2 usage or unsupported URI, 3 not found, 4 incomplete, "
        "5 corrupt, 6 demo losses diverged, 7 store unreachable or --timeout passed",
    )
    parser.add_argument("--version", action="version", version=VERSION_TEXT)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (*COMMANDS, *cli_cache.COMMANDS, *cli_bench.COMMANDS):
        add(subparsers)
    return parser


def exit_code(error: CheckpointError) -> int:
    """The documented exit code for a tierckpt error."""
    return next(code for cls, code in ERROR_EXIT_CODES if isinstance(error, cls))


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
