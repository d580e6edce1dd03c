"""Scenarios for ``group="self"`` (rank-local saves and loads) run on every rank of the gloo worker pool
(tests/distributed.py) by tests/test_integration_lightning.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tierckpt


def rank_zero_saves_alone(root: str) -> tuple[int, list[float]]:
    """Rank 0 saves with ``group="self"`` while the other ranks wait at a barrier (as Lightning's do); then
    every rank loads it by itself. Returns the saved world size and what this rank loaded."""
    uri = f"{root}/rank0-only"
    if dist.get_rank() == 0:
        tierckpt.save(uri, {"w": torch.arange(4.0), "step": 7}, group="self")
    dist.barrier()
    state = {"w": torch.zeros(4), "step": 0}
    tierckpt.load(uri, state, group="self")
    assert state["step"] == 7
    saved = tierckpt.read_checkpoint(tierckpt.store.open_store(uri))
    return saved.meta.world_size, state["w"].tolist()
