"""Adapters: turn what the user passes into flat tensor and object entries.

``flatten_state`` walks the state mapping and returns :class:`FlatState`:

* ``nn.Module`` (plain, DDP, ``torch.compile``, FSDP2, FSDP1 with ``use_orig_params=True``): its
  parameters and persistent buffers. DTensors (FSDP2, TP) keep their shard as a :class:`Box`; FSDP1
  parameters are 1-D views into the flat shard and become :class:`FlatRange` pieces, written as they
  are — no all-gather.
* ``torch.optim.Optimizer``: per-parameter state keyed by the parameter's fqn (so it reshards like
  the parameter) and ``param_groups`` as an object.
* Objects with ``state_dict``/``load_state_dict`` (LR schedulers, GradScaler, samplers...): their
  state dict as one object — stored once when equal on every rank, else per rank.
* Nested dicts: recursed. Tensors and DTensors: entries.
* Objects with ``__tierckpt_entry__(fqn) -> TensorEntry`` describe a sharded tensor themselves
  (see :mod:`tierckpt.sharded` for framework-free TP/PP descriptions).
* Objects with ``state_dict()`` and ``load_resharded(states)``: their state is saved per rank, and
  on load they receive every saved rank's state to split or merge (data-parallel resharding of
  dataloader state).
* Anything else: an object entry.

Keys are dotted paths: ``model.layers.0.weight``, ``optim.state.model.layers.0.weight.exp_avg``.
Plain (non-DTensor) tensors are taken to be replicated across ranks, as in torch DCP; a value that
differs per rank belongs in an object entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError, StateMismatchError
from .regions import Box, FlatRange, Region

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

    def assign(self, value: Any) -> None:
        self.container[self.slot] = value


@dataclass
class FlatState:
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    frameworks: set[str] = field(default_factory=set)
    after_load: list[Callable[[], None]] = field(default_factory=list)
    """Run after every entry is filled (optimizer hyperparameters, ``load_state_dict`` calls)."""

    def add_tensor(self, entry: TensorEntry) -> None:
        self._check_new(entry.fqn)
        self.tensors[entry.fqn] = entry

    def add_object(self, entry: ObjectEntry) -> None:
        self._check_new(entry.key)
        self.objects[entry.key] = entry

    def _check_new(self, key: str) -> None:
        if key in self.tensors or key in self.objects:
            raise CheckpointError(f"two entries of the state map to the key {key!r}; rename one of them")


def clean_fqn(name: str) -> str:
    """Drop wrapper prefixes (``_orig_mod.``, ``_fsdp_wrapped_module.``...) from a parameter name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def tensor_entry(fqn: str, tensor: torch.Tensor) -> TensorEntry:
    """An entry for a tensor or DTensor: a DTensor holds its shard's box, a tensor the whole."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return _dtensor_entry(fqn, tensor)
    return TensorEntry(fqn=fqn, tensor=tensor, shape=tuple(tensor.shape), region=Box.full(tuple(tensor.shape)))


def _dtensor_entry(fqn: str, tensor: Any) -> TensorEntry:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

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
    local_shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise CheckpointError(f"tensor {fqn!r}: local shard shape {tuple(local.shape)} != expected {tuple(local_shape)}")
    return TensorEntry(fqn=fqn, tensor=local, shape=tuple(tensor.shape), region=Box(tuple(offsets), tuple(local_shape)))


# -- modules ---------------------------------------------------------------------------------------
def _unwrap(module: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        else:
            return module


def _is_fsdp2(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def _fsdp1_modules(module: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    return list(FullyShardedDataParallel.fsdp_modules(module))


def module_entries(prefix: str, module: nn.Module, state: FlatState, params: dict[int, TensorEntry]) -> None:
    """Add a module's parameters and persistent buffers; record parameter entries by ``id``."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        state.frameworks.add("ddp")
    root = _unwrap(module)
    fsdp1 = _fsdp1_modules(root)
    if fsdp1:
        state.frameworks.add("fsdp1")
        _fsdp1_entries(prefix, root, fsdp1, state, params)
        return
    if _is_fsdp2(root):
        state.frameworks.add("fsdp2")
    named_params = {id(p): p for p in root.parameters()}
    for name, tensor in root.state_dict(keep_vars=True).items():
        entry = tensor_entry(f"{prefix}.{clean_fqn(name)}", tensor)
        if "fsdp2" not in state.frameworks and entry.region != Box.full(entry.shape):
            state.frameworks.add("dtensor")
        state.add_tensor(entry)
        if id(tensor) in named_params:
            params.setdefault(id(tensor), entry)
    state.frameworks.add("module")


