"""The first step of a load whose store has a node memory tier: every rank reads the checkpoint's
metadata from its own node's tier, and one collective both agrees on it and carries what each rank needs.

Without a memory tier, one rank reads ``COMMIT``, the header and the tensor table through the store's
chain and broadcasts them: on an object store, every rank reading them would multiply the requests. In a
memory tier they are small files on the node's tmpfs, cheaper to read on every rank than to pickle and
broadcast. So each rank reads them from its tier (:func:`read_from_tier`): ``COMMIT``, then the header,
the tensor table and (when small) the pieces table of the generation it names, each refused unread past
its bound and checked against the size and CRC-32C that ``COMMIT`` records. Rank 0 also reads ``COMMIT``
through the chain, as the one reader did before: a newer commit below the tier (saved by nodes whose
tiers are elsewhere) is not hidden by the tier's copy. Each rank then prepares its state against what
it read, and the load's first collective carries every rank's preparation together with a token of what
it read (:func:`start_from_tiers`).

The group goes on from there only when every rank read the same ``COMMIT`` (its sequence, generation
and CRC-32C) and every document passed its checks, so every rank holds the same checked metadata.
Otherwise — a rank's node holds no copy (a replacement node), the copies disagree, a document is
damaged or missing, the chain holds a newer commit — the load falls back to one reader and a broadcast,
the reader chosen from the same collective's answers as before: rank 0, unless another rank's node
holds a newer ``COMMIT`` (then the lowest such rank). The fallback reads through the chain, so its
errors name the damaged file and the fix exactly as a load without this step does; only rank 0's own
tier read, checked against the chain's ``COMMIT``, is sent as it is. Either way a small pieces table travels
with the header (:attr:`~tierckpt.formats.reader.Checkpoint.pieces_table`), so a replacement node needs
no collective of its own for it. Every rank of the group must have the memory tier on (as for saves).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.node.face import NodeTier
from tierckpt.backends.bounded import MAX_RECORD_BYTES
from tierckpt.comm import Comm, describe_error
from tierckpt.errors import CheckpointError
from tierckpt.formats.reader import Checkpoint
from tierckpt.formats.native import decoded_checkpoint, metadata_documents, read_commit

logger = logging.getLogger("tierckpt")

MAX_COMMIT_BYTES = MAX_RECORD_BYTES
"""A ``COMMIT`` in the tier larger than this is not read here (the fallback reads it through the chain)."""


@dataclass(frozen=True, slots=True)
class TierRead:
    """What one rank read of the committed checkpoint from its node's memory tier."""

    seq: int
    """The sequence of the tier's ``COMMIT`` (-1: none, or unreadable)."""
    token: tuple[int, str, int] | None = None
    """``(seq, generation, CRC-32C of COMMIT)`` when every document was read and passed its checks."""
    ckpt: Checkpoint | None = None
    """The header and tensor table, and the whole pieces table when ``COMMIT`` records it at most
    ``WHOLE_PIECES_BYTES`` long (with ``token`` only)."""
    why: str | None = None
    """Why the tier's copy cannot be used (without ``token``)."""


def read_from_tier(tier: NodeTier, chain: Backend, *, leader: bool) -> TierRead:
    """The committed checkpoint's metadata from ``tier`` (see the module docstring); ``leader`` (rank 0)
    also reads ``COMMIT`` through ``chain`` and uses the tier's copy only if it names the same commit.
    Never raises for what it finds: a copy that cannot be used says why, and the load falls back."""
    uri = chain.root_uri
    try:
        data = tier.read_file(layout.COMMIT, MAX_COMMIT_BYTES)
        record = layout.CommitRecord.decode(data)
    except FileNotFoundError:
        return TierRead(-1, why="no COMMIT in this node's memory tier")
    except (CheckpointError, OSError) as exc:
        return TierRead(-1, why=str(exc))
    gen = record.generation
    if record.checksum(layout.HEADER) is None or record.checksum(layout.TENSORS) is None:
        return TierRead(record.seq, why="its COMMIT records no checksums of the metadata")
    try:
        def document(key: str, limit: int) -> bytes:
            doc = tier.read_file(layout.in_generation(gen, key), limit)
            record.check_document(key, doc, uri)
            return doc

        ckpt = decoded_checkpoint(record, *(document(key, limit) for key, limit in metadata_documents(record)))
        if leader:  # last: in parallel, the I/O loop's thread would hold the GIL the reads above need
            theirs = read_commit(chain)
            if (theirs.seq, theirs.generation) != (record.seq, gen):
                return TierRead(record.seq, why=f"the store's COMMIT names {theirs.generation!r} (seq {theirs.seq})")
    except Exception as exc:  # noqa: BLE001 - whatever failed, the fallback reads through the chain and reports it
        return TierRead(record.seq, why=f"{type(exc).__name__}: {exc}")
    return TierRead(record.seq, (record.seq, gen, crc32c.crc32c(data)), ckpt)


@dataclass(frozen=True, slots=True)
class TierStart:
    """The agreed outcome of :func:`start_from_tiers`: the checkpoint and every rank's preparation."""

    ckpt: Checkpoint
    kept: Any
    """This rank's own part of the preparation (it keeps the whole pieces table it was given, if any: the
    same bytes on every rank, or none on every rank, as every rank read the same ``COMMIT``)."""
    shared: list[Any]
    """Every rank's shared part of the preparation, in rank order."""


def start_from_tiers(
    comm: Comm, read: TierRead, prepare: Callable[[Checkpoint, bytes | None], tuple[Any, Any]], what: str,
) -> tuple[TierStart | None, int]:
    """Prepare against what this rank read (``prepare(ckpt, pieces) -> (kept, shared)``) and agree in one
    collective: ``(start, 0)`` when every rank read the same checked commit (a preparation that failed on
    any rank then raises on every rank, naming ``what``), else ``(None, reader)``: the load falls back to
    ``reader`` reading and broadcasting the metadata."""
    result, error = None, None
    if read.ckpt is not None:
        try:
            result = prepare(read.ckpt, read.ckpt.pieces_table)
        except Exception as exc:  # noqa: BLE001 - shared with every rank, raised if the tiers agree
            error = exc
    kept, shared = result if result is not None else (None, None)
    gathered = comm.all_gather_object((read.seq, read.token, shared, describe_error(error)))
    tokens = {token for _, token, _, _ in gathered}
    if len(tokens) == 1 and None not in tokens:
        comm.raise_failures(error, [message for _, _, _, message in gathered], what)
        assert read.ckpt is not None
        return TierStart(read.ckpt, kept, [s for _, _, s, _ in gathered]), 0
    if read.why is not None:
        logger.debug("rank %d: the memory tier's copy of the metadata is not used: %s", comm.rank, read.why)
    seqs = [seq for seq, _, _, _ in gathered]
    return None, seqs.index(max(seqs)) if seqs[0] < max(seqs) else 0
