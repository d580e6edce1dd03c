"""Offline verification of a checkpoint: completeness and every checksum (``tierckpt verify``).

:func:`verify` checks, in order:

1. ``COMMIT``, the header and the tensor and pieces tables are readable and valid, ``COMMIT``'s own
   CRC-32C holds and each metadata document has the size and CRC-32C that ``COMMIT`` records (so one
   flipped bit in any of them is a problem); a missing ``COMMIT`` raises :class:`~tierckpt.errors.IncompleteCheckpointError`, no checkpoint
   :class:`~tierckpt.errors.CheckpointNotFoundError`; unreadable metadata is one problem and stops
   the check there).
2. Every data and object file the header lists exists with the listed size, and every file a piece
   or an object points to is listed.
3. The pieces of each tensor cover it exactly: the covered element counts add up to the tensor's
   size and no two pieces share an element (flat pieces are compared as their boxes).
4. The CRC-32C of every piece and every object, streamed in batches of at most ``chunk_bytes``:
   small pieces are read together, a large piece in chunks with the checksum continued, so memory
   stays bounded whatever the checkpoint's size. Each piece's block checksums (what every load
   checks) must combine to its CRC-32C, so the two can never disagree unnoticed.

Every problem found is reported (:class:`Problem`: kind, file, tensor or object, byte offset); the
check does not stop at the first one.

Where the bytes come from. A remote URI is checked on the remote itself, past this node's cache and memory
tier (a node's copy may be sound while the remote's is not), unless ``node=True`` asks for the node's copy.
One exception: on the node that saved, a generation committed in its write-back tier but not yet uploaded
is what the URI will hold; then that copy is checked and the report says so (``node_only``). A remote that
does not answer raises :class:`~tierckpt.errors.StorageUnreachableError` (exit 7), never "node only".
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.call_args import uri_text
from tierckpt.deadline import bounded
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, DeadlineExceededError, StorageUnreachableError
from tierckpt.io.crc import combine_blocks
from tierckpt.io.scheduler import ReadRequest, get_scheduler
from tierckpt.formats.reader import Checkpoint
from tierckpt.formats.select import read_checkpoint, read_pieces
from tierckpt.native.metadata import PieceMeta, TensorMeta
from tierckpt.native.regions import Box, Region, StoredBox, stored_boxes
from tierckpt.store import durability_of, forget_cached, node_face, node_only_reason, open_store
from tierckpt.node.status import StoreStatus

DEFAULT_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """One thing wrong with a checkpoint."""

    kind: str
    """``metadata``, ``missing-file``, ``file-size``, ``unlisted-file``, ``past-end``, ``uncovered``,
    ``overlap``, ``checksum`` or ``object-checksum``."""
    message: str
    file: str | None = None
    """Data or object file, relative to the generation directory."""
    tensor: str | None = None
    object: str | None = None
    byte_offset: int | None = None
    byte_length: int | None = None


@dataclass(slots=True, kw_only=True)
class VerifyReport:
    """What :func:`verify` checked and the problems it found (``ok`` when there are none)."""

    uri: str
    generation: str | None = None
    tensors: int = 0
    pieces: int = 0
    objects: int = 0
    files: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    node_only: str | None = None
    """Set on the node that saved through its write-back cache while the checkpoint is committed there
    but not (yet) on the remote: why, and the ``tierckpt sync`` command that finishes it."""
    read_from: str = "store"
    """Where the checked bytes were read: ``remote`` (the URI's own store, past this node's tiers), ``node``
    (this node's cache and memory tier, falling through to the remote) or ``store`` (a URI with no node tier)."""

    @property
    def ok(self) -> bool:
        """Sound, and committed where the URI points (not only in this node's cache)."""
        return not self.problems and self.node_only is None

    def to_dict(self) -> dict[str, Any]:
        """The ``verify --json`` document."""
        doc = {k: getattr(self, k) for k in ("uri", "generation", "tensors", "pieces", "objects", "files", "bytes_checked")}
        doc["ok"] = self.ok
        doc["committed_on_remote"] = self.node_only is None
        doc["read_from"] = self.read_from
        if self.node_only is not None:
            doc["node_only"] = self.node_only
        doc["problems"] = [{k: v for k, v in asdict(p).items() if v is not None} for p in self.problems]
        return doc

    def render(self) -> str:
        """One summary line, then one line per problem."""
        checked = (
            f"{self.tensors} tensors in {self.pieces} pieces, {self.objects} objects, {self.files} files, "
            f"{self.bytes_checked} bytes checksummed"
        )
        source = {"remote": "read from the remote", "store": "",
                  "node": f"read from this node's copy; `tierckpt verify {self.uri}` checks the remote's"}
        checked += f" ({source[self.read_from]})" if source[self.read_from] else ""
        if self.ok:
            return f"ok: {self.uri} (generation {self.generation}): {checked}"
        if not self.problems:
            return f"NODE ONLY: {self.uri}: sound, but {self.node_only}; {checked}"
        lines = [f"CORRUPT: {self.uri} (generation {self.generation}): {len(self.problems)} problem(s); {checked}"]
        lines += [f"  {p.kind}: {p.message}" for p in self.problems]
        return "\n".join(lines)


@bounded("verify")
def verify(
    uri: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    node: bool = False,
) -> VerifyReport:
    """Check the committed checkpoint at ``uri`` completely (see the module docstring): on the remote itself,
    or with ``node=True`` this node's copy (its cache and memory tier)."""
    uri = uri_text("verify", uri)
    options = dict(storage_options or {})
    backend = open_store(uri, options)
    report = VerifyReport(uri=uri)
    durable = durability_of(backend)
    if durable is not None:
        report.read_from = "node"
        if not node and not _pending_here(get_scheduler().run(durable.status())):
            backend, report.read_from = open_store(uri, {**options, "cache": False, "memory": False}), "remote"
    try:
        return _check(backend, report, progress, chunk_bytes)
    except StorageUnreachableError as exc:
        if report.read_from != "remote" or isinstance(exc, DeadlineExceededError):
            raise
        raise StorageUnreachableError(
            f"verify {uri}: the remote is unreachable, so its copy cannot be checked ({exc}); "
            f"`tierckpt verify --node {uri}` checks this node's copy"
        ) from exc


def _check(backend: Backend, report: VerifyReport, progress: bool, chunk_bytes: int) -> VerifyReport:
    """Fill in ``report`` with what reading the checkpoint through ``backend`` finds."""
    try:
        ckpt = read_checkpoint(backend)
        report.generation = ckpt.meta.generation
        pieces = read_pieces(backend, ckpt)
    except CorruptCheckpointError as exc:
        report.problems.append(Problem(kind="metadata", message=str(exc)))
        return report
    meta = ckpt.meta
    report.tensors, report.objects, report.files = len(ckpt.tensors), len(meta.objects), len(meta.files)
    report.pieces = sum(len(p) for p in pieces.values())
    sizes = _check_files(backend, ckpt, pieces, report.problems)
    for fqn in sorted(ckpt.tensors):
        report.problems += _coverage_problems(ckpt.tensors[fqn], pieces.get(fqn, []))
    report.problems += _block_checksum_problems(pieces)
    report.bytes_checked = _check_checksums(backend, ckpt, pieces, sizes, report.problems, progress, chunk_bytes)
    report.node_only = node_only_reason(backend) if report.read_from == "node" else None
    return report


def _pending_here(status: StoreStatus) -> bool:
    """Whether this node holds a committed generation that it has not finished uploading, or holds in its memory
    tier only (the node that saved through its write-back tiers): that generation is what the URI will hold,
    and only this node has it."""
    return (status.generation is not None and not status.committed_on_remote
            and (bool(status.pending_keys) or status.only_in_memory))


# -- files -------------------------------------------------------------------------------------------
def _check_files(
    backend: Backend, ckpt: Checkpoint, pieces: dict[str, list[PieceMeta]], problems: list[Problem]
) -> dict[str, int]:
    """Actual sizes of the listed files that exist; problems for missing, resized and unlisted files."""
    sched = get_scheduler()
    gen = ckpt.meta.generation
    sizes: dict[str, int] = {}
    for f in ckpt.meta.files:
        try:
            actual = sched.run(backend.size(layout.in_generation(gen, f.key)))
        except CheckpointNotFoundError:
            problems.append(Problem(kind="missing-file", file=f.key, message=f"{f.key} is missing (the header lists {f.size} bytes)"))
            continue
        sizes[f.key] = actual
        if actual != f.size:
            what = "truncated" if actual < f.size else "longer than listed"
            problems.append(
                Problem(kind="file-size", file=f.key, message=f"{f.key} has {actual} bytes, the header lists {f.size} ({what})")
            )
    listed = {f.key for f in ckpt.meta.files}
    used = {p.file for ps in pieces.values() for p in ps} | {o.file for o in ckpt.meta.objects}
    for key in sorted(used - listed):
        problems.append(Problem(kind="unlisted-file", file=key, message=f"{key} is used by pieces or objects but not listed in the header"))
    return sizes


# -- coverage ----------------------------------------------------------------------------------------
def _coverage_problems(tensor: TensorMeta, pieces: list[PieceMeta]) -> list[Problem]:
    """Overlapping pieces, and elements no piece holds, of one tensor."""
    boxes = [(sb, p) for p in pieces for sb in stored_boxes(p.region, tensor.shape)]
    problems = [_overlap_problem(tensor, a, b, inter) for a, b, inter in _overlaps(boxes)]
    covered = sum(sb.box.numel for sb, _ in boxes)
    total = math.prod(tensor.shape)
    if not problems and covered != total:
        problems.append(
            Problem(
                kind="uncovered", tensor=tensor.fqn,
                message=f"tensor {tensor.fqn!r}: its {len(pieces)} piece(s) cover {covered} of {total} elements "
                f"({total - covered} missing)",
            )
        )
    return problems


def _overlaps(boxes: list[tuple[StoredBox, PieceMeta]]) -> Iterator[tuple[PieceMeta, PieceMeta, Box]]:
    """Pairs of distinct boxes that share elements: a sweep over the first dimension."""
    if not boxes or boxes[0][0].box.ndim == 0:
        for i in range(1, len(boxes)):  # 0-d: every further box overlaps the first
            yield boxes[0][1], boxes[i][1], boxes[i][0].box
        return
    ordered = sorted(boxes, key=lambda b: b[0].box.offsets[0])
    starts = [b[0].box.offsets[0] for b in ordered]
    for i, (sb, piece) in enumerate(ordered):
        stop = bisect.bisect_left(starts, sb.box.ends[0], lo=i + 1)
        for other, other_piece in ordered[i + 1 : stop]:
            inter = sb.box.intersect(other.box)
            if inter is not None:
                yield piece, other_piece, inter


def _overlap_problem(tensor: TensorMeta, a: PieceMeta, b: PieceMeta, inter: Box) -> Problem:
    return Problem(
        kind="overlap", tensor=tensor.fqn, file=b.file, byte_offset=b.byte_offset,
        message=f"tensor {tensor.fqn!r}: pieces {_where(a)} and {_where(b)} overlap in box offsets "
        f"{list(inter.offsets)} lengths {list(inter.lengths)}",
    )


def _region_text(region: Region) -> str:
    if isinstance(region, Box):
        return f"box offsets {list(region.offsets)} lengths {list(region.lengths)}"
    return f"flat elements [{region.start}, {region.stop})"


def _where(p: PieceMeta) -> str:
    return f"{p.file} @ {p.byte_offset} +{p.byte_length}"


# -- checksums ---------------------------------------------------------------------------------------
def _block_checksum_problems(pieces: dict[str, list[PieceMeta]]) -> list[Problem]:
    """Pieces whose block CRCs do not combine to the piece's CRC-32C (the pieces table is inconsistent)."""
    by_size: dict[int, list[PieceMeta]] = {}
    for fqn in sorted(pieces):
        for p in pieces[fqn]:
            if p.block_bytes:
                by_size.setdefault(p.block_bytes, []).append(p)
    problems = []
    for block, group in by_size.items():
        combined = combine_blocks([list(p.block_crc32c) for p in group], [p.byte_length for p in group], block)
        problems += [
            Problem(
                kind="block-checksums", file=p.file, tensor=p.fqn, byte_offset=p.byte_offset, byte_length=p.byte_length,
                message=f"tensor {p.fqn!r} piece {_region_text(p.region)} at {_where(p)}: its block checksums combine to "
                f"{c:#010x}, its CRC-32C is {p.crc32c:#010x} (the pieces table is corrupt)",
            )
            for p, c in zip(group, combined) if c != p.crc32c
        ]
    return problems


@dataclass(slots=True)
class _Item:
    """A byte range with a stored CRC-32C: one piece or one object."""

    file: str
    byte_offset: int
    byte_length: int
    expected: int
    problem: dict[str, Any]
    crc: int = 0


def _items(ckpt: Checkpoint, pieces: dict[str, list[PieceMeta]]) -> list[_Item]:
    out = [
        _Item(p.file, p.byte_offset, p.byte_length, p.crc32c, {"kind": "checksum", "tensor": fqn, "what": f"tensor {fqn!r} piece {_region_text(p.region)}"})
        for fqn in sorted(pieces) for p in pieces[fqn]
    ]
    out += [
        _Item(o.file, o.byte_offset, o.byte_length, o.crc32c, {"kind": "object-checksum", "object": o.key, "what": f"object {o.key!r}" + ("" if o.rank is None else f" of rank {o.rank}")})
        for o in ckpt.meta.objects
    ]
    return sorted(out, key=lambda i: (i.file, i.byte_offset))


def _check_checksums(
    backend: Backend, ckpt: Checkpoint, pieces: dict[str, list[PieceMeta]], sizes: dict[str, int],
    problems: list[Problem], progress: bool, chunk_bytes: int,
) -> int:
    """Stream every piece and object through CRC-32C; returns the bytes checked."""
    readable: list[_Item] = []
    for item in _items(ckpt, pieces):
        if item.file not in sizes:
            continue  # missing or unlisted: reported already
        if item.byte_offset + item.byte_length > sizes[item.file]:
            problems.append(_item_problem(item, "past-end", f"lies past the end of {item.file} ({sizes[item.file]} bytes)"))
        else:
            readable.append(item)
    total = sum(i.byte_length for i in readable)
    bar = _progress_bar(total) if progress else None
    gen = ckpt.meta.generation
    bad = _stream(backend, gen, readable, chunk_bytes, bar)
    if bar is not None:
        bar.close()
    # Bytes a node cache served may have been corrupted on their way into it: drop those copies and read
    # the failing items again from the remote (tierckpt.loading.reread); only a mismatch there is reported.
    if bad and forget_cached(node_face(backend), {(layout.in_generation(gen, i.file), i.byte_offset, i.byte_offset + i.byte_length) for i in bad}):
        for item in bad:
            item.crc = 0
        bad = _stream(backend, gen, bad, chunk_bytes, None)
    for item in bad:
        problems.append(_item_problem(item, item.problem["kind"], f"checksum mismatch (stored {item.expected:#010x}, read {item.crc:#010x})"))
    for item in readable:
        if item.byte_length == 0 and item.expected != 0:
            problems.append(_item_problem(item, item.problem["kind"], f"checksum mismatch (stored {item.expected:#010x} for 0 bytes)"))
    return total


def _stream(backend: Backend, gen: str, items: list[_Item], chunk_bytes: int, bar: Any) -> list[_Item]:
    """Read ``items`` through CRC-32C in batches of at most ``chunk_bytes``; the items whose CRC differs."""
    bad: list[_Item] = []
    buffer = bytearray(max(1, min(chunk_bytes, sum(i.byte_length for i in items))))
    sched = get_scheduler()
    for batch in _batches(items, chunk_bytes):
        view = memoryview(buffer)
        requests, cursor = [], 0
        for item, start, length in batch:
            requests.append(ReadRequest(key=layout.in_generation(gen, item.file), start=item.byte_offset + start, out=view[cursor : cursor + length]))
            cursor += length
        sched.run(sched.read(backend, requests))
        for (item, start, length), req in zip(batch, requests):
            item.crc = crc32c.crc32c(req.out, item.crc)
            if start + length == item.byte_length and item.crc != item.expected:
                bad.append(item)
        if bar is not None:
            bar.update(cursor)
    return bad


def _batches(items: list[_Item], chunk_bytes: int) -> Iterator[list[tuple[_Item, int, int]]]:
    """Segments ``(item, start, length)`` grouped so each batch reads at most ``chunk_bytes``."""
    batch: list[tuple[_Item, int, int]] = []
    room = chunk_bytes
    for item in items:
        start = 0
        while start < item.byte_length:
            length = min(room, item.byte_length - start)
            batch.append((item, start, length))
            start += length
            room -= length
            if room == 0:
                yield batch
                batch, room = [], chunk_bytes
    if batch:
        yield batch


def _item_problem(item: _Item, kind: str, what: str) -> Problem:
    info = item.problem
    return Problem(
        kind=kind, file=item.file, tensor=info.get("tensor"), object=info.get("object"),
        byte_offset=item.byte_offset, byte_length=item.byte_length,
        message=f"{info['what']} at {_where_item(item)}: {what}",
    )


def _where_item(item: _Item) -> str:
    return f"{item.file} @ {item.byte_offset} +{item.byte_length}"


def _progress_bar(total: int) -> Any:
    from tierckpt.progress import ByteProgress

    return ByteProgress("verify", total)
