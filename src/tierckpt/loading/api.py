"""Synchronous load with resharding.

Lifecycle (every rank of the loading group unless noted):

1. Rank 0 reads ``COMMIT``, the header and the tensor table (:mod:`tierckpt.formats.native`), checks them
   against the sizes and CRC-32Cs that ``COMMIT`` records, and broadcasts them (a missing commit raises
   :class:`~tierckpt.errors.IncompleteCheckpointError` when data exists without one). The reader is
   chosen once from what the directory holds (:mod:`tierckpt.formats.select`): a torch DCP directory or a
   safetensors folder is read in place by its foreign reader, its pieces included.

Steps 2-5 run in :mod:`tierckpt.loading.generation`:

2. Each rank flattens its target state and checks it against the checkpoint: missing keys, shape and
   dtype mismatches (keys the state does not ask for are not loaded). Ranks all-gather their needs
   and findings; in strict mode any finding on any rank raises on every rank, before anything is read.
   Meanwhile each rank reads a small pieces table whole (checked against ``COMMIT``).
3. Each rank decodes the rows of the pieces table for the tensors the group needs and plans its own
   units (:mod:`tierckpt.planner.rank_plan`: what it reads and what it receives; with memory tiers, each
   unit read by a rank whose node holds its file). Each rank checks the
   sizes of the data files it will read, so a truncated or missing file fails before any tensor is
   modified, and fetches, checks and decodes its objects (weights-only unless ``allow_pickle``), agreed
   in one collective that also carries each rank's round share: every rank then forms the same rounds.
4. Round by round (:class:`~tierckpt.loading.read_step.ReadStep`): readers fetch their units (straight into the target's memory when a unit is
   exactly one contiguous part of one local target), check the CRC-32C of every block they read whole
   (:mod:`tierckpt.io.readcheck`; ranks of one node reading the same bytes share that work), copy
   local deliveries, and exchange the rest with one all-to-all per round. After the last round the
   ranks combine the checksums of blocks read in parts.
5. Objects are put in place; optimizers and stateful objects get their ``load_state_dict`` calls; the
   collective that agrees on it carries every rank's monitor summary.

With a node memory tier in the store's chain, steps 1 and 2 are one collective: every rank reads the
metadata from its own node's tier and prepares its state against it (:mod:`tierckpt.loading.tier_metadata`),
and the group keeps that only if every rank read the same checked commit (else step 1 runs as above).
Each rank also reports in step 2 what its node's tier holds of the generation, and every file is read
from the cheapest place the group can reach (:mod:`tierckpt.loading.locality`): units go to a rank whose node
holds their file (:func:`~tierckpt.planner.rank_plan.local_reader`), which reads them from its
memory tier; the pieces table and objects files a rank's node lacks come from a node that holds them;
only what no node holds is read through the chain. Every check above applies to bytes read from memory too.

Racing a save. A save that commits a newer generation deletes the one this load follows. When a
step fails and ``COMMIT`` has moved since the load read it, the load starts again on the newer
generation (at most :data:`RACE_RETRIES` times), filling every target again, so it returns one
committed checkpoint exactly — never an error caused by the race, never a mix of two generations.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from tierckpt.loading import route_costs
from tierckpt.backends import Backend
from tierckpt.call_args import checked_uri, uri_text
from tierckpt.formats.reader import Checkpoint
from tierckpt.comm import Comm, Group
from tierckpt.errors import CheckpointBusyError, CheckpointError, CollectiveError, MissingFileError, StateMismatchError
from tierckpt.deadline import bounded
from tierckpt.gc_pause import gc_paused
from tierckpt.loading.generation import LoadOptions, load_generation, prepare
from tierckpt.formats.native import RACE_RETRIES, WHOLE_PIECES_BYTES, newer_commit, read_commit, read_document
from tierckpt.monitor import Monitor
from tierckpt.progress import attached
from tierckpt.loading.nested import nest, template_of
from tierckpt.planner import Topology
from tierckpt.formats.select import read_checkpoint, read_pieces, reader_of
from tierckpt.loading.reread import drop_and_retry
from tierckpt.node.face import NodeFace
from tierckpt.store import open_chain, open_store
from tierckpt.loading.tier_metadata import TierStart, read_from_tier, start_from_tiers

__all__ = [
    "DEFAULT_CHUNK_BYTES", "DEFAULT_ROUND_BYTES", "RACE_RETRIES", "WHOLE_PIECES_BYTES", "Checkpoint", "load",
    "read_checkpoint", "read_commit", "read_document", "read_pieces", "read_state",
]

logger = logging.getLogger("tierckpt")

DEFAULT_CHUNK_BYTES = 32 << 20
"""``load(chunk_bytes=)``: saved boxes are planned in row slabs of about this size (the planner has no default)."""
DEFAULT_ROUND_BYTES = 256 << 20
"""``load(round_bytes=)``: a rank holds about this much of read, sent and received buffers per round
(two rounds overlap; the planner has no default)."""

def _template_free(load_fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """``load(uri)`` with no state: the saved state as a nested dict (:func:`read_state`)."""

    @functools.wraps(load_fn)
    def load(uri: str, state: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        if state is None:
            return read_state(uri, **kwargs)
        return load_fn(uri, state, **kwargs)

    return load


def _after_failure(backend: Backend, node: NodeFace, generation: str) -> tuple[bool, bool]:
    """After a failed load of ``generation``: whether a newer commit replaced it, and whether the chain below
    the node memory tier (when there is one) commits it too (its bytes can be read from there)."""
    if newer_commit(backend, generation) is not None:
        return True, False
    if node.memory_tier is None:
        return False, False
    try:
        return False, read_commit(node.below_memory).generation == generation
    except CheckpointError:
        return False, False


def _naming_an_older_commit(exc: MissingFileError, uri: str, node: NodeFace) -> MissingFileError:
    """``exc``, or when the node memory tier commits a generation the chain below never got whole (saved with
    ``persist=False``, or a node lost before its files went down) while the chain below still commits an older
    one, ``exc`` naming that generation and how to load it."""
    mine = node.memory_tier.committed() if node.memory_tier is not None else None
    if mine is None:
        return exc
    try:
        below = read_commit(node.below_memory)
    except CheckpointError:
        return exc
    if below.seq >= mine.seq:
        return exc
    hint = (
        f"This node's memory tier commits generation {mine.generation} (commit {mine.seq}); where "
        f"{uri!r} points, COMMIT still names the older generation {below.generation} (commit {below.seq}). To load "
        "that one, pass storage_options={'memory': False}"
    )
    return MissingFileError(f"{exc}. {hint}")


@_template_free
@gc_paused  # outermost: no collection during any of the call, its deadline's set-up included
@bounded("load")
def load(
    uri: str,
    state: dict[str, Any],
    *,
    group: Group = None,
    strict: bool = True,
    allow_pickle: bool = False,
    verify: bool = False,
    check_crc: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    round_bytes: int = DEFAULT_ROUND_BYTES,
    topology: Topology | None = None,
    monitor: Monitor | None = None,
    collective_timeout_s: float | None = None,
    progress: bool | None = False,
) -> dict[str, Any]:
    """Load the checkpoint at ``uri`` into ``state`` in place (resharding as needed) and return it.

    Without ``state``, return the saved state as a nested dict of full CPU tensors and decoded
    objects (:func:`read_state`), for tools that have no state to fill.

    Tensors, modules and optimizers are filled in place; other values are replaced in their dicts.
    ``strict=False`` loads what matches and warns about the rest. Every byte read is checked against
    the CRC-32C of its block as it is read (a mismatch raises :class:`ChecksumMismatchError` naming the
    file and tensor, once bytes a node cache served were dropped and read again from the remote:
    :mod:`tierckpt.loading.reread`); ``check_crc=False`` skips that check, only to measure its cost. ``verify=True``
    also checks the CRC-32C of every piece the load touches before modifying anything (a second pass).
    ``allow_pickle=True`` permits objects that need full unpickling (only for checkpoints you trust).
    ``topology`` overrides the costs the load routes are chosen by (default: the backend's kind of
    store, the group's backend, and each rank's node from :func:`tierckpt.node.host.node_id`, with the costs
    the job measured of them and ``$TIERCKPT_ROUTE_COSTS`` over those: :mod:`tierckpt.loading.route_costs`). Every rank
    of the group must call it; a rank
    that does not arrive within ``collective_timeout_s`` (default: the group's timeout) is named in a :class:`CollectiveError`.
    ``group="self"`` loads in this process alone, with no collective (each rank reads what it needs itself).
    ``progress=True`` draws a progress bar of the bytes read on stderr, on rank 0 only (``None``: only when
    stderr is a terminal; :mod:`tierckpt.progress`).
    """
    uri = checked_uri("load", uri, state)
    comm = Comm(group)
    comm.check_in(f"load from {uri!r}", collective_timeout_s)
    monitor = monitor or Monitor()
    with attached(monitor, f"load {uri}", progress, comm.rank):
        backend, node = open_chain(uri, dict(storage_options or {}))
        options = LoadOptions(strict, allow_pickle, verify, check_crc, chunk_bytes, round_bytes, topology)
        tier = node.memory_tier
        start: TierStart | None = None
        read: Checkpoint | None = None  # what rank 0 read from its tier, checked against the chain's COMMIT
        reading_rank = 0  # the rank that reads the metadata through the chain
        if tier is not None:  # every rank reads the metadata from its node's memory tier (tier_metadata)
            with monitor.phase("metadata"):
                mine = read_from_tier(tier, backend, leader=comm.rank == 0)
                start, reading_rank = start_from_tiers(
                    comm, mine, lambda ckpt, pieces: prepare(state, ckpt, comm.rank, tier, pieces, route_costs.kept_share(backend, comm)),
                    "preparing the state to load",
                )
                read = mine.ckpt if comm.rank == 0 else None
        attempt = 0
        reread: set[tuple[str, int, int]] = set()  # bytes a node cache served that failed their checksums
        while True:
            if start is None:
                with monitor.phase("metadata"):
                    ckpt = _broadcast_checkpoint(comm, backend, accept_foreign=not verify, src=reading_rank, have=read)
            else:
                ckpt = start.ckpt
            # The chain the format is read through (a foreign format, rewritten in place: below the node cache).
            reader = reader_of(ckpt)
            try:
                summaries = load_generation(uri, state, comm, reader.source(backend), tier if reader.generations else None,
                                            ckpt, options, monitor, start)
            except (CollectiveError, StateMismatchError):
                raise
            except CheckpointError as exc:
                if not reader.generations:
                    raise  # a foreign format has no commit to follow
                if drop_and_retry(comm, node, exc, reread):  # a bad cached copy: read it again from below
                    logger.warning("load of %s: a node-cache copy failed its checksum (%s); reading it again", uri, exc)
                    continue
                # Every rank raised (failures are agreed); the reading rank tells whether a newer commit explains
                # it, and whether the chain below the node memory tier commits this generation too.
                moved, below = comm.broadcast_object(
                    _after_failure(backend, node, ckpt.meta.generation) if comm.rank == reading_rank else None, reading_rank
                )
                if not moved and below:  # the memory tiers' copies failed: the same bytes, read from below
                    logger.warning("load of %s: reading generation %s from the node memory tiers failed (%s); "
                                   "reading it from where the URI points", uri, ckpt.meta.generation, exc)
                    node = node.without_memory()
                    backend, tier, start, read, reading_rank = node.store, None, None, None, 0
                    continue
                if not moved:
                    if isinstance(exc, MissingFileError):
                        raise _naming_an_older_commit(exc, uri, node) from exc
                    raise
                if attempt == RACE_RETRIES:
                    raise CheckpointBusyError(
                        f"loading {uri!r}: newer saves replaced the checkpoint {attempt + 1} times while it was being "
                        f"loaded (last: {exc}); saves to this URI outpace the load. Load a checkpoint that is not being "
                        "re-saved, or save with keep_previous=True"
                    ) from exc
                attempt, start, read = attempt + 1, None, None
                logger.info("load of %s: generation %s was replaced while loading; loading the newer commit",
                            uri, ckpt.meta.generation)
                continue
            monitor.finish("load", uri, comm.rank, summaries)
            return state


def read_state(uri: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """The checkpoint at ``uri`` as a nested dict of full CPU tensors and decoded objects, nested as it
    was saved (:mod:`tierckpt.loading.nested`): a template-free load, for tools that have no state to fill.

    A collective like :func:`load`, whose other arguments it takes (``group``, ``allow_pickle``,
    ``verify``...): in a process group every rank calls it and gets the whole state.
    """
    uri = uri_text("read_state", uri)
    backend = open_store(uri, dict(storage_options or {}))
    ckpt = read_checkpoint(backend, accept_foreign=not options.get("verify", False))
    flat = template_of(ckpt)
    load(uri, flat, storage_options=storage_options, **options)
    return nest(flat, ckpt.meta.structure)

def _broadcast_checkpoint(
    comm: Comm, backend: Backend, accept_foreign: bool = False, src: int = 0, have: Checkpoint | None = None,
) -> Checkpoint:
    """Rank ``src`` reads the checkpoint's metadata through the chain (or sends ``have``, what it already
    read and checked) and every rank returns it; a failure to read raises on every rank. A small pieces
    table travels with it (:attr:`~tierckpt.formats.reader.Checkpoint.pieces_table`): no other rank
    reads it, and ranks whose node lacks it (a replacement node) need no collective of their own for it."""
    result: Checkpoint | None = None
    error: str | None = None
    exc_type: type[CheckpointError] = CheckpointError
    if comm.rank == src:
        try:
            result = have if have is not None else read_checkpoint(backend, accept_foreign=accept_foreign)
        except CheckpointError as exc:
            if comm.world_size == 1:
                raise
            error, exc_type = str(exc), type(exc)
    result, error, exc_type = comm.broadcast_object((result, error, exc_type), src)
    if error is not None:
        raise exc_type(error)
    assert result is not None
    return result
