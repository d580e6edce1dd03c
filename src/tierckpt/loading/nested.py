"""A template-free load: the saved state as a nested dict, for tools that have no state to fill.

``tierckpt.load`` fills a state the caller built (modules, optimizers, tensors of the right shapes).
A tool that has none — a trainer's ``load_checkpoint(path)``, an exporter, a notebook — calls
:func:`tierckpt.loading.api.read_state` (or ``tierckpt.load(uri)`` without a state) and gets what was
saved (loaded into :func:`template_of` the checkpoint, then :func:`nest`-ed): every tensor whole, on CPU (assembled from every rank's shards, DTensors included), every object decoded, nested
as the saved state was. A module comes back as its ``state_dict`` (``{"model": {"layers.0.weight":
...}}``), an optimizer as torch's flattened optimizer state dict (``{"optim": {"state.<fqn>.exp_avg":
..., "param_groups.<fqn>.lr": ...}}``, what ``set_optimizer_state_dict`` with
``StateDictOptions(flatten_optimizer_state_dict=True)`` takes), a stateful object as its state dict.

The nesting comes from the structure the save recorded in the header
(:attr:`tierckpt.state.entries.FlatState.structure`): a key splits at every dot, except under a node recorded
as one level (a module, an optimizer, a dict of dotted names) and at a recorded dotted name. Dict keys
come back as strings; empty dicts are not saved, so they do not come back. A checkpoint saved before
the structure was recorded, and a torch DCP directory, record none: their state comes back flat,
``{saved key: value}``. A per-rank object gives this rank's value (rank 0's in one process), as a
load does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tierckpt.errors import CheckpointError
from tierckpt.formats.reader import Checkpoint

__all__ = ["nest", "template_of"]


def template_of(ckpt: Checkpoint) -> dict[str, Any]:
    """A flat state to load ``ckpt`` into: an empty full CPU tensor per saved tensor, ``None`` per object key."""
    flat: dict[str, Any] = {fqn: torch.empty(t.shape, dtype=t.torch_dtype) for fqn, t in ckpt.tensors.items()}
    flat.update({o.key: None for o in ckpt.meta.objects})
    return flat


def nest(flat: Mapping[str, Any], structure: Mapping[str, list[str]] | None) -> dict[str, Any]:
    """``{dotted key: value}`` nested by a recorded structure (:attr:`tierckpt.state.entries.FlatState.structure`;
    ``{}``: every key splits at every dot); ``None`` (none recorded) leaves the keys flat."""
    if structure is None:
        return dict(flat)
    root: dict[str, Any] = {}
    for key, value in flat.items():
        node, path, rest = root, "", key
        while True:
            names = structure.get(path)
            if names == []:
                name = rest
            else:
                dotted = [n for n in names or () if rest == n or rest.startswith(n + ".")]
                name = max(dotted, key=len) if dotted else rest.split(".", 1)[0]
            if name == rest:
                _put(node, name, value, key)
                break
            child = node.setdefault(name, {})
            if not isinstance(child, dict):
                raise CheckpointError(f"saved key {key!r} lies under {name!r}, which the checkpoint also holds as a value")
            node, path, rest = child, f"{path}.{name}" if path else name, rest[len(name) + 1 :]
    return root


def _put(node: dict[str, Any], name: str, value: Any, key: str) -> None:
    if name in node:
        raise CheckpointError(f"saved key {key!r} names a value where the checkpoint also holds a dict")
    node[name] = value
