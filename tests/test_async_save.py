"""Asynchronous save: snapshot semantics, bounded staging, plan cache, failure reporting."""

import threading

import pytest
import torch

import scenarios
import tierckpt
from tierckpt.saving import commit as save_commit


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {
        "big": torch.randn(300, 257),
        "half": torch.randn(33, 7).to(torch.bfloat16),
        "ints": torch.arange(1000, dtype=torch.int64),
        "step": 3,
    }


def _zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


@pytest.mark.parametrize("staging_bytes", [None, 4096, 100_001])
def test_training_may_mutate_after_return(tmp_path, staging_bytes):
    """The checkpoint holds the values at the call, even when tensors change right after it returns
    and even when the state is far larger than the staging buffer (it then streams through it)."""
    state = _state()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    handle = tierckpt.async_save(str(tmp_path / "c"), state, staging_bytes=staging_bytes)
    for value in state.values():
        if isinstance(value, torch.Tensor):
            value.add_(1) if value.dtype != torch.bool else None
    meta = handle.wait()
    assert handle.done() and meta.num_tensors == 3
    loaded = tierckpt.load(str(tmp_path / "c"), _zeros_like(state))
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value


def test_unchanged_layout_reuses_the_plan(tmp_path):
    state = _state()
    first, second = tierckpt.Monitor(), tierckpt.Monitor()
    tierckpt.async_save(str(tmp_path / "a"), state, monitor=first).wait()
    state["big"].mul_(2)
    tierckpt.async_save(str(tmp_path / "b"), state, monitor=second).wait()
    assert second.counters["plan_cache_hits"] == 1
    loaded = tierckpt.load(str(tmp_path / "b"), _zeros_like(state))
    assert torch.equal(loaded["big"], state["big"])


def test_background_failure_surfaces_on_wait_and_leaves_no_commit(tmp_path, monkeypatch):
    good = tmp_path / "c"
    tierckpt.save(str(good), _state(1))

    def broken_commit(*args, **kwargs):
        raise OSError("disk vanished")

    monkeypatch.setattr(save_commit, "_commit", broken_commit)
    handle = tierckpt.async_save(str(good), _state(2))
    with pytest.raises(OSError, match="disk vanished"):
        handle.wait()
    monkeypatch.undo()
    loaded = tierckpt.load(str(good), _zeros_like(_state()))
    assert torch.equal(loaded["big"], _state(1)["big"]), "the last committed checkpoint must be intact"


def test_a_snapshot_whose_file_cannot_be_named_fails_the_save_and_keeps_the_last_commit(tmp_path, monkeypatch):
    """The snapshot becomes the data file in the background finish: a failure there fails the save on
    wait() (nothing committed, the staging buffer free again), and the next save commits."""
    from tierckpt.saving.snapshot import Snapshot

    good = tmp_path / "c"
    tierckpt.save(str(good), _state(1))

    def unnamed(self, p, on_written=None):
        raise OSError("no room to name the file")

    monkeypatch.setattr(Snapshot, "stream", unnamed)
    handle = tierckpt.async_save(str(good), _state(2))
    with pytest.raises(OSError, match="no room to name the file"):
        handle.wait()
    loaded = tierckpt.load(str(good), _zeros_like(_state()))
    assert torch.equal(loaded["big"], _state(1)["big"]), "the last committed checkpoint must be intact"
    monkeypatch.undo()
    tierckpt.async_save(str(good), _state(3)).wait(timeout_s=60)
    loaded = tierckpt.load(str(good), _zeros_like(_state()))
    assert torch.equal(loaded["big"], _state(3)["big"])


def test_unwaited_failure_is_raised_by_the_next_save(tmp_path, monkeypatch):
    def broken_commit(*args, **kwargs):
        raise OSError("disk vanished")

    monkeypatch.setattr(save_commit, "_commit", broken_commit)
    handle = tierckpt.async_save(str(tmp_path / "x"), _state())
    while not handle.done():
        threading.Event().wait(0.01)
    monkeypatch.undo()
    with pytest.raises(tierckpt.CheckpointError, match="earlier async save"):
        tierckpt.save(str(tmp_path / "y"), _state())
    tierckpt.save(str(tmp_path / "y"), _state())  # reported once, then saves work again


