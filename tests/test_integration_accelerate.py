"""tierckpt.integrations.accelerate: save_state/load_state through tierckpt resume an Accelerate run exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import tierckpt  # noqa: E402
from accelerate_child import (  # noqa: E402
    K_STEPS, N_STEPS, Counter, assert_equal, build, fresh_accelerator, snapshot, split_run, train,
)
from conftest import free_port  # noqa: E402
from processes import communicate_all  # noqa: E402
from tierckpt.errors import CheckpointError  # noqa: E402
from tierckpt.integrations.accelerate import load_state, save_state  # noqa: E402
from tierckpt.formats.select import read_checkpoint  # noqa: E402
from tierckpt.store import open_store  # noqa: E402

CHILD = str(Path(__file__).parent / "accelerate_child.py")


def assert_resumed_exactly(straight_losses: list[float], expected: dict[str, Any], losses: list[float],
                            got: dict[str, Any], seen: dict[str, Any], batches_per_epoch: int) -> None:
    """The split run's losses and final weights, optimizer, scheduler, RNG and registered object equal the
    uninterrupted run's bit for bit, and the load restored the extra value, step counter and loader epoch."""
    assert seen["saves_counted"] == 1
    assert seen["extra"] == {"global_step": K_STEPS}
    assert seen["step"] == 3
    assert seen["iteration_before"] == 0 and seen["iteration"] == K_STEPS // batches_per_epoch > 0
    assert seen["counter"] == K_STEPS * 4
    assert losses == straight_losses
    assert got["optim"]["state"], "no optimizer state to compare"
    assert_equal(got, expected)


def test_resume_is_bit_exact(tmp_path: Any) -> None:
    straight = build(seed=0)
    straight_losses = train(straight, 0, N_STEPS)
    expected = snapshot(straight)
    losses, got, seen = split_run(str(tmp_path / "ckpt"))
    assert_resumed_exactly(straight_losses, expected, losses, got, seen, len(straight["loader"]))


@pytest.mark.multiproc
def test_ddp_two_ranks_resume_is_bit_exact(tmp_path: Path) -> None:
    port, world, result = free_port(), 2, tmp_path / "result"
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, CHILD, str(tmp_path / "ckpt"), str(result)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, done in enumerate(communicate_all(procs, 240, "accelerate DDP run")):
        assert done.returncode == 0, f"rank {rank}:\n{done.stderr[-4000:]}"
    results = [torch.load(f"{result}-{rank}.pt", weights_only=False) for rank in range(world)]
    for r in results:
        assert r["world"] == world
        # 20 samples, 4 a rank and step on 2 ranks: 3 batches an epoch (accelerate's even_batches wraps around)
        assert_resumed_exactly(r["straight_losses"], r["expected"], r["losses"], r["got"], r["seen"], 3)
    # the ranks' random streams differ, so each rank got its own back
    assert not torch.equal(results[0]["got"]["torch_rng"], results[1]["got"]["torch_rng"])


def test_load_refuses_other_prepared_objects(tmp_path: Any) -> None:
    run = build(seed=0)
    uri = str(tmp_path / "ckpt")
    save_state(run["accelerator"], uri)
    other = build(seed=0)
    other["accelerator"].register_for_checkpointing(Counter())
    with pytest.raises(CheckpointError, match=r"holds \[.*'custom_0'.*\] but this accelerator has \[.*'custom_1'"):
        load_state(other["accelerator"], uri)


def test_load_refuses_a_checkpoint_of_another_kind(tmp_path: Any) -> None:
    run = build(seed=0)
    uri = str(tmp_path / "plain")
    tierckpt.save(uri, {"model": run["accelerator"].unwrap_model(run["model"])})
    with pytest.raises(CheckpointError, match="not saved by tierckpt.integrations.accelerate.save_state"):
        load_state(run["accelerator"], uri)


def test_hooks_are_refused_not_skipped(tmp_path: Any) -> None:
    run = build(seed=0)
    run["accelerator"].register_save_state_pre_hook(lambda models, weights, output_dir: None)
    with pytest.raises(CheckpointError, match="register_save_state_pre_hook"):
        save_state(run["accelerator"], str(tmp_path / "ckpt"))


def _two_models(seed: int) -> tuple[Any, list[torch.nn.Module], list[torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    accelerator = fresh_accelerator()
    a, b = torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(3, 1))
    oa, ob = torch.optim.AdamW(a.parameters(), lr=0.01), torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    a, b, oa, ob = accelerator.prepare(a, b, oa, ob)
    return accelerator, [a, b], [oa, ob]


def test_each_optimizer_is_named_by_its_own_model(tmp_path: Path) -> None:
    accelerator, models, optims = _two_models(seed=0)
    models[1](models[0](torch.randn(4, 2))).sum().backward()
    for optim in optims:
        optim.step()
    uri = str(tmp_path / "ckpt")
    save_state(accelerator, uri)
    tensors = set(read_checkpoint(open_store(uri, {})).tensors)
    assert {"optimizer_0.state.weight.exp_avg", "optimizer_1.state.0.weight.momentum_buffer"} <= tensors

    fresh, fresh_models, fresh_optims = _two_models(seed=1)
    load_state(fresh, uri)
    for model, loaded in zip(models, fresh_models):
        assert_equal(model.state_dict(), loaded.state_dict())
    for optim, loaded in zip(optims, fresh_optims):
        assert optim.state_dict()["state"]
        assert_equal(optim.state_dict(), loaded.state_dict())