def _fsdp1_entries(
    prefix: str, root: nn.Module, fsdp_modules: list[nn.Module], state: FlatState, params: dict[int, TensorEntry]
) -> None:
    flat_of: dict[int, tuple[tuple[int, ...], FlatRange]] = {}
    for fsdp in fsdp_modules:
        if not getattr(fsdp, "_use_orig_params", False):
            raise CheckpointError(
                "FSDP1 module wrapped with use_orig_params=False: wrap it with use_orig_params=True so each "
                "parameter is a view into its flat shard and can be saved without an all-gather"
            )
        handle = getattr(fsdp, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        for info, pinfo, shape in zip(flat._shard_param_infos, flat._param_infos, flat._shapes):
            param = getattr(pinfo.module, pinfo.param_name)
            if info.in_shard:
                region = FlatRange(info.intra_param_start_idx, info.intra_param_end_idx + 1)
            else:
                region = FlatRange(0, 0)
            flat_of[id(param)] = (tuple(shape), region)
    for name, param in root.named_parameters(remove_duplicate=False):
        fqn = f"{prefix}.{clean_fqn(name)}"
        if id(param) in flat_of:
            shape, region = flat_of[id(param)]
            if param.numel() != region.numel:
                raise CheckpointError(
                    f"FSDP1 parameter {fqn!r} is not a view of its flat shard right now (size {param.numel()}, "
                    f"shard holds {region.numel}); save and load outside forward/backward"
                )
            entry = TensorEntry(fqn=fqn, tensor=param, shape=shape, region=region)
        else:
            entry = tensor_entry(fqn, param)
        state.add_tensor(entry)
        params.setdefault(id(param), entry)
    for name, buf in _persistent_buffers(root):
        state.add_tensor(tensor_entry(f"{prefix}.{clean_fqn(name)}", buf))


def _persistent_buffers(root: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


# -- optimizers ------------------------------------------------------------------------------------
def optimizer_entries(
    key: str, optim: torch.optim.Optimizer, state: FlatState, params: dict[int, TensorEntry], *, for_load: bool,
    saved_keys: Callable[[str], bool] | None = None,
) -> None:
    """Add an optimizer's per-parameter state (resharding like its parameter) and its param groups."""
    state.frameworks.add("optimizer")
    if for_load and saved_keys is not None and saved_keys(f"{key}.state."):
        init_optimizer_state(optim)
    names: list[list[str]] = []
    for gi, group in enumerate(optim.param_groups):
        group_names = []
        for pi, param in enumerate(group["params"]):
            entry = params.get(id(param))
            pname = entry.fqn if entry is not None else f"param_group{gi}.param{pi}"
            group_names.append(pname)
            for sname, value in optim.state.get(param, {}).items():
                skey = f"{key}.state.{pname}.{sname}"
                if isinstance(value, torch.Tensor):
                    state.add_tensor(_state_tensor_entry(skey, value, entry))
                else:
                    state.add_object(ObjectEntry(key=skey, value=value, container=optim.state[param], slot=sname))
        names.append(group_names)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": n} for g, n in zip(optim.param_groups, names)]
    holder: dict[str, Any] = {"groups": groups}
    state.add_object(ObjectEntry(key=f"{key}.param_groups", value=groups, container=holder, slot="groups"))
    if for_load:
        state.after_load.append(lambda: _apply_param_groups(key, optim, holder["groups"]))


def _state_tensor_entry(key: str, value: torch.Tensor, param: TensorEntry | None) -> TensorEntry:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor) or param is None:
        return tensor_entry(key, value)
    if isinstance(param.region, FlatRange) and value.dim() == 1 and value.numel() == param.region.numel:
        return TensorEntry(fqn=key, tensor=value, shape=param.shape, region=param.region)
    return tensor_entry(key, value)


def _apply_param_groups(key: str, optim: torch.optim.Optimizer, groups: Any) -> None:
    if not isinstance(groups, list) or len(groups) != len(optim.param_groups):
        raise StateMismatchError(
            f"optimizer {key!r}: the checkpoint has {len(groups) if isinstance(groups, list) else '?'} param groups, "
            f"the optimizer has {len(optim.param_groups)}; build the optimizer with the same groups"
        )
    for saved, group in zip(groups, optim.param_groups):
        for k, v in saved.items():
            if k != "params":
                if isinstance(group.get(k), torch.Tensor) and not isinstance(v, torch.Tensor):
                    group[k].fill_(v)
                else:
                    group[k] = v


def init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Create missing per-parameter state with a zero-gradient step at learning rate 0.

    Optimizers create state lazily on their first step; loading needs the tensors to exist.
    The parameters are not changed (lr 0 also cancels decoupled weight decay).
    """
    params = [p for g in optim.param_groups for p in g["params"]]
    if all(optim.state.get(p) for p in params):
        return
    lrs = [g.get("lr") for g in optim.param_groups]
    given = []
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
            given.append(p)
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p in given:
            p.grad = None


# -- the walk --------------------------------------------------------------------------------------
def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def flatten_state(
    state: Mapping[str, Any], *, for_load: bool, saved_keys: Callable[[str], bool] | None = None
) -> FlatState:
    """Flatten a user state mapping into entries (see the module docstring)."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a mapping of names to values, got {type(state).__name__}")
    flat = FlatState()
    params: dict[int, TensorEntry] = {}
    # Modules first, so optimizers can name their parameters by fqn.
    for key, value in state.items():
        if isinstance(value, nn.Module):
            module_entries(_key(key), value, flat, params)
    for key, value in state.items():
        if isinstance(value, nn.Module):
            continue
        if isinstance(value, torch.optim.Optimizer):
            optimizer_entries(_key(key), value, flat, params, for_load=for_load, saved_keys=saved_keys)
        else:
            _walk(_key(key), value, state, key, flat, for_load)
    return flat


