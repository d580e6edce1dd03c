"""One rank of a tiny torchtitan-style run for tests/test_integration_torchtitan.py (a process per rank, gloo).

``python torchtitan_child.py RANK WORLD PORT CKPT_DIR OUT STEPS [--exclude KEY ...] [--expect-error]``: builds
an FSDP2 model, torchtitan's ``OptimizersContainer`` (AdamW) and ``LRSchedulersContainer`` (warmup), a
stateful dataloader and train state, and a :class:`TierckptCheckpointManager` (``interval=2``) as torchtitan's
trainer builds it; loads the newest checkpoint, trains up to ``STEPS`` (saving when due), then writes the
full parameters, optimizer state, learning rate, step and dataloader position to ``OUT.<rank>.pt``.
"""

from __future__ import annotations

import argparse
import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

from tierckpt.integrations.torchtitan import TierckptCheckpointManager

GLOBAL_BATCH = 12  # divides among 2 and 3 ranks
TOTAL_STEPS = 4  # the schedule's length, the same for every run (a run may stop before it)


class TrainState:
    """The trainer's own checkpointed state (torchtitan's ``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


class Loader:
    """A stateful dataloader keyed by data-parallel rank, as torchtitan's ``ParallelAwareDataloader``."""

    def __init__(self, rank: int, world: int) -> None:
        self.dp_rank, self.dp_world_size, self.position = rank, world, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.position)
        x = torch.randn(GLOBAL_BATCH, 8, generator=g)
        y = torch.randn(GLOBAL_BATCH, 4, generator=g)
        self.position += 1
        share = GLOBAL_BATCH // self.dp_world_size
        lo = self.dp_rank * share
        return x[lo:lo + share], y[lo:lo + share]

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.dp_rank}": self.position, "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = state_dict[f"dp_rank_{self.dp_rank}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, kind in (("rank", int), ("world", int), ("port", int), ("ckpt", str), ("out", str), ("steps", int)):
        parser.add_argument(name, type=kind)
    parser.add_argument("--exclude", nargs="*", default=[])
    parser.add_argument("--expect-error", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (args.world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(optimizers=optimizers, training_steps=TOTAL_STEPS)
    train_state, loader = TrainState(), Loader(args.rank, args.world)
    manager = TierckptCheckpointManager.Config(
        enable=True, folder="ckpt", interval=2, keep_latest_k=0, exclude_from_loading=args.exclude,
    ).build(dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
            states={"train_state": train_state}, sd_adapter=None, base_folder=args.ckpt)
    try:
        manager.load()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        if not args.expect_error:
            raise
        torch.save({"error": f"{type(exc).__name__}: {exc}"}, f"{args.out}.{args.rank}.pt")
        dist.destroy_process_group()
        return
    while train_state.step < args.steps:
        train_state.step += 1
        x, y = loader.next_batch()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        manager.save(train_state.step, last_step=False)
    manager.close()
    result = {
        "params": {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()},
        "optim": {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in optimizers.state_dict().items()},
        "lr": [group["lr"] for opt in optimizers for group in opt.param_groups],
        "step": train_state.step,
        "position": loader.position,
    }
    torch.save(result, f"{args.out}.{args.rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
