"""Encoding of non-tensor objects (step counters, RNG states, dataloader state...).

Objects are written with ``torch.save`` and read with ``torch.load(weights_only=True)``, which only
rebuilds plain containers, numbers, strings and tensors — it cannot run code. An object that needs
full unpickling (a custom class) is marked ``pickle`` at save time and is only read when the caller
passes ``allow_pickle=True``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from .errors import CheckpointError, CorruptCheckpointError


def encode_object(value: Any) -> tuple[bytes, str]:
    """Bytes and codec (``torch`` when a weights-only load reads it back, else ``pickle``)."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"cannot serialize object of type {type(value).__name__}: {exc}") from exc
    data = buf.getvalue()
    return data, codec_of(data)


def codec_of(data: bytes) -> str:
    """``torch`` when ``torch.load(weights_only=True)`` reads ``torch.save`` bytes, else ``pickle``."""
    try:
        torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        return "torch"
    except Exception:  # noqa: BLE001 - any failure means a weights-only load cannot read it
        return "pickle"


def decode_object(data: bytes, codec: str, key: str, *, allow_pickle: bool) -> Any:
    if codec == "pickle" and not allow_pickle:
        raise CheckpointError(
            f"object {key!r} was saved as a pickle, and unpickling can run code; pass allow_pickle=True "
            "to load it if you trust this checkpoint"
        )
    try:
        return torch.load(io.BytesIO(data), weights_only=codec == "torch", map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - translated to the documented error
        raise CorruptCheckpointError(f"object {key!r} cannot be decoded: {exc}") from exc
