"""The records of a checkpoint's metadata: what was saved and where its bytes are (:class:`CheckpointMeta`,
:class:`TensorMeta`, :class:`PieceMeta`, :class:`ObjectMeta`, :class:`FileMeta`) and the dtypes they
name. Plain frozen values, never pickled into a checkpoint: :mod:`tierckpt.native.metadata` encodes and decodes
them (and is where callers import them from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tierckpt.errors import CorruptCheckpointError
from tierckpt.native.layout import FORMAT_VERSION
from tierckpt.native.regions import Region

FORMAT_MINOR = 1
"""Minor version: readers of the same ``FORMAT_VERSION`` read every minor version (see docs/format.md).
0 (a header without ``format_minor``) named optimizer state after the state key of the parameter's
module; 1 uses torch's ``get_state_dict`` names."""

#: Upper bounds that keep a crafted file from asking for absurd work or memory.
MAX_NDIM = 64
MAX_NUMEL = 1 << 50

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "bool",
        "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """The stored name of a dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CorruptCheckpointError(f"dtype {dtype} is not supported; supported: {sorted(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in checkpoint metadata") from None


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element (``dtype.itemsize``: no tensor made; planners ask it for every piece)."""
    return dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    """A tensor of the saved state, independent of how it was sharded."""

    fqn: str
    """Fully qualified name, e.g. ``model.layers.0.attn.qkv.weight``."""
    dtype: str
    """Element type name, e.g. ``bfloat16``."""
    shape: tuple[int, ...]
    """Global shape."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.torch_dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class PieceMeta:
    """One saved piece of a tensor: which elements, and where their raw bytes are."""

    fqn: str
    region: Region
    """The elements held: a box, or a flat range of the row-major flattening."""
    file: str
    """Data file key, relative to the generation directory."""
    byte_offset: int
    byte_length: int
    crc32c: int
    """CRC-32C of the piece's bytes."""
    block_bytes: int = 0
    """Size of the checksummed blocks of the piece; 0 in checkpoints written before block checksums."""
    block_crc32c: tuple[int, ...] = ()
    """CRC-32C of each ``block_bytes`` block of the piece's bytes (the last block may be shorter)."""

    def blocks(self) -> tuple[int, tuple[int, ...]]:
        """``(block size, block CRCs)``; a piece without block checksums is one block: the whole piece."""
        if self.block_bytes:
            return self.block_bytes, self.block_crc32c
        return max(self.byte_length, 1), (self.crc32c,)


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectMeta:
    """A non-tensor value (step counter, RNG state, dataloader state...)."""

    key: str
    rank: int | None
    """``None`` when every rank saved the same value (stored once); else the rank that saved it."""
    file: str
    byte_offset: int
    byte_length: int
    crc32c: int
    codec: str
    """``torch`` (``torch.load(weights_only=True)`` reads it) or ``pickle`` (needs ``allow_pickle``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FileMeta:
    key: str
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointMeta:
    """The header of a checkpoint generation."""

    format_version: int = FORMAT_VERSION
    format_minor: int = FORMAT_MINOR
    generation: str
    world_size: int
    created_unix: float
    frameworks: tuple[str, ...] = ()
    """What the saved state held, e.g. ``("fsdp2", "optimizer")``."""
    files: tuple[FileMeta, ...] = ()
    objects: tuple[ObjectMeta, ...] = ()
    num_tensors: int = 0
    num_pieces: int = 0
    tensor_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    structure: dict[str, list[str]] | None = None
    """How the saved keys nest (see :attr:`tierckpt.state.entries.FlatState.structure`; every save records
    it, ``{}`` when every key splits at every dot); ``None`` in checkpoints saved before it was recorded,
    and in foreign formats (torch DCP directories...)."""
