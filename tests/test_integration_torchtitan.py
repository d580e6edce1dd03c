"""``tierckpt.integrations.torchtitan``: torchtitan's ``BaseCheckpointManager`` through tierckpt, against the real
library (its ``OptimizersContainer``, ``LRSchedulersContainer`` and config machinery), FSDP2 on gloo CPU ranks,
each rank its own process (tests/torchtitan_child.py) under one deadline so that a hang fails the test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan")

import tierckpt  # noqa: E402
from tierckpt.errors import CheckpointError, CheckpointNotFoundError  # noqa: E402
from tierckpt.integrations.torchtitan import TierckptCheckpointManager  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conftest import free_port  # noqa: E402
from processes import communicate_all  # noqa: E402

CHILD = str(Path(__file__).parent / "torchtitan_child.py")


def _run(ckpt: Path, out: Path, steps: int, world: int = 2, extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, CHILD, str(r), str(world), str(port), str(ckpt), str(out), str(steps), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(world)
    ]
    for rank, done in enumerate(communicate_all(procs, 240, f"torchtitan run {out.name}")):
        assert done.returncode == 0, f"rank {rank}:\n{done.stderr[-4000:]}"
    return [torch.load(f"{out}.{r}.pt") for r in range(world)]


def _assert_equal(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert list(got) == list(want), where
    for key in want:
        if isinstance(want[key], torch.Tensor):
            assert torch.equal(got[key], want[key]), f"{where}: {key} differs"
        else:
            assert got[key] == want[key], f"{where}: {key}: {got[key]!r} != {want[key]!r}"


@pytest.mark.multiproc
def test_resume_is_exact_and_reshards_onto_three_ranks(tmp_path: Path) -> None:
    """FSDP2 on 2 ranks: a run resumed from step 2 ends at step 4 bit-exact equal to an uninterrupted one
    (parameters, AdamW moments and steps, scheduled lr, train state, dataloader position). The step-4
    checkpoint then loads onto 3 ranks (dataloader excluded: it cannot reshard), every rank holding the
    saved parameters, optimizer state, lr and step."""
    plain = _run(tmp_path / "plain", tmp_path / "plain", 4)
    _run(tmp_path / "ckpt", tmp_path / "first", 2)
    root = tmp_path / "ckpt" / "ckpt"
    saved = tierckpt.read_checkpoint(tierckpt.store.open_store(str(root / "step-00000002")))
    assert saved.meta.world_size == 2
    assert "model.0.weight" in saved.tensors and "optimizer.state.0.weight.exp_avg" in saved.tensors
    resumed = _run(tmp_path / "ckpt", tmp_path / "resume", 4)
    for rank in range(2):
        assert resumed[rank]["step"] == 4 and resumed[rank]["position"] == 4
        for part in ("params", "optim"):
            _assert_equal(resumed[rank][part], plain[rank][part], f"rank {rank} {part}")
        assert resumed[rank]["lr"] == plain[rank]["lr"]
    three = _run(tmp_path / "plain", tmp_path / "three", 4, world=3, extra=("--exclude", "dataloader"))
    for rank in range(3):
        assert three[rank]["step"] == 4 and three[rank]["position"] == 0  # dataloader excluded: not loaded
        for part in ("params", "optim"):
            _assert_equal(three[rank][part], plain[0][part], f"rank {rank} of 3, {part}")
        assert three[rank]["lr"] == plain[0]["lr"]


@pytest.mark.multiproc
def test_dataloader_at_another_degree_is_refused_by_name(tmp_path: Path) -> None:
    """Loading a 2-rank checkpoint on 3 ranks with the dataloader included fails on every rank, naming the
    fix, instead of one rank loading another's position."""
    _run(tmp_path / "ckpt", tmp_path / "first", 2)
    got = _run(tmp_path / "ckpt", tmp_path / "three", 2, world=3, extra=("--expect-error",))
    for rank in range(3):
        assert "saved by 2 data-parallel ranks and this run has 3" in got[rank]["error"], got[rank]
        assert "exclude_from_loading" in got[rank]["error"]


def test_hf_formats_are_refused_when_configured() -> None:
    with pytest.raises(CheckpointError, match="does not read or write Hugging Face safetensors"):
        TierckptCheckpointManager.Config(enable=True, last_save_in_hf=True)


def test_disabled_manager_does_nothing(tmp_path: Path) -> None:
    manager = TierckptCheckpointManager.Config(enable=False).build(
        dataloader=None, model_parts=[torch.nn.Linear(2, 2)], optimizers=None, lr_schedulers=None, states={},
        sd_adapter=None, base_folder=str(tmp_path),
    )
    assert manager.load() is False and manager.save(10) is False
    assert list(tmp_path.iterdir()) == []


def test_load_step_not_committed_is_refused_by_name(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    manager = TierckptCheckpointManager.Config(enable=True, load_step=5).build(
        dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
        sd_adapter=None, base_folder=str(tmp_path),
    )
    with pytest.raises(CheckpointNotFoundError, match=r"load_step=5: no committed step 5 under .* \(found \[\]\)"):
        manager.load(5)
    assert manager.load() is False  # no step and no initial_load_path: a fresh start


def _single_process_manager(base: Path, model: torch.nn.Module, **config: Any) -> TierckptCheckpointManager:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return TierckptCheckpointManager.Config(enable=True, **config).build(
        dataloader=None, model_parts=[model], optimizers=optimizer, lr_schedulers=scheduler, states={},
        sd_adapter=None, base_folder=str(base),
    )


def test_initial_load_path_starts_a_new_folder_from_the_model_alone(tmp_path: Path) -> None:
    """With nothing under ``folder``, ``initial_load_path`` (model only, torchtitan's default) fills the model
    and leaves the optimizer and scheduler as built; ``last_save_model_only`` writes the model in
    ``export_dtype`` alone."""
    torch.manual_seed(0)
    source = torch.nn.Linear(3, 2)
    saver = _single_process_manager(tmp_path / "a", source, interval=2, export_dtype="bfloat16")
    assert saver.save(1) is False and saver.save(2) is True and saver.save(3, last_step=True) is True
    last = tierckpt.read_checkpoint(tierckpt.store.open_store(saver.manager.uri_of(3)))
    dtypes = {key: t.dtype for key, t in last.tensors.items()}
    assert dtypes == {"model.weight": "bfloat16", "model.bias": "bfloat16"}
    target = torch.nn.Linear(3, 2)
    loader = _single_process_manager(tmp_path / "b", target, initial_load_path=saver.manager.uri_of(2))
    assert loader.load() is True
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)
    assert loader.states["optimizer"].state == {}  # model only: the optimizer keeps its built state
