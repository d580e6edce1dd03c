"""Optimizer param groups in torch DCP's two conventions, and the rewrites between them.

torch's ``get_state_dict(model, optim)`` names an optimizer's param group settings in one of two ways:

* **indexed** (the default): by group number, ``optim.param_groups.0.lr``, with
  ``optim.param_groups.0.params`` listing the group's parameter fqns;
* **flattened** (``StateDictOptions(flatten_optimizer_state_dict=True)``, what tierckpt saves): by
  parameter, ``optim.param_groups.<fqn>.lr``, each parameter holding its group's settings.

Per-parameter state (``optim.state.<fqn>.exp_avg``) is named the same way in both. This module turns
one into the other: :func:`indexed_aliases` lets a DCP directory saved indexed load in place under the
flattened names, :func:`indexed_to_flat` and :func:`flat_to_indexed` rewrite a whole state dict for
``tierckpt convert``, and :func:`rename_legacy_optimizers` renames format 1.0's optimizer keys.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch

from tierckpt.native.metadata import ObjectMeta
from tierckpt.state.adapters import named_groups, param_group_items

_INDEXED_SETTING = re.compile(r"^(?P<group>(?P<prefix>.+)\.param_groups\.(?P<index>\d+))\.(?P<setting>.+)$")
"""``<prefix>.param_groups.<i>.<setting>``: a setting of group ``i`` in the indexed convention."""
_FLAT_SETTING = re.compile(r"^(?P<prefix>.+?)\.param_groups\.(?P<param>.+)\.(?P<setting>[^.]+)$")
"""``<prefix>.param_groups.<param fqn>.<setting>``: a parameter's copy of a setting (flattened)."""


def _indexed(keys: Iterable[str]) -> Iterator[tuple[str, re.Match[str]]]:
    """The keys that are settings of an indexed param group (one whose ``.params`` key is among ``keys``)."""
    keys = list(keys)
    heads = {key.removesuffix(".params") for key in keys if key.endswith(".params")}
    for key in keys:
        m = _INDEXED_SETTING.match(key)
        if m and m["group"] in heads:
            yield key, m


# -- in place: a DCP directory saved indexed, read under the flattened names ------------------------------
def indexed_aliases(objects: Iterable[ObjectMeta], decode: Callable[[ObjectMeta], Any]) -> list[ObjectMeta]:
    """Flattened-name copies of the settings of every indexed param group among ``objects``.

    For a group ``<prefix>.param_groups.<i>`` whose ``params`` object decodes (``decode``) to a list of
    fqns, each setting object ``<prefix>.param_groups.<i>.<setting>`` gets one alias per parameter,
    ``<prefix>.param_groups.<fqn>.<setting>``, pointing at the same bytes. So a module and optimizer
    (or a flattened state dict) load in place from a DCP directory saved with torch's default
    ``get_state_dict``. An alias whose name a saved object already has is not made.
    """
    objects = list(objects)
    by_key = {o.key: o for o in objects}
    members: dict[str, list[str] | None] = {}
    out: list[ObjectMeta] = []
    for key, m in _indexed(by_key):
        if m["setting"] == "params":
            continue
        group = m["group"]
        if group not in members:
            names = decode(by_key[f"{group}.params"])
            members[group] = names if isinstance(names, list) and all(isinstance(n, str) for n in names) else None
        for name in members[group] or []:
            alias = f"{m['prefix']}.param_groups.{name}.{m['setting']}"
            if alias not in by_key:
                out.append(dataclasses.replace(by_key[key], key=alias))
    return out


