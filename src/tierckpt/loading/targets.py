"""Where the bytes of a load's units land: each delivery's part of its target tensor, and whether a unit
or a delivery can be read or received straight into its target (one contiguous CPU part of the unit's dtype).
Used by the read step (:mod:`tierckpt.loading.read_step`) and the streamed peer units (:mod:`tierckpt.loading.peer_stream`)."""

from __future__ import annotations

import torch

from tierckpt.native.metadata import TensorMeta
from tierckpt.planner import ReadUnit
from tierckpt.planner.load_planner import Delivery
from tierckpt.native.regions import FlatRange, StoredBox
from tierckpt.state.adapters import TensorEntry


def _target_view(entry: TensorEntry, stored: StoredBox) -> torch.Tensor:
    """The target's storage for one stored box, shaped like the box (global-offset coordinates)."""
    if isinstance(entry.region, FlatRange):
        flat = entry.tensor.reshape(-1)
        return flat[stored.element_offset : stored.element_offset + stored.box.numel].view(stored.box.lengths)
    return entry.tensor


def delivery_target(entry: TensorEntry, delivery: Delivery) -> torch.Tensor:
    """The part of a target that one delivery fills, shaped like the delivery's box."""
    return _target_view(entry, delivery.target_box)[delivery.box.relative_to(delivery.target_box.box).slices()]


def contiguous_target(entry: TensorEntry, delivery: Delivery, dtype: torch.dtype) -> torch.Tensor | None:
    """The bytes of a delivery's target, when it is one contiguous CPU part of ``dtype`` (bytes can land there
    as read or received)."""
    target = delivery_target(entry, delivery)
    if target.device.type != "cpu" or target.dtype != dtype or not target.is_contiguous():
        return None
    return target.reshape(-1).view(torch.uint8)


def direct_buffer(unit: ReadUnit, targets: list[TensorEntry], rank: int) -> torch.Tensor | None:
    """The target memory to read ``unit`` into when it is exactly one contiguous CPU part of one target."""
    if len(unit.deliveries) != 1:
        return None
    d = unit.deliveries[0]
    if d.rank != rank or d.box != unit.box:
        return None
    return contiguous_target(targets[d.target], d, unit_dtype(unit))


def unit_dtype(unit: ReadUnit) -> torch.dtype:
    """The torch dtype of a unit's bytes."""
    return TensorMeta(fqn=unit.fqn, dtype=unit.dtype, shape=()).torch_dtype


def deliver(entry: TensorEntry, delivery: Delivery, part: torch.Tensor) -> None:
    """Copy ``part`` (the delivery's elements, in any shape) into its place in the target."""
    delivery_target(entry, delivery).copy_(part.reshape(delivery.box.lengths))
