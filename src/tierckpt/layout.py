"""Where each document of a checkpoint lives under its root, and the commit record.

::

    <root>/COMMIT                                  JSON naming the committed generation (written last)
    <root>/<generation>/meta/header.json           CheckpointMeta
    <root>/<generation>/meta/tensors.parquet       one row per tensor
    <root>/<generation>/meta/pieces.parquet        one row per saved piece
    <root>/<generation>/data/rank-00000.bin        raw tensor bytes written by rank 0
    <root>/<generation>/objects/rank-00000.bin     encoded non-tensor objects written by rank 0

Every save writes a fresh generation; readers follow ``COMMIT``. A re-save therefore never touches
the committed copy until its own commit has replaced the record in one atomic write.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass

from .errors import CorruptCheckpointError
from .metadata import FORMAT_NAME, FORMAT_VERSION, validate_generation

COMMIT = "COMMIT"


def header_key(generation: str) -> str:
    return f"{generation}/meta/header.json"


def tensors_key(generation: str) -> str:
    return f"{generation}/meta/tensors.parquet"


def pieces_key(generation: str) -> str:
    return f"{generation}/meta/pieces.parquet"


def in_generation(generation: str, key: str) -> str:
    """``key`` of a generation; a checkpoint without generations (a torch DCP directory, ``""``) keeps it at the root."""
    return f"{generation}/{key}" if generation else key


def objects_file(rank: int) -> str:
    return f"objects/rank-{rank:05d}.bin"


_STEP_NAME = re.compile(r"step-([0-9]+)")


def step_of(name: str) -> int | None:
    """The step a checkpoint directory name stands for: ``step-00000100``, ``step-100`` -> 100; else ``None``.

    The one rule for step names, shared by :class:`~tierckpt.CheckpointManager`, ``tierckpt ls`` and
    retention: ``step-`` followed by decimal digits, with or without zero padding.
    """
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def step_name(step: int) -> str:
    """The directory name :class:`~tierckpt.CheckpointManager` gives a step: ``step-00000100``."""
    return f"step-{step:08d}"


def new_generation() -> str:
    """A fresh, sortable generation name: ``g-<unix ms>-<random>``."""
    return f"g-{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class CommitRecord:
    generation: str
    committed_unix: float

    def encode(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "generation": self.generation,
            "committed_unix": self.committed_unix,
            "host": os.uname().nodename if hasattr(os, "uname") else "",
        }
        return json.dumps(doc, sort_keys=True).encode()

    @staticmethod
    def decode(data: bytes) -> CommitRecord:
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT_NAME:
                raise ValueError("not a tierckpt commit record")
            return CommitRecord(validate_generation(doc["generation"]), float(doc["committed_unix"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(f"the COMMIT record is unreadable: {exc}") from exc


def stale_generations(keys: list[str], committed: str) -> list[str]:
    """Generations among ``keys`` that ``committed`` superseded: leftovers of crashed or failed saves.

    Only generations older than the committed one count; a newer one may be a save still in flight.
    Names sort by creation time (``g-<unix ms>-...``).
    """
    found = {k.split("/", 1)[0] for k in keys if k.startswith("g-") and "/" in k}
    return sorted(g for g in found if g != committed and g < committed)
