"""A save's first step, on every rank: flatten and encode the state, agree on the plan and the new generation.

It has two halves. :func:`_prepare_local` is this rank's alone, with no collective: flatten the state
into the pieces it offers and encode its objects, while rank 0 reads the base ``COMMIT`` on the I/O
loop. :func:`_agree` is the group's: a check-in, then one collective that agrees that every rank could
prepare its state and carries the plan-cache digests, the object digests and rank 0's name for the new
generation; the plan is reused when every digest matches the cached plan's, else the offers are
all-gathered and every rank computes the same :class:`~tierckpt.planner.SavePlan`. Between the halves,
an async save whose offers match its previous save's may copy its snapshot while the group agrees
(:func:`cached_plan`, :mod:`tierckpt.saving.api`).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import crc32c

from tierckpt.native import layout
from tierckpt.saving import commit as save_commit
from tierckpt.backends import Backend
from tierckpt.comm import Comm, Group, attempt
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native.coverage import check_offered_coverage
from tierckpt.native.metadata import dtype_name
from tierckpt.native.regions import Region
from tierckpt.monitor import Monitor
from tierckpt.formats.objects import AllowPickle, encode_object, refuse_pickles
from tierckpt.planner import LocalPiece, SavePlan, plan_save
from tierckpt.planner.save_planner import offers_digest
from tierckpt.saving.prepared import _Prepared
from tierckpt.saving.process import _PROCESS, _group_key, _raise_unreported
from tierckpt.errors import CheckpointError
from tierckpt.state.adapters import FlatState, flatten_state
from tierckpt.node.face import NodeFace
from tierckpt.store import identity_of, open_chain
from tierckpt.node.memory.replication import Replication, replicator_for

_Kept = tuple[FlatState, list[LocalPiece], dict[str, tuple[bytes, str]]]
"""What a rank keeps of its prepared state: the flattened state, the pieces it offers, its encoded objects."""
_Shared = tuple[str, dict[str, tuple[int, int]], bool, bool]
"""What a rank shares of it: the offers' plan-cache digest, ``(crc, size)`` of each encoded object,
whether its chain has the node memory tier, its ``persist``."""


@dataclass
class _Local:
    """One rank's half of a save's first step (:func:`_prepare_local`): its store, its state as it
    prepared it (or how that failed), and rank 0's read of the base ``COMMIT``."""

    uri: str
    group: Group
    comm: Comm
    backend: Backend
    node: NodeFace
    started: float
    base: concurrent.futures.Future[bytes | None] | None
    kept: _Kept | None
    shared: _Shared | None
    error: Exception | None
    monitor: Monitor
    write_back: bool
    persist: bool


def _prepare(
    uri: str, state: Mapping[str, Any], group: Group, storage_options: Mapping[str, Any] | None,
    tags: Mapping[str, str] | None, keep_previous: bool, align_bytes: int, monitor: Monitor,
    collective_timeout_s: float | None, write_back: bool, persist: bool, allow_pickle: AllowPickle = False,
) -> _Prepared:
    """Both halves, one after the other."""
    local = _prepare_local(uri, state, group, storage_options, write_back, persist, monitor, allow_pickle)
    return _agree(local, tags, keep_previous, align_bytes, collective_timeout_s)


