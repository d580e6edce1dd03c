"""Synchronous load with resharding.

Lifecycle (every rank of the loading group unless noted):

1. Rank 0 reads ``COMMIT``, the header and the tensor table (:mod:`tierckpt.meta_read`), checks them
   against the sizes and CRC-32Cs that ``COMMIT`` records, and broadcasts them (a missing commit raises
   :class:`~tierckpt.errors.IncompleteCheckpointError` when data exists without one; a torch DCP
   directory is read in place by :mod:`tierckpt.dcp_format`, its pieces included).
2. Each rank flattens its target state and checks it against the checkpoint: missing keys, shape and
   dtype mismatches (keys the state does not ask for are not loaded). Ranks all-gather their needs
   and findings; in strict mode any finding on any rank raises on every rank, before anything is read.
   Meanwhile each rank reads a small pieces table whole (checked against ``COMMIT``).
3. Each rank decodes the rows of the pieces table for the tensors the group needs and computes the
   same :class:`~tierckpt.planner.LoadPlan`. Each rank checks the sizes of the data files it will read,
   so a truncated or missing file fails before any tensor is modified, and fetches, checks and decodes
   its objects (weights-only unless ``allow_pickle``), agreed in one collective.
4. Round by round (:class:`~tierckpt.read_step.ReadStep`): readers fetch their units (straight into the target's memory when a unit is
   exactly one contiguous part of one local target), check the CRC-32C of every block they read whole
   (:mod:`tierckpt.io.readcheck`; ranks of one node reading the same bytes share that work), copy
   local deliveries, and exchange the rest with one all-to-all per round. After the last round the
   ranks combine the checksums of blocks read in parts.
5. Objects are put in place; optimizers and stateful objects get their ``load_state_dict`` calls; the
   collective that agrees on it carries every rank's monitor summary.

With a node memory tier in the store's chain, steps 1 and 2 are one collective: every rank reads the
metadata from its own node's tier and prepares its state against it (:mod:`tierckpt.tier_metadata`),
and the group keeps that only if every rank read the same checked commit (else step 1 runs as above).
Each rank also reports in step 2 what its node's tier holds of the generation, and every file is read
from the cheapest place the group can reach (:mod:`tierckpt.local_load`): units go to a rank whose node
holds their file (:func:`~tierckpt.planner.locality.assign_local_readers`), which reads them from its
memory tier; the pieces table and objects files a rank's node lacks come from a node that holds them;
only what no node holds is read through the chain. Every check above applies to bytes read from memory too.

Racing a save. A save that commits a newer generation deletes the one this load follows. When a
step fails and ``COMMIT`` has moved since the load read it, the load starts again on the newer
generation (at most :data:`RACE_RETRIES` times), filling every target again, so it returns one
committed checkpoint exactly — never an error caused by the race, never a mix of two generations.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import crc32c

from . import layout
from .backends import Backend
from .call_args import checked_uri
from .comm import Comm, Group
from .errors import (
    CheckpointBusyError, CheckpointError, CheckpointNotFoundError, ChecksumMismatchError, CollectiveError,
    CorruptCheckpointError, MissingFileError, StateMismatchError,
)
from .deadline import bounded, carried
from .gc_pause import gc_paused
from .io.readcheck import ReadChecker
from .io.scheduler import get_scheduler
from .load_cast import refuse_meta_tensors
from .local_load import LocalReads, held_files, rereaders
from .meta_read import (
    RACE_RETRIES, WHOLE_PIECES_BYTES, Checkpoint, newer_commit, read_checkpoint, read_commit, read_document, read_pieces,
    whole_pieces,
)
from .metadata import ObjectMeta, PieceMeta, decode_pieces
from .load_match import match, report
from .monitor import Monitor
from .progress import attached
from .nested import nest, template_of
from .objects_read import fetch_objects, wanted_objects
from .node import node_id
from .planner import LoadPlan, TargetPiece, Topology, plan_load, topology as route_topology
from .planner.locality import assign_local_readers, relocate, spans_of
from .planner.routes import store_kind
from .read_step import ReadStep
from .reread import drop_and_retry
from .state import FlatState, flatten_state
from .store import identity_of, memory_tier_of, open_store, without_node_cache
from .tier_metadata import TierStart, read_from_tier, start_from_tiers
from .tiers.memory import MemoryTier

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
PARALLEL_METADATA = 16
"""At most this many size checks of data files are in flight at once (one thread each)."""


def _naming_an_older_commit(load_fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """A :class:`MissingFileError` of a checkpoint committed in the node memory tier also names, when the
    chain below still commits an older generation (the newer one was never written down whole: saved with
    ``persist=False``, or a node lost before its files went down), that generation and how to load it."""

    @functools.wraps(load_fn)
    def load(uri: str, state: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        if state is None:  # template-free: the saved state as a nested dict
            return read_state(uri, **kwargs)
        try:
            return load_fn(uri, state, **kwargs)
        except MissingFileError as exc:
            hint = _older_commit_below(uri, kwargs.get("storage_options"))
            if hint is None:
                raise
            raise MissingFileError(f"{exc}. {hint}") from exc

    return load


def _older_commit_below(uri: str, storage_options: Mapping[str, Any] | None) -> str | None:
    store = open_store(uri, dict(storage_options or {}))
    tier = memory_tier_of(store)
    mine = tier.committed() if tier is not None else None
    if mine is None:
        return None
    try:
        below = read_commit(store.below)  # type: ignore[attr-defined]  # a MemoryLink (it has a tier)
    except CheckpointError:
        return None
    if below.seq >= mine.seq:
        return None
    return (
        f"This node's memory tier commits generation {mine.generation} (commit {mine.seq}); where "
        f"{uri!r} points, COMMIT still names the older generation {below.generation} (commit {below.seq}). To load "
        "that one, pass storage_options={'memory': False}"
    )


@_naming_an_older_commit
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
    :mod:`tierckpt.reread`); ``check_crc=False`` skips that check, only to measure its cost. ``verify=True``
    also checks the CRC-32C of every piece the load touches before modifying anything (a second pass).
    ``allow_pickle=True`` permits objects that need full unpickling (only for checkpoints you trust).
    ``topology`` overrides the costs the load routes are chosen by (default: the backend's kind of
    store, the group's backend, and each rank's node from :func:`tierckpt.node.node_id`). Every rank
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
        backend = open_store(uri, dict(storage_options or {}))
        options = _Options(strict, allow_pickle, verify, check_crc, chunk_bytes, round_bytes, topology)
        tier = memory_tier_of(backend)
        start: TierStart | None = None
        read: Checkpoint | None = None  # what rank 0 read from its tier, checked against the chain's COMMIT
        reader = 0
        if tier is not None:  # every rank reads the metadata from its node's memory tier (tier_metadata)
            with monitor.phase("metadata"):
                mine = read_from_tier(tier, backend, leader=comm.rank == 0)
                start, reader = start_from_tiers(
                    comm, mine, lambda ckpt, pieces: _prepare(state, ckpt, comm.rank, tier, pieces),
                    "preparing the state to load",
                )
                read = mine.ckpt if comm.rank == 0 else None
        attempt = 0
        reread: set[tuple[str, int, int]] = set()  # bytes a node cache served that failed their checksums
        while True:
            if start is None:
                with monitor.phase("metadata"):
                    ckpt = _broadcast_checkpoint(comm, backend, accept_dcp=not verify, src=reader, have=read)
            else:
                ckpt = start.ckpt
            # torch DCP rewrites its files in place, which a node cache would serve stale.
            source = without_node_cache(backend) if ckpt.pieces is not None else backend
            try:
                summaries = _load_generation(uri, state, comm, source, ckpt, options, monitor, start)
            except (CollectiveError, StateMismatchError):
                raise
            except CheckpointError as exc:
                if ckpt.pieces is not None:
                    raise  # a DCP directory has no commit to follow
                if drop_and_retry(comm, backend, exc, reread):  # a bad cached copy: read it again from below
                    logger.warning("load of %s: a node-cache copy failed its checksum (%s); reading it again", uri, exc)
                    continue
                # Every rank raised (failures are agreed); the reader tells whether a newer commit explains it.
                moved = comm.broadcast_object(
                    newer_commit(backend, ckpt.meta.generation) is not None if comm.rank == reader else None, reader
                )
                if not moved:
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


def read_state(uri: str, *, storage_options: Mapping[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """The checkpoint at ``uri`` as a nested dict of full CPU tensors and decoded objects, nested as it
    was saved (:mod:`tierckpt.nested`): a template-free load, for tools that have no state to fill.

    A collective like :func:`load`, whose other arguments it takes (``group``, ``allow_pickle``,
    ``verify``...): in a process group every rank calls it and gets the whole state.
    """
    backend = open_store(uri, dict(storage_options or {}))
    ckpt = read_checkpoint(backend, accept_dcp=not options.get("verify", False))
    flat = template_of(ckpt)
    load(uri, flat, storage_options=storage_options, **options)
    return nest(flat, ckpt.meta.structure)


@dataclass(frozen=True, slots=True)
class _Options:
    """The tuning and checking arguments of :func:`load`."""

    strict: bool
    allow_pickle: bool
    verify: bool
    check_crc: bool
    chunk_bytes: int
    round_bytes: int
    topology: Topology | None


def _load_generation(
    uri: str, state: dict[str, Any], comm: Comm, backend: Backend, ckpt: Checkpoint, opts: _Options, monitor: Monitor,
    start: TierStart | None,
) -> list[dict[str, float]]:
    """Steps 2-5 of the lifecycle for the generation ``ckpt`` names; fills every target and returns every
    rank's monitor summary. ``start``: step 2 already done with the metadata read from the memory tiers."""
    tier = memory_tier_of(backend) if ckpt.pieces is None else None
    with monitor.phase("metadata"):
        if start is not None:
            (flat, needs, wanted, table), gathered = start.kept, start.shared
        else:
            # One collective agrees that every rank could prepare its state and carries what each needs
            # and what its node's memory tier holds. Without a tier, each rank reads a small pieces table
            # meanwhile (with one, a rank's node may lack it: it is read once the holders are known).
            (flat, needs, wanted, table), gathered = comm.exchange_agreed(
                lambda: _prepare(state, ckpt, comm.rank, tier, whole_pieces(backend, ckpt) if tier is None else None),
                "preparing the state to load", same=("URI", identity_of(uri, backend)),
            )
        report(gathered, ckpt, opts.strict, uri)
        local = LocalReads.of(comm.rank, tier, [(g[4], g[5]) for g in gathered])
        preread = all(g[7] for g in gathered)
        # Small files a rank needs and its node lacks come from a node that holds them (one collective, if any).
        shared = local.share(comm, ckpt.meta.generation, [[*([] if preread else [layout.PIECES]), *g[6]] for g in gathered]
                             ) if local.active else {}
        all_needs = [g[0] for g in gathered]
        fqns = {n.fqn for rank_needs in all_needs for n in rank_needs}
        if preread:
            # Every rank holds the same bytes, checked against COMMIT, and decodes them for the same tensors:
            # the same pieces on every rank, or the same error raised on every rank (nothing to agree on).
            pieces = decode_pieces(table, ckpt.tensors, fqns, ckpt.meta.num_pieces)
        elif ckpt.pieces is not None:
            pieces = read_pieces(backend, ckpt, fqns)  # listed with a torch DCP directory's metadata: nothing to read
        else:
            pieces = comm.run_agreed(lambda: _local_pieces(backend, ckpt, fqns, local, shared), "reading the pieces table")
    with monitor.phase("plan"):
        topo = opts.topology or _topology(backend, comm, [g[4] for g in gathered], min(g[8] for g in gathered))
        nodes = list(topo.nodes)
        plan = plan_load(
            ckpt.tensors, pieces, all_needs, chunk_bytes=opts.chunk_bytes, round_bytes=opts.round_bytes, topology=topo,
        )
        if local.active:  # each unit to a rank whose node's memory tier holds its file, where one does
            locality = assign_local_readers(spans_of(plan), local.holdings)
            plan = relocate(plan, locality.readers, opts.round_bytes)
            monitor.count("bytes_read_memory", sum(
                u.nbytes for u, here in zip(plan.units, locality.local) if here and u.reader == comm.rank
            ))
        _log_routes(plan, topo, comm.rank, monitor)
    gen = ckpt.meta.generation

    def check_and_fetch() -> dict[str, Any]:
        _check_files(backend, ckpt, plan, comm.rank, local)
        # Objects are small: fetch, check and decode them before any tensor is modified.
        return fetch_objects(backend, ckpt, flat, wanted, opts.allow_pickle, local, shared)

    with monitor.phase("objects"):
        values = comm.run_agreed(check_and_fetch, "checking the data files and loading objects")
    if opts.verify:
        with monitor.phase("verify"):
            comm.run_agreed(lambda: _verify_pieces(backend, gen, pieces, comm, local), "verifying checksums")
    targets = [flat.tensors[n.fqn] for n in needs]
    # A torch DCP directory records no checksums (its pieces carry none): there is nothing to check.
    checker = ReadChecker(gen, pieces) if opts.check_crc and ckpt.pieces is None else None
    executor = ReadStep(backend, gen, plan, targets, comm, monitor, checker, nodes, opts.chunk_bytes, local)

    def read() -> tuple[None, Any]:
        executor.run()
        return None, checker.partials() if checker is not None else None

    with monitor.phase("read"):
        # The agreement that every rank read its units carries each rank's partial block checksums.
        _, partials = comm.exchange_agreed(read, f"loading {uri!r}")
        if checker is not None:
            _settle_checksums(checker, backend, comm, partials, local)

    def apply() -> tuple[None, dict[str, float]]:
        with monitor.phase("apply"):
            for key, value in values.items():
                flat.objects[key].assign(value)
            for fn in flat.after_load:
                fn()
        return None, monitor.summary()

    # The agreement that every rank applied its state carries every rank's summary (the monitor's record).
    return comm.exchange_agreed(apply, "applying loaded state")[1]


