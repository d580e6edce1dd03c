"""Scenario functions run on every rank of the worker pool (see tests/distributed.py).

Each builds real sharded state (DTensor, FSDP2, DDP, FSDP1), saves or loads it with tierckpt on a
subgroup, and compares every loaded element bit-exactly with a reference computed from a seed.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import tierckpt
from distributed import subgroup

SPECS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w": ((37, 24), torch.float32),
    "wide": ((6, 50), torch.float32),
    "b16": ((16, 6), torch.bfloat16),
    "h": ((10, 3), torch.float16),
    "i": ((9,), torch.int64),
    "cube": ((5, 4, 7), torch.float32),
    "scalar": ((), torch.float32),
    "empty": ((0, 4), torch.float32),
}


def reference(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A deterministic tensor for ``name`` (the same on every rank and in every run)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=gen).to(dtype)


def make_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    """A CPU mesh over ranks ``0..prod(shape)-1`` (every rank calls it; members use it)."""
    n = 1
    for d in shape:
        n *= d
    return DeviceMesh("cpu", torch.arange(n).reshape(shape))


def as_dtensor(full: torch.Tensor, mesh: DeviceMesh, placements: list[Any]) -> DTensor:
    """This rank's shard of ``full`` as a DTensor, built locally (no collective)."""
    local_shape, offsets = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    index = tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))
    local = full[index].clone() if full.dim() else full.clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def parse_placements(spec: str, ndim: int) -> list[Any]:
    """``"S0,R"`` -> ``[Shard(0), Replicate()]``; a shard dim past ``ndim`` becomes the last dim."""
    out: list[Any] = []
    for part in spec.split(","):
        out.append(Replicate() if part == "R" else Shard(min(int(part[1:]), ndim - 1)))
    return out


def _layout_state(mesh_shape: tuple[int, ...] | None, spec: str | None, fill: bool) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    mesh = make_mesh(mesh_shape) if mesh_shape else None
    for name, (shape, dtype) in SPECS.items():
        full = reference(name, shape, dtype) if fill else torch.zeros(shape, dtype=dtype)
        if mesh is None or not shape:
            state[name] = full
        else:
            state[name] = as_dtensor(full, mesh, parse_placements(spec, len(shape)))
    return state


def dtensor_reshard(
    path: str, save_mesh: tuple[int, ...] | None, save_spec: str | None,
    load_mesh: tuple[int, ...] | None, load_spec: str | None, storage_options: dict | None = None,
) -> dict[str, float]:
    """Save DTensors laid out one way, load them laid out another; check every element."""
    save_world = _size(save_mesh)
    load_world = _size(load_mesh)
    group = subgroup(save_world)
    mesh_state = _layout_state(save_mesh, save_spec, fill=True) if save_mesh else None
    if group is not None:
        state = mesh_state if mesh_state is not None else _layout_state(None, None, fill=True)
        tierckpt.save(path, {"s": state}, group=group, storage_options=storage_options)
    dist.barrier()
    group = subgroup(load_world)
    targets = _layout_state(load_mesh, load_spec, fill=False) if load_mesh else None
    stats: dict[str, float] = {}
    if group is not None:
        targets = targets if targets is not None else _layout_state(None, None, fill=False)
        monitor = tierckpt.Monitor()
        tierckpt.load(path, {"s": targets}, group=group, monitor=monitor, storage_options=storage_options)
        for name, (shape, dtype) in SPECS.items():
            check_tensor(name, targets[name], reference(name, shape, dtype))
        stats = dict(monitor.counters)
    dist.barrier()
    return stats


def _size(mesh: tuple[int, ...] | None) -> int:
    n = 1
    for d in mesh or ():
        n *= d
    return n


def check_tensor(name: str, loaded: torch.Tensor, full: torch.Tensor) -> None:
    """Bit-exact comparison of a loaded tensor (or this rank's DTensor shard) with the reference."""
    if isinstance(loaded, DTensor):
        local_shape, offsets = compute_local_shape_and_global_offset(full.shape, loaded.device_mesh, loaded.placements)
        index = tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))
        expected = full[index] if full.dim() else full
        got = loaded.to_local()
    else:
        expected, got = full, loaded
    if got.dtype != expected.dtype or not torch.equal(got.view(-1).view(torch.uint8) if got.numel() else got,
                                                      expected.contiguous().view(-1).view(torch.uint8) if expected.numel() else expected):
        raise AssertionError(f"{name}: loaded values differ from the saved ones on rank {dist.get_rank()}")