def _prepare_local(
    uri: str, state: Mapping[str, Any], group: Group, storage_options: Mapping[str, Any] | None,
    write_back: bool, persist: bool, monitor: Monitor, allow_pickle: AllowPickle = False,
) -> _Local:
    """This rank's half, no collective: open the store, start rank 0's read of ``COMMIT`` on the I/O loop
    (a remote round trip then overlaps the rest), flatten and encode the state. A failure to prepare the
    state (an object that needs pickle without ``allow_pickle``, :func:`~tierckpt.formats.objects.refuse_pickles`)
    is kept, to be shared by :func:`_agree`: every rank raises it, before anything is written."""
    _raise_unreported()
    comm = Comm(group)
    backend, node = open_chain(uri, dict(storage_options or {}))
    started = time.time()
    # A write-back save reads the node's view (its pending COMMIT first) and may start while the remote
    # is unreachable.
    offline_ok = write_back and node.durable is not None
    base = get_scheduler().submit(save_commit._read_commit(backend, offline_ok)) if comm.rank == 0 else None
    with monitor.phase("flatten"):
        result, error = attempt(lambda: _offer(uri, state, node.memory_tier is not None, persist, allow_pickle))
    kept, shared = result if result is not None else (None, None)
    return _Local(uri, group, comm, backend, node, started, base, kept, shared, error, monitor, write_back, persist)


def cached_plan(local: _Local, align_bytes: int) -> SavePlan | None:
    """The plan of the group's previous save when this rank offers the same pieces as then: the plan the
    group will agree on unless another rank's offers changed (:func:`_agree` tells)."""
    cached = _PROCESS.plans.get((_group_key(local.group), align_bytes))
    if cached is None or local.shared is None or local.comm.rank >= len(cached[0]):
        return None
    return cached[1] if cached[0][local.comm.rank] == local.shared[0] else None


def _agree(
    local: _Local, tags: Mapping[str, str] | None, keep_previous: bool, align_bytes: int,
    collective_timeout_s: float | None,
) -> _Prepared:
    """The group's half: check in, share what each rank prepared (raising on every rank if any failed),
    take rank 0's name for the new generation, and reuse or compute the plan."""
    comm, backend, uri, monitor, persist = local.comm, local.backend, local.uri, local.monitor, local.persist
    comm.check_in(f"save to {uri!r}", collective_timeout_s)
    with monitor.phase("plan"):
        # One collective agrees that every rank could prepare its state and carries each rank's
        # plan-cache digest and object digests, and rank 0's name for the new generation (named after
        # the base COMMIT's sequence).
        proposal, error = attempt(
            lambda: None if local.base is None else layout.new_generation(layout.next_seq(local.base.result()))
        )
        error = local.error or error
        shared = None if error is not None or local.shared is None else (*local.shared, proposal)
        agreement = comm.share_attempt(shared, error, "preparing the state to save", same=("URI", identity_of(uri, backend)))
        assert local.kept is not None and local.shared is not None  # else share_attempt raised
        flat, offers, encoded = local.kept
        _check_tiers_agree(uri, [a[2] for a in agreement])
        _check_persist(uri, [a[3] for a in agreement], local.node.memory_tier is not None)
        generation = agreement[0][4]
        if not persist:
            local.node.keep_in_memory(generation)  # the chain has a memory tier (_check_persist)
        digests = [a[0] for a in agreement]
        plan_key = (_group_key(local.group), align_bytes)
        cached = _PROCESS.plans.get(plan_key)
        if cached is not None and cached[0] == digests:
            plan = cached[1]
            monitor.count("plan_cache_hits")
        else:
            gathered = comm.all_gather_object(offers)
            plan = comm.run_agreed(lambda: _covering_plan(gathered, align_bytes), "planning the save")
            _PROCESS.plans[plan_key] = (digests, plan)
        owners = _place_objects([a[1] for a in agreement], plan)
    # The replicator is built here, in the foreground every rank reaches together (first save only).
    tier = local.node.memory_tier
    replicator, not_replicated = replicator_for(tier, local.group, _group_key(local.group))
    return _Prepared(
        uri=uri, comm=comm, backend=backend, node=local.node, flat=flat, encoded=encoded, plan=plan, owners=owners,
        generation=generation, started=local.started, monitor=monitor, tags=dict(tags or {}),
        keep_previous=keep_previous, base=local.base, write_back=local.write_back,
        replication=Replication(uri, tier, replicator, not_replicated), persist=persist,
    )


