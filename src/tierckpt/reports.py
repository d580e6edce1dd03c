"""What a checkpoint holds, as documents: ``inspect`` (also :func:`tierckpt.inspect`), ``stats`` and ``ls`` as
JSON-ready dicts, and their text tables (what the CLI prints).

Each report is built as a dict (what ``--json`` prints) by one function and rendered as text by
another, so a script and a person read the same facts. The command wiring is in :mod:`tierckpt.cli.main`.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tierckpt.native import layout
from tierckpt.call_args import uri_text
from tierckpt.deadline import bounded
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, StorageUnreachableError
from tierckpt.native.layout import Found
from tierckpt.monitor import ranks_from_timings, straggler_report

if TYPE_CHECKING:
    from tierckpt.loading.api import Checkpoint
    from tierckpt.native.metadata import PieceMeta


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (escape sequences, carriage returns, bidi
    overrides: whatever ``str.isprintable`` refuses) written as a Python escape, ``\\x1b``: the names a
    checkpoint holds are untrusted and the text reports print them."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _lines(lines: Sequence[str]) -> str:
    """A report's lines, each made :func:`printable`, joined."""
    return "\n".join(printable(line) for line in lines)


# -- inspect -------------------------------------------------------------------------------------------
def _region_doc(piece: PieceMeta) -> dict[str, Any]:
    from tierckpt.native.regions import Box

    if isinstance(piece.region, Box):
        return {"kind": "box", "offsets": list(piece.region.offsets), "lengths": list(piece.region.lengths)}
    return {"kind": "flat", "start": piece.region.start, "stop": piece.region.stop}


def describe(uri: str, ckpt: Checkpoint, pieces: dict[str, list[PieceMeta]], with_pieces: bool = False) -> dict[str, Any]:
    """A JSON-ready summary of a checkpoint (the ``inspect --json`` document)."""
    from tierckpt.formats.select import reader_of

    meta = ckpt.meta
    reader = reader_of(ckpt)  # a foreign format read in place (DCP, safetensors...): no generation, no creation time
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
        "format": reader.format,
        "generation": meta.generation,
        "format_version": meta.format_version,
        "created_unix": meta.created_unix,
        "created": None if not reader.generations else datetime.datetime.fromtimestamp(meta.created_unix, datetime.timezone.utc).isoformat(timespec="seconds"),
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


