"""The entries a state flattens into: tensors (with the region of the global tensor this rank holds)
and objects (with where a loaded value goes), and how a tensor or DTensor becomes an entry.

Shared by :mod:`tierckpt.state.adapters` (the walk over a user's state) and :mod:`tierckpt.state.optim`
(optimizers), so neither imports the other.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt.errors import CheckpointError, StateMismatchError
from tierckpt.native.regions import Box, Region

_WRAPPER_PREFIXES = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


@dataclass(eq=False)
class TensorEntry:
    """A tensor this rank holds: ``tensor`` is its local data, holding ``region`` of the global tensor."""

    fqn: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    region: Region


@dataclass(eq=False)
class ObjectEntry:
    """A non-tensor value, and where a loaded value goes (``container[slot]``)."""

    key: str
    value: Any
    container: MutableMapping[Any, Any]
    slot: Any
    all_ranks: bool = False
    """Load every saved rank's value (a list, in saved rank order) instead of this rank's one."""

    def check(self, value: Any) -> None:
        """Raise if ``value`` (decoded, before anything is assigned) cannot go where this entry puts it."""

    def assign(self, value: Any) -> None:
        self.container[self.slot] = value


@dataclass(eq=False)
class NumberIntoTensor(ObjectEntry):
    """A 0-d tensor of the state that the checkpoint holds as a number object (an optimizer ``step`` kept
    as a Python int, as DeepSpeed's CPU Adam keeps it): the loaded number is written into the tensor
    (``container``, at ``slot`` ``...``), as torch's Adam turns such a step into its tensor."""

    def check(self, value: Any) -> None:
        if type(value) not in (int, float):
            raise StateMismatchError(
                f"{self.key!r} is a 0-d tensor in the state, but the checkpoint holds a {type(value).__name__} there, not a number"
            )
        if type(value) is float and not self.value.is_floating_point():
            raise StateMismatchError(
                f"{self.key!r} is a 0-d {self.value.dtype} tensor in the state, but the checkpoint holds the float {value!r} there"
            )


@dataclass
class FlatState:
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    frameworks: set[str] = field(default_factory=set)
    after_load: list[Callable[[], None]] = field(default_factory=list)
    """Run after every entry is filled (optimizer hyperparameters, ``load_state_dict`` calls)."""
    structure: dict[str, list[str]] = field(default_factory=dict)
    """How keys split back into the nested state, where splitting at every dot would not do: node path
    (``""``: the state itself) -> ``[]`` when the rest of a key under it is one name (a module's fqns,
    an optimizer's flattened keys, a dict of dotted names), else its child names that hold dots
    (:mod:`tierckpt.loading.nested`). Saved in the header."""

    def add_tensor(self, entry: TensorEntry) -> None:
        self._check_new(entry.fqn)
        self.tensors[entry.fqn] = entry

    def add_object(self, entry: ObjectEntry) -> None:
        self._check_new(entry.key)
        self.objects[entry.key] = entry

    def _check_new(self, key: str) -> None:
        if key in self.tensors or key in self.objects:
            raise CheckpointError(f"two entries of the state map to the key {key!r}; rename one of them")


@dataclass(frozen=True)
class ParamRef:
    """A module parameter: the state key of its module, its fqn within the module, and its entry."""

    module_key: str
    name: str
    entry: TensorEntry


def clean_fqn(name: str) -> str:
    """Drop wrapper prefixes (``_orig_mod.``, ``_fsdp_wrapped_module.``...) from a parameter name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing DTensor's module (about 0.7 s, half of it sympy)
    in a process that never did: no DTensor can exist there, and a load of plain tensors (an eval job, a
    restart of a one-process job) would pay that import on its first call."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def tensor_entry(fqn: str, tensor: torch.Tensor) -> TensorEntry:
    """An entry for a tensor or DTensor: a DTensor holds its shard's box, a tensor the whole."""
    if is_dtensor(tensor):
        return _dtensor_entry(fqn, tensor)
    return TensorEntry(fqn=fqn, tensor=tensor, shape=tuple(tensor.shape), region=Box.full(tuple(tensor.shape)))


@functools.lru_cache(maxsize=1024)
def _local_box(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]) -> Box:
    """The box of a ``shape`` DTensor that this rank holds on ``mesh`` under ``placements``.

    Cached: a state's DTensors share a few shapes and placements, and every save and load flattens the
    whole state again; torch's computation is most of a flatten's time (about 60 % of a save's ``flatten``
    phase for 8 DTensors). A mesh is hashed and compared by its ranks and dimension names, and this
    rank's coordinate on equal meshes is the same, so the key determines the box."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return Box(tuple(offsets), tuple(local_shape))


def _dtensor_entry(fqn: str, tensor: Any) -> TensorEntry:
    for placement in tensor.placements:
        if placement.is_partial():
            raise CheckpointError(
                f"tensor {fqn!r} has a Partial placement; reduce it (e.g. redistribute to Replicate) before saving"
            )
        if type(placement).__name__ == "_StridedShard":
            raise CheckpointError(
                f"tensor {fqn!r} uses a strided shard placement (FSDP2 over TP), whose local data is not one "
                "box; save the TP-sharded model before applying fully_shard, or use one mesh dimension"
            )
    shape = tuple(tensor.shape)
    box = _local_box(shape, tensor.device_mesh, tuple(tensor.placements))
    local = tensor.to_local()
    if tuple(local.shape) != box.lengths:
        raise CheckpointError(f"tensor {fqn!r}: local shard shape {tuple(local.shape)} != expected {box.lengths}")
    return TensorEntry(fqn=fqn, tensor=local, shape=shape, region=box)

