"""Concurrent jobs on one checkpoint URI: one commits, the other fails clearly, nothing is mixed; a
load during a newer save reads the committed checkpoint."""

import threading

import pytest
import torch

import tierckpt
from tierckpt.saving import cleanup
from tierckpt.saving import commit as save_commit


def _state(value: float) -> dict:
    return {"w": torch.full((256, 64), float(value)), "b": torch.full((64,), float(value)), "step": int(value)}


def _load(uri: str) -> dict:
    return tierckpt.load(uri, {"w": torch.zeros(256, 64), "b": torch.zeros(64), "step": 0})


@pytest.fixture
def held_background_commits(monkeypatch):
    """Background (async) saves pause right before their commit until the returned event is set."""
    release = threading.Event()
    original = save_commit._commit

    def commit(p, meta, pieces):
        if threading.current_thread() is not threading.main_thread():
            release.wait(30)
        return original(p, meta, pieces)

    monkeypatch.setattr(save_commit, "_commit", commit)
    yield release
    release.set()


def test_two_jobs_saving_to_one_uri(tmp_path, held_background_commits):
    root = tmp_path / "ckpt"
    first = tierckpt.save(str(root), _state(1)).generation
    job_a = tierckpt.async_save(str(root), _state(2))          # paused before its commit
    third = tierckpt.save(f"file://{root}", _state(3)).generation  # another job (another spelling of the URI)
    held_background_commits.set()
    with pytest.raises(tierckpt.CheckpointBusyError, match="another job committed"):
        job_a.wait()
    loaded = _load(str(root))
    assert torch.equal(loaded["w"], torch.full((256, 64), 3.0)) and loaded["step"] == 3
    generations = {p.name for p in root.iterdir() if p.name.startswith("g-")}
    assert generations <= {first, third}, f"job A's data must be removed, found {sorted(generations)}"
    assert cleanup.wait_pending(30) == []  # the winner's removal of the generation it superseded
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("g-")) == [third]


def test_load_while_a_newer_save_is_in_flight(tmp_path, held_background_commits):
    root = str(tmp_path / "ckpt")
    tierckpt.save(root, _state(1))
    newer = tierckpt.async_save(root, _state(2))                # written, not committed yet
    loaded = _load(root)
    assert torch.equal(loaded["w"], torch.full((256, 64), 1.0)) and loaded["step"] == 1
    held_background_commits.set()
    newer.wait()
    assert _load(root)["step"] == 2
