"""Multi-rank scenarios: one rank's reads (or writes) fail in the middle of a load (a save).

Run on every rank of tests/distributed.py's pool. The failure is injected on one rank only, at the local
store's read calls (every way the read step reads a local file), after the metadata and the pre-read
checks, so it strikes while the other ranks wait for that rank's part of an exchange.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import tierckpt
from scenarios import as_dtensor, make_mesh, reference
from tierckpt.backends.local import LocalBackend
from tierckpt.errors import StorageError
from tierckpt.node.host import NODE_ID_ENV
from tierckpt.planner import topology

SHAPE = (64, 512)
INJECTED = "injected read failure"


def _failing(name: str):
    original = getattr(LocalBackend, name)

    async def read(self, key: str, *args, **kwargs):
        if "/data/" in f"/{key}":
            raise StorageError(f"{INJECTED}: {name} of {key} on rank {dist.get_rank()}")
        return await original(self, key, *args, **kwargs)

    return original, read


def one_rank_fails_its_reads(path: str, failing_rank: int, timeout_s: float) -> dict[str, str]:
    """Save two matrices ``Shard(0)`` on every rank; load them ``Shard(1)`` on the same ranks, the route
    costed as an object store (each byte read once, parts exchanged in rounds), ``failing_rank``'s local reads
    failing. Returns this rank's error type and message (every rank must raise)."""
    world = dist.get_world_size()
    mesh = make_mesh((world,))
    full = {name: reference(name, SHAPE, torch.float32) for name in ("a", "b")}
    tierckpt.save(path, {k: as_dtensor(v, mesh, [Shard(0)]) for k, v in full.items()})
    state = {k: as_dtensor(torch.zeros(SHAPE), mesh, [Shard(1)]) for k in full}
    names = [f"node-{r * 2 // world}" for r in range(world)]
    os.environ[NODE_ID_ENV] = names[dist.get_rank()]
    patched = {}
    if dist.get_rank() == failing_rank:
        for name in ("read_runs", "read_segments", "read_into", "_read_range"):
            patched[name], replacement = _failing(name)
            setattr(LocalBackend, name, replacement)
    try:
        tierckpt.load(path, state, topology=topology("object_store", "gloo", names), collective_timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return {"type": type(exc).__name__, "message": str(exc)}
    finally:
        for name, original in patched.items():
            setattr(LocalBackend, name, original)
        os.environ.pop(NODE_ID_ENV, None)
        dist.barrier()
    return {"type": "", "message": "the load succeeded"}


def one_rank_fails_its_writes(path: str, failing_rank: int, timeout_s: float) -> dict[str, str]:
    """Save two matrices ``Shard(0)`` on every rank, ``failing_rank``'s data-file writes failing. Returns this
    rank's error type and message (every rank must raise, and nothing may be committed)."""
    world = dist.get_world_size()
    mesh = make_mesh((world,))
    full = {name: reference(name, SHAPE, torch.float32) for name in ("a", "b")}
    original = LocalBackend.open_writer

    async def refused(self, key: str):
        if "/data/" in f"/{key}":
            raise StorageError(f"{INJECTED}: writing {key} on rank {dist.get_rank()}")
        return await original(self, key)

    if dist.get_rank() == failing_rank:
        LocalBackend.open_writer = refused
    try:
        tierckpt.save(path, {k: as_dtensor(v, mesh, [Shard(0)]) for k, v in full.items()}, collective_timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return {"type": type(exc).__name__, "message": str(exc), "committed": str(os.path.exists(os.path.join(path, "COMMIT")))}
    finally:
        LocalBackend.open_writer = original
        dist.barrier()
    return {"type": "", "message": "the save succeeded"}
