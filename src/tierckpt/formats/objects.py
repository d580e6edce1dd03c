"""Encoding of non-tensor objects (step counters, RNG states, dataloader state...).

Objects are written with ``torch.save`` and read with ``torch.load(weights_only=True)``, which only
rebuilds plain containers, numbers, strings and tensors — it cannot run code. An object that needs
full unpickling (a custom class) is refused at save time unless the saver passes ``allow_pickle``
(:func:`refuse_pickles`: the error names its key and type, and the fix); then it is marked ``pickle`` and
only read when the loader passes ``allow_pickle=True`` too.
"""

from __future__ import annotations

import functools
import io
import math
import pickle
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch

from tierckpt.errors import CheckpointError, CorruptCheckpointError


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


AllowPickle = bool | Literal["warn"]
"""``save(allow_pickle=)``: ``False`` refuses objects that need pickle, ``"warn"`` saves them with a warning,
``True`` saves them."""


def refuse_pickles(uri: str, values: Mapping[str, Any], codecs: Mapping[str, str], allow_pickle: AllowPickle) -> None:
    """Raise (``allow_pickle=False``) or warn (``"warn"``) about the objects of ``values`` whose codec (in
    ``codecs``) is ``pickle``, naming each key, the type that needs unpickling and the fix: a checkpoint
    holding them loads only with ``load(..., allow_pickle=True)``, so refusing them here says so at save
    time, not at the first load."""
    if allow_pickle not in (True, False, "warn"):
        raise CheckpointError(f"save to {uri!r}: allow_pickle={allow_pickle!r}: pass False (refuse objects that need "
                              "pickle), True (store them as pickles) or 'warn' (store them, with a warning)")
    pickled = sorted(key for key, codec in codecs.items() if codec == "pickle")
    if not pickled or allow_pickle is True:
        return
    named = "; ".join(f"{key!r} ({_pickled_part(values[key])})" for key in pickled[:5])
    more = f" and {len(pickled) - 5} more" if len(pickled) > 5 else ""
    load_needs = ("a load reads it back only with load(..., allow_pickle=True), which can run code, so only from "
                  "checkpoints you trust")
    if allow_pickle == "warn":
        warnings.warn(f"save to {uri!r}: saved as pickle: {named}{more}; {load_needs}", UserWarning, stacklevel=2)
        return
    raise CheckpointError(
        f"save to {uri!r}: object {named}{more} can only be saved as a pickle ({load_needs}). Save it as plain "
        "data instead (numbers, strings, lists, dicts, tensors: e.g. dataclasses.asdict(obj), vars(obj), "
        "obj.state_dict()), or pass allow_pickle=True to save (allow_pickle='warn' to be warned) to store it as a pickle"
    )


def _pickled_part(value: Any, path: str = "") -> str:
    """``type`` of what in ``value`` needs unpickling, with where it sits inside a container (``[2]``, ``['cfg']``)."""
    items: list[tuple[str, Any]] = []
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    elif type(value) is dict:
        items = [(f"[{k!r}]", v) for k, v in value.items()]
    for where, item in items:
        if _plain_key(item) is None and codec_of(_torch_bytes(item)) == "pickle":
            return _pickled_part(item, path + where)
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    return f"type {kind} at {path}" if path else f"type {kind}"


def _torch_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


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
        from tierckpt.formats.deepspeed_objects import decode_value

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
