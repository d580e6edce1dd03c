"""The names under a checkpoint root, how checkpoints are found among keys, and the commit record.

The one place that knows the layout: callers ask :func:`is_generation`, :func:`step_of`,
:func:`find_checkpoints` and :func:`retention` instead of matching names themselves.

::

    <root>/COMMIT                                  JSON naming the committed generation (written last)
    <root>/<generation>/meta/header.json           CheckpointMeta
    <root>/<generation>/meta/tensors.parquet       one row per tensor
    <root>/<generation>/meta/pieces.parquet        one row per saved piece
    <root>/<generation>/data/rank-00000.bin        raw tensor bytes written by rank 0
    <root>/<generation>/objects/rank-00000.bin     encoded non-tensor objects written by rank 0

Every save writes a fresh generation; readers follow ``COMMIT``. A re-save therefore never touches
the committed copy until its own commit has replaced the record in one atomic compare-and-swap
(:meth:`~tierckpt.backends.Backend.commit` with the record the save started from as ``expected``).

Commit sequence. Each record carries ``seq``, one more than the record it replaced, and each
generation's name carries the ``seq`` its save will commit as. Because the commit is a compare-and-swap
against the record the save started from, a generation whose ``seq`` is at most the committed record's
can never be committed: :func:`superseded_generations` may delete it while its save still runs (that
save then fails with ``CheckpointBusyError``). No decision depends on a clock.

Checksums. A record lists the size and CRC-32C of each metadata document of its generation and ends
with the CRC-32C of its own canonical encoding, so one flipped bit anywhere in the metadata is caught.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import crc32c

from tierckpt.errors import CheckpointError, CorruptCheckpointError

FORMAT_NAME = "tierckpt"
"""Stamped in ``COMMIT`` and ``meta/header.json``; readers reject documents naming another format."""
FORMAT_VERSION = 1
"""Major format version: a reader reads exactly its own (minor versions: :data:`tierckpt.native.metadata.FORMAT_MINOR`)."""

COMMIT = "COMMIT"
HEADER = "meta/header.json"
TENSORS = "meta/tensors.parquet"
PIECES = "meta/pieces.parquet"
META_DOCUMENTS = (HEADER, TENSORS, PIECES)
"""The metadata documents of a generation (keys relative to it) whose checksums ``COMMIT`` records."""


def header_key(generation: str) -> str:
    return in_generation(generation, HEADER)


def tensors_key(generation: str) -> str:
    return in_generation(generation, TENSORS)


def pieces_key(generation: str) -> str:
    return in_generation(generation, PIECES)


def in_generation(generation: str, key: str) -> str:
    """``key`` of a generation; a checkpoint without generations (a torch DCP directory, ``""``) keeps it at the root."""
    return f"{generation}/{key}" if generation else key


def objects_file(rank: int) -> str:
    return f"objects/rank-{rank:05d}.bin"


_STEP_NAMES = (
    re.compile(r"(?:step|checkpoint)-([0-9]+)"),
    re.compile(r"(?:[^/]*-)?step=([0-9]+)(?:-[^/]*?)?(?:\.ckpt)?"),
)
"""tierckpt's and Hugging Face's names (``step-100``, ``checkpoint-100``), and Lightning's (``step=100``
as a ``-``-separated field, ``.ckpt`` optional: ``epoch=2-step=100.ckpt``, ``epoch=2-step=100-v1.ckpt``)."""


def step_of(name: str) -> int | None:
    """The step a checkpoint name stands for: ``step-00000100``, ``step-100`` -> 100; else ``None``.

    The one rule for step names, shared by :class:`~tierckpt.CheckpointManager`, ``tierckpt ls`` and
    ``tierckpt gc``: the last part of ``name`` is ``step-`` followed by decimal digits, with or
    without zero padding (``run/step-100`` -> 100; ``ckpt100``, ``step-1a`` -> ``None``); or what other
    trainers write: Hugging Face's ``checkpoint-100``, Lightning's ``epoch=2-step=100.ckpt`` (``step=N``
    as a field of a ``-``-separated name, with or without ``.ckpt``, other fields such as ``-v1`` or
    ``-val_loss=0.12`` around it) -> 100.
    """
    last = name.rpartition("/")[2]
    for pattern in _STEP_NAMES:
        match = pattern.fullmatch(last)
        if match:
            return int(match.group(1))
    return None


def step_name(step: int) -> str:
    """The directory name :class:`~tierckpt.CheckpointManager` gives a step: ``step-00000100``; a step is
    a non-negative integer (``step--0000001`` would be read back as no step at all)."""
    try:
        number = -1 if isinstance(step, bool) else operator.index(step)
    except TypeError:
        number = -1
    if number < 0:
        raise CheckpointError(
            f"step {step!r} is not a training step: steps are non-negative integers (0, 1, 2, ...); pass the "
            "step counter of the training loop"
        )
    return f"step-{number:08d}"


_GENERATION = re.compile(r"g-[0-9A-Za-z_-]{1,64}")
"""Every generation name a reader accepts (older writers' names included)."""
_SEQUENCED_NAME = re.compile(r"^g-(\d{1,18})-\d{1,20}-[0-9a-f]{1,32}$")
_MAX_SEQ = 10**18 - 1


def is_generation(name: str) -> bool:
    """Whether ``name`` (one path part) is a generation directory: ``g-`` and 1 to 64 of ``[0-9A-Za-z_-]``."""
    return isinstance(name, str) and _GENERATION.fullmatch(name) is not None


def validate_generation(name: str) -> str:
    """``name`` if it is a generation name, else :class:`CorruptCheckpointError` (it came from stored metadata)."""
    if not is_generation(name):
        raise CorruptCheckpointError(
            f"invalid generation name {name!r} in checkpoint metadata: generation names match "
            f"{_GENERATION.pattern!r}"
        )
    return name


def generation_path(key: str) -> str | None:
    """The generation directory a key lies in: ``"step-1/g-12-ab/data/x"`` -> ``"step-1/g-12-ab"``; else ``None``."""
    parts = key.split("/")
    for i, part in enumerate(parts[:-1]):
        if is_generation(part):
            return "/".join(parts[: i + 1])
    return None


def new_generation(seq: int = 1) -> str:
    """A fresh generation name ``g-<seq>-<unix ms>-<random>`` for a save that will commit as ``seq``.

    The wall-clock part only helps people read listings; no decision depends on it.
    """
    return f"g-{seq:08d}-{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:12]}"


def seq_of(generation: str) -> int | None:
    """The commit sequence a generation's save commits as (``None``: a name from before sequences)."""
    match = _SEQUENCED_NAME.match(generation)
    return int(match.group(1)) if match else None


def next_seq(base: bytes | None) -> int:
    """The sequence of a save that starts from the ``COMMIT`` bytes ``base`` (``None``: no commit yet)."""
    return 1 if base is None else CommitRecord.decode(base).seq + 1


@dataclass(frozen=True, slots=True)
class FileChecksum:
    """Size and CRC-32C of one metadata document, as recorded in ``COMMIT``."""

    size: int
    crc32c: int

    @staticmethod
    def of(data: bytes) -> FileChecksum:
        return FileChecksum(len(data), crc32c.crc32c(data))


def _canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _seq(value: object) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_SEQ:
        raise ValueError(f"field 'seq' is {value!r}, not an integer in [0, {_MAX_SEQ}]")
    return value


def _checksums(value: object) -> tuple[tuple[str, FileChecksum], ...]:
    if not isinstance(value, dict):
        raise ValueError(f"field 'checksums' is a {type(value).__name__}, not an object")
    out = []
    for key, entry in sorted(value.items()):
        size, crc = entry.get("size"), entry.get("crc32c")  # a non-dict entry raises AttributeError
        if type(size) is not int or type(crc) is not int or size < 0 or not 0 <= crc < 2**32:
            raise ValueError(f"field 'checksums' entry {key!r} is {entry!r}, not a size and a 32-bit CRC")
        out.append((key, FileChecksum(size, crc)))
    return tuple(out)


_DECODED_MAX = 64
_DECODED: dict[bytes, CommitRecord] = {}
"""Records decoded lately, by their bytes (:meth:`CommitRecord.decode`)."""


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """The content of ``COMMIT``: which generation is committed, its commit sequence and checksums.

    Records written before sequences and checksums (``seq`` 0, no ``checksums``) still decode.
    """

    generation: str
    committed_unix: float
    seq: int = 0
    """One more than the sequence of the record this one replaced (0: a record from before sequences)."""
    checksums: tuple[tuple[str, FileChecksum], ...] = ()
    """``(key relative to the generation, checksum)`` of each metadata document."""

    def encode(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces) ending with ``crc32c``, the CRC-32C of the rest."""
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "generation": self.generation,
            "committed_unix": self.committed_unix,
            "host": os.uname().nodename if hasattr(os, "uname") else "",
            "seq": self.seq,
            "checksums": {k: {"size": c.size, "crc32c": c.crc32c} for k, c in self.checksums},
        }
        doc["crc32c"] = crc32c.crc32c(_canonical(doc))
        return _canonical(doc)

    @staticmethod
    def generation_in(data: bytes) -> str | None:
        """The generation the record ``data`` names; ``None`` when it is not a readable tierckpt commit record
        (a ``COMMIT`` object some other writer put there)."""
        try:
            return CommitRecord.decode(data).generation
        except CorruptCheckpointError:
            return None

    @staticmethod
    def decode(data: bytes) -> CommitRecord:
        """Parse and check a record; anything malformed raises :class:`CorruptCheckpointError` naming the field.

        Records are small and immutable, and a save reads the same few many times (its base, the tier's,
        the chain below's): the last :data:`_DECODED_MAX` records decoded are kept by their bytes."""
        if type(data) is not bytes:
            return CommitRecord._decode(data)
        known = _DECODED.get(data)
        if known is not None:
            return known
        record = CommitRecord._decode(data)
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.clear()
        _DECODED[data] = record
        return record

    @staticmethod
    def _decode(data: bytes) -> CommitRecord:
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
                raise ValueError("not a tierckpt commit record")
            sealed = any(k in doc for k in ("crc32c", "seq", "checksums"))
            committed = float(doc["committed_unix"])
            if not math.isfinite(committed):
                raise ValueError(f"field 'committed_unix' is {doc['committed_unix']!r}, not a finite number")
            record = CommitRecord(
                generation=validate_generation(doc["generation"]),
                committed_unix=committed,
                seq=_seq(doc["seq"]) if sealed else 0,
                checksums=_checksums(doc["checksums"]) if sealed else (),
            )
            if sealed:
                _check_seal(data, doc)
            return record
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
            what = f"field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise CorruptCheckpointError(
                f"the COMMIT record is unreadable: {type(exc).__name__}: {what}; restore it from a copy, "
                "or delete it and load an earlier checkpoint"
            ) from exc

    def checksum(self, key: str) -> FileChecksum | None:
        """The recorded checksum of the document ``key`` (relative to the generation), if any."""
        return next((c for k, c in self.checksums if k == key), None)

    def check_document(self, key: str, data: bytes, uri: str) -> None:
        """Raise :class:`CorruptCheckpointError` unless ``data`` has the size and CRC-32C recorded for ``key``."""
        expected = self.checksum(key)
        if expected is None:
            return  # a record from before checksums
        actual = FileChecksum.of(data)
        if actual != expected:
            raise CorruptCheckpointError(
                f"{uri}: {key} of generation {self.generation!r} has {actual.size} bytes with CRC-32C "
                f"{actual.crc32c:#010x}, COMMIT records {expected.size} bytes with {expected.crc32c:#010x}: "
                "the metadata is corrupt; restore the checkpoint from a copy or load an earlier one"
            )


def _check_seal(data: bytes, doc: dict) -> None:
    """A record with a sequence must carry its CRC-32C and be byte-for-byte its canonical encoding."""
    stored = doc.get("crc32c")
    if type(stored) is not int:
        raise ValueError(f"field 'crc32c' is {stored!r}, not an integer")
    if _canonical(doc) != bytes(data):
        raise ValueError("it is not in its canonical encoding (edited or corrupted)")
    body = dict(doc)
    del body["crc32c"]
    actual = crc32c.crc32c(_canonical(body))
    if actual != stored:
        raise ValueError(f"its CRC-32C is {actual:#010x}, it records {stored:#010x} (corrupted)")


def generations_in(keys: Iterable[str]) -> set[str]:
    """Generation names among the keys of a root (``g-.../...``)."""
    return {part for k in keys if "/" in k and is_generation(part := k.split("/", 1)[0])}


def is_superseded(generation: str, record: CommitRecord) -> bool:
    """Whether ``generation`` (not the committed one) can never be committed over ``record``.

    Its save started from a record older than ``record`` (its sequence is at most ``record.seq``), so its
    compare-and-swap of ``COMMIT`` must fail. A name from before sequences is superseded once the
    root holds a sequenced record: no writer of this format version names a generation that way.
    """
    seq = seq_of(generation)
    if seq is None:
        return record.seq > 0
    return seq <= record.seq


def superseded_generations(keys: Iterable[str], record: CommitRecord) -> list[str]:
    """Generations among ``keys`` that are safe to delete: neither committed nor possibly in flight."""
    return sorted(g for g in generations_in(keys) if g != record.generation and is_superseded(g, record))


class Found(NamedTuple):
    """What the keys under a root show of one checkpoint (see :func:`find_checkpoints`)."""

    committed: bool
    """It has a ``COMMIT`` record."""
    generations: frozenset[str]
    """Its generation directories (the committed one included)."""


def find_checkpoints(keys: Iterable[str]) -> dict[str, Found]:
    """Every checkpoint among the keys of a root, at any depth: prefix (``""``: the root) -> :class:`Found`.

    A checkpoint is a prefix holding a ``COMMIT`` record or generation directories (a save that never
    committed). The one discovery rule, shared by ``tierckpt ls``, ``tierckpt gc`` and
    :class:`~tierckpt.CheckpointManager`.
    """
    committed: set[str] = set()
    generations: dict[str, set[str]] = {}
    for key in keys:
        prefix, _, last = key.rpartition("/")
        if last == COMMIT:
            committed.add(prefix)
            continue
        path = generation_path(key)
        if path is not None:
            prefix, _, generation = path.rpartition("/")
            generations.setdefault(prefix, set()).add(generation)
    return {p: Found(p in committed, frozenset(generations.get(p, ()))) for p in committed | set(generations)}


def committed_children(keys: Iterable[str]) -> list[str]:
    """Names of the root's direct children that are committed checkpoints (``step-100`` for ``step-100/COMMIT``), sorted."""
    return sorted(p for p, found in find_checkpoints(keys).items() if found.committed and p and "/" not in p)


def by_step(names: Iterable[str]) -> dict[int, str]:
    """Step -> name among checkpoint names (:func:`step_of`); of two names of one step the padded
    :func:`step_name` wins, then the first in sorted order. Names without a step are left out."""
    found: dict[int, str] = {}
    for name in sorted(names):
        step = step_of(name)
        if step is not None and (step not in found or name.rpartition("/")[2] == step_name(step)):
            found[step] = name
    return found


def retention(checkpoints: Iterable[tuple[int, float, str]], keep_last: int | None, keep_every: int | None) -> set[str]:
    """Names to keep among committed checkpoints ``(step, committed_unix, name)`` (step -1: none).

    The one retention rule (``tierckpt gc`` and :class:`~tierckpt.CheckpointManager`): keeps the
    ``keep_last`` newest (by step, then commit time, then name), those whose step is a multiple of
    ``keep_every``, and always the newest one.
    """
    order = sorted(checkpoints)
    keep = {name for _, _, name in order[-(keep_last or 1):]}
    if keep_every:
        keep |= {name for step, _, name in order if step >= 0 and step % keep_every == 0}
    return keep
