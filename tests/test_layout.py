"""tierckpt.native.layout: the one place that names generations and steps, finds checkpoints and retains them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt.cli import main as cli
from tierckpt.native import layout
from tierckpt.errors import CorruptCheckpointError
from tierckpt.native.keys import validate_key
from tierckpt.manager.api import CheckpointManager


def test_generation_rule() -> None:
    for name in ("g-1", "g-00000003-1795426503517-249c95852def", "g-1763700000000-1a2b3c4d5e6f", "g-" + "a" * 64):
        assert layout.is_generation(name) and layout.validate_generation(name) == name
    for name in ("g-", "g-" + "a" * 65, "g-a/b", "g-a.b", "G-1", "xg-1", "step-1", "", "g-1\n"):
        assert not layout.is_generation(name), name
        with pytest.raises(CorruptCheckpointError, match="invalid generation name"):
            layout.validate_generation(name)
    assert not layout.is_generation(7)  # type: ignore[arg-type]
    assert layout.is_generation(layout.new_generation(5))


def test_generation_path_and_generations_in() -> None:
    assert layout.generation_path("step-1/g-12-ab/data/x") == "step-1/g-12-ab"
    assert layout.generation_path("g-1/meta/header.json") == "g-1"
    assert layout.generation_path("step-1/COMMIT") is None
    assert layout.generation_path("g-1") is None  # a file named like a generation is not a directory
    assert layout.generations_in(["g-1/a", "g-2/b/c", "COMMIT", "g-bad.name/x", "gx/y", "g-3"]) == {"g-1", "g-2"}


def test_step_rule_reads_the_last_part() -> None:
    assert layout.step_of("run/step-100") == 100 and layout.step_of("a/b/step-00000007") == 7
    assert layout.step_of("step-100/x") is None and layout.step_of("ckpt100") is None


def test_find_checkpoints_at_any_depth() -> None:
    keys = [
        "COMMIT", "g-1/meta/header.json", "g-0/data/rank-00000.bin",  # the root itself, with a leftover
        "run/step-1/COMMIT", "run/step-1/g-1/data/rank-00000.bin",
        "run/step-2/g-9/data/rank-00000.bin",  # a save that never committed
        "run/LATEST", "notes/readme.txt",
    ]
    found = layout.find_checkpoints(keys)
    assert found == {
        "": layout.Found(True, frozenset({"g-0", "g-1"})),
        "run/step-1": layout.Found(True, frozenset({"g-1"})),
        "run/step-2": layout.Found(False, frozenset({"g-9"})),
    }
    assert layout.committed_children(keys) == []  # only direct children count
    assert layout.committed_children(["b/COMMIT", "a/COMMIT", "a/g-1/x", "c/g-2/x", "COMMIT"]) == ["a", "b"]


def test_by_step_prefers_the_padded_name() -> None:
    assert layout.by_step(["step-100", "step-00000100", "step-0100", "other", "step-7"]) == {
        100: "step-00000100", 7: "step-7",
    }
    assert layout.by_step(["step-0100", "step-100"]) == {100: "step-0100"}  # then the first sorted


def test_retention_orders_by_step_then_commit_time() -> None:
    order = [(-1, 5.0, "manual"), (10, 2.0, "step-10"), (20, 1.0, "step-20"), (20, 3.0, "step-20-again")]
    assert layout.retention(order, 1, None) == {"step-20-again"}
    assert layout.retention(order, 2, 10) == {"step-10", "step-20", "step-20-again"}
    assert layout.retention(order, None, 20) == {"step-20", "step-20-again"}  # the newest is always kept
    assert layout.retention([], 3, 2) == set()


def test_metadata_and_backends_share_one_key_rule() -> None:
    assert validate_key("g-1/data/rank-00000.bin") == "g-1/data/rank-00000.bin"
    for key in ("", "/abs", "a/../b", "a//b", "a\\b", "a\x00b", "./a"):
        with pytest.raises(CorruptCheckpointError, match="invalid storage key"):
            validate_key(key)


def _save(path: Path, step: int) -> None:
    tierckpt.save(str(path), {"w": torch.full((4,), float(step))})


def test_gc_and_ls_read_steps_by_the_one_rule(tmp_path: Path) -> None:
    """A child without a step-<digits> name has no step: gc counts it older than every step and
    keep_every never keeps it (before, any trailing digits were a step for gc only)."""
    for name in ("step-20", "step-00000030", "ckpt40"):
        _save(tmp_path / name, int(name[-2:]))
    listing = {e["path"]: e["step"] for e in cli.list_checkpoints(str(tmp_path))["checkpoints"]}
    assert listing == {"step-20": 20, "step-00000030": 30, "ckpt40": None}
    result = tierckpt.gc(str(tmp_path), keep_every=20)
    assert result.kept == ("step-20", "step-00000030") and result.deleted == ("ckpt40",)
    assert not (tmp_path / "ckpt40" / layout.COMMIT).exists()
    out = {"w": torch.zeros(4)}
    tierckpt.load(str(tmp_path / "step-20"), out)
    assert torch.equal(out["w"], torch.full((4,), 20.0))


def test_manager_retention_deletes_by_the_one_rule(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path), keep_last=2, keep_every=3)
    for step in range(1, 7):
        manager.save(step, {"w": torch.full((2,), float(step))})
    assert manager.steps() == [3, 5, 6]
    assert json.loads((tmp_path / "LATEST").read_bytes()) == {"step": 6}


def test_a_commit_record_decoded_again_is_the_same_and_a_malformed_one_still_raises() -> None:
    """``CommitRecord.decode`` keeps the records it decoded lately by their bytes: the same bytes give the same
    record; bytes that differ in one place are decoded (and refused) afresh."""
    from tierckpt.errors import CorruptCheckpointError
    from tierckpt.native.layout import CommitRecord, new_generation

    data = CommitRecord(new_generation(3), 1.5, seq=3).encode()
    first = CommitRecord.decode(data)
    assert CommitRecord.decode(data) is first and first.seq == 3
    tampered = data.replace(b'"seq":3', b'"seq":4')
    with pytest.raises(CorruptCheckpointError, match="COMMIT record is unreadable"):
        CommitRecord.decode(tampered)
    with pytest.raises(CorruptCheckpointError):
        CommitRecord.decode(tampered)  # a refusal is never remembered
    assert CommitRecord.decode(bytearray(data)) == first  # other buffers decode too
