"""A tiny Accelerate training run for tests/test_integration_accelerate.py, and one DDP rank of it.

Run as ``accelerate_child.py CKPT RESULT`` with the variables accelerate reads (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set: on gloo, CPU, trains N_STEPS uninterrupted, then K_STEPS,
``save_state`` to CKPT, and in a fresh Accelerator ``load_state`` and the steps to N_STEPS; writes this
rank's losses and final states of both runs to ``RESULT-<rank>.pt``.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration
from torch import nn

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


def fresh_accelerator() -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))


def build(seed: int) -> dict[str, Any]:
    """A prepared run; ``seed`` sets the model's initial weights and the sampler's seed (both restored by a load)."""
    torch.manual_seed(seed)
    accelerator = fresh_accelerator()
    rank = accelerator.process_index  # per-rank streams: every rank's RNG state must come back
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
    torch.manual_seed(seed * 10 + rank)  # after prepare: the model's initial weights and the sampler's seed are rank 0's
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    return {"accelerator": accelerator, "model": model, "optim": optim, "sched": sched, "loader": loader,
            "counter": counter}


def train(run: dict[str, Any], start: int, stop: int) -> list[float]:
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


def snapshot(run: dict[str, Any]) -> dict[str, Any]:
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


def assert_equal(a: Any, b: Any, where: str = "") -> None:
    """``a`` equals ``b`` exactly, tensors and arrays element by element; ``where`` names the first difference."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def split_run(uri: str, seed: int = 123) -> tuple[list[float], dict[str, Any], dict[str, Any]]:
    """K_STEPS, save_state to ``uri``, then a fresh run (``seed``: other weights, sampler seed and RNG
    streams) that load_state's and trains to N_STEPS: the losses of both parts, the fresh run's snapshot,
    and what its load saw (``extra``, step counter, loader epoch and counter before training on)."""
    from tierckpt.integrations.accelerate import load_state, save_state

    first = build(seed=0)
    losses = train(first, 0, K_STEPS)
    first["accelerator"].step = 3
    save_state(first["accelerator"], uri, global_step=K_STEPS)
    saves_counted = first["accelerator"].save_iteration  # as accelerator.save_state counts them
    resumed = build(seed=seed)
    before = resumed["loader"].iteration
    extra = load_state(resumed["accelerator"], uri, global_step=0)
    seen = {"saves_counted": saves_counted, "extra": extra, "step": resumed["accelerator"].step, "iteration_before": before,
            "iteration": resumed["loader"].iteration, "counter": resumed["counter"].seen}
    losses += train(resumed, K_STEPS, N_STEPS)
    return losses, snapshot(resumed), seen


def main(uri: str, result: str) -> None:
    straight = build(seed=0)
    straight_losses = train(straight, 0, N_STEPS)
    expected = snapshot(straight)
    rank = straight["accelerator"].process_index
    world = straight["accelerator"].num_processes
    losses, got, seen = split_run(uri)
    torch.save({"world": world, "straight_losses": straight_losses, "expected": expected, "losses": losses,
                "got": got, "seen": seen}, f"{result}-{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