# -- whole state dicts (tierckpt convert) -----------------------------------------------------------------
def indexed_to_flat(state: dict[str, Any]) -> None:
    """Rewrite DCP's indexed param groups in place under the flattened names tierckpt stores.

    ``optim.param_groups.0.lr`` (with ``optim.param_groups.0.params`` listing the fqns) becomes
    ``optim.param_groups.<fqn>.lr`` for every fqn of the group. Groups of numbered parameters (a plain
    ``Optimizer.state_dict()``) become one ``optim.param_groups`` list, as saving that dict does.
    """
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for key, m in list(_indexed(state)):
        found.setdefault(m["prefix"], {}).setdefault(int(m["index"]), {})[m["setting"]] = state.pop(key)
    for prefix, indexed in found.items():
        groups = [indexed[i] for i in sorted(indexed)]
        if named_groups(groups):
            state.update((key, group[setting]) for key, group, setting in param_group_items(prefix, groups))
        else:
            state[f"{prefix}.param_groups"] = groups


def flat_to_indexed(state: dict[str, Any], objects: Collection[str]) -> None:
    """Rewrite flattened param group settings in place under DCP's indexed names (the inverse of
    :func:`indexed_to_flat`), what ``dcp.load`` into the default ``get_state_dict(model, optim)`` reads.

    The flattened names do not say which group a parameter was in: parameters with the same settings
    (same names, types and values) form one group, groups numbered in the order of their first key.
    So two groups saved with equal settings come out as one (``dcp.load`` then names the missing
    ``param_groups.1.*`` key); the flattened form keeps them apart. Keys under a prefix whose
    parameters do not all have the same setting names are not optimizer settings and stay as they are;
    only the keys in ``objects`` (the checkpoint's objects: settings are never tensor entries) are considered.
    """
    per_prefix: dict[str, dict[str, dict[str, Any]]] = {}
    keys: dict[str, list[str]] = {}
    for key in objects:
        value = state[key]
        m = _FLAT_SETTING.match(key)
        if m and not (m["param"].isdigit() and f"{m['prefix']}.param_groups.{m['param']}.params" in state):
            per_prefix.setdefault(m["prefix"], {}).setdefault(m["param"], {})[m["setting"]] = value
            keys.setdefault(m["prefix"], []).append(key)
    for prefix, params in per_prefix.items():
        if len({tuple(sorted(s)) for s in params.values()}) != 1:
            continue
        groups: list[tuple[dict[str, Any], list[str]]] = []
        for name, settings in params.items():
            match = next((g for g in groups if _same_settings(g[0], settings)), None)
            if match is None:
                groups.append((settings, [name]))
            else:
                match[1].append(name)
        for key in keys[prefix]:
            del state[key]
        for i, (settings, names) in enumerate(groups):
            state.update({f"{prefix}.param_groups.{i}.{k}": v for k, v in settings.items()})
            state[f"{prefix}.param_groups.{i}.params"] = names


def _same_settings(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(_same_value(a[k], b[k]) for k in a)


def _same_value(a: Any, b: Any) -> bool:
    """Equal with the same type (1, 1.0 and True are three values), tensors elementwise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return bool(a == b)


def rename_legacy_optimizers(state: dict[str, Any]) -> None:
    """Rename a format 1.0 checkpoint's optimizer keys in place to torch's (what a save writes now).

    1.0 named each parameter ``<module key>.<fqn>`` and stored the param groups as one
    ``<optim>.param_groups`` list. When every parameter of an optimizer is a tensor under one module
    key, the key is dropped (``optim.state.<fqn>.<name>``), as a save does now; the groups' settings
    become ``<optim>.param_groups.<param>.<setting>``.
    """
    for key in [k for k in state if k.endswith(".param_groups") and named_groups(state[k])]:
        prefix, groups = key.removesuffix(".param_groups"), state.pop(key)
        names = [n for g in groups for n in g["params"]]
        heads = {n.split(".", 1)[0] for n in names}
        if len(heads) == 1 and all("." in n and isinstance(state.get(n), torch.Tensor) for n in names):
            module = heads.pop()
            old_state = f"{prefix}.state.{module}."
            moved = {f"{prefix}.state.{k.removeprefix(old_state)}": state.pop(k) for k in list(state) if k.startswith(old_state)}
            state.update(moved)
            groups = [{**g, "params": [n.removeprefix(f"{module}.") for n in g["params"]]} for g in groups]
        state.update((k, group[setting]) for k, group, setting in param_group_items(prefix, groups))