def _covering_plan(offers: list[list[LocalPiece]], align_bytes: int) -> SavePlan:
    """The plan of a save whose ranks' offers hold each element of each tensor once, as every load checks
    (:mod:`tierckpt.coverage`); other offers are refused before anything is written. The plan's writes are
    the distinct offered regions, replicas written once and split ones in disjoint parts, so they are checked."""
    plan = plan_save(offers, align_bytes=align_bytes)
    regions: dict[str, list[Region]] = {}
    for write in (w for writes in plan.writes for w in writes):
        regions.setdefault(write.fqn, []).append(write.region)
    check_offered_coverage({t.fqn: t for t in plan.tensors}, regions)
    return plan


def _offer(uri: str, state: Mapping[str, Any], memory_tier: bool, persist: bool,
           allow_pickle: AllowPickle) -> tuple[_Kept, _Shared]:
    """Flatten and encode this rank's state: ``(kept, shared)`` (see :data:`_Kept`, :data:`_Shared`)."""
    flat = flatten_state(state, for_load=False)
    offers = [
        LocalPiece(fqn=e.fqn, dtype=dtype_name(e.tensor.dtype), shape=e.shape, region=e.region)
        for e in flat.tensors.values()
    ]
    encoded = {key: encode_object(entry.value) for key, entry in flat.objects.items()}
    refuse_pickles(uri, {k: e.value for k, e in flat.objects.items()}, {k: c for k, (_, c) in encoded.items()}, allow_pickle)
    digests = {key: (crc32c.crc32c(data), len(data)) for key, (data, _) in encoded.items()}
    return (flat, offers, encoded), (offers_digest([offers]), digests, memory_tier, persist)


def _check_tiers_agree(uri: str, memory_tier: list[bool]) -> None:
    """Every rank saves through the node memory tier or none does: a checkpoint half in memory would be
    reported ``memory``/``replicated`` while some of its files are in no node's memory. Raised on every
    rank (the flags came with the agreement), before anything is written."""
    if len(set(memory_tier)) > 1:
        on = [r for r, flag in enumerate(memory_tier) if flag]
        off = [r for r, flag in enumerate(memory_tier) if not flag]
        raise CheckpointError(
            f"ranks disagree on the node memory tier for {uri!r}: on for ranks {on}, off for ranks {off}; "
            "set TIERCKPT_MEMORY (or storage_options memory=) the same on every rank"
        )


def _check_persist(uri: str, persist: list[bool], memory_tier: bool) -> None:
    """``persist=False`` needs the node memory tier, and every rank must pass the same ``persist``: a
    checkpoint half written down would be committed below with files missing there. Raised on every rank
    (the flags came with the agreement), before anything is written."""
    if all(persist):
        return
    if not memory_tier:
        raise CheckpointError(
            f"save to {uri!r} with persist=False keeps the checkpoint in the node memory tier only, and {uri!r} "
            "has none: turn it on (TIERCKPT_MEMORY=on or storage_options memory=True) or save with persist=True"
        )
    if any(persist):
        raise CheckpointError(
            f"ranks disagree on persist for {uri!r}: True for ranks {[r for r, f in enumerate(persist) if f]}, "
            f"False for ranks {[r for r, f in enumerate(persist) if not f]}; pass the same value on every rank"
        )


def _place_objects(digests: list[dict[str, tuple[int, int]]], plan: SavePlan) -> dict[str, int | None]:
    """Which rank writes each object: one writer for values equal on every rank, else each rank its own."""
    world = len(digests)
    load = list(plan.file_sizes)
    owners: dict[str, int | None] = {}
    for key in sorted(set().union(*digests)):
        values = {d.get(key) for d in digests}
        if len(values) == 1 and None not in values:
            writer = min(range(world), key=lambda r: (load[r], r))
            load[writer] += next(iter(values))[1]
            owners[key] = writer
        else:
            owners[key] = None
    return owners
