"""Which reader reads a checkpoint directory: chosen once, from what the directory holds.

:func:`reader_for` probes the root (:class:`~tierckpt.formats.reader.Root`: one existence check per
marker file, one listing at most, shared by every probe) and answers with the first reader of
:data:`READERS` that recognises it: the native reader when ``COMMIT`` is there, then each foreign reader
in order. A root none recognises gets the error that says what it is
(:func:`tierckpt.formats.foreign.missing_commit_error`: an interrupted save, a manager root, another format...).
Nothing is decided by catching the failure of a read.

A foreign format is registered by one :class:`ForeignReader` in :data:`FOREIGN`: its name, a probe of
the root, a function reading ``(CheckpointMeta, tensors, pieces)`` and the refusal message for
operations that need a native checkpoint. Everything else (read past the node cache, no checksums,
no commit to follow) is what every foreign reader shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tierckpt.formats import dcp as dcp_format
from tierckpt.formats import deepspeed_read
from tierckpt.formats import safetensors as safetensors_format
from tierckpt.backends import Backend
from tierckpt.formats.reader import Checkpoint, CheckpointReader, Root
from tierckpt.errors import CheckpointError
from tierckpt.formats.foreign import missing_commit_error
from tierckpt.formats.native import NATIVE, read_native
from tierckpt.native.metadata import CheckpointMeta, PieceMeta, TensorMeta
from tierckpt.store import without_node_cache

__all__ = ["FOREIGN", "READERS", "ForeignReader", "read_checkpoint", "read_pieces", "reader_for", "reader_of"]


@dataclass(frozen=True, slots=True)
class ForeignReader:
    """A format read in place that has no ``COMMIT``, no generations and no checksums
    (:class:`~tierckpt.formats.reader.CheckpointReader`)."""

    format: str
    probe: Callable[[Root], bool]
    """Whether a root is in this format, from its marker files."""
    read_all: Callable[[Backend], tuple[CheckpointMeta, dict[str, TensorMeta], dict[str, list[PieceMeta]]]]
    """Header, tensor table and every piece of the directory at the root of a backend (below the node cache)."""
    refused: Callable[[str], str]
    """The message for an operation that needs a native checkpoint, given the URI."""
    generations = False
    checksums = False

    def holds(self, root: Root) -> bool:
        return self.probe(root)

    def read(self, backend: Backend) -> Checkpoint:
        meta, tensors, pieces = self.read_all(self.source(backend))
        return Checkpoint(meta=meta, tensors=tensors, pieces=pieces, format=self.format)

    def pieces(self, backend: Backend, ckpt: Checkpoint, fqns: set[str] | None) -> dict[str, list[PieceMeta]]:
        listed = ckpt.pieces or {}
        return {f: listed[f] for f in (listed if fqns is None else fqns) if f in listed}

    def source(self, backend: Backend) -> Backend:
        # Rewritten in place (DCP saves again into the same directory, save_pretrained overwrites its
        # files), so bytes a node cache holds could be stale: read below it.
        return without_node_cache(backend)

    def refusal(self, uri: str) -> str | None:
        return self.refused(uri)


DCP = ForeignReader(dcp_format.FORMAT, dcp_format.holds, dcp_format.read_dcp, dcp_format.refusal)
SAFETENSORS = ForeignReader(
    safetensors_format.FORMAT, safetensors_format.holds, safetensors_format.read_safetensors, safetensors_format.refusal,
)
DEEPSPEED_ZERO = ForeignReader(
    deepspeed_read.ZERO_FORMAT, deepspeed_read.holds_zero, deepspeed_read.read_zero, deepspeed_read.zero_refusal,
)
DEEPSPEED_UNIVERSAL = ForeignReader(
    deepspeed_read.UNIVERSAL_FORMAT, deepspeed_read.holds_universal, deepspeed_read.read_universal,
    deepspeed_read.universal_refusal,
)
FOREIGN: tuple[ForeignReader, ...] = (DEEPSPEED_ZERO, DEEPSPEED_UNIVERSAL, DCP, SAFETENSORS)
"""Foreign readers, probed in this order after the native one."""
READERS: tuple[CheckpointReader, ...] = (NATIVE, *FOREIGN)
_BY_FORMAT: dict[str, CheckpointReader] = {r.format: r for r in READERS}


def reader_for(backend: Backend) -> CheckpointReader:
    """The reader of the directory at the root of ``backend``; a root no reader recognises raises the
    error saying what it holds (an interrupted save, nothing at all, another kind of folder)."""
    root = Root(backend)
    for reader in READERS:
        if reader.holds(root):
            return reader
    raise missing_commit_error(backend.root_uri, root.keys)


def reader_of(ckpt: Checkpoint) -> CheckpointReader:
    """The reader that read ``ckpt``: what its format allows (node tiers, checksums, a newer commit)."""
    return _BY_FORMAT[ckpt.format]


def read_checkpoint(backend: Backend, *, accept_foreign: bool = False) -> Checkpoint:
    """The checkpoint at the root of ``backend``, read by the reader its directory calls for
    (:func:`reader_for`): a native checkpoint's ``COMMIT``, header and tensor table (following a newer
    ``COMMIT`` when a save deleted the generation meanwhile); a torch DCP directory or a Hugging Face
    safetensors folder or a DeepSpeed ZeRO or universal folder read in place with ``accept_foreign`` (see
    :mod:`tierckpt.formats.dcp`, :mod:`tierckpt.formats.safetensors`, :mod:`tierckpt.formats.deepspeed_read`), and refused, naming the format and the conversion, without it.
    """
    native = read_native(backend)  # COMMIT read outright with what it names, one trip: no probe before it
    if native is not None:
        return native
    reader = reader_for(backend)
    refusal = reader.refusal(backend.root_uri)
    if refusal is not None and not accept_foreign:
        raise CheckpointError(refusal)
    return reader.read(backend)


def read_pieces(backend: Backend, ckpt: Checkpoint, fqns: set[str] | None = None) -> dict[str, list[PieceMeta]]:
    """The validated pieces of the tensors in ``fqns`` (all when ``None``), as ``ckpt``'s reader finds them:
    the native pieces table (read whole, or only the row groups that can hold ``fqns``: see
    :func:`tierckpt.formats.native.read_table_pieces`), or those a foreign format listed with its metadata."""
    return reader_of(ckpt).pieces(backend, ckpt, fqns)
