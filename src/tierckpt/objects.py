"""Encoding of non-tensor objects (step counters, RNG states, dataloader state...).

Objects are written with ``torch.save`` and read with ``torch.load(weights_only=True)``, which only
rebuilds plain containers, numbers, strings and tensors — it cannot run code. An object that needs
full unpickling (a custom class) is marked ``pickle`` at save time and is only read when the caller
passes ``allow_pickle=True``.
"""

from __future__ import annotations

import functools
import io
import math
import pickle
from typing import Any

import torch

from .errors import CheckpointError, CorruptCheckpointError


_PLAIN_TYPES = (int, bool, type(None))
_PLAIN_MAX_LEN = 64
"""Strings and tuples/lists longer than this are not cached (nor kept alive by the cache)."""


def _plain_key(value: Any) -> Any:
    """A cache key for a number, short string, ``None`` or short tuple/list of them (typed: ``1``,
    ``1.0`` and ``True`` differ; floats by their bits: ``-0.0`` is not ``0.0``), else ``None``."""
    if type(value) is float:
        return None if math.isnan(value) else (float, value.hex())
    if type(value) in _PLAIN_TYPES or (type(value) is str and len(value) <= _PLAIN_MAX_LEN):
        return (type(value), value)
    if type(value) in (tuple, list) and len(value) <= _PLAIN_MAX_LEN:
        keys = tuple(_plain_key(v) for v in value)
        return None if any(k is None for k in keys) else (type(value), keys)
    return None


def _from_key(key: Any) -> Any:
    kind, value = key
    if kind is float:
        return float.fromhex(value)
    return kind(_from_key(k) for k in value) if kind in (tuple, list) else value


@functools.lru_cache(maxsize=1024)
def _encode_plain(key: Any) -> tuple[bytes, str]:
    """Plain values repeat (every parameter holds its group's ``lr``...): each distinct one is
    encoded once, and a weights-only load always reads them."""
    buf = io.BytesIO()
    torch.save(_from_key(key), buf)
    return buf.getvalue(), "torch"


def encode_object(value: Any) -> tuple[bytes, str]:
    """Bytes and codec (``torch`` when a weights-only load reads it back, else ``pickle``)."""
    key = _plain_key(value)
    if key is not None:
        return _encode_plain(key)
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
    if codec.startswith("deepspeed:"):  # a setting or number inside a DeepSpeed file's data.pkl
        from .deepspeed_objects import decode_value

        return decode_value(data, codec, key)
    try:
        if codec == "torch" and len(data) <= _SMALL_BYTES:
            frozen, value = _decode_small(data)
            if frozen:
                return value
        return torch.load(io.BytesIO(data), weights_only=codec == "torch", map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - translated to the documented error
        raise CorruptCheckpointError(f"object {key!r} cannot be decoded: {exc}") from exc


_SMALL_BYTES = 4096


@functools.lru_cache(maxsize=1024)
def _decode_small(data: bytes) -> tuple[bool, Any]:
    """A small object's value, and whether it is immutable (a number, string, ``None`` or tuple of
    them): those are decoded once and shared, as the same settings repeat for every parameter."""
    value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    key = _plain_key(value)
    return key is not None and _immutable(key), value


def _immutable(key: Any) -> bool:
    kind, value = key
    if kind is list:
        return False
    return all(_immutable(k) for k in value) if kind is tuple else True
