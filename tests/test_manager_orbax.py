"""CheckpointManager features Orbax users expect: best-k retention by a metric, ``should_save``, ``delete``,
a save on SIGTERM (``reached_preemption``), a context manager; and a root given as a ``Path``."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt.native import layout
from tierckpt.manager.api import CheckpointManager
from tierckpt.manager.best import METRICS_TAG
from tierckpt.formats.select import read_checkpoint
from tierckpt.store import open_store

LOSSES = {1: 0.9, 2: 0.3, 3: 0.7, 4: 0.2, 5: 0.8, 6: 0.95}


def by_loss(root: Path, **kwargs: object) -> CheckpointManager:
    return CheckpointManager(root, keep_last=1, best_fn=lambda m: m["loss"], best_mode="min", keep_best=2, **kwargs)


def test_best_k_keeps_the_best_by_metric_and_the_newest_across_a_restart(tmp_path: Path) -> None:
    """keep_best=2 by the lowest loss, keep_last=1: steps 2 and 4 (the best two) and the newest stay; a
    restarted manager ranks the steps its previous self saved from their headers."""
    root = tmp_path / "run"
    manager = by_loss(root)
    for step, loss in LOSSES.items():
        manager.save(step, {"w": torch.full((4,), float(step))}, metrics={"loss": loss})
    assert manager.steps() == [2, 4, 6]
    meta = read_checkpoint(open_store(manager.uri_of(4))).meta
    assert meta.tags[METRICS_TAG] == '{"loss": 0.2}'

    restarted = by_loss(root)  # a new process: knows no scores but its own saves'
    restarted.save(7, {"w": torch.full((4,), 7.0)}, metrics={"loss": 0.1})
    assert restarted.steps() == [4, 7]  # 7 and 4 are now the best two; 7 is also the newest
    target = {"w": torch.zeros(4)}
    assert restarted.load_latest(target) == 7 and torch.equal(target["w"], torch.full((4,), 7.0))


def test_best_k_mode_max_and_steps_without_metrics_are_kept(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "run", best_fn=lambda m: m["acc"], best_mode="max", keep_best=1)
    manager.save(1, {"w": torch.ones(2)}, metrics={"acc": 0.5})
    manager.save(2, {"w": torch.ones(2)})  # no metrics: never deleted by best-k
    manager.save(3, {"w": torch.ones(2)}, metrics={"acc": 0.9})
    manager.save(4, {"w": torch.ones(2)}, metrics={"acc": 0.1})
    assert manager.steps() == [2, 3, 4]  # 3 is the best, 4 the newest, 2 has no score; 1 goes


def test_best_k_refuses_what_it_cannot_rank(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with pytest.raises(tierckpt.CheckpointError, match="best_fn and keep_best go together"):
        CheckpointManager(root, best_fn=lambda m: m["loss"])
    with pytest.raises(tierckpt.CheckpointError, match="best_mode='lowest'"):
        CheckpointManager(root, best_fn=lambda m: m["loss"], best_mode="lowest", keep_best=1)
    with pytest.raises(tierckpt.CheckpointError, match="metrics are ranked by best_fn"):
        CheckpointManager(root).save(1, {"w": torch.ones(2)}, metrics={"loss": 1.0})
    manager = by_loss(root)
    with pytest.raises(tierckpt.CheckpointError, match="best_fn failed on the metrics"):
        manager.save(1, {"w": torch.ones(2)}, metrics={"acc": 1.0})
    with pytest.raises(tierckpt.CheckpointError, match="JSON object"):
        manager.save(1, {"w": torch.ones(2)}, metrics={"loss": torch.ones(1)})
    assert manager.steps() == []  # a refused save wrote nothing


def test_should_save_and_delete(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "run", save_every=5)
    assert [s for s in range(1, 11) if manager.should_save(s)] == [5, 10]
    manager.save(5, {"w": torch.ones(2)})
    manager.save(10, {"w": torch.ones(2)})
    assert not manager.should_save(5)  # saved already
    manager.delete(5)
    assert manager.steps() == [10] and not (tmp_path / "run" / layout.step_name(5)).exists()
    with pytest.raises(tierckpt.CheckpointNotFoundError, match="no committed step 7 to delete"):
        manager.delete(7)


def test_sigterm_makes_the_next_step_a_save_and_close_restores_the_handler(tmp_path: Path) -> None:
    calls: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        manager = CheckpointManager(tmp_path / "run", save_every=100, save_on_preemption=True)
        assert not manager.should_save(7) and not manager.reached_preemption(7)
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice: the process goes on
        assert manager.reached_preemption(7) and manager.should_save(7)
        assert manager.save(7, {"w": torch.full((2,), 7.0)})
        assert not manager.should_save(7)
        assert manager.steps() == [7] and manager.durable_where_uri_points(7)
        assert calls == [signal.SIGTERM]  # the handler installed before still ran
        manager.close()
        assert signal.getsignal(signal.SIGTERM) is not manager.preemption._handle
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM] * 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_context_manager_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, use_async=True) as manager:
        manager.save(3, {"w": torch.full((1000,), 3.0)})
    assert manager._pending is None
    assert (root / "LATEST").read_text() == '{"step": 3}'
    target = {"w": torch.zeros(1000)}
    assert CheckpointManager(root).load_latest(target) == 3 and torch.equal(target["w"], torch.full((1000,), 3.0))


def test_a_path_root(tmp_path: Path) -> None:
    """``CheckpointManager(Path)`` (it raised AttributeError: 'PosixPath' object has no attribute 'strip')."""
    manager = CheckpointManager(tmp_path / "run", keep_last=1)
    manager.save(1, {"w": torch.ones(2)})
    manager.save(2, {"w": torch.full((2,), 2.0)})
    assert manager.root_uri == str(tmp_path / "run") and manager.steps() == [2]


def preempted_on_one_rank(root: str) -> tuple[bool, bool, list[int]]:
    """On every rank: only rank 1 gets SIGTERM; each rank's view of ``should_save`` before and after it."""
    import torch.distributed as dist

    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        manager = CheckpointManager(root, save_every=100, save_on_preemption=True)
        before = manager.should_save(6)
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        after = manager.should_save(7)
        if after:
            manager.save(7, {"w": torch.full((8,), float(dist.get_rank()))})
        manager.close()
        return before, after, manager.steps()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_preemption_notice_on_one_rank_makes_every_rank_save(dist_pool, tmp_path: Path) -> None:
    results = dist_pool.run(preempted_on_one_rank, str(tmp_path / "run"))
    assert results == [(False, True, [7])] * 4