# -- whole models: plain, DDP, FSDP2, FSDP1 ---------------------------------------------------------
def build(kind: str, group: Any, mesh: DeviceMesh, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A TinyTransformer wrapped as ``kind`` on ``group`` (FSDP2: on ``mesh``), with AdamW."""
    from tierckpt.demo.model import TinyTransformer

    torch.manual_seed(seed)
    model = TinyTransformer()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=group)
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, process_group=group, use_orig_params=True, device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int, rank: int, first: int = 0) -> list[float]:
    from tierckpt.demo.model import batch

    losses = []
    for step in range(first, first + steps):
        x, y = batch(step, rank)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 61), y.reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state as full tensors, gathered by torch's own state_dict utilities."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    return {"model": model_sd, "optim": optim_sd["state"]}


def assert_same(expected: Any, got: Any, path: str = "") -> None:
    if isinstance(expected, dict):
        if set(expected) != set(got):
            raise AssertionError(f"{path}: keys differ: {sorted(map(str, set(expected) ^ set(got)))}")
        for k in expected:
            assert_same(expected[k], got[k], f"{path}.{k}")
    elif isinstance(expected, torch.Tensor):
        if expected.dtype != got.dtype or expected.shape != got.shape or not torch.equal(expected, got):
            raise AssertionError(f"{path}: tensors differ")
    elif expected != got:
        raise AssertionError(f"{path}: {expected!r} != {got!r}")


def module_reshard(path: str, save_kind: str, save_world: int, load_kind: str, load_world: int) -> bool:
    """Train under one framework, save, load under another; compare full states bit-exactly."""
    save_mesh, load_mesh = make_mesh((save_world,)), make_mesh((load_world,))  # collective: every rank
    group = subgroup(save_world)
    if group is not None:
        model, optim = build(save_kind, group, save_mesh)
        train(model, optim, 2, dist.get_rank())
        expected = full_state(model, optim)
        tierckpt.save(path, {"model": model, "optim": optim, "step": 2}, group=group)
        if dist.get_rank() == 0:
            torch.save(expected, path + ".expected")
    dist.barrier()
    group = subgroup(load_world)
    if group is not None:
        model, optim = build(load_kind, group, load_mesh, seed=1)
        state = {"model": model, "optim": optim, "step": 0}
        tierckpt.load(path, state, group=group)
        expected = torch.load(path + ".expected", weights_only=True)
        got = full_state(model, optim)
        assert_same(expected, got)
        if state["step"] != 2:
            raise AssertionError(f"step counter loaded as {state['step']}")
        if model.__class__.__name__ == "TinyTransformer" and model.head.weight is not model.embed.weight:
            raise AssertionError("tied weights came apart")
    dist.barrier()
    return True


def async_then_reshard(path: str) -> bool:
    """FSDP2 on 2 ranks saves asynchronously, keeps training, and 3 ranks load the snapshot."""
    save_mesh, load_mesh = make_mesh((2,)), make_mesh((3,))
    group = subgroup(2)
    if group is not None:
        model, optim = build("fsdp2", group, save_mesh)
        train(model, optim, 1, dist.get_rank())
        expected = full_state(model, optim)  # may alias live tensors (e.g. step): serialize it now
        if dist.get_rank() == 0:
            torch.save(expected, path + ".expected")
        handle = tierckpt.async_save(path, {"model": model, "optim": optim}, group=group)
        train(model, optim, 1, dist.get_rank(), first=1)  # mutates parameters while the save runs
        handle.wait()
    dist.barrier()
    group = subgroup(3)
    if group is not None:
        model, optim = build("fsdp2", group, load_mesh, seed=1)
        tierckpt.load(path, {"model": model, "optim": optim}, group=group)
        assert_same(torch.load(path + ".expected", weights_only=True), full_state(model, optim))
    dist.barrier()
    return True


def async_saves_copy_while_agreeing(path: str) -> list[dict[str, int]]:
    """Four ranks save asynchronously five times, mutating their tensors as soon as each call returns: from
    the second save on, a rank whose offers are unchanged copies its snapshot while the group agrees. At the
    fourth, rank 1 adds a tensor: the others copied under the old plan and take their snapshot again under
    the new one. Every checkpoint holds the values at the call, bit for bit. Returns each save's counters."""
    group = subgroup(4)
    if group is None:
        return []
    rank = dist.get_rank()

    def state(step: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(step)  # plain tensors are replicated: equal on every rank
        tensors = {"w": torch.randn(64, 33), "b": torch.randn(17).to(torch.bfloat16)}
        tensors[f"r{rank}"] = torch.full((9, 5), 100.0 * step + rank)
        if step >= 3 and rank == 1:
            tensors["extra"] = torch.full((12,), float(step))
        return tensors

    counters = []
    for step in range(5):
        live = state(step)
        monitor = tierckpt.Monitor()
        handle = tierckpt.async_save(f"{path}/{step}", live, group=group, monitor=monitor)
        for tensor in live.values():
            tensor.add_(1)  # training goes on at once
        handle.wait(timeout_s=60)
        counters.append({k: int(v) for k, v in monitor.counters.items() if k.startswith(("snapshots", "plan_cache"))})
        expected = state(step)
        loaded = tierckpt.load(f"{path}/{step}", {k: torch.zeros_like(v) for k, v in expected.items()}, group=group)
        assert all(torch.equal(loaded[k], v) for k, v in expected.items()), f"save {step} on rank {rank}"
    return counters


def staging_fails_on_one_rank(path: str) -> str:
    """Rank 1 cannot stage its async save: it raises at once; rank 0, already back in training,
    learns it from ``wait()``; nothing is committed and the previous checkpoint stays loadable."""
    from tierckpt.saving import api as saver

    group = subgroup(2)
    if group is None:
        return ""
    rank = dist.get_rank()
    def state(value: float) -> dict[str, torch.Tensor]:  # two tensors: the balanced plan gives each rank one
        return {"a": torch.full((64, 8), value), "b": torch.full((64, 8), value + 0.5)}

    tierckpt.save(path, state(1.0), group=group)
    acquire = saver._PROCESS.staging.acquire
    if rank == 1:
        def no_memory(*args, **kwargs):
            raise RuntimeError("no pinned memory left")
        saver._PROCESS.staging.acquire = no_memory
    try:
        handle = tierckpt.async_save(path, state(2.0), group=group)
        if rank == 1:
            return "rank 1 returned a handle"
        try:
            handle.wait(timeout_s=60)
        except tierckpt.CheckpointError as exc:
            outcome = f"wait: {exc}"
        else:
            return "rank 0's save committed"
    except RuntimeError as exc:
        outcome = f"raised: {exc}"
    finally:
        saver._PROCESS.staging.acquire = acquire
    dist.barrier(group=group)
    loaded = tierckpt.load(path, state(0.0), group=group)
    assert all(torch.equal(loaded[k], v) for k, v in state(1.0).items()), "the previous checkpoint must be intact"
    generations = [name for name in os.listdir(path) if name.startswith("g-")]
    assert len(generations) == 1, f"the failed save left files behind: {generations}"
    return outcome


def missing_rank(path: str) -> str:
    """Ranks 0-1 save with a short timeout while rank 2 of their 3-rank group never calls save."""
    group = subgroup(3)
    if group is None:
        return ""
    if dist.get_rank() == 2:
        import time

        time.sleep(4)  # never arrives at the save; outlives the others' timeout
        return ""
    try:
        tierckpt.save(path, {"x": torch.ones(3)}, group=group, collective_timeout_s=1.5)
    except tierckpt.CollectiveError as exc:
        return str(exc)
    return "no error"


def soak(uri: str, options: dict, rounds: int) -> dict[str, list[int]]:
    """Every rank saves and loads ``rounds`` times through the node cache to S3; returns RSS and fd counts."""
    import os

    mesh = make_mesh((4,))
    rss, fds = [], []
    for i in range(rounds):
        state = {n: as_dtensor(reference(f"{n}{i}", shape, dtype), mesh, parse_placements("S0", len(shape)))
                 for n, (shape, dtype) in SPECS.items() if shape}
        tierckpt.save(uri, {"s": state, "round": i}, storage_options=options)
        targets = {n: as_dtensor(torch.zeros(shape, dtype=dtype), mesh, parse_placements("S1", len(shape)))
                   for n, (shape, dtype) in SPECS.items() if shape}
        loaded = tierckpt.load(uri, {"s": targets, "round": -1}, storage_options=options)
        if loaded["round"] != i:
            raise AssertionError(f"round {i} loaded round {loaded['round']}")
        for n, (shape, dtype) in SPECS.items():
            if shape:
                check_tensor(n, targets[n], reference(f"{n}{i}", shape, dtype))
        with open("/proc/self/status") as f:
            rss.append(next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")))
        fds.append(len(os.listdir("/proc/self/fd")))
    solo = subgroup(1)  # every rank takes part in creating it; rank 0 checks S3 itself alone
    if solo is not None:
        tierckpt.wait(uri, timeout_s=120, **options)
        direct = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in SPECS.items() if shape}
        tierckpt.load(uri, {"s": direct, "round": -1}, group=solo, storage_options={**options, "cache": False})
        for n, (shape, dtype) in SPECS.items():
            if shape:
                check_tensor(n, direct[n], reference(f"{n}{rounds - 1}", shape, dtype))
    dist.barrier()
    return {"rss_kib": rss, "fds": fds}


def column_reshard(path: str, storage_options: dict | None) -> dict[str, float]:
    """One (64, 1536) fp32 tensor saved row-sharded on 2 ranks, loaded column-sharded on 3 (2 KiB runs)."""
    full = reference("wide_rows", (64, 1536), torch.float32)
    save_mesh, load_mesh = make_mesh((2,)), make_mesh((3,))
    group = subgroup(2)
    if group is not None:
        tierckpt.save(path, {"w": as_dtensor(full, save_mesh, [Shard(0)])}, group=group, storage_options=storage_options)
    dist.barrier()
    group = subgroup(3)
    stats: dict[str, float] = {}
    if group is not None:
        target = as_dtensor(torch.zeros(64, 1536), load_mesh, [Shard(1)])
        monitor = tierckpt.Monitor()
        tierckpt.load(path, {"w": target}, group=group, storage_options=storage_options, monitor=monitor)
        check_tensor("w", target, full)
        stats = dict(monitor.counters)
    dist.barrier()
    return stats
