"""Adapters: turn what the user passes into flat tensor and object entries.

``flatten_state`` walks the state mapping and returns :class:`FlatState`:

* ``nn.Module`` (plain, DDP, ``torch.compile``, FSDP2, FSDP1 with ``use_orig_params=True``): its
  parameters and persistent buffers. DTensors (FSDP2, TP) keep their shard as a :class:`Box`; FSDP1
  parameters are 1-D views into the flat shard and become :class:`FlatRange` pieces, written as they
  are — no all-gather.
* ``torch.optim.Optimizer``: under torch's ``get_state_dict`` names (flattened, as with
  ``StateDictOptions(flatten_optimizer_state_dict=True)``): per-parameter state
  ``<key>.state.<param fqn>.<name>`` (so it reshards like the parameter) and each parameter's copy
  of its group's settings, ``<key>.param_groups.<param fqn>.<setting>`` (:mod:`tierckpt.state.optim`).
  ``(module, optimizer)``: the same, parameters named by the module without saving it.
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

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from tierckpt.state.entries import (  # noqa: F401 - re-exported: the entries are part of this module's interface
    FlatState, ObjectEntry, ParamRef, TensorEntry, clean_fqn, is_dtensor, tensor_entry,
)
from tierckpt.errors import CheckpointError
from tierckpt.state.optim import (  # noqa: F401 - init_optimizer_state is re-exported
    holds_state_elsewhere, init_optimizer_state, named_groups, optimizer_entries, param_group_items, wrapper_entries,
)
from tierckpt.native.regions import Box, FlatRange


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
    _record_node(flat, "", state)
    # Modules first, so optimizers can name their parameters by fqn.
    for key, value in state.items():
        if isinstance(value, nn.Module):
            flat.structure[_key(key)] = []
            module_entries(_key(key), value, flat, params)
    for key, value in state.items():
        if is_pairing(value):
            _pair_params(_key(key), value[0], params)

    def walk(path: str, value: Any, container: Any, slot: Any) -> None:
        _walk(path, value, container, slot, flat, for_load, legacy_names)

    for key, value in state.items():
        if isinstance(value, nn.Module):
            continue
        optim = value[1] if is_pairing(value) else value
        if isinstance(optim, torch.optim.Optimizer):
            flat.structure[_key(key)] = []
            if holds_state_elsewhere(optim):
                wrapper_entries(_key(key), optim, flat, for_load=for_load, walk=walk, saved_keys=saved_keys)
            else:
                optimizer_entries(
                    _key(key), optim, flat, params, for_load=for_load, walk=walk, saved_keys=saved_keys,
                    legacy_names=legacy_names,
                )
        else:
            _walk(_key(key), value, state, key, flat, for_load, legacy_names)
    return flat


def is_pairing(value: Any) -> bool:
    """``(module, optimizer)``: an optimizer whose parameters are named by that module, which is not saved
    with it (``{"optim": (model, optim), "sched": sched}`` loads what ``{"model": model, "optim": optim,
    "sched": sched}`` saved, the model loaded apart)."""
    return (
        isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], nn.Module)
        and isinstance(value[1], torch.optim.Optimizer)
    )


def _pair_params(key: str, module: nn.Module, params: dict[int, ParamRef]) -> None:
    """Record the parameters of a paired module for naming only: its tensors are not entries of the state."""
    scratch = FlatState()
    module_entries(key, module, scratch, params)


def _key(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise CheckpointError(f"state keys must be non-empty strings, got {key!r}")
    return key



def _record_node(flat: FlatState, path: str, mapping: Mapping[Any, Any]) -> None:
    """Record how the keys under a dict node split (:attr:`FlatState.structure`), when some name holds a dot."""
    dotted = [str(k) for k in mapping if "." in str(k)]
    if dotted:
        nested = any(isinstance(v, (dict, nn.Module, torch.optim.Optimizer)) or is_pairing(v) for v in mapping.values())
        flat.structure[path] = dotted if nested else []


def _is_named_optimizer_state(value: Any) -> bool:
    """An optimizer state dict from torch's ``get_state_dict`` (not flattened)."""
    return isinstance(value, dict) and set(value) == {"state", "param_groups"} and named_groups(value["param_groups"])


def _walk(path: str, value: Any, container: Any, slot: Any, flat: FlatState, for_load: bool, legacy_names: bool) -> None:
    if not legacy_names and _is_named_optimizer_state(value):
        # Stored under torch's flattened names, as a native optimizer's are; on load each
        # parameter's copy of a setting goes back into its group.
        flat.structure[path] = []
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
        _record_node(flat, path, value)
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

