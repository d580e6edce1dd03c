"""What every checkpoint reader gives the loader: a :class:`Checkpoint`, and the :class:`CheckpointReader`
protocol a format implements to be read in place.

A directory is read by exactly one reader, chosen once from what it holds (:mod:`tierckpt.formats.select`):
the native reader when a ``COMMIT`` record is there (:mod:`tierckpt.formats.native`), else the first foreign
reader whose probe recognises the directory's marker files (torch DCP, a Hugging Face safetensors
folder). The loader, ``verify``, ``convert`` and the CLI then ask that reader what the format allows
(node tiers, checksums, a newer commit to follow) instead of guessing from the metadata's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native.metadata import CheckpointMeta, PieceMeta, TensorMeta

NATIVE_FORMAT = "tierckpt"
""":attr:`Checkpoint.format` of a checkpoint read through its ``COMMIT`` record."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint's header and tensor table, as its reader read them (a plain record: it is broadcast)."""

    meta: CheckpointMeta
    tensors: dict[str, TensorMeta]
    pieces: dict[str, list[PieceMeta]] | None = None
    """Every piece, when the format lists them with its metadata (a foreign format); else ``None``
    (the native pieces table is read by the tensors a load needs)."""
    record: layout.CommitRecord | None = None
    """The ``COMMIT`` record that named it (its checksums check the other metadata documents)."""
    pieces_table: bytes | None = None
    """The native pieces table, whole and checked against ``record``, when it is small enough to be read
    with the header (:data:`tierckpt.formats.native.WHOLE_PIECES_BYTES`): it travels with the metadata a load
    broadcasts, so no other rank reads it."""
    format: str = NATIVE_FORMAT
    """The :attr:`CheckpointReader.format` of the reader that read it (:func:`tierckpt.formats.select.reader_of`)."""


class Root:
    """What a checkpoint directory holds, asked of the store lazily and at most once each: the probes
    of every reader share one listing and one existence check per marker file."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._keys: list[str] | None = None
        self._exists: dict[str, bool] = {}

    def has(self, key: str) -> bool:
        """Whether ``key`` is stored at the root (answered from the listing once there is one)."""
        if self._keys is not None:
            return key in self._keys
        if key not in self._exists:
            self._exists[key] = bool(get_scheduler().run(self.backend.exists(key)))
        return self._exists[key]

    @property
    def keys(self) -> Sequence[str]:
        """Every key under the root (one listing)."""
        if self._keys is None:
            self._keys = list(get_scheduler().run(self.backend.list("")))
        return self._keys


class CheckpointReader(Protocol):
    """How one format's directory is read as a checkpoint, and what that format allows a load to do."""

    format: str
    """The format's name, in messages and ``tierckpt inspect`` (``"tierckpt"``, ``"torch DCP"``, ``"safetensors"``)."""
    generations: bool
    """The directory holds ``COMMIT``-named generations: node tiers may hold its files (every file but
    ``COMMIT`` is immutable), and a newer commit may replace the generation a load follows. A format
    rewritten in place (DCP, ``save_pretrained``) is read past the node cache, and nothing is retried."""
    checksums: bool
    """Its pieces carry CRC-32Cs: reads are checked, ``verify`` can run (else it is refused)."""

    def holds(self, root: Root) -> bool:
        """Whether the directory at ``root`` is in this format (a probe of its marker files, nothing read)."""
        ...

    def read(self, backend: Backend) -> Checkpoint:
        """The checkpoint at the root of ``backend``: its header and tensor table (with the pieces, where
        the format lists them with its metadata)."""
        ...

    def pieces(self, backend: Backend, ckpt: Checkpoint, fqns: set[str] | None) -> dict[str, list[PieceMeta]]:
        """The validated pieces of the tensors in ``fqns`` (all when ``None``)."""
        ...

    def source(self, backend: Backend) -> Backend:
        """The chain the checkpoint's data is read through (a foreign format: below the node cache)."""
        ...

    def refusal(self, uri: str) -> str | None:
        """Why an operation that needs a native checkpoint refuses this one, and what to do (``None``: it does not)."""
        ...
