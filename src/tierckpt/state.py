"""Adapters: turn what the user passes into flat tensor and object entries.

``flatten_state`` walks the state mapping and returns :class:`FlatState`:

* ``nn.Module`` (plain, DDP, ``torch.compile``, FSDP2, FSDP1 with ``use_orig_params=True``): its
  parameters and persistent buffers. DTensors (FSDP2, TP) keep their shard as a :class:`Box`; FSDP1
  parameters are 1-D views into the flat shard and become :class:`FlatRange` pieces, written as they
  are — no all-gather.
* ``torch.optim.Optimizer``: under torch's ``get_state_dict`` names (flattened, as with
  ``StateDictOptions(flatten_optimizer_state_dict=True)``): per-parameter state
  ``<key>.state.<param fqn>.<name>`` (so it reshards like the parameter) and each parameter's copy
  of its group's settings, ``<key>.param_groups.<param fqn>.<setting>``.
* Optimizer state dicts from ``get_state_dict`` (``{"state": ..., "param_groups": [...]}``, by fqn):
  the same keys, so a checkpoint saved either way loads either way.
* Objects with ``state_dict``/``load_state_dict`` (LR schedulers, GradScaler, samplers...): their
  state dict as one object — stored once when equal on every rank, else per rank.
* Nested dicts: recursed. Tensors and DTensors: entries.
* Objects with ``__tierckpt_entry__(fqn) -> TensorEntry`` describe a sharded tensor themselves
  (see :mod:`tierckpt.sharded` for framework-free TP/PP descriptions).
* Objects with ``state_dict()`` and ``load_resharded(states)``: their state is saved per rank, and
  on load they receive every saved rank's state to split or merge (data-parallel resharding of
  dataloader state).
* Anything else: an object entry.

Keys are dotted paths: ``model.layers.0.weight``, ``optim.state.layers.0.weight.exp_avg``,
``optim.param_groups.layers.0.weight.lr``.
Plain (non-DTensor) tensors are taken to be replicated across ranks, as in torch DCP; a value that
differs per rank belongs in an object entry.
"""

from __future__ import annotations

import sys
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


def module_entries(prefix: str, module: nn.Module, state: FlatState, params: dict[int, ParamRef]) -> None:
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
            params.setdefault(id(tensor), ParamRef(prefix, clean_fqn(name), entry))
    state.frameworks.add("module")


