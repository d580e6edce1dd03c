"""A tiny transformers training run for tests/test_integration_transformers.py, and one DDP rank of it.

Run as ``hf_trainer_child.py full|resume OUTPUT RESULT`` with torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set: trains a :class:`TierckptTrainer` on gloo, CPU, and
writes this rank's final weights, optimizer state and the steps it ran to ``RESULT-<rank>.pt``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments, set_seed

STEPS = 10


def tiny_model() -> GPT2LMHeadModel:
    """2 layers, 16 wide, dropout on (so the RNG state matters)."""
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def dataset(n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.randint(0, 64, (8,), generator=g)}
            for _ in range(n)]


def training_args(output_dir: str, **overrides: Any) -> TrainingArguments:
    set_seed(0)
    options: dict[str, Any] = dict(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=4, use_cpu=True, report_to=[],
        save_strategy="steps", save_steps=3, seed=1, disable_tqdm=True, logging_steps=1,
    )
    return TrainingArguments(**{**options, **overrides})


class CountSteps(TrainerCallback):
    """The global steps this trainer ran itself."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        self.steps.append(state.global_step)


def main(mode: str, output_dir: str, result: str) -> None:
    from tierckpt.integrations.transformers import TierckptTrainer

    # 24 samples: 3 batches per rank and epoch, so checkpoint-5 falls inside the second epoch.
    args = training_args(output_dir, save_steps=5, ddp_backend="gloo")
    counter = CountSteps()
    trainer = TierckptTrainer(model=tiny_model(), args=args, train_dataset=dataset(24), callbacks=[counter])
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    torch.save({
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "optimizer": optimizer.state_dict(), "scheduler": trainer.lr_scheduler.state_dict(),
        "steps": counter.steps, "world": torch.distributed.get_world_size(),
    }, f"{result}-{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
