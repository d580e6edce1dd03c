"""Loads racing a save loop: a load that began on generation N finishes on N or on the newer
COMMIT — never an error, never a torn state."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tierckpt
from tierckpt.native import layout

sys.path.insert(0, str(Path(__file__).parent))
import racing_child  # noqa: E402
from racing_child import SaveHook, empty_state, make_state, matches  # noqa: E402

CHILD = str(Path(__file__).parent / "racing_child.py")
LOADS = 100


def seq(uri: str) -> int:
    """The commit sequence of the checkpoint at ``uri`` (0: nothing committed yet)."""
    try:
        return layout.CommitRecord.decode((Path(uri) / layout.COMMIT).read_bytes()).seq
    except FileNotFoundError:
        return 0


def test_loads_racing_a_save_loop_never_fail(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tierckpt")
    uri = str(tmp_path / "ckpt")
    tierckpt.save(str(tmp_path / "warm"), make_state(0))
    assert matches(tierckpt.load(str(tmp_path / "warm"), empty_state()))  # this process's first load imports and plans
    saver = subprocess.Popen([sys.executable, CHILD, "save-loop", uri, "300"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors: list[str] = []
    steps: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while seq(uri) < 3:  # the save loop is warm
            assert saver.poll() is None and time.monotonic() < deadline, saver.communicate()
            time.sleep(0.01)
        deadline = time.monotonic() + 240
        while len(steps) + len(errors) < LOADS:
            assert time.monotonic() < deadline, f"only {len(steps)} loads in time"
            try:
                loaded = tierckpt.load(uri, empty_state())
            except tierckpt.CheckpointError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            assert matches(loaded), f"load {len(steps)} is torn: not exactly the state of step {loaded['step']}"
            steps.append(loaded["step"])
        assert saver.poll() is None, "the save loop ended before the loads did"
    finally:
        saver.kill()
        saver.communicate()
    restarts = sum("was replaced while loading" in r.getMessage() for r in caplog.records)
    print(f"\nracing loads: {len(steps)} of {LOADS} loads bit-exact, {len(errors)} errors, {restarts} restarted on a "
          f"newer COMMIT, {len(set(steps))} distinct checkpoints seen (saves {min(steps)}..{max(steps)})")
    assert errors == [], f"{len(errors)} of {LOADS} loads failed, e.g. {errors[:3]}"
    assert len(set(steps)) >= 5, f"the loads did not race the saves (steps {sorted(set(steps))})"


def test_a_load_whose_generation_is_replaced_midway_returns_the_newer_checkpoint(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tierckpt")
    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, make_state(1) | {"hook": SaveHook(uri)})
    first = layout.CommitRecord.decode((Path(uri) / layout.COMMIT).read_bytes()).generation
    loaded = tierckpt.load(uri, empty_state() | {"hook": SaveHook(uri, 2)})
    assert loaded["step"] == 2 and matches(loaded)
    assert not (Path(uri) / first).exists()
    assert any(first in r.getMessage() and "replaced while loading" in r.getMessage() for r in caplog.records)


def test_two_ranks_restart_together_when_the_generation_is_replaced_midway(dist_pool, tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, make_state(1) | {"hook": SaveHook(uri)})
    results = [r for r in dist_pool.run(racing_child.load_replaced_midway, uri) if r is not None]
    assert results == [(2, True), (2, True)]


def test_a_missing_file_of_the_committed_generation_is_still_an_error(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, make_state(1))
    (data,) = Path(uri).glob("g-*/data/rank-00000.bin")
    data.unlink()
    with pytest.raises(tierckpt.CorruptCheckpointError, match="is missing"):
        tierckpt.load(uri, empty_state())
