"""Optimizers as entries: per-parameter state named and sharded like its parameter, param group settings.

Keys are torch's flattened ``get_state_dict`` names (``StateDictOptions(flatten_optimizer_state_dict=True)``):
``<key>.state.<param>.<name>`` and ``<key>.param_groups.<param>.<setting>``. A parameter is named by
(first match):

* the module it belongs to, when that module is in the same state (``{"model": m, "optim": o}``) or
  paired with the optimizer (``{"optim": (m, o)}``, see :mod:`tierckpt.state.adapters`): its fqn in the module;
* the optimizer itself, when it was built from named parameters (torch's ``param_names`` group key);
* else ``param_group<i>.param<j>`` (a strict load then says how to name them).

An optimizer that overrides ``state_dict`` and keeps nothing in its own ``state`` (a container of
other optimizers, as torchtitan's ``OptimizersContainer``) is saved through its ``state_dict()``
(walked like a nested dict, so a flattened ``get_optimizer_state_dict`` comes out under the same keys)
and loaded with its ``load_state_dict``: see :func:`wrapper_entries`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from tierckpt.state.entries import FlatState, ObjectEntry, ParamRef, TensorEntry, clean_fqn, is_dtensor, tensor_entry
from tierckpt.errors import StateMismatchError
from tierckpt.native.regions import FlatRange

Walk = Callable[[str, Any, Any, Any], None]
"""``walk(path, value, container, slot)``: flatten a nested value into the state (:func:`tierckpt.state.adapters._walk`)."""


def optimizer_entries(
    key: str, optim: torch.optim.Optimizer, state: FlatState, params: dict[int, ParamRef], *, for_load: bool,
    walk: Walk, saved_keys: Callable[[str], bool] | None = None, legacy_names: bool = False,
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
                    walk(skey, value, optim.state[param], sname)
    if legacy_names:
        _legacy_param_groups(key, optim, names, state, for_load)
    else:
        _param_group_entries(key, optim, names, state, for_load)


def _param_names(optim: torch.optim.Optimizer, params: dict[int, ParamRef], *, qualified: bool = False) -> list[list[str]]:
    """The name of each parameter of each group in the optimizer's keys.

    A parameter is named as in torch's ``get_state_dict``: its fqn within its module. When the
    optimizer's parameters come from several modules of the state (or ``qualified``), the module's
    state key goes in front, so names stay unique. A parameter of no module in the state is named by
    its group's ``param_names`` (an optimizer built from ``named_parameters()``), else
    ``param_group<i>.param<j>``.
    """
    refs = [[params.get(id(p)) for p in group["params"]] for group in optim.param_groups]
    qualified = qualified or len({r.module_key for group in refs for r in group if r is not None}) > 1
    return [
        [
            (r.entry.fqn if qualified else r.name) if r is not None else _own_name(group, gi, pi)
            for pi, r in enumerate(group_refs)
        ]
        for gi, (group, group_refs) in enumerate(zip(optim.param_groups, refs))
    ]


def _own_name(group: dict[str, Any], gi: int, pi: int) -> str:
    """A parameter's name from what its optimizer carries: its group's ``param_names`` (torch records
    them when the optimizer is built from ``named_parameters()``), else its position."""
    names = group.get("param_names")
    if isinstance(names, list) and len(names) == len(group["params"]) and isinstance(names[pi], str):
        return clean_fqn(names[pi])
    return f"param_group{gi}.param{pi}"


def holds_state_elsewhere(optim: torch.optim.Optimizer) -> bool:
    """Whether ``optim`` overrides ``state_dict`` and keeps nothing in its own ``state``: a container of
    other optimizers (torchtitan's ``OptimizersContainer``), whose state only its ``state_dict()`` shows."""
    overrides = type(optim).state_dict is not torch.optim.Optimizer.state_dict
    return overrides and not any(optim.state.values())


def wrapper_entries(
    key: str, optim: torch.optim.Optimizer, state: FlatState, *, for_load: bool, walk: Walk,
    saved_keys: Callable[[str], bool] | None = None,
) -> None:
    """Add an optimizer that holds its state elsewhere through its own ``state_dict()``, walked as a
    nested dict (a flattened ``get_optimizer_state_dict`` gives the keys a native optimizer has); a load
    fills that dict and hands it to ``load_state_dict``.

    Its tensors are only as sharded as the dict's (DTensors stay shards). On load, when the checkpoint
    has optimizer state under ``key`` but the dict has no tensor to put it in (state not created yet),
    :class:`StateMismatchError` says so: nothing is loaded half-way, nothing is skipped silently.
    """
    state.frameworks.add("optimizer")
    holder = {"sd": optim.state_dict()}
    before = set(state.tensors)
    walk(key, holder["sd"], holder, "sd")
    if not for_load:
        return
    prefix = f"{key}.state."
    if saved_keys is not None and saved_keys(prefix) and not any(k.startswith(prefix) for k in set(state.tensors) - before):
        raise StateMismatchError(
            f"optimizer {key!r} ({type(optim).__name__}) keeps its state outside its own `state`, and its "
            "state_dict() holds no state tensor to load the checkpoint's into; create its state first (its "
            "state_dict() must list the tensors, e.g. torch's get_optimizer_state_dict does), then load"
        )
    state.after_load.append(lambda: optim.load_state_dict(holder["sd"]))


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



def named_groups(groups: Any) -> bool:
    """Whether ``groups`` are torch param groups whose parameters are named (as ``get_state_dict``
    names them), rather than numbered (as ``Optimizer.state_dict`` does)."""
    return isinstance(groups, list) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(n, str) for n in g["params"])
        for g in groups
    )


