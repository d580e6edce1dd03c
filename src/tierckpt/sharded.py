"""Framework-free descriptions of sharded tensors (Megatron-style tensor and pipeline parallelism).

A model that shards its weights by hand (Megatron column/row-parallel linears, vocab-parallel
embeddings, pipeline stages) has no DTensor to tell tierckpt where a local tensor sits in the global
one. Wrap each local tensor in one of these and put it in the state like any tensor::

    state = {"model": {
        "layers.0.qkv.weight": column_parallel(qkv.weight, tp_rank, tp_size),   # shard dim 0
        "layers.0.proj.weight": row_parallel(proj.weight, tp_rank, tp_size),    # shard dim 1
        "embed.weight": vocab_parallel(embed.weight, tp_rank, tp_size, vocab_size=50257),
        "final_norm.weight": ShardedTensor(norm.weight, norm.weight.shape, (0,)),  # replicated
    }}
    tierckpt.save(uri, state, group=group)

* :class:`ShardedTensor` — the local tensor is a box of the global tensor (``global_offsets``).
* :class:`FlatShardedTensor` — the local 1-D tensor is elements ``[flat_start, flat_start + n)`` of
  the row-major flattening of the global tensor (distributed-optimizer / ZeRO buffers).

Replicated pieces (same fqn and region on several ranks: the TP ranks of one DP group, or DP
replicas) are written once; ``replica_id`` is accepted for Megatron parity but not needed.

**Pipeline stages** hold different layers: each stage just names its own layers with *global* layer
numbers, and a rank that does not hold a layer does not list it::

    first = pp_rank * layers_per_stage
    for i, layer in enumerate(stage.layers):
        state["model"][f"layers.{first + i}.mlp.fc1.weight"] = column_parallel(layer.fc1.weight, tp_rank, tp_size)

The checkpoint then holds every layer once, and any other PP x TP layout (or one process) loads it.
Loading writes into the local tensors in place, so the model's own parameters are filled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierckpt.errors import CheckpointError
from tierckpt.native.regions import Box, FlatRange
from tierckpt.state.adapters import TensorEntry

__all__ = [
    "FlatShardedTensor", "ShardedTensor", "column_parallel", "from_megatron", "row_parallel", "stage_layers",
    "vocab_parallel",
]


def _shape(value: Sequence[int], what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value)
    except TypeError:
        raise CheckpointError(f"{what} must be a sequence of ints, got {value!r}") from None
    if any(v < 0 for v in out):
        raise CheckpointError(f"{what} must not be negative, got {list(out)}")
    return out


@dataclass(frozen=True, eq=False)
class ShardedTensor:
    """``local`` holds the box of a ``global_shape`` tensor that starts at ``global_offsets``.

    ``global_shape`` may have more dimensions than ``local`` (Megatron's ``prepend_axis_num``): the
    local tensor is then treated as having leading dimensions of length 1, e.g. one layer of a
    ``(num_layers, ...)`` stack at offset ``(layer, 0, ...)``. The ranks' boxes of one name must cover its
    global shape exactly, as a save checks: a stack under one name needs every layer on some rank, and a
    layer saved under a name of its own has the shape ``(1, ...)`` at offset ``(0, ...)``.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    global_offsets: tuple[int, ...]
    replica_id: Any = 0

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise CheckpointError(f"ShardedTensor.local must be a torch.Tensor, got {type(self.local).__name__}")
        shape = _shape(self.global_shape, "global_shape")
        offsets = _shape(self.global_offsets, "global_offsets")
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "global_offsets", offsets)
        if len(offsets) != len(shape):
            raise CheckpointError(f"global_offsets {list(offsets)} and global_shape {list(shape)} have different lengths")
        prepend = len(shape) - self.local.dim()
        if prepend < 0:
            raise CheckpointError(
                f"local tensor has {self.local.dim()} dims but global_shape {list(shape)} only {len(shape)}"
            )
        lengths = self.lengths
        for d, (o, n, g) in enumerate(zip(offsets, lengths, shape)):
            if o + n > g:
                raise CheckpointError(
                    f"local shard of shape {list(self.local.shape)} at offsets {list(offsets)} reaches past the global "
                    f"shape {list(shape)} in dim {d} ({o} + {n} > {g})"
                )

    @property
    def lengths(self) -> tuple[int, ...]:
        """The local box's lengths in global dimensions (prepended dims have length 1)."""
        return (1,) * (len(self.global_shape) - self.local.dim()) + tuple(self.local.shape)

    def __tierckpt_entry__(self, fqn: str) -> TensorEntry:
        return TensorEntry(
            fqn=fqn, tensor=self.local.view(self.lengths), shape=self.global_shape,
            region=Box(self.global_offsets, self.lengths),
        )