def test_second_save_to_a_busy_root(tmp_path, monkeypatch):
    release = threading.Event()
    original = save_commit._commit

    def slow_commit(*args, **kwargs):
        release.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(save_commit, "_commit", slow_commit)
    root = str(tmp_path / "c")
    first = tierckpt.async_save(root, _state(1))
    with pytest.raises(tierckpt.CheckpointBusyError):
        tierckpt.async_save(root, _state(2), if_busy="error")
    release.set()
    second = tierckpt.async_save(root, _state(2))  # waits for the first
    assert first.done()
    second.wait()
    loaded = tierckpt.load(root, _zeros_like(_state()))
    assert torch.equal(loaded["big"], _state(2)["big"])


@pytest.mark.multiproc
def test_async_save_fsdp2_then_reshard(dist_pool, tmp_path):
    dist_pool.run(scenarios.async_then_reshard, str(tmp_path / "ckpt"))


@pytest.mark.multiproc
def test_staging_failure_on_one_rank_reaches_every_rank(dist_pool, tmp_path):
    """No collective follows the copy (each rank returns as soon as its own copy is done), so a rank
    that cannot stage reports through the background coordination: rank 0's wait() names it."""
    outcomes = dist_pool.run(scenarios.staging_fails_on_one_rank, str(tmp_path / "ckpt"))
    assert outcomes[1] == "raised: no pinned memory left"
    assert outcomes[0].startswith("wait: ") and "rank 1: RuntimeError: no pinned memory left" in outcomes[0]


@pytest.mark.multiproc
def test_a_rank_copies_its_snapshot_while_the_group_agrees(dist_pool, tmp_path):
    """A rank whose offers match its previous save copies while the group agrees on plan and generation;
    when another rank's offers changed, it takes the snapshot again under the new plan (bit-exact loads are
    checked in the scenario)."""
    counters = dist_pool.run(scenarios.async_saves_copy_while_agreeing, str(tmp_path / "ckpt"))
    for rank in range(4):
        while_agreeing = [c.get("snapshots_while_agreeing", 0) for c in counters[rank]]
        taken_again = [c.get("snapshots_taken_again", 0) for c in counters[rank]]
        cache_hits = [c.get("plan_cache_hits", 0) for c in counters[rank]]
        # save 3: rank 1's offers changed (it adds a tensor), so it waits for the new plan; the others
        # copied under the old one and copy again.
        assert while_agreeing == [0, 1, 1, int(rank != 1), 1], (rank, counters[rank])
        assert taken_again == [0, 0, 0, int(rank != 1), 0], (rank, counters[rank])
        assert cache_hits == [0, 1, 1, 0, 1], (rank, counters[rank])


def test_a_snapshot_that_cannot_be_given_up_neither_hides_the_failure_nor_holds_the_staging_buffer(
        tmp_path, monkeypatch, caplog) -> None:
    """An async save whose agreement fails while its snapshot was copied (the plan of the previous save):
    giving the snapshot up fails too. The save raises its own error, the failed release is logged, and the
    staging buffer is free for the next save (which would otherwise wait for it forever)."""
    import threading

    from tierckpt.errors import CheckpointError
    from tierckpt.saving import api as saver
    from tierckpt.saving.snapshot import Snapshot

    state = {"w": torch.arange(4096, dtype=torch.float32)}
    tierckpt.async_save(str(tmp_path / "a"), state).wait()  # the plan the next save's snapshot is copied under

    def agreement_fails(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise CheckpointError("the group could not agree (injected)")

    def release_fails(self) -> None:  # type: ignore[no-untyped-def]
        raise OSError("the snapshot's memory could not be given up (injected)")

    with monkeypatch.context() as patch:
        patch.setattr(saver, "_agree", agreement_fails)
        patch.setattr(Snapshot, "release", release_fails)
        with caplog.at_level("WARNING", logger="tierckpt"), pytest.raises(CheckpointError, match="could not agree"):
            tierckpt.async_save(str(tmp_path / "b"), state)
    assert "was not given up" in caplog.text and "injected" in caplog.text
    done: list[object] = []
    saving = threading.Thread(target=lambda: done.append(tierckpt.async_save(str(tmp_path / "c"), state).wait()),
                              daemon=True)
    saving.start()
    saving.join(60)
    assert done, "the next save waited for the staging buffer the failed save kept"
    assert torch.equal(tierckpt.load(str(tmp_path / "c"), {"w": torch.zeros(4096)})["w"], state["w"])