def _key(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise CheckpointError(f"state keys must be non-empty strings, got {key!r}")
    return key


def _walk(path: str, value: Any, container: Any, slot: Any, flat: FlatState, for_load: bool) -> None:
    if isinstance(value, torch.Tensor):
        flat.add_tensor(tensor_entry(path, value))
    elif callable(getattr(value, "__tierckpt_entry__", None)):
        flat.add_tensor(value.__tierckpt_entry__(path))
    elif callable(getattr(value, "load_resharded", None)) and callable(getattr(value, "state_dict", None)):
        holder = {"states": value.state_dict()}
        flat.add_object(ObjectEntry(key=path, value=holder["states"], container=holder, slot="states", all_ranks=True))
        if for_load:
            flat.after_load.append(lambda: value.load_resharded(holder["states"]))
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk(f"{path}.{k}", v, value, k, flat, for_load)
    elif _is_stateful(value):
        # The whole state dict is one object, tensors included: it is stored once when every rank
        # has the same bytes and per rank otherwise (an RNG or a per-rank counter keeps its values).
        holder = {"sd": value.state_dict()}
        flat.add_object(ObjectEntry(key=path, value=holder["sd"], container=holder, slot="sd"))
        if for_load:
            flat.after_load.append(lambda: value.load_state_dict(holder["sd"]))
    else:
        if not isinstance(container, MutableMapping):
            raise CheckpointError(f"cannot load {path!r} in place: its container is not a mutable mapping")
        flat.add_object(ObjectEntry(key=path, value=value, container=container, slot=slot))