@dataclass(frozen=True, eq=False)
class FlatShardedTensor:
    """``local`` (1-D) holds elements ``[flat_start, flat_start + local.numel())`` of the row-major
    flattening of a ``global_shape`` tensor — a distributed optimizer's slice of a parameter."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    flat_start: int
    replica_id: Any = 0

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise CheckpointError(f"FlatShardedTensor.local must be a torch.Tensor, got {type(self.local).__name__}")
        if self.local.dim() != 1:
            raise CheckpointError(f"FlatShardedTensor.local must be 1-D, got shape {list(self.local.shape)}")
        shape = _shape(self.global_shape, "global_shape")
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "flat_start", int(self.flat_start))
        total = math.prod(shape)
        if self.flat_start < 0 or self.flat_start + self.local.numel() > total:
            raise CheckpointError(
                f"flat range [{self.flat_start}, {self.flat_start + self.local.numel()}) is outside a tensor of shape "
                f"{list(shape)} ({total} elements)"
            )

    def __tierckpt_entry__(self, fqn: str) -> TensorEntry:
        region = FlatRange(self.flat_start, self.flat_start + self.local.numel())
        return TensorEntry(fqn=fqn, tensor=self.local, shape=self.global_shape, region=region)


# -- Megatron layouts --------------------------------------------------------------------------------
def _check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise CheckpointError(f"tp_rank {tp_rank} is not in 0..{tp_size - 1} (tp_size {tp_size})")


def _split(tensor: torch.Tensor, tp_rank: int, tp_size: int, dim: int, full: bool) -> ShardedTensor:
    _check_tp(tp_rank, tp_size)
    if not -tensor.dim() <= dim < tensor.dim():
        raise CheckpointError(f"cannot shard dim {dim} of a {tensor.dim()}-D tensor")
    dim %= tensor.dim()
    shape = list(tensor.shape)
    if full:
        if shape[dim] % tp_size:
            raise CheckpointError(f"dim {dim} of size {shape[dim]} does not split evenly into {tp_size} TP shards")
        n = shape[dim] // tp_size
        local = tensor.narrow(dim, tp_rank * n, n)
    else:
        n = shape[dim]
        shape[dim] = n * tp_size
        local = tensor
    offsets = [0] * tensor.dim()
    offsets[dim] = tp_rank * n
    return ShardedTensor(local, tuple(shape), tuple(offsets))


def column_parallel(tensor: torch.Tensor, tp_rank: int, tp_size: int, dim: int = 0, *, full: bool = False) -> ShardedTensor:
    """A column-parallel weight (output features split over TP ranks: dim 0 of ``[out, in]``) or bias.

    ``tensor`` is this rank's shard (the global size along ``dim`` is ``tp_size`` times it), or with
    ``full=True`` the whole tensor, of which this rank's shard becomes a view.
    """
    return _split(tensor, tp_rank, tp_size, dim, full)


def row_parallel(tensor: torch.Tensor, tp_rank: int, tp_size: int, dim: int = 1, *, full: bool = False) -> ShardedTensor:
    """A row-parallel weight (input features split over TP ranks: dim 1 of ``[out, in]``).

    Its bias is not sharded (it is added after the all-reduce): save it as a plain tensor.
    """
    return _split(tensor, tp_rank, tp_size, dim, full)


def vocab_parallel(
    local: torch.Tensor, tp_rank: int, tp_size: int, *, vocab_size: int | None = None
) -> ShardedTensor:
    """A vocab-parallel embedding (or output layer) shard: rows ``[tp_rank * n, (tp_rank + 1) * n)``.

    Megatron pads the vocabulary so it divides by ``tp_size`` (times ``make_vocab_size_divisible_by``);
    the padded size then depends on the TP size. Pass the real ``vocab_size`` to save only the real rows:
    the global tensor is ``[vocab_size, hidden]``, the padding rows are neither saved nor loaded (they
    keep their values), and a checkpoint loads under any TP size whatever its padding. Without
    ``vocab_size`` the padded tensor is the global tensor, and loading needs the same padded size.
    """
    _check_tp(tp_rank, tp_size)
    n = local.shape[0]
    start = tp_rank * n
    if vocab_size is None:
        return ShardedTensor(local, (n * tp_size, *local.shape[1:]), (start,) + (0,) * (local.dim() - 1))
    if vocab_size > n * tp_size:
        raise CheckpointError(f"vocab_size {vocab_size} is larger than the padded vocabulary {n * tp_size}")
    real = max(0, min(n, vocab_size - start))
    return ShardedTensor(local[:real], (vocab_size, *local.shape[1:]), (min(start, vocab_size),) + (0,) * (local.dim() - 1))


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Global indices of the layers pipeline stage ``pp_rank`` holds (contiguous, earlier stages get the
    remainder), for naming them ``layers.{i}...`` so every stage layout names a layer the same way."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise CheckpointError(f"pp_rank {pp_rank} is not in 0..{pp_size - 1}")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def from_megatron(sharded: Any) -> ShardedTensor | FlatShardedTensor:
    """Map a ``megatron.core.dist_checkpointing.ShardedTensor`` (duck-typed: no import) to ours.

    ``global_shape``/``global_offset`` (with ``prepend_axis_num`` leading axes) become a box. A
    ``flattened_range`` (older releases; 0.16 rejects it) is a flat slice of the *local* box, which
    is one flat range of the global tensor only when the box is a slab of whole trailing dims; other
    cases raise. ``replica_id`` is kept for reference; tierckpt dedups replicas itself.
    """
    data = sharded.data
    prepend = int(getattr(sharded, "prepend_axis_num", 0) or 0)
    shape = tuple(sharded.global_shape)
    offsets = tuple(sharded.global_offset)
    flat = getattr(sharded, "flattened_range", None)
    if flat is None:
        return ShardedTensor(data, shape, offsets, replica_id=sharded.replica_id)
    local_shape = (1,) * prepend + tuple(sharded.local_shape)
    box = Box(offsets, local_shape)
    # The box is contiguous in the global flattening iff after the first dim longer than 1 every dim is full.
    dims = [d for d, n in enumerate(local_shape) if n != 1]
    if dims and any(local_shape[d] != shape[d] or offsets[d] for d in range(dims[0] + 1, len(shape))):
        raise CheckpointError(
            f"megatron tensor {sharded.key!r}: flattened_range of a box {list(local_shape)} at {list(offsets)} is not "
            f"one flat range of the global shape {list(shape)}; save the un-flattened tensor instead"
        )
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    base = sum(o * s for o, s in zip(box.offsets, strides))
    return FlatShardedTensor(data.reshape(-1), shape, base + flat.start, replica_id=sharded.replica_id)