def _broadcast_checkpoint(
    comm: Comm, backend: Backend, accept_dcp: bool = False, src: int = 0, have: Checkpoint | None = None,
) -> Checkpoint:
    """Rank ``src`` reads the checkpoint's metadata through the chain (or sends ``have``, what it already
    read and checked) and every rank returns it; a failure to read raises on every rank."""
    result: Checkpoint | None = None
    error: str | None = None
    exc_type: type[CheckpointError] = CheckpointError
    if comm.rank == src:
        try:
            result = have if have is not None else read_checkpoint(backend, accept_dcp=accept_dcp)
        except CheckpointError as exc:
            if comm.world_size == 1:
                raise
            error, exc_type = str(exc), type(exc)
    result, error, exc_type = comm.broadcast_object((result, error, exc_type), src)
    if error is not None:
        raise exc_type(error)
    assert result is not None
    return result


def _prepare(
    state: Mapping[str, Any], ckpt: Checkpoint, rank: int, tier: MemoryTier | None, table: bytes | None,
) -> tuple[tuple[FlatState, list[TargetPiece], dict[str, list[ObjectMeta]], bytes | None], tuple[Any, ...]]:
    """Flatten this rank's state for loading: ``(kept, shared)``. Kept: the flat state, its needs, its
    objects and ``table`` (the whole pieces table, if read already). Shared: needs, findings, tensor and
    object keys (what :func:`_report` reads), the node, what its memory tier holds (``None``: no tier),
    the objects files this rank reads, whether it holds the pieces table already, and the CPU cores it may
    run on (the load routes' :attr:`~tierckpt.planner.Topology.cores`)."""
    saved_keys = set(ckpt.tensors) | {o.key for o in ckpt.meta.objects}
    flat = flatten_state(
        state, for_load=True, saved_keys=lambda p: any(k.startswith(p) for k in saved_keys),
        legacy_names=ckpt.meta.format_minor < 1,
    )
    refuse_meta_tensors(flat)
    needs, findings = match(flat, ckpt)
    wanted = wanted_objects(ckpt, flat, rank)
    held = held_files(tier, ckpt.meta, ckpt.record)
    files = sorted({o.file for metas in wanted.values() for o in metas}) if held is not None else []
    shared = (needs, findings, sorted(flat.tensors), sorted(flat.objects), node_id(), held, files, table is not None,
              _cores())
    return (flat, needs, wanted, table), shared