def _fsdp1_entries(
    prefix: str, root: nn.Module, fsdp_modules: list[nn.Module], state: FlatState, params: dict[int, ParamRef]
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
        params.setdefault(id(param), ParamRef(prefix, clean_fqn(name), entry))
    for name, buf in _persistent_buffers(root):
        state.add_tensor(tensor_entry(f"{prefix}.{clean_fqn(name)}", buf))


def _persistent_buffers(root: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


# -- optimizers ------------------------------------------------------------------------------------
def optimizer_entries(
    key: str, optim: torch.optim.Optimizer, state: FlatState, params: dict[int, ParamRef], *, for_load: bool,
    saved_keys: Callable[[str], bool] | None = None, legacy_names: bool = False,
) -> None:
    """Add an optimizer's per-parameter state (resharding like its parameter) and its param group settings.

    Keys are torch's flattened ``get_state_dict`` names: ``<key>.state.<param>.<name>`` and
    ``<key>.param_groups.<param>.<setting>`` (see :func:`_param_names`). ``legacy_names`` reads a
    checkpoint of format 1.0 instead: parameters named with their module's state key in front and the
    param groups as one ``<key>.param_groups`` object.
    """
    state.frameworks.add("optimizer")
    if for_load and saved_keys is not None and saved_keys(f"{key}.state."):
        init_optimizer_state(optim)
    names = _param_names(optim, params, qualified=legacy_names)
    for group, group_names in zip(optim.param_groups, names):
        for param, pname in zip(group["params"], group_names):
            ref = params.get(id(param))
            for sname, value in optim.state.get(param, {}).items():
                skey = f"{key}.state.{pname}.{sname}"
                if isinstance(value, torch.Tensor):
                    state.add_tensor(_state_tensor_entry(skey, value, ref.entry if ref is not None else None))
                elif legacy_names:
                    state.add_object(ObjectEntry(key=skey, value=value, container=optim.state[param], slot=sname))
                else:  # nested state (e.g. Shampoo's) is flattened further, as torch does
                    _walk(skey, value, optim.state[param], sname, state, for_load, legacy_names)
    if legacy_names:
        _legacy_param_groups(key, optim, names, state, for_load)
    else:
        _param_group_entries(key, optim, names, state, for_load)


def _param_names(optim: torch.optim.Optimizer, params: dict[int, ParamRef], *, qualified: bool = False) -> list[list[str]]:
    """The name of each parameter of each group in the optimizer's keys.

    A parameter is named as in torch's ``get_state_dict``: its fqn within its module. When the
    optimizer's parameters come from several modules of the state (or ``qualified``), the module's
    state key goes in front, so names stay unique. A parameter of no module is ``param_group<i>.param<j>``.
    """
    refs = [[params.get(id(p)) for p in group["params"]] for group in optim.param_groups]
    qualified = qualified or len({r.module_key for group in refs for r in group if r is not None}) > 1
    return [
        [
            f"param_group{gi}.param{pi}" if r is None else (r.entry.fqn if qualified else r.name)
            for pi, r in enumerate(group)
        ]
        for gi, group in enumerate(refs)
    ]


def param_group_items(prefix: str, groups: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """``(key, group, setting)`` for every parameter and setting of ``groups`` (dicts whose ``params``
    are parameter names), keyed as torch's flattened optimizer state dict: ``<prefix>.param_groups.<param>.<setting>``."""
    for group in groups:
        for name in group["params"]:
            for setting in group:
                if setting != "params":
                    yield f"{prefix}.param_groups.{name}.{setting}", group, setting


def _param_group_entries(
    key: str, optim: torch.optim.Optimizer, names: list[list[str]], state: FlatState, for_load: bool
) -> None:
    """Every parameter's copy of its group's settings; on load, each group takes its settings back."""
    holders = [
        [{**{k: v for k, v in group.items() if k != "params"}, "params": [name]} for name in group_names]
        for group, group_names in zip(optim.param_groups, names)
    ]
    for group_key, holder, setting in param_group_items(key, [h for group in holders for h in group]):
        state.add_object(ObjectEntry(key=group_key, value=holder[setting], container=holder, slot=setting))
    if for_load:
        state.after_load.append(lambda: _apply_group_settings(key, optim, holders))


def _apply_group_settings(key: str, optim: torch.optim.Optimizer, holders: list[list[dict[str, Any]]]) -> None:
    for group, params in zip(optim.param_groups, holders):
        if not params:
            continue
        first = params[0]
        for setting in group:
            if setting == "params":
                continue
            for other in params[1:]:
                if not _same(other[setting], first[setting]):
                    raise StateMismatchError(
                        f"optimizer {key!r}: parameters {first['params'][0]!r} and {other['params'][0]!r} share a "
                        f"param group, but the checkpoint has {setting}={first[setting]!r} for one and "
                        f"{other[setting]!r} for the other; build the optimizer with the param groups it was saved with"
                    )
            _set_group_value(group, setting, first[setting])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def _set_group_value(group: dict[str, Any], setting: str, value: Any) -> None:
    """Set a group setting, in place when the optimizer holds it as a tensor (a tensor ``lr``)."""
    if isinstance(group.get(setting), torch.Tensor) and not isinstance(value, torch.Tensor):
        group[setting].fill_(value)
    else:
        group[setting] = value


def _legacy_param_groups(
    key: str, optim: torch.optim.Optimizer, names: list[list[str]], state: FlatState, for_load: bool
) -> None:
    """Format 1.0: the param groups as one object, a list of the groups with their parameters' names."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": n} for g, n in zip(optim.param_groups, names)]
    holder: dict[str, Any] = {"groups": groups}
    state.add_object(ObjectEntry(key=f"{key}.param_groups", value=groups, container=holder, slot="groups"))
    if for_load:
        state.after_load.append(lambda: _apply_param_groups(key, optim, holder["groups"]))


def _state_tensor_entry(key: str, value: torch.Tensor, param: TensorEntry | None) -> TensorEntry:
    if is_dtensor(value) or param is None:
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
                _set_group_value(group, k, v)


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
    state: Mapping[str, Any], *, for_load: bool, saved_keys: Callable[[str], bool] | None = None,
    legacy_names: bool = False,
) -> FlatState:
    """Flatten a user state mapping into entries (see the module docstring).

    ``legacy_names`` flattens optimizers as format 1.0 named them, to load such a checkpoint.
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a mapping of names to values, got {type(state).__name__}")
    flat = FlatState()
    params: dict[int, ParamRef] = {}
    # Modules first, so optimizers can name their parameters by fqn.
    for key, value in state.items():
        if isinstance(value, nn.Module):
            module_entries(_key(key), value, flat, params)
    for key, value in state.items():
        if isinstance(value, nn.Module):
            continue
        if isinstance(value, torch.optim.Optimizer):
            optimizer_entries(
                _key(key), value, flat, params, for_load=for_load, saved_keys=saved_keys, legacy_names=legacy_names
            )
        else:
            _walk(_key(key), value, state, key, flat, for_load, legacy_names)
    return flat


def _key(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise CheckpointError(f"state keys must be non-empty strings, got {key!r}")
    return key


def named_groups(groups: Any) -> bool:
    """Whether ``groups`` are torch param groups whose parameters are named (as ``get_state_dict``
    names them), rather than numbered (as ``Optimizer.state_dict`` does)."""
    return isinstance(groups, list) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(n, str) for n in g["params"])
        for g in groups
    )


def _is_named_optimizer_state(value: Any) -> bool:
    """An optimizer state dict from torch's ``get_state_dict`` (not flattened)."""
    return isinstance(value, dict) and set(value) == {"state", "param_groups"} and named_groups(value["param_groups"])


def _walk(path: str, value: Any, container: Any, slot: Any, flat: FlatState, for_load: bool, legacy_names: bool) -> None:
    if not legacy_names and _is_named_optimizer_state(value):
        # Stored under torch's flattened names, as a native optimizer's are; on load each
        # parameter's copy of a setting goes back into its group.
        _walk(f"{path}.state", value["state"], value, "state", flat, for_load, legacy_names)
        for key, group, setting in param_group_items(path, value["param_groups"]):
            flat.add_object(ObjectEntry(key=key, value=group[setting], container=group, slot=setting))
    elif isinstance(value, torch.Tensor):
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
            _walk(f"{path}.{k}", v, value, k, flat, for_load, legacy_names)
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

