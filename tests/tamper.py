"""Helpers for tests that rewrite a checkpoint's metadata on purpose (crafted or hostile input)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tierckpt.native import layout


def reseal(root: Path) -> None:
    """Record the rewritten metadata's sizes and CRC-32Cs in COMMIT, as a save would have: the crafted
    documents then reach the decoders' own validation instead of failing COMMIT's checksums."""
    record = layout.CommitRecord.decode((root / layout.COMMIT).read_bytes())
    gen = root / record.generation
    checksums = tuple((k, layout.FileChecksum.of((gen / k).read_bytes())) for k in layout.META_DOCUMENTS)
    (root / layout.COMMIT).write_bytes(dataclasses.replace(record, checksums=checksums).encode())