def _local_pieces(
    backend: Backend, ckpt: Checkpoint, fqns: set[str], local: LocalReads, shared: dict[str, bytes],
) -> dict[str, list[PieceMeta]]:
    """The pieces table from where this rank finds it: shared by a peer, its node's memory tier, the chain."""
    data = shared.get(layout.PIECES)
    if data is None:
        return read_pieces(local.source(layout.PIECES, backend), ckpt, fqns)
    if ckpt.record is not None:
        ckpt.record.check_document(layout.PIECES, data, backend.root_uri)
    return decode_pieces(data, ckpt.tensors, fqns, ckpt.meta.num_pieces)


def _topology(backend: Backend, comm: Comm, nodes: list[str], cores: int) -> Topology:
    """The route costs of this load: the backend's kind of store, the group's backend, each rank's node,
    the fewest cores a rank sees."""
    scheme = backend.root_uri.split("://", 1)[0] if "://" in backend.root_uri else ""
    kind = store_kind(local_path=backend.capabilities.local_path, scheme=scheme, nodes=nodes)
    return route_topology(kind, comm.backend, nodes, cores)


def _cores() -> int:
    """CPU cores this process may run on (its affinity, where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 0


def _log_routes(plan: LoadPlan, topo: Topology, rank: int, monitor: Monitor) -> None:
    """Count this rank's units and bytes per route in the monitor; log the group's totals once."""
    for unit in plan.units:
        if unit.reader == rank:
            monitor.count(f"units_{unit.route}")
            monitor.count(f"bytes_read_{unit.route}", unit.nbytes)
    if rank == 0:
        by_route = plan.bytes_by_route()
        logger.info(
            "load plan: %d units; %d bytes read directly, %d read once and exchanged (store %s, %s exchange, %d node(s))",
            len(plan.units), by_route["direct"], by_route["exchange"], topo.store.kind, topo.exchange.kind, topo.num_nodes,
        )


def _check_files(backend: Backend, ckpt: Checkpoint, plan: LoadPlan, rank: int, local: LocalReads) -> None:
    """Each data file this rank reads (from its memory tier or the chain) has the size the header lists,
    and holds every run read from it."""
    ends: dict[str, int] = {}
    for u in plan.units:
        if u.reader == rank and len(u.run_offsets):
            ends[u.file] = max(ends.get(u.file, 0), int(u.run_offsets.max()) + u.run_bytes)
    files = sorted(ends)
    sizes = {file: _checked_size(local.tier, ckpt, file) for file in files if local.here(file)}  # type: ignore[arg-type]
    remote = [file for file in files if file not in sizes]
    if remote:  # every size at once: on an object store each check is a round trip
        with concurrent.futures.ThreadPoolExecutor(min(len(remote), PARALLEL_METADATA)) as pool:
            sizes.update(zip(remote, pool.map(carried(lambda file: _checked_size(backend, ckpt, file)), remote)))
    for file in files:
        end, size = ends[file], sizes[file]
        if end > size:
            raise CorruptCheckpointError(
                f"pieces of checkpoint {backend.root_uri!r} lie past the end of {file!r} (byte {end} of {size}): "
                "the pieces table is corrupt"
            )


def _checked_size(backend: Backend, ckpt: Checkpoint, file: str) -> int:
    """The size of ``file``, which must exist and match the header's, before any buffer is sized from metadata."""
    sizes = {f.key: f.size for f in ckpt.meta.files}
    key = layout.in_generation(ckpt.meta.generation, file)
    try:
        if isinstance(backend, MemoryTier):  # a file on this node's tmpfs: one stat, without the I/O loop
            actual = os.path.getsize(backend.path_of(key))
        else:
            actual = get_scheduler().run(backend.size(key))
    except (CheckpointNotFoundError, FileNotFoundError):
        raise MissingFileError(f"file {key!r} of checkpoint {backend.root_uri!r} is missing") from None
    if file not in sizes or actual != sizes[file]:
        raise CorruptCheckpointError(
            f"file {key!r} of checkpoint {backend.root_uri!r} has {actual} bytes, the metadata says "
            f"{sizes.get(file, 'nothing')}: it is truncated or was replaced"
        )
    return actual