@bounded("inspect")
def inspect(uri: str | os.PathLike[str], *, pieces: bool = False,
            storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the checkpoint at ``uri`` holds (tensors, objects, files, totals, who saved it), as the JSON-ready
    document ``tierckpt inspect URI --json`` prints (``pieces=True``: ``--pieces``, every saved piece of every
    tensor). A torch DCP directory, a safetensors folder or a DeepSpeed checkpoint is described too, read in
    place. Reads only metadata; runs in this process alone (no collective)."""
    from tierckpt.loading.api import read_checkpoint, read_pieces
    from tierckpt.store import open_store

    uri = uri_text("inspect", uri)
    backend = open_store(uri, dict(storage_options or {}))
    ckpt = read_checkpoint(backend, accept_foreign=True)
    return describe(uri, ckpt, read_pieces(backend, ckpt), with_pieces=pieces)


def render_inspect(summary: dict[str, Any]) -> str:
    """The ``inspect`` document as aligned text tables."""
    from tierckpt.formats import dcp as dcp_format

    totals = summary["totals"]
    if summary["format"] == "torch DCP":
        about = (f"  torch DCP checkpoint (metadata version {summary['tags'][dcp_format.FORMAT_TAG]}), read in place: "
                 "no generations, no checksums")
    elif summary["format"] == "safetensors":
        about = "  Hugging Face safetensors folder, read in place: tensors under 'model', no generations, no checksums"
    elif summary["created"] is None:  # another foreign format (DeepSpeed's): no generation, no creation time
        about = f"  {summary['format']} checkpoint, read in place: no generations, no checksums"
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
    return _lines(lines)


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
    """Rows padded to aligned columns (columns in ``right`` right-aligned), each cell :func:`printable`."""
    escaped = [[printable(str(c)) for c in row] for row in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *escaped)]

    def fmt(row: Sequence[str]) -> str:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  " + "  ".join(cells).rstrip()

    return [fmt(header)] + [fmt(r) for r in escaped]



# -- stats ---------------------------------------------------------------------------------------------
WRITE_PHASES = ("stage", "write")
"""Phases in which a save moves bytes to storage (a synchronous save streams during ``stage``)."""

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
        return _lines(lines + ["no timings were recorded for this save"])
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
    return _lines(lines)


def _rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate / 2**20:.1f} MiB/s"



# -- ls ------------------------------------------------------------------------------------------------
def list_checkpoints(root: str) -> dict[str, Any]:
    """The ``ls --json`` document: every checkpoint under ``root``, sorted by step then path."""
    from tierckpt.errors import TransientStorageError
    from tierckpt.store import memory_keys_under, open_store
    from tierckpt.io.scheduler import get_scheduler

    in_memory = memory_keys_under(root)  # checkpoints committed in this node's memory tier (when it is on)
    store = open_store(root)
    try:
        keys = get_scheduler().run(store.list(""))
    except TransientStorageError:
        if not in_memory:
            raise
        keys = []  # the remote is unreachable: what the memory tier holds is still listed
    unreachable = _remote_unreachable(store)
    found = layout.find_checkpoints(sorted(set(keys) | set(in_memory)))
    if not found and unreachable is not None:  # "none" would be a guess: the remote's own listing is unknown
        raise StorageUnreachableError(
            f"cannot list {root!r}: the remote did not answer, and this node's tiers list no checkpoint under it "
            f"(they list what this node has pending upload there): {unreachable}"
        )
    if not found:
        raise CheckpointNotFoundError(f"no checkpoints under {root!r}")
    latest = _latest_steps(root, found)
    entries = [_describe_entry(root, prefix, committed, gens, latest, unreachable is not None)
               for prefix, (committed, gens) in found.items()]
    entries.sort(key=lambda e: (e["step"] is None, e["step"] or 0, e["path"]))
    return {"root": root, "checkpoints": entries} | ({"remote_unreachable": unreachable} if unreachable else {})


def _remote_unreachable(store: object) -> str | None:
    """Why the remote below ``store``'s node tiers did not answer (then a listing through them holds only what
    this node has), else ``None`` (it answered, or ``store`` has no node tier: its listing is the remote's)."""
    from tierckpt.io.scheduler import get_scheduler
    from tierckpt.store import durability_of

    durable = durability_of(store)
    st = None if durable is None else get_scheduler().run(durable.status())
    return st.remote_error if st is not None and st.remote_unreachable else None


def _latest_steps(root: str, found: Mapping[str, Found]) -> set[str]:
    """Prefixes of the latest step of each directory holding ``step-*`` checkpoints (CheckpointManager's rule)."""
    from tierckpt.manager.api import CheckpointManager

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


def _describe_entry(root: str, prefix: str, committed: bool, gens: frozenset[str], latest: set[str],
                    remote_down: bool) -> dict[str, Any]:
    """One row of ``ls``: a committed checkpoint's header facts, or what an uncommitted one left (``remote_down``:
    the root's remote did not answer, so this node's view of the checkpoint is checked against its own).

    ``status``: ``committed`` (where the URI points), ``node-only`` (committed in this node's cache, not on
    the remote: ``node_only`` says why), ``incomplete``, ``corrupt`` or ``unreachable`` (the store did not
    answer: its metadata could not be read, or this node holds it committed, nothing of it pending, and
    whether the remote does is unknown; ``error`` says which)."""
    from tierckpt.store import memory_levels, node_only_reason, open_store
    from tierckpt.loading.api import read_checkpoint

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
    unknown = _unknown_on_remote(store) if remote_down else None
    node_only = None if unknown is not None else node_only_reason(store)
    if unknown is not None:
        entry["error"] = unknown
    if node_only is not None:
        entry["node_only"] = node_only
    levels = memory_levels(store)
    if levels is not None:
        entry["levels"] = levels
    status = "unreachable" if unknown is not None else "committed" if node_only is None else "node-only"
    entry.update(
        status=status, generation=meta.generation, created_unix=meta.created_unix, created=_utc(meta.created_unix),
        tensor_bytes=meta.tensor_bytes, world_size=meta.world_size, num_tensors=meta.num_tensors,
        uncommitted_generations=len(gens),
    )
    return entry


def _unknown_on_remote(store: object) -> str | None:
    """When where ``store``'s committed generation stands on the remote is unknown
    (:attr:`~tierckpt.node.status.StoreStatus.remote_unknown`: nothing of it pending here, the remote silent):
    one line saying so and why (the checkpoint is then neither ``committed`` nor ``node-only`` but
    ``unreachable``); else ``None``."""
    from tierckpt.io.scheduler import get_scheduler
    from tierckpt.store import durability_of

    durable = durability_of(store)
    st = None if durable is None else get_scheduler().run(durable.status())
    if st is None or not st.remote_unknown:
        return None
    return (f"generation {st.generation} is committed on this node, nothing of it pending upload; whether the "
            f"remote holds it is unknown: the remote did not answer: {st.remote_error}")


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
    if "remote_unreachable" in doc:
        lines.append(f"  the remote did not answer: listed from this node's tiers only; checkpoints the remote may hold "
                     f"beyond them are not shown ({doc['remote_unreachable']})")
    lines += _table(header, rows, right=(0, 5, 6))
    return _lines(lines)
