"""A tiny Lightning training run that checkpoints through ``TierckptCheckpointIO`` (used by
``tests/test_integration_lightning.py``: imported for the one-process runs, run as one rank per process for DDP).

``python lightning_child.py MODE CKPT_DIR OUT MAX_STEPS`` runs one rank of a job on the CPU (gloo),
its rank environment set as torchrun sets it (``TORCHELASTIC_RUN_ID``, ``RANK``, ``WORLD_SIZE``...): DDP with
``TierckptCheckpointIO``, or with ``LIGHTNING_CHILD_STRATEGY=fsdp2`` FSDP2 through ``TierckptModelParallelStrategy``.
``LIGHTNING_CHILD_HPARAMS=custom``: the FSDP2 module also holds a hyperparameter of a class of its own (only
unpickling reads it back), printed as ``schedule N`` when a resume loads it; ``LIGHTNING_CHILD_WEIGHTS_ONLY=0``
constructs the strategy with ``weights_only=False`` and ``=fit`` passes it to ``trainer.fit`` instead.
MODE:

- ``plain``: train MAX_STEPS steps, no checkpoint;
- ``first``: train MAX_STEPS steps, checkpointing after each epoch's last step (``ModelCheckpoint(save_last=True)``);
- ``resume``: a model initialised from another seed resumes with ``ckpt_path="last"`` and trains to MAX_STEPS.

Each rank writes ``OUT.<rank>.pt``: its parameters and optimizer state (``torch.save``), and prints ``done``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from tierckpt.integrations.lightning import TierckptCheckpointIO

SAMPLES, BATCH = 32, 8


class TinyModule(L.LightningModule):
    """Two Linear layers, AdamW and a step LR schedule: weights, moments, step counters and scheduler state."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


class TinyFSDP2Module(TinyModule):
    """:class:`TinyModule` sharded with FSDP2 over the strategy's data-parallel mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class Schedule:
    """A hyperparameter of a class of the user's own: a checkpoint holding it is read back only by unpickling."""

    def __init__(self, step_size: int) -> None:
        self.step_size = step_size


class TinyFSDP2HparamsModule(TinyFSDP2Module):
    """:class:`TinyFSDP2Module` with a :class:`Schedule` among its hyperparameters; prints the one a resume loads."""

    def __init__(self) -> None:
        super().__init__()
        self.hparams["schedule"] = Schedule(3)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        print(f"schedule {checkpoint['hyper_parameters']['schedule'].step_size}", flush=True)


def loader() -> torch.utils.data.DataLoader:
    """The same random data in every process, unshuffled (Lightning restarts an epoch's loader on resume and
    does not restore the global RNG, so a resume is exact at an epoch's end with a loader whose order does not
    depend on it; under DDP Lightning adds a distributed sampler shuffled by the seed and the epoch)."""
    g = torch.Generator().manual_seed(1234)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def fit(max_steps: int, ckpt_dir: str | None, *, resume: bool = False, init_seed: int = 0, world: int = 1,
        model_class: type[TinyModule] = TinyModule, weights_only: bool | None = None, **trainer: Any) -> L.Trainer:
    """Train a fresh :class:`TinyModule` (initialised from ``init_seed``, the global seed staying 0: under DDP
    it seeds Lightning's distributed sampler) to ``max_steps`` on ``world`` ranks; with
    ``ckpt_dir``, checkpoint after each epoch's last step (the newest kept, and ``last.ckpt``); ``resume``: from
    ``ckpt_path="last"``. (Lightning's own epoch-end checkpoint, ``every_n_epochs``, is saved before the epoch's
    scheduler step, and a resume from it is not exact with any ``CheckpointIO``.)"""
    L.seed_everything(0, verbose=False)
    with torch.random.fork_rng():
        torch.manual_seed(init_seed)
        model = model_class()
    every = SAMPLES // BATCH // world
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=every)] if ckpt_dir else []
    t = L.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False, deterministic=True,
        enable_model_summary=False, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks,
        **({} if "strategy" in trainer and not isinstance(trainer["strategy"], str) else {"plugins": [TierckptCheckpointIO()]}),
        **trainer,
    )
    t.fit(model, loader(), ckpt_path="last" if resume else None, weights_only=weights_only)
    return t


def trained_state(t: L.Trainer) -> dict[str, Any]:
    """What an exact resume must reproduce: the parameters, the optimizer's and the scheduler's state (sharded
    tensors gathered whole, a collective: every rank calls it)."""
    return {
        "params": {k: _whole(v.detach()) for k, v in t.lightning_module.state_dict().items()},
        "optimizer": _whole(t.optimizers[0].state_dict()),
        "scheduler": t.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": t.global_step,
    }


def _whole(value: Any) -> Any:
    """``value`` with every DTensor replaced by its full tensor (a copy)."""
    if isinstance(value, torch.Tensor):
        return value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


def main() -> None:
    mode, ckpt_dir, out, max_steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    strategy, world = os.environ.get("LIGHTNING_CHILD_STRATEGY", "ddp"), int(os.environ["WORLD_SIZE"])
    if strategy == "fsdp2":
        from tierckpt.integrations.lightning import TierckptModelParallelStrategy

        weights_only = os.environ.get("LIGHTNING_CHILD_WEIGHTS_ONLY")
        extra: dict[str, Any] = {
            "strategy": TierckptModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                                      weights_only=False if weights_only == "0" else None),
            "model_class": TinyFSDP2HparamsModule if os.environ.get("LIGHTNING_CHILD_HPARAMS") == "custom" else TinyFSDP2Module,
            "weights_only": False if weights_only == "fit" else None,
        }
    else:
        extra = {"strategy": "ddp"}
    t = fit(max_steps, None if mode == "plain" else ckpt_dir, resume=mode == "resume", init_seed=1 if mode == "resume" else 0,
            world=world, devices=world, num_nodes=1, **extra)
    torch.save(trained_state(t), f"{out}.{t.global_rank}.pt")
    print("done", flush=True)


if __name__ == "__main__":
    main()
