"""One generation's load, steps 2-5 of the lifecycle in :mod:`tierckpt.loading.api`: prepare every rank's
state against the checkpoint and agree on it, find the pieces, plan the reads, check the data files and
fetch the objects, read every unit (:class:`~tierckpt.loading.read_step.ReadStep`) with its checksums, and put
the state in place.

It reads what the checkpoint's reader (:mod:`tierckpt.formats.select`) says the format has: the node memory
tier and the pieces table for a native checkpoint, the pieces a foreign format listed with its metadata,
CRC-32C checks only where the format records checksums. Raises on every rank when any rank fails; the
caller (:func:`tierckpt.loading.api.load`) decides whether a newer commit explains the failure.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from tierckpt.native import layout
from tierckpt.loading import route_costs
from tierckpt.backends import Backend
from tierckpt.node.face import NodeTier
from tierckpt.formats.reader import Checkpoint
from tierckpt.comm import Comm
from tierckpt.native.coverage import check_exact_coverage
from tierckpt.errors import CheckpointNotFoundError, ChecksumMismatchError, CorruptCheckpointError, MissingFileError
from tierckpt.io.readcheck import ReadChecker
from tierckpt.io.scheduler import get_scheduler
from tierckpt.loading.cast import refuse_meta_tensors
from tierckpt.loading.match import match, report
from tierckpt.loading.wire import pack_asked, pack_needs, unpack
from tierckpt.loading.locality import LocalReads, held_files, rereaders
from tierckpt.formats.native import whole_pieces
from tierckpt.native.metadata import ObjectMeta, PieceMeta, decode_pieces
from tierckpt.monitor import Monitor
from tierckpt.node.host import node_id
from tierckpt.loading.objects import fetch_objects, wanted_objects
from tierckpt.planner import LoadPlan, TargetPiece, Topology, topology as route_topology
from tierckpt.planner.rank_plan import RankDraft, RoundShare, agree_rounds, plan_rank
from tierckpt.planner.plan_types import route_finder
from tierckpt.planner.routes import DIRECT, EXCHANGE, NODE, Route, store_kind
from tierckpt.loading.read_step import P2P_MIN_BYTES, ReadStep
from tierckpt.formats.select import read_pieces, reader_of
from tierckpt.state.adapters import FlatState, flatten_state
from tierckpt.store import identity_of
from tierckpt.loading.tier_metadata import TierStart

logger = logging.getLogger("tierckpt")

PARALLEL_METADATA = 16
"""At most this many size checks of data files are in flight at once (one thread each)."""


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """The tuning and checking arguments of :func:`load`."""

    strict: bool
    allow_pickle: bool
    verify: bool
    check_crc: bool
    chunk_bytes: int
    round_bytes: int
    topology: Topology | None


def load_generation(
    uri: str, state: dict[str, Any], comm: Comm, backend: Backend, tier: NodeTier | None, ckpt: Checkpoint,
    opts: LoadOptions, monitor: Monitor, start: TierStart | None,
) -> list[dict[str, float]]:
    """Steps 2-5 of the lifecycle for the generation ``ckpt`` names, read through ``backend`` (the chain
    its reader reads from) and this node's memory tier ``tier`` (``None``: off, or a format without
    generations); fills every target and returns every rank's monitor summary. ``start``: step 2 already
    done with the metadata read from the memory tiers."""
    reader = reader_of(ckpt)
    with monitor.phase("metadata"):
        if start is not None:
            (flat, needs, wanted, table), gathered = start.kept, start.shared
        else:
            # One collective agrees that every rank could prepare its state and carries what each needs
            # and what its node's memory tier holds. A small pieces table came with the header; without it and
            # without a tier, each rank reads it meanwhile (with a tier, a rank's node may lack it: it is read
            # once the holders are known).
            (flat, needs, wanted, table), gathered = comm.exchange_agreed(
                lambda: prepare(state, ckpt, comm.rank, tier, whole_pieces(backend, ckpt) if tier is None else ckpt.pieces_table,
                                route_costs.kept_share(backend, comm)),
                "preparing the state to load", same=("URI", identity_of(uri, backend)),
            )
        group, gathered = unpack(gathered, ckpt)  # needs and keys travel as positions in the checkpoint (load_wire)
        report(gathered, ckpt, opts.strict, uri)
        local = LocalReads.of(comm.rank, tier, [(g[4], g[5]) for g in gathered])
        preread = all(g[7] for g in gathered)
        # Small files a rank needs and its node lacks come from a node that holds them (one collective, if any).
        shared = local.share(comm, ckpt.meta.generation, [[*([] if preread else [layout.PIECES]), *g[6]] for g in gathered]
                             ) if local.active else {}
        fqns = {group.names[p] for p in group.needed()}
        if preread:
            # Every rank holds the same bytes, checked against COMMIT, and decodes them for the same tensors:
            # the same pieces on every rank, or the same error raised on every rank (nothing to agree on).
            pieces = decode_pieces(table, ckpt.tensors, fqns, ckpt.meta.num_pieces)
        else:
            pieces = comm.run_agreed(lambda: _local_pieces(backend, ckpt, fqns, local, shared), "reading the pieces table")
    with monitor.phase("plan"):
        topo = opts.topology or route_costs.measured_topology(
            _topology(backend, comm, [g[4] for g in gathered], min(g[8] for g in gathered)), comm, backend, ckpt,
            [g[9] for g in gathered], routes_open=not group.one_rank_per_tensor())
        nodes = list(topo.nodes)
        mine: RankDraft | None = None
        failure: Exception | None = None
        try:  # this rank's units only (each to a rank whose node's memory tier holds its file, where one does)
            check_exact_coverage(ckpt.tensors, pieces, uri)
            mine = plan_rank(ckpt.tensors, pieces, group, comm.rank, chunk_bytes=opts.chunk_bytes,
                             round_bytes=opts.round_bytes, p2p_min_bytes=P2P_MIN_BYTES, topology=topo,
                             held=local.holders() if local.active else None)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement below, not on this one alone
            failure = exc
    gen = ckpt.meta.generation

    def check_and_fetch() -> tuple[dict[str, Any], RoundShare | None]:
        if failure is not None:
            raise failure
        assert mine is not None
        reads = mine.reads()
        _check_files(backend, ckpt, reads, local)
        # Objects are small: fetch, check and decode them before any tensor is modified.
        values = fetch_objects(backend, ckpt, flat, wanted, opts.allow_pickle, local, shared)
        return values, mine.share if mine is not None else None

    with monitor.phase("objects"):
        # The agreement carries each rank's round share (planner.rank_plan): no collective of its own.
        values, shares = comm.exchange_agreed(check_and_fetch, "checking the data files and loading objects")
    with monitor.phase("plan"):
        assert mine is not None
        plan = agree_rounds(mine, shares, ckpt.tensors)
        if monitor.progress is not None:  # the bar's total: the bytes this rank reads (counted as bytes_read)
            monitor.progress.expect(sum(u.nbytes for u in plan.units if u.reader == comm.rank))
        if local.active:
            monitor.count("bytes_read_memory", sum(u.nbytes for u in plan.units if u.reader == comm.rank and local.here(u.file)))
        _log_routes(plan, topo, comm.rank, monitor)
    if opts.verify:
        with monitor.phase("verify"):
            comm.run_agreed(lambda: _verify_pieces(backend, gen, pieces, comm, local), "verifying checksums")
    targets = [flat.tensors[n.fqn] for n in needs]
    # A foreign format records no checksums (its pieces carry none): there is nothing to check.
    checker = ReadChecker(gen, pieces) if opts.check_crc and reader.checksums else None
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


def prepare(
    state: Mapping[str, Any], ckpt: Checkpoint, rank: int, tier: NodeTier | None, table: bytes | None,
    costs: tuple[str, Any],
) -> tuple[tuple[FlatState, list[TargetPiece], dict[str, list[ObjectMeta]], bytes | None], tuple[Any, ...]]:
    """Flatten this rank's state for loading: ``(kept, shared)``. Kept: the flat state, its needs, its
    objects and ``table`` (the whole pieces table, if read already). Shared (:mod:`tierckpt.loading.wire`'s
    compact form, restored by its ``unpack``): needs, findings, the keys asked for and an empty slot (what
    :func:`tierckpt.loading.match.report` reads), the node, what its memory tier holds (``None``: no tier),
    the objects files this rank reads, whether it holds the pieces table already, the CPU cores it may
    run on (the load routes' :attr:`~tierckpt.planner.Topology.cores`) and ``costs``, what it knows of the
    routes' costs (:func:`tierckpt.loading.route_costs.kept_share`)."""
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
    shared = (pack_needs(needs, ckpt), findings, pack_asked([*flat.tensors, *flat.objects], ckpt), None, node_id(), held,
              files, table is not None, _cores(), costs)
    return (flat, needs, wanted, table), shared


def _local_pieces(
    backend: Backend, ckpt: Checkpoint, fqns: set[str], local: LocalReads, shared: dict[str, bytes],
) -> dict[str, list[PieceMeta]]:
    """The pieces from where this rank finds them: shared by a peer, its node's memory tier, the chain
    (or listed with a foreign format's metadata: nothing is read)."""
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
    """Count this rank's units and bytes per route in the monitor; log rank 0's plan (the group's, or its own).

    One walk over the units, each unit's route found once (:func:`~tierckpt.planner.plan_types.route_finder`)
    and the counters added once per route: a plan has a unit per small tensor, and this runs on every load."""
    route_of = route_finder(topo.nodes)
    logged = rank == 0
    units: dict[Route, int] = {DIRECT: 0, NODE: 0, EXCHANGE: 0}
    read: dict[Route, int] = dict(units)
    planned: dict[Route, int] = dict(units)  # rank 0's log: the bytes of the plan's units (the group's, or its own)
    for unit in plan.units:
        mine = unit.reader == rank
        in_log = logged and (plan.rank is None or unit.reader == plan.rank)
        if mine or in_log:
            route, nbytes = route_of(unit), unit.nbytes
            if mine:
                units[route] += 1
                read[route] += nbytes
            if in_log:
                planned[route] += nbytes
    for route, count in units.items():
        if count:
            monitor.count(f"units_{route}", count)
            monitor.count(f"bytes_read_{route}", read[route])
    if logged:
        logger.info(
            "load plan%s: %d units; %d bytes read directly, %d read once per node and shared there, %d read once "
            "and exchanged (%s)", "" if plan.rank is None else " of rank 0", len(plan.units), planned[DIRECT],
            planned[NODE], planned[EXCHANGE], topo.describe(),
        )


SIZES_AT_ONCE = 16
"""A rank checks at most this many data files' sizes in its own thread (:func:`_check_files`); more go to the
I/O loop, :data:`PARALLEL_METADATA` at once."""


def _check_files(backend: Backend, ckpt: Checkpoint, reads: Iterable[tuple[str, np.ndarray, int]], local: LocalReads) -> None:
    """Each data file this rank reads (``reads``: file, run offsets, run bytes; from its memory tier or the
    chain) has the size the header lists, and holds every run read from it."""
    ends: dict[str, int] = {}
    for file, offsets, run_bytes in reads:
        if len(offsets):
            ends[file] = max(ends.get(file, 0), int(offsets.max()) + run_bytes)
    files = sorted(ends)
    listed = {f.key: f.size for f in ckpt.meta.files}
    sizes = {file: _expected_size(backend, ckpt, listed, file, _tier_size(local.tier, ckpt, backend, file))
             for file in files if local.here(file)}
    unsized = [file for file in files if file not in sizes]
    # A few local files' sizes in this thread (a stat each, no trip through the I/O loop); many, or any on a store
    # that must be asked, on the I/O loop, several at once (a shared file system answers a stat in a round trip).
    for file in unsized if len(unsized) <= SIZES_AT_ONCE else ():
        try:
            actual = backend.size_at_once(layout.in_generation(ckpt.meta.generation, file))
        except CheckpointNotFoundError:
            raise _missing(backend, ckpt, file) from None
        if actual is not None:
            sizes[file] = _expected_size(backend, ckpt, listed, file, actual)
    remote = [file for file in unsized if file not in sizes]
    if remote:  # every size at once on the I/O loop: on an object store each one is a round trip
        sizes.update(zip(remote, get_scheduler().run(_chain_sizes(backend, ckpt, listed, remote))))
    for file in files:
        end, size = ends[file], sizes[file]
        if end > size:
            raise CorruptCheckpointError(
                f"pieces of checkpoint {backend.root_uri!r} lie past the end of {file!r} (byte {end} of {size}): "
                "the pieces table is corrupt"
            )


def _missing(backend: Backend, ckpt: Checkpoint, file: str) -> MissingFileError:
    return MissingFileError(f"file {layout.in_generation(ckpt.meta.generation, file)!r} of checkpoint "
                            f"{backend.root_uri!r} is missing")


def _tier_size(tier: NodeTier | None, ckpt: Checkpoint, backend: Backend, file: str) -> int:
    """The size of ``file`` in this node's memory tier (one stat, without the I/O loop)."""
    assert tier is not None  # LocalReads.here() holds only with a tier
    try:
        return tier.file_size(layout.in_generation(ckpt.meta.generation, file))
    except (CheckpointNotFoundError, FileNotFoundError):
        raise _missing(backend, ckpt, file) from None


async def _chain_sizes(backend: Backend, ckpt: Checkpoint, listed: Mapping[str, int], files: list[str]) -> list[int]:
    """The checked sizes of ``files`` through the chain, at most :data:`PARALLEL_METADATA` asked at once."""
    limit = asyncio.Semaphore(PARALLEL_METADATA)

    async def one(file: str) -> int:
        async with limit:
            try:
                actual = await backend.size(layout.in_generation(ckpt.meta.generation, file))
            except (CheckpointNotFoundError, FileNotFoundError):
                raise _missing(backend, ckpt, file) from None
        return _expected_size(backend, ckpt, listed, file, actual)

    return list(await asyncio.gather(*(one(file) for file in files)))


def _expected_size(backend: Backend, ckpt: Checkpoint, listed: Mapping[str, int], file: str, actual: int) -> int:
    """``actual``, the size of ``file``, when it is the header's (``listed``), checked before any buffer is
    sized from metadata."""
    if file not in listed or actual != listed[file]:
        raise CorruptCheckpointError(
            f"file {layout.in_generation(ckpt.meta.generation, file)!r} of checkpoint {backend.root_uri!r} has "
            f"{actual} bytes, the metadata says {listed.get(file, 'nothing')}: it is truncated or was replaced"
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
                checker.check_whole(blocks, local.store(here, backend), 0, 1)

    comm.run_agreed(check, "checking data checksums")
