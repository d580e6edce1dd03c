"""tierckpt.integrations.accelerate: save_state/load_state through tierckpt resume an Accelerate run exactly."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402

from tierckpt.errors import CheckpointError  # noqa: E402
from tierckpt.integrations.accelerate import load_state, save_state  # noqa: E402

N_STEPS = 12  # 5 batches an epoch: crosses two epoch boundaries
K_STEPS = 7  # mid-epoch 1


class Counter:
    """A custom object registered for checkpointing."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen = sd["seen"]


def _fresh_accelerator() -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))


def _build(seed: int) -> dict[str, Any]:
    """A prepared run; ``seed`` sets the model's initial weights and the sampler's seed (both restored by a load)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    accelerator = _fresh_accelerator()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    data = torch.utils.data.TensorDataset(torch.randn(20, 4, generator=torch.Generator().manual_seed(7)),
                                          torch.randn(20, 1, generator=torch.Generator().manual_seed(8)))
    # A DataLoader draws a seed from its generator each time an iteration starts: with the global RNG's
    # (no generator=), a mid-epoch resume's skip_first_batches draws once more than the uninterrupted run.
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator())
    model, optim, sched, loader = accelerator.prepare(model, optim, sched, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return {"accelerator": accelerator, "model": model, "optim": optim, "sched": sched, "loader": loader,
            "counter": counter}


def _train(run: dict[str, Any], start: int, stop: int) -> list[float]:
    """Steps ``start``..``stop``: one batch a step, epochs of ``len(loader)`` batches, noise from the global RNG."""
    accelerator, model, optim, sched, loader = (run[k] for k in ("accelerator", "model", "optim", "sched", "loader"))
    losses = []
    step = start
    epoch, skip = divmod(start, len(loader))
    while step < stop:
        loader.set_epoch(epoch)
        for x, y in accelerator.skip_first_batches(loader, skip) if skip else loader:
            noise = torch.randn(()) * 1e-3 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
            loss = ((model(x) - y) ** 2).mean() + noise
            accelerator.backward(loss)
            optim.step()
            sched.step()
            optim.zero_grad()
            run["counter"].seen += len(x)
            losses.append(loss.item())
            step += 1
            if step == stop:
                return losses
        epoch, skip = epoch + 1, 0
    return losses


def _snapshot(run: dict[str, Any]) -> dict[str, Any]:
    model = run["accelerator"].unwrap_model(run["model"])
    return {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": run["optim"].state_dict(),
        "sched": run["sched"].state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "seen": run["counter"].seen,
    }


def _assert_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_resume_is_bit_exact(tmp_path: Any) -> None:
    straight = _build(seed=0)
    straight_losses = _train(straight, 0, N_STEPS)
    expected = _snapshot(straight)

    first = _build(seed=0)
    first_losses = _train(first, 0, K_STEPS)
    first["accelerator"].step = 3
    uri = str(tmp_path / "ckpt")
    save_state(first["accelerator"], uri, global_step=K_STEPS)

    resumed = _build(seed=123)  # other weights, other sampler seed, other RNG streams
    assert resumed["loader"].iteration == 0
    extra = load_state(resumed["accelerator"], uri, global_step=0)
    assert extra == {"global_step": K_STEPS}
    assert resumed["accelerator"].step == 3
    assert resumed["loader"].iteration == K_STEPS // len(resumed["loader"])
    assert resumed["counter"].seen == K_STEPS * 4
    resumed_losses = _train(resumed, K_STEPS, N_STEPS)

    assert first_losses + resumed_losses == straight_losses
    _assert_equal(_snapshot(resumed), expected)


def test_load_refuses_other_prepared_objects(tmp_path: Any) -> None:
    run = _build(seed=0)
    uri = str(tmp_path / "ckpt")
    save_state(run["accelerator"], uri)
    other = _build(seed=0)
    other["accelerator"].register_for_checkpointing(Counter())
    with pytest.raises(CheckpointError, match=r"holds \[.*'custom_0'.*\] but this accelerator has \[.*'custom_1'"):
        load_state(other["accelerator"], uri)


def test_load_refuses_a_checkpoint_of_another_kind(tmp_path: Any) -> None:
    import tierckpt

    run = _build(seed=0)
    uri = str(tmp_path / "plain")
    tierckpt.save(uri, {"model": run["accelerator"].unwrap_model(run["model"])})
    with pytest.raises(CheckpointError, match="not saved by tierckpt.integrations.accelerate.save_state"):
        load_state(run["accelerator"], uri)


def test_hooks_are_refused_not_skipped(tmp_path: Any) -> None:
    run = _build(seed=0)
    run["accelerator"].register_save_state_pre_hook(lambda models, weights, output_dir: None)
    with pytest.raises(CheckpointError, match="register_save_state_pre_hook"):
        save_state(run["accelerator"], str(tmp_path / "ckpt"))
