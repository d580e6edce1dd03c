"""Multi-rank scenario for per-rank load plans (run on every rank of the test pool)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import tierckpt
from scenarios import as_dtensor, make_mesh
from tierckpt.planner import topology


def rows_to_columns(path: str, round_bytes: int) -> dict[str, float]:
    """4 ranks save a 2048 x 2048 fp32 matrix and 6 small ones as row shards (``Shard(0)``) and load
    them as column shards, every slab read once and exchanged (an object store's costs), with
    ``round_bytes`` small enough that each rank cuts its rounds at its own places. The big matrix's
    deliveries are 1 MiB (point to point), the small ones' a few bytes (all-to-all). Asserts each
    rank's columns bit-exact; returns the load's counters."""
    world = dist.get_world_size()
    mesh = make_mesh((world,))
    gen = torch.Generator().manual_seed(7)
    full = {"big": torch.randn(2048, 2048, generator=gen)}
    full.update({f"s{i}": torch.randn(8 + i, 12, generator=gen) for i in range(6)})
    tierckpt.save(path, {k: as_dtensor(v, mesh, [Shard(0)]) for k, v in full.items()})
    targets = {k: as_dtensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}
    monitor = tierckpt.Monitor()
    tierckpt.load(path, targets, round_bytes=round_bytes, chunk_bytes=4 << 20, monitor=monitor,
                  topology=topology("object_store", "gloo", ["n"] * world))
    for k, v in full.items():
        assert torch.equal(targets[k].to_local(), as_dtensor(v, mesh, [Shard(1)]).to_local()), k
    dist.barrier()
    return {**monitor.counters, "tensor_bytes": sum(v.nbytes for v in full.values())}


def planning_fails_on_one_rank(path: str) -> str:
    """2 ranks save and load a row-sharded matrix; rank 1's planning fails (a stand-in for a checkpoint
    whose pieces leave its need uncovered). Returns the error each rank raised: every rank raises, none
    waits for the other in the next collective."""
    from distributed import subgroup
    from tierckpt.loading import generation as load_generation
    from tierckpt.errors import CorruptCheckpointError

    mesh = make_mesh((2,))
    group = subgroup(2)
    if group is None:
        dist.barrier()
        return ""
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    tierckpt.save(path, {"w": as_dtensor(full, mesh, [Shard(0)])}, group=group)
    original = load_generation.plan_rank

    def failing(*args, **kwargs):
        raise CorruptCheckpointError("the checkpoint's pieces of 'w' cover 16 of the 32 elements rank 1 needs")

    if dist.get_rank() == 1:
        load_generation.plan_rank = failing
    try:
        tierckpt.load(path, {"w": as_dtensor(torch.zeros(8, 8), mesh, [Shard(1)])}, group=group)
    except CorruptCheckpointError as exc:
        return str(exc)
    finally:
        load_generation.plan_rank = original
        dist.barrier()
    return "no error"
