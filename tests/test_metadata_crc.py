"""Every metadata file's CRC-32C is recorded in COMMIT and COMMIT seals itself: one flipped bit
anywhere in COMMIT, header.json or the Parquet tables is caught by verify and by the default load.
Records written before checksums still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt.native import layout
from tierckpt.errors import CorruptCheckpointError
from tierckpt.formats.verify import verify

POSITIONS_PER_FILE = 64


def sample_state(value: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(int(value))
    return {
        "model": {f"layer{i}.weight": torch.randn(16, 8, generator=g) for i in range(6)},
        "ints": torch.arange(50, dtype=torch.int64),
        "step": 7,
    }


def empty_state() -> dict:
    return {"model": {f"layer{i}.weight": torch.zeros(16, 8) for i in range(6)},
            "ints": torch.zeros(50, dtype=torch.int64), "step": 0}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), sample_state())
    return root


def metadata_files(root: Path) -> list[Path]:
    gen = root / layout.CommitRecord.decode((root / layout.COMMIT).read_bytes()).generation
    return [root / layout.COMMIT, *(gen / key for key in layout.META_DOCUMENTS)]


def positions(size: int) -> list[int]:
    """``POSITIONS_PER_FILE`` byte positions spread over a file, the first and the last included."""
    return sorted({round(i * (size - 1) / (POSITIONS_PER_FILE - 1)) for i in range(POSITIONS_PER_FILE)})


def test_every_flipped_bit_in_the_metadata_is_caught(ckpt: Path) -> None:
    tried = caught_by_verify = caught_by_load = 0
    missed: list[str] = []
    for path in metadata_files(ckpt):
        original = path.read_bytes()
        for pos in positions(len(original)):
            flipped = bytearray(original)
            flipped[pos] ^= 1 << (pos % 8)
            path.write_bytes(bytes(flipped))
            tried += 1
            report = verify(str(ckpt))
            if report.ok:
                missed.append(f"{path.name}@{pos}")
            else:
                caught_by_verify += 1
            try:
                tierckpt.load(str(ckpt), empty_state())
            except CorruptCheckpointError:
                caught_by_load += 1
        path.write_bytes(original)
    print(f"\nmetadata flips: {tried} tried, {caught_by_verify} caught by verify, {caught_by_load} by the default load")
    assert tried >= 240
    assert missed == [], f"verify missed {len(missed)} of {tried} flips: {missed[:10]}"
    assert caught_by_load == tried, f"the default load caught {caught_by_load} of {tried} flips"
    assert verify(str(ckpt)).ok


def test_every_single_bit_flip_of_commit_is_refused(ckpt: Path) -> None:
    """Exhaustively: each of the 8 bits of every byte of COMMIT."""
    data = (ckpt / layout.COMMIT).read_bytes()
    accepted = []
    for pos in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[pos] ^= 1 << bit
            try:
                layout.CommitRecord.decode(bytes(flipped))
            except CorruptCheckpointError:
                continue
            accepted.append((pos, bit))
    print(f"\nCOMMIT flips: {8 * len(data)} tried, {8 * len(data) - len(accepted)} refused")
    assert accepted == [], f"{len(accepted)} of {8 * len(data)} flips decoded: {accepted[:10]}"


def test_commit_records_its_sequence_and_the_checksums_of_the_metadata(ckpt: Path) -> None:
    doc = json.loads((ckpt / layout.COMMIT).read_bytes())
    assert doc["seq"] == 1 and sorted(doc["checksums"]) == sorted(layout.META_DOCUMENTS)
    tierckpt.save(str(ckpt), sample_state(2.0))
    record = layout.CommitRecord.decode((ckpt / layout.COMMIT).read_bytes())
    assert record.seq == 2 and layout.seq_of(record.generation) == 2
    for key in layout.META_DOCUMENTS:
        data = (ckpt / record.generation / key).read_bytes()
        assert record.checksum(key) == layout.FileChecksum.of(data)


def test_a_commit_record_from_before_checksums_still_loads(ckpt: Path) -> None:
    record = layout.CommitRecord.decode((ckpt / layout.COMMIT).read_bytes())
    legacy = {"format": "tierckpt", "format_version": 1, "generation": record.generation,
              "committed_unix": record.committed_unix, "host": "old-host"}
    (ckpt / layout.COMMIT).write_bytes(json.dumps(legacy, sort_keys=True).encode())
    loaded = tierckpt.load(str(ckpt), empty_state())
    assert torch.equal(loaded["model"]["layer3.weight"], sample_state()["model"]["layer3.weight"])
    assert verify(str(ckpt)).ok
    tierckpt.save(str(ckpt), sample_state(3.0))  # a save over a legacy record starts the sequence
    assert layout.CommitRecord.decode((ckpt / layout.COMMIT).read_bytes()).seq == 1


@pytest.mark.parametrize("field, value", [("seq", -1), ("seq", True), ("committed_unix", float("inf")),
                                          ("checksums", {"meta/header.json": {"size": "x", "crc32c": 1}})])
def test_malformed_commit_fields_name_the_field(ckpt: Path, field: str, value: object) -> None:
    doc = json.loads((ckpt / layout.COMMIT).read_bytes())
    doc[field] = value
    del doc["crc32c"]
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    import crc32c

    doc["crc32c"] = crc32c.crc32c(body)
    with pytest.raises(CorruptCheckpointError, match=field):
        layout.CommitRecord.decode(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
