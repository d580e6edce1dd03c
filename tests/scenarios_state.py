"""Scenarios (run on every rank of the worker pool) for training state: Megatron-style sharded
tensors, per-rank RNG / sampler / reader resharding, and exact training resume."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import tierckpt
from distributed import subgroup
from scenarios import build, make_mesh, reference
from tierckpt.native.regions import Box
from tierckpt.sharded import (
    FlatShardedTensor, ShardedTensor, column_parallel, row_parallel, stage_layers, vocab_parallel,
)
from tierckpt.state.training import MultiSourceReader, ResumableSampler, RNGState

# -- Megatron-style TP x PP ------------------------------------------------------------------------
LAYERS, HIDDEN, FFN, VOCAB = 4, 6, 8, 13
FLAT_SHAPE = (5, 7)
SENTINEL = -7.0


def _full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    return reference(name, shape, torch.float32)


def megatron_state(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, fill: bool) -> dict[str, Any]:
    """This rank's weights as a Megatron model holds them, described with tierckpt.sharded.

    Locals own their memory (cloned slices), as a real TP model's parameters do; ``fill=False`` gives
    zeros (and a sentinel in vocab padding rows) to load into.
    """

    def local(name: str, shape: tuple[int, ...], dim: int | None) -> torch.Tensor:
        full = _full(name, shape)
        if dim is not None:
            n = shape[dim] // tp_size
            full = full.narrow(dim, tp_rank * n, n)
        return full.clone() if fill else torch.zeros_like(full)

    model: dict[str, Any] = {}
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    padded = -(-VOCAB // tp_size) * tp_size
    for name, present in (("embed.weight", first), ("output_layer.weight", last)):
        if present:
            rows = padded // tp_size
            shard = torch.full((rows, HIDDEN), SENTINEL)
            real = max(0, min(rows, VOCAB - tp_rank * rows))
            if fill:
                shard[:real] = _full(name, (VOCAB, HIDDEN))[tp_rank * rows : tp_rank * rows + real]
            elif real:
                shard[:real] = 0
            model[name] = vocab_parallel(shard, tp_rank, tp_size, vocab_size=VOCAB)
    for i in stage_layers(LAYERS, pp_rank, pp_size):
        p = f"layers.{i}"
        model[f"{p}.fc1.weight"] = column_parallel(local(f"{p}.fc1.weight", (FFN, HIDDEN), 0), tp_rank, tp_size)
        model[f"{p}.fc1.bias"] = column_parallel(local(f"{p}.fc1.bias", (FFN,), 0), tp_rank, tp_size)
        model[f"{p}.fc2.weight"] = row_parallel(local(f"{p}.fc2.weight", (HIDDEN, FFN), 1), tp_rank, tp_size)
        model[f"{p}.fc2.bias"] = local(f"{p}.fc2.bias", (HIDDEN,), None)  # replicated over TP: plain tensor
        # A layer saved under its own name with a prepended axis (Megatron prepend_axis_num=1): the global
        # tensor of that name is the one layer, (1, ffn, hidden), which its TP shards cover.
        n = FFN // tp_size
        model[f"stack.{i}"] = ShardedTensor(
            local(f"stack.{i}", (1, FFN, HIDDEN), None)[0, tp_rank * n : (tp_rank + 1) * n].clone()
            if fill else torch.zeros(n, HIDDEN),
            (1, FFN, HIDDEN), (0, tp_rank * n, 0),
        )
    if last:
        model["final_norm.weight"] = ShardedTensor(local("final_norm.weight", (HIDDEN,), None), (HIDDEN,), (0,))
    return model


def _flat_buffer(rank: int, bounds: list[int], fill: bool) -> FlatShardedTensor:
    """A distributed-optimizer slice: elements ``bounds[rank]..bounds[rank+1]`` of a (5, 7) tensor."""
    full = _full("dist_opt.exp_avg", FLAT_SHAPE).reshape(-1)[bounds[rank] : bounds[rank + 1]]
    return FlatShardedTensor(full.clone() if fill else torch.zeros_like(full), FLAT_SHAPE, bounds[rank])


def _full_shape(name: str) -> tuple[int, ...]:
    if name in ("embed.weight", "output_layer.weight"):
        return (VOCAB, HIDDEN)
    if name.startswith("stack."):
        return (1, FFN, HIDDEN)
    if name == "final_norm.weight" or name.endswith("fc2.bias"):
        return (HIDDEN,)
    if name == "dist_opt.exp_avg":
        return FLAT_SHAPE
    return {"fc1.weight": (FFN, HIDDEN), "fc1.bias": (FFN,), "fc2.weight": (HIDDEN, FFN)}[name.split(".", 2)[2]]


def _check(model: dict[str, Any]) -> int:
    """Compare every loaded local tensor with the reference, bit-exactly; return the count checked."""
    for name, value in model.items():
        ref = _full(name, _full_shape(name))
        if isinstance(value, torch.Tensor):
            got, expected = value, ref
        else:
            entry = value.__tierckpt_entry__(name)
            got = entry.tensor
            if isinstance(entry.region, Box):
                expected = ref[entry.region.slices()]
            else:
                expected = ref.reshape(-1)[entry.region.start : entry.region.stop]
            if name in ("embed.weight", "output_layer.weight") and value.local._base is not None:
                padded = value.local._base  # vocab_parallel holds a view of the real rows of the padded shard
                if not torch.all(padded[value.local.shape[0] :] == SENTINEL):
                    raise AssertionError(f"{name}: vocab padding rows were written on rank {dist.get_rank()}")
        if not torch.equal(got, expected):
            raise AssertionError(f"{name}: loaded values differ on rank {dist.get_rank()}")
    return len(model)


def megatron_reshard(path: str) -> dict[str, int]:
    """Save TP2 x PP2 (4 ranks) plus a flat optimizer buffer; load as TP4 x PP1 and in one process."""
    rank = dist.get_rank()
    group = subgroup(4)
    pp, tp = divmod(rank, 2)
    model = megatron_state(tp, 2, pp, 2, fill=True)
    model["dist_opt.exp_avg"] = _flat_buffer(rank, [0, 10, 17, 30, 35], fill=True)
    tierckpt.save(path, {"model": model}, group=group)
    dist.barrier()
    # TP4 x PP1: every rank holds every layer; different vocab padding (16 rows vs 14).
    target = megatron_state(rank, 4, 0, 1, fill=False)
    target["dist_opt.exp_avg"] = _flat_buffer(rank, [0, 9, 18, 27, 35], fill=False)
    tierckpt.load(path, {"model": target}, group=group)
    checked = {"tp4": _check(target)}
    dist.barrier()
    one = subgroup(1)
    if one is not None:
        plain: dict[str, Any] = {}
        for i in range(LAYERS):
            for leaf in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
                plain[f"layers.{i}.{leaf}"] = torch.zeros(_full_shape(f"layers.{i}.{leaf}"))
            plain[f"stack.{i}"] = torch.zeros(_full_shape(f"stack.{i}"))
        for name in ("embed.weight", "output_layer.weight", "final_norm.weight", "dist_opt.exp_avg"):
            plain[name] = torch.zeros(_full_shape(name))
        tierckpt.load(path, {"model": plain}, group=one)
        checked["one"] = _check(plain)
    dist.barrier()
    return checked


# -- per-rank state resharding through tierckpt -----------------------------------------------------
SOURCE_LENGTHS = {"web": 23, "code": 17, "math": 11}
SOURCE_IDS = {"web": 1, "code": 2, "math": 3}


def source_item(name: str, j: int) -> list[int]:
    """Item ``j`` of source ``name``: 1-4 tokens, each unique over all sources."""
    return [SOURCE_IDS[name] * 10_000 + j * 10 + t for t in range(1 + j % 4)]


def sources() -> dict[str, Any]:
    def factory(name: str) -> Any:
        return lambda start: (source_item(name, j) for j in range(start, SOURCE_LENGTHS[name]))

    return {name: factory(name) for name in SOURCE_LENGTHS}


def all_tokens() -> Counter:
    return Counter(t for name, n in SOURCE_LENGTHS.items() for j in range(n) for t in source_item(name, j))


def make_reader(dp_rank: int, dp_size: int) -> MultiSourceReader:
    return MultiSourceReader(sources(), {"web": 0.5, "code": 0.3, "math": 0.2}, dp_rank, dp_size, seq_len=5, seed=11)


def make_sampler(dp_rank: int, dp_size: int) -> ResumableSampler:
    return ResumableSampler(29, 6, dp_rank, dp_size, seed=3)


def _draws() -> tuple[float, float, float]:
    return torch.rand(()).item(), float(np.random.rand()), random.random()


def state_reshard(path: str, save_world: int, load_world: int, reads: int) -> dict[str, Any]:
    """Save RNG, sampler and reader on ``save_world`` ranks after ``reads`` steps; resume on ``load_world``.

    Checks (on rank 0, from everything every rank saw): the reader's tokens before + after are every
    token exactly once (as an uninterrupted run's are); the sampler's epoch is every index exactly
    once and each global batch is the uninterrupted run's; each loading rank's next random numbers are
    those saved rank ``r % save_world`` drew right after saving.
    """
    rank = dist.get_rank()
    seen: dict[str, Any] = {"tokens": [], "batches": [], "rng": None}
    group = subgroup(save_world)
    if group is not None:
        torch.manual_seed(100 + rank)
        np.random.seed(200 + rank)
        random.seed(300 + rank)
        reader, sampler = make_reader(rank, save_world), make_sampler(rank, save_world)
        for _ in range(reads):
            seen["tokens"].extend(next(reader))
        for _ in range(2):
            seen["batches"].append(sampler.next_batch())
        tierckpt.save(path, {"reader": reader, "sampler": sampler, "rng": RNGState(group=group)}, group=group)
        seen["rng"] = _draws()
    saved = [None] * dist.get_world_size()
    dist.all_gather_object(saved, seen)
    group = subgroup(load_world)
    after: dict[str, Any] = {"tokens": [], "batches": [], "rng": None}
    if group is not None:
        torch.manual_seed(999)
        reader, sampler, rng = make_reader(rank, load_world), make_sampler(rank, load_world), RNGState(group=group)
        tierckpt.load(path, {"reader": reader, "sampler": sampler, "rng": rng}, group=group)
        after["rng"] = _draws()
        expected = saved[rank % save_world]["rng"]
        if after["rng"] != expected:
            raise AssertionError(f"rank {rank}: random numbers after load {after['rng']} != saved rank's {expected}")
        after["tokens"] = [t for seq in reader for t in seq]
        epoch = sampler.epoch
        while sampler.epoch == epoch:
            after["batches"].append(sampler.next_batch())
    resumed: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(resumed, after)
    result: dict[str, Any] = {}
    if rank == 0:
        tokens = Counter(t for s in saved[:save_world] + resumed[:load_world] for t in s["tokens"])
        if tokens != all_tokens():
            missing, repeated = all_tokens() - tokens, {t: c for t, c in tokens.items() if c > 1}
            raise AssertionError(f"reader: missing {sorted(missing)[:10]}, repeated {sorted(repeated)[:10]}")
        reference_run = make_sampler(0, 1)
        order = reference_run.order(0)
        global_before = [sorted(i for s in saved[:save_world] for i in s["batches"][b]) for b in range(2)]
        global_after = [sorted(i for s in resumed[:load_world] for i in s["batches"][b])
                        for b in range(len(resumed[0]["batches"]))]
        expected_batches = [sorted(order[i : i + 6]) for i in range(0, 29, 6)]
        if global_before + global_after != expected_batches:
            raise AssertionError(f"sampler: global batches {global_before + global_after} != {expected_batches}")
        result = {"tokens": sum(tokens.values()), "batches": len(expected_batches)}
    dist.barrier()
    return result


# -- exact resume ---------------------------------------------------------------------------------
GLOBAL_BATCH = 8
DATASET = 32


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """32 sequences: the union of ``demo.model.batch(step, r)`` for steps 0..3 and ranks 0..1."""
    from tierckpt.demo.model import batch

    xs, ys = zip(*(batch(step, r) for step in range(DATASET // GLOBAL_BATCH) for r in range(2)))
    return torch.cat(xs), torch.cat(ys)


def train_steps(
    model: torch.nn.Module, optim: torch.optim.Optimizer, sampler: ResumableSampler, steps: int, group: Any
) -> list[float]:
    """Steps on the global batch (independent of the world size): each rank takes its rows, the loss is
    the global mean (local sum / global tokens, times world size to undo the gradient averaging)."""
    x_all, y_all = dataset()
    world = dist.get_world_size(group)
    losses = []
    for _ in range(steps):
        idx = sampler.next_batch()
        x, y = x_all[idx], y_all[idx]
        tokens = GLOBAL_BATCH * x_all.shape[1]
        loss_sum = torch.nn.functional.cross_entropy(model(x).reshape(-1, 61), y.reshape(-1), reduction="sum")
        optim.zero_grad()
        (loss_sum * (world / tokens)).backward()
        optim.step()
        total = loss_sum.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item() / tokens)
    return losses


K, SAVE_AT = 6, 3


def exact_resume(path: str, save_kind: str, save_world: int, load_kind: str, load_world: int) -> dict[str, float]:
    """Train K steps uninterrupted; separately train SAVE_AT, save, resume under another layout to K."""
    save_mesh, load_mesh = make_mesh((save_world,)), make_mesh((load_world,))  # collective: every rank
    rank = dist.get_rank()
    group = subgroup(save_world)
    uninterrupted: list[float] = []
    if group is not None:
        model, optim = build(save_kind, group, save_mesh)
        uninterrupted = train_steps(model, optim, ResumableSampler(DATASET, GLOBAL_BATCH, rank, save_world, seed=5), K, group)
        model, optim = build(save_kind, group, save_mesh)
        sampler = ResumableSampler(DATASET, GLOBAL_BATCH, rank, save_world, seed=5)
        first = train_steps(model, optim, sampler, SAVE_AT, group)
        if first != uninterrupted[:SAVE_AT]:
            raise AssertionError(f"training is not deterministic: {first} != {uninterrupted[:SAVE_AT]}")
        state = {"model": model, "optim": optim, "sampler": sampler, "rng": RNGState(group=group), "step": SAVE_AT}
        tierckpt.save(path, state, group=group)
    dist.barrier()
    group = subgroup(load_world)
    out: dict[str, float] = {}
    if group is not None:
        model, optim = build(load_kind, group, load_mesh, seed=1)
        sampler = ResumableSampler(DATASET, GLOBAL_BATCH, rank, load_world, seed=5)
        state = {"model": model, "optim": optim, "sampler": sampler, "rng": RNGState(group=group), "step": 0}
        tierckpt.load(path, state, group=group)
        if state["step"] != SAVE_AT:
            raise AssertionError(f"step loaded as {state['step']}")
        resumed = train_steps(model, optim, sampler, K - state["step"], group)
        if rank == 0:
            diffs = [abs(a - b) / abs(b) for a, b in zip(resumed, uninterrupted[SAVE_AT:])]
            out = {"max_rel_diff": max(diffs), "bit_exact": float(resumed == uninterrupted[SAVE_AT:])}
            if max(diffs) > 1e-6:
                raise AssertionError(f"losses after resume {resumed} != uninterrupted {uninterrupted[SAVE_AT:]}")
    dist.barrier()
    return out
