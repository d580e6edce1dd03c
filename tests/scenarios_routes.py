"""Multi-rank scenarios for the load routes (run on every rank of the test pool)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import tierckpt
from distributed import subgroup
from scenarios import assert_same, build, full_state, make_mesh, train
from tierckpt.node.host import NODE_ID_ENV


def ddp_resume(uri: str, storage_options: dict | None, separate_nodes: bool) -> dict[str, float]:
    """DDP model + AdamW trained and saved on 2 ranks, loaded by 2 fresh ranks; bit-exact full states.

    ``separate_nodes``: each rank names its own node (``TIERCKPT_NODE_ID``), as two machines would.
    Returns the load's monitor counters plus ``tensor_bytes`` and ``num_tensors`` of the checkpoint.
    """
    mesh = make_mesh((2,))
    group = subgroup(2)
    stats: dict[str, float] = {}
    if group is not None:
        model, optim = build("ddp", group, mesh)
        train(model, optim, 1, dist.get_rank())
        expected = full_state(model, optim)
        meta = tierckpt.save(uri, {"model": model, "optim": optim}, group=group, storage_options=storage_options)
        model, optim = build("ddp", group, mesh, seed=1)
        previous = os.environ.get(NODE_ID_ENV)
        if separate_nodes:
            os.environ[NODE_ID_ENV] = f"node-{dist.get_rank()}"
        try:
            monitor = tierckpt.Monitor()
            tierckpt.load(uri, {"model": model, "optim": optim}, group=group, storage_options=storage_options, monitor=monitor)
        finally:
            os.environ.pop(NODE_ID_ENV, None)
            if previous is not None:
                os.environ[NODE_ID_ENV] = previous
        assert_same(expected, full_state(model, optim))
        stats = {**monitor.counters, "tensor_bytes": meta.tensor_bytes, "num_tensors": meta.num_tensors}
    dist.barrier()
    return stats


def replicated_flips(path: str, count: int, seed: int) -> dict[str, float]:
    """A plain (replicated) tensor saved by 2 ranks, loaded whole by 2 ranks of one node (direct reads
    from the page cache, checksums shared between the ranks). ``count`` random bit flips, one at a time:
    how many every rank caught with an error naming the file and the tensor; then a clean load's counters."""
    from pathlib import Path

    from scenarios_integrity import SHAPE, flip, full_tensor, random_flips
    from tierckpt.errors import CorruptCheckpointError

    group = subgroup(2)
    result: dict[str, float] = {}
    if group is not None:
        tierckpt.save(path, {"w": full_tensor()}, group=group)
        flips = random_flips(Path(path), count, seed)
        caught = 0
        for file, byte, bit, fqn in flips:
            if dist.get_rank(group) == 0:
                flip(file, byte, bit)
            dist.barrier(group)
            try:
                tierckpt.load(path, {"w": torch.zeros(SHAPE)}, group=group)
            except CorruptCheckpointError as exc:
                caught += str(file.name) in str(exc) and repr(fqn) in str(exc)
            dist.barrier(group)
            if dist.get_rank(group) == 0:
                flip(file, byte, bit)
            dist.barrier(group)
        target = torch.zeros(SHAPE)
        monitor = tierckpt.Monitor()
        tierckpt.load(path, {"w": target}, group=group, monitor=monitor)
        assert torch.equal(target, full_tensor())
        result = {**monitor.counters, "tried": len(flips), "caught": caught, "tensor_bytes": target.numel() * 4}
    dist.barrier()
    return result


def large_exchange(path: str) -> dict[str, float]:
    """Two ranks, each its own simulated node, save two 2 MiB tensors in row halves (``Shard(0)``) and
    load them whole into plain tensors: each half is read once by one rank and sent whole to the other
    (1 MiB deliveries, point to point). ``w``'s target is contiguous, so it is received in place; ``t``'s
    is a transposed view, received into a buffer and copied. Returns the load's counters and the bytes
    of ``w``."""
    from torch.distributed.tensor import Shard

    from scenarios import as_dtensor, reference

    mesh = make_mesh((2,))  # on every rank of the pool: a mesh is built collectively
    group = subgroup(2)
    stats: dict[str, float] = {}
    if group is not None:
        w, t = reference("w", (512, 1024), torch.float32), reference("t", (512, 1024), torch.float32)
        tierckpt.save(path, {"w": as_dtensor(w, mesh, [Shard(0)]), "t": as_dtensor(t, mesh, [Shard(0)])}, group=group)
        targets = {"w": torch.zeros(512, 1024), "t": torch.zeros(1024, 512).t()}
        os.environ[NODE_ID_ENV] = f"node-{dist.get_rank()}"
        try:
            monitor = tierckpt.Monitor()
            tierckpt.load(path, targets, group=group, monitor=monitor)
        finally:
            os.environ.pop(NODE_ID_ENV, None)
        assert torch.equal(targets["w"], w) and torch.equal(targets["t"], t)
        assert not targets["t"].is_contiguous()
        stats = {**monitor.counters, "w_bytes": w.nbytes}
    dist.barrier()
    return stats
