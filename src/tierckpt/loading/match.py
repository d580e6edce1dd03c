"""Step 2 of a load: the state checked against the checkpoint (keys, shapes, dtypes), and the report.

Each rank matches its flattened state (:func:`match`: its needs and findings; a 0-d tensor the checkpoint
holds as a number becomes an object entry that writes the number into it); the findings of every
rank are reported together (:func:`report`): in strict mode any finding raises
:class:`~tierckpt.errors.StateMismatchError` on every rank before anything is read.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any

import torch

from tierckpt.errors import StateMismatchError
from tierckpt.loading.cast import castable, read_then_cast
from tierckpt.formats.reader import Checkpoint
from tierckpt.state.entries import NumberIntoTensor, TensorEntry, is_dtensor
from tierckpt.native.metadata import dtype_name
from tierckpt.planner import TargetPiece
from tierckpt.state.adapters import FlatState

logger = logging.getLogger("tierckpt")


def match(flat: FlatState, ckpt: Checkpoint) -> tuple[list[TargetPiece], list[tuple[str, str]]]:
    """This rank's needs, and findings ``(kind, message)`` about keys, shapes and dtypes."""
    needs: list[TargetPiece] = []
    findings: list[tuple[str, str]] = []
    saved_objects = {o.key for o in ckpt.meta.objects}
    for fqn, entry in list(flat.tensors.items()):
        saved = ckpt.tensors.get(fqn)
        if saved is None and fqn in saved_objects and _takes_a_number(entry):
            del flat.tensors[fqn]  # an int step saved as an object (DeepSpeed's CPU Adam): loaded into the tensor
            flat.objects[fqn] = NumberIntoTensor(key=fqn, value=entry.tensor, container=entry.tensor, slot=...)
            continue
        if saved is None:
            findings.append(("object" if fqn in saved_objects else "missing", fqn))
            continue
        dtype = dtype_name(entry.tensor.dtype)
        if saved.shape != entry.shape:
            findings.append(("shape", f"{fqn!r}: checkpoint has shape {list(saved.shape)}, the state has {list(entry.shape)}"))
        elif saved.dtype != dtype and not castable(saved.torch_dtype, entry.tensor.dtype):
            findings.append(("dtype", f"{fqn!r}: checkpoint has dtype {saved.dtype}, the state has {dtype}, and "
                                      "casting would drop the imaginary part"))
        else:
            if saved.dtype != dtype:
                read_then_cast(flat, entry, saved.torch_dtype)
            needs.append(TargetPiece(fqn=fqn, region=entry.region))
    findings.extend(("missing", key) for key in flat.objects if key not in saved_objects)
    return needs, findings


def _takes_a_number(entry: TensorEntry) -> bool:
    """A plain 0-d real tensor (an optimizer's step): a saved number loads into it."""
    t = entry.tensor
    return entry.shape == () and not is_dtensor(t) and not t.is_complex() and t.dtype != torch.bool


def report(gathered: list[Any], ckpt: Checkpoint, strict: bool, uri: str) -> None:
    """Strict: every requested key is in the checkpoint with its shape and dtype. Keys the checkpoint
    has and the state did not ask for are not loaded, and only logged (at debug level)."""
    findings = sorted({f for g in gathered for f in g[1]})
    lines = [f"shape mismatch {m}" for kind, m in findings if kind == "shape"]
    lines.extend(f"dtype mismatch {m}" for kind, m in findings if kind == "dtype")
    lines.extend(f"{m!r} is a tensor in the state but an object in the checkpoint" for kind, m in findings if kind == "object")
    missing = [m for kind, m in findings if kind == "missing"]
    if missing:
        lines.append(f"missing from the checkpoint: {_few(missing)}")
        if any(_UNNAMED_PARAM.search(m) for m in missing):
            lines.append(UNNAMED_HINT)
    if logger.isEnabledFor(logging.DEBUG):
        wanted = {k for g in gathered for k in g[2]} | {k for g in gathered for k in g[3]}
        unasked = sorted((set(ckpt.tensors) | {o.key for o in ckpt.meta.objects}) - wanted)
        if unasked:
            logger.debug("checkpoint %r: %d key(s) not requested, not loaded: %s", uri, len(unasked), _few(unasked))
    if not lines:
        return
    message = f"state does not match checkpoint {uri!r}: " + "; ".join(lines)
    if strict:
        raise StateMismatchError(message + ". Fix the state, or pass strict=False to load what matches")
    warnings.warn(message + " (strict=False: loading what matches)", stacklevel=3)


_UNNAMED_PARAM = re.compile(r"\.param_group\d+\.param\d+\.")
UNNAMED_HINT = (
    "an optimizer's parameters have no names here (param_group<i>.param<j>), while checkpoints name them by "
    "their module's fqn: put the model in the same call ({'model': model, 'optim': optim}), or pair them "
    "({'optim': (model, optim)}) to load the optimizer without the model"
)


def _few(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
