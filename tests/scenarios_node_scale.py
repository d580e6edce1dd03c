"""8-rank scenarios of the load routes (run on every rank of an 8-worker pool, one simulated node or two)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import tierckpt
from scenarios import as_dtensor, make_mesh, reference
from tierckpt.node.host import NODE_ID_ENV
from tierckpt.planner import Topology, topology
from tierckpt.planner.routes import EXCHANGES, STORES

SHAPE = (64, 512)
"""fp32, 128 KiB: rows of 2 KiB, so a rank's column window at 8 ranks is one 256-byte run per row."""


def _load(path: str, state: dict, route: str, nodes: int) -> tierckpt.Monitor:
    """Load with ``nodes`` simulated nodes (``TIERCKPT_NODE_ID``, ranks in blocks). ``route``: ``"auto"``,
    the loader's own costs; ``"exchange"``, costed as an object store (every byte read once by the group,
    parts exchanged); ``"direct"``, a node of one core (the exchange's messages never overlap)."""
    world = dist.get_world_size()
    names = [f"node-{r * nodes // world}" for r in range(world)]
    os.environ[NODE_ID_ENV] = names[dist.get_rank()]
    topo = {
        "exchange": topology("object_store", "gloo", names),
        "direct": Topology(store=STORES["node_local"], exchange=EXCHANGES["gloo"], nodes=tuple(names), cores=1),
        "auto": None,
    }[route]
    try:
        monitor = tierckpt.Monitor()
        tierckpt.load(path, state, monitor=monitor, topology=topo)
    finally:
        os.environ.pop(NODE_ID_ENV, None)
    return monitor


def rows_to_columns(path: str, route: str, nodes: int) -> dict[str, float]:
    """Two matrices saved ``Shard(0)`` (rows) on 8 ranks, loaded ``Shard(1)`` (columns) on the same 8:
    every saved piece meets every loaded one. Bit-exact; returns this rank's load counters."""
    mesh = make_mesh((dist.get_world_size(),))
    full = {name: reference(name, SHAPE, torch.float32) for name in ("a", "b")}
    tierckpt.save(path, {k: as_dtensor(v, mesh, [Shard(0)]) for k, v in full.items()})
    state = {k: as_dtensor(torch.zeros(SHAPE), mesh, [Shard(1)]) for k in full}
    monitor = _load(path, state, route, nodes)
    for k, v in full.items():
        assert torch.equal(state[k].to_local(), as_dtensor(v, mesh, [Shard(1)]).to_local()), k
    dist.barrier()
    return {**monitor.counters, "tensor_bytes": sum(v.nbytes for v in full.values())}


def replicated(path: str, route: str, nodes: int) -> dict[str, float]:
    """Plain (replicated, DDP-style) tensors saved by 8 ranks, loaded whole by each of them. Bit-exact;
    returns this rank's load counters."""
    full = {name: reference(name, SHAPE, torch.float32) for name in ("w", "m")}
    tierckpt.save(path, {k: v.clone() for k, v in full.items()})
    state = {k: torch.zeros(SHAPE) for k in full}
    monitor = _load(path, state, route, nodes)
    assert all(torch.equal(state[k], v) for k, v in full.items())
    dist.barrier()
    return {**monitor.counters, "tensor_bytes": sum(v.nbytes for v in full.values())}