def _verify_pieces(backend: Backend, gen: str, pieces: dict[str, list[PieceMeta]], comm: Comm,
                   local: LocalReads) -> None:
    """``verify=True``: every saved piece read whole and checked against its CRC-32C, the pieces shared
    round robin over the ranks — with memory tiers, over the ranks whose node holds the piece's file,
    which read it from their tier (the remote may be down, and another node's tier is not theirs)."""
    sched = get_scheduler()
    everything = [p for fqn in sorted(pieces) for p in pieces[fqn]]
    readers = rereaders([p.file for p in everything], local, comm.world_size) if local.active else (
        [i % comm.world_size for i in range(len(everything))])
    for piece, reader in zip(everything, readers):
        if reader != comm.rank:
            continue
        store = local.source(piece.file, backend)
        data = sched.run(store.get_range(layout.in_generation(gen, piece.file), piece.byte_offset,
                                         piece.byte_offset + piece.byte_length))
        if crc32c.crc32c(data) != piece.crc32c:
            end = piece.byte_offset + piece.byte_length
            raise ChecksumMismatchError(
                f"checksum mismatch in {piece.file!r} at bytes {piece.byte_offset}..{end} "
                f"(tensor {piece.fqn!r}, region {piece.region}): the data file is corrupt",
                layout.in_generation(gen, piece.file), piece.byte_offset, end,
            )


def _settle_checksums(checker: ReadChecker, backend: Backend, comm: Comm, gathered: list[Any], local: LocalReads) -> None:
    """Check the blocks read in parts (by several ranks or units) from every rank's partial CRCs
    (``gathered``); blocks the group read only in part are read whole, agreed in one collective (with
    memory tiers: by a rank whose node holds the block's file, from its tier)."""
    incomplete = checker.settle(gathered)  # the same on every rank: a mismatch raises on all of them
    if not incomplete:
        return
    if not local.active:
        comm.run_agreed(lambda: checker.check_whole(incomplete, backend, comm.rank, comm.world_size), "checking data checksums")
        return
    readers = rereaders([piece.file for piece, _ in incomplete], local, comm.world_size)
    mine = [block for block, reader in zip(incomplete, readers) if reader == comm.rank]

    def check() -> None:
        for here in (True, False):
            blocks = [b for b in mine if local.here(b[0].file) == here]
            if blocks:
                checker.check_whole(blocks, local.tier if here else backend, 0, 1)  # type: ignore[arg-type]

    comm.run_agreed(check, "checking data checksums")
