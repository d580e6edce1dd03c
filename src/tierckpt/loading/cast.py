"""What a load does with targets that cannot take the saved bytes as they are.

* A target of another dtype than the checkpoint's (an fp32 checkpoint into a bf16 model) is filled as
  torch DCP fills it: the saved values, cast to the target's dtype. The load reads the saved bytes into a
  tensor of the saved dtype (every check applies to them, resharding included) and, once every rank has
  read, copies it into the target, which rounds exactly as ``saved.to(target.dtype)`` does. It costs one
  temporary of the target's local shape in the saved dtype. Only complex into real is refused (the
  imaginary part would be dropped).
* A target on the meta device has no storage: the load would fill nothing, so it is refused.
"""

from __future__ import annotations

import torch

from tierckpt.errors import StateMismatchError
from tierckpt.state.adapters import FlatState, TensorEntry

SHOWN_KEYS = 4
"""The meta-device error names at most this many keys."""


def castable(saved: torch.dtype, target: torch.dtype) -> bool:
    """Whether a load casts values saved as ``saved`` into a ``target`` tensor (all but complex into real)."""
    return target.is_complex or not saved.is_complex


def read_then_cast(flat: FlatState, entry: TensorEntry, saved: torch.dtype) -> None:
    """Make the load read ``entry`` into a temporary of the ``saved`` dtype, copied (cast) into the target
    first thing after every rank has read (before optimizers' and stateful objects' hooks)."""
    target = entry.tensor
    staging = torch.empty(tuple(target.shape), dtype=saved, device=target.device)
    flat.tensors[entry.fqn] = TensorEntry(fqn=entry.fqn, tensor=staging, shape=entry.shape, region=entry.region)

    def cast() -> None:
        with torch.no_grad():
            target.copy_(staging)

    flat.after_load.insert(0, cast)


def refuse_meta_tensors(flat: FlatState) -> None:
    """Raise when a target tensor is on the meta device (a model built under ``torch.device("meta")``)."""
    meta = [fqn for fqn, entry in flat.tensors.items() if entry.tensor.is_meta]
    if not meta:
        return
    shown = ", ".join(map(repr, meta[:SHOWN_KEYS])) + (f" and {len(meta) - SHOWN_KEYS} more" if len(meta) > SHOWN_KEYS else "")
    raise StateMismatchError(
        f"{len(meta)} tensor(s) of the state are on the meta device ({shown}): they have no storage, so loading "
        "would fill nothing. Materialize the model first, e.g. model.to_empty(device='cpu') (or 'cuda'), then load"
    )
