"""The load routes' costs measured on the machines and the store a job actually uses.

:mod:`tierckpt.planner.routes` chooses each slab's route from a :class:`~tierckpt.planner.routes.Topology`
whose constants are a guess about "a shared file system" or "gloo". A guess is wrong somewhere (a page-cached
disk taken for a shared file system, gloo over loopback with more processes than cores), so a load replaces
the constants with what the group measured, in this order:

1. **Prior**: the constants of the store's kind and the group's backend (:data:`~tierckpt.planner.routes.STORES`,
   :data:`~tierckpt.planner.routes.EXCHANGES`).
2. **Measured**, the first time a job loads from a kind of store with a given set of nodes (then kept for the
   process: later loads reuse it and take no probe) a checkpoint of which some tensor is needed by several
   ranks (a load where each tensor has one needing rank, as every one-rank load, has no route to choose:
   each slab is read by that rank, and nothing is measured). A bounded probe, every rank at once:

   * the store: each rank reads :data:`PROBE_READ_BYTES` of the checkpoint's largest data file through the
     load's own backend (at its own offset, by the segment read a load uses), all ranks together, then the
     same bytes again and an eighth of them again (each twice, the faster counts; only where the store's
     repeats are node copies), then :data:`PROBE_RUNS` runs of :data:`PROBE_SMALL_BYTES` spread over them in
     one call (three times, the fastest counts; :data:`PROBE_REMOTE_RUNS` once on a store that is not a local
     path). Each
     node's bytes over its slowest rank's seconds give ``byte_s`` (the node's link), the group's bytes over
     the slowest rank's give ``group_byte_s`` (where the store has a group share), the repeats give
     ``cached_byte_s`` (where repeats come from the node's page cache) as the slope between the two sizes — a
     call's fixed cost (the hop to the I/O loop, the mapping) is ``request_s``'s, not the bytes': taken from
     one 4 MiB read on 16 cores it made page-cache copies look 7x slower than a load's and sent a replicated
     load on one node to the exchange — and the runs' seconds over their number give ``request_s``;
   * the exchange: three all-to-alls on the group's own backend, each the fastest of :data:`EXCHANGE_TRIES`,
     timed on every rank — one byte to every other rank (``message_s``), :data:`PROBE_SEND_BYTES` to each rank
     of the same node (``local_byte_s``) and to each rank of other nodes (``remote_byte_s``), the two less the
     first's seconds (the collective's own latency), but never less than :data:`MIN_BYTES_SHARE` of their own.
     The slowest rank's seconds count; each is converted with the cost model's own overlap rule (:func:`~tierckpt.planner.routes.exchange_seconds`), so the model gives back the probe's time
     for the probe's traffic.

   A rank whose chain cannot read the sample (a replacement node recovering from its peers' memory tiers
   while the store is away) makes the group keep the store's prior and measure the exchange alone: the
   probe never fails a load that would not fail without it.

   Every rank all-gathers every rank's timings and reduces them the same way: every rank takes the same
   decision. A rank that kept a measurement the others lack (or the reverse) makes the group probe again.

   The probe does not shrink with the load: read with a few MiB, the slope between the two read sizes is
   mostly a call's fixed cost, page-cache copies look several times dearer than a load's, and a replicated
   load on one node goes to the exchange (4 ranks on the 2-core VM: 0.32x the tree before; with 32 MiB,
   0.95x). A process pays it once, at its first load with a route to choose (``constants`` skips it).
3. **Override**: ``$TIERCKPT_ROUTE_COSTS``, the same on every rank — comma-separated ``name=seconds``
   (any of :data:`~tierckpt.planner.routes.COST_FIELDS`, e.g. ``local_byte_s=2e-9,message_s=1e-4``),
   applied over the measurement, and/or the word ``constants`` to skip the probe and start from the prior.
   ``load(..., topology=...)`` bypasses all three with an explicit :class:`~tierckpt.planner.routes.Topology`.

The costs measured and overridden are named in :attr:`~tierckpt.planner.routes.Topology.measured` and logged
with the plan.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.formats.reader import Checkpoint
from tierckpt.comm import Comm, check_same_on_every_rank, describe_error
from tierckpt.errors import CheckpointError, RouteCostsError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.planner.routes import COST_FIELDS, Topology, with_costs

log = logging.getLogger(__name__)

ROUTE_COSTS_ENV = "TIERCKPT_ROUTE_COSTS"
CONSTANTS = "constants"
"""The word in ``$TIERCKPT_ROUTE_COSTS`` that skips the probe."""
PROBE_READ_BYTES = 32 << 20
"""Bytes each rank reads of the store in the probe (less where the file is smaller)."""
PROBE_SMALL_BYTES = 2 << 10
"""The runs of the per-request probe: :data:`PROBE_RUNS` of them read in one call (a strided box's runs, as a
load reads them: positional reads or mapped copies on a local file, ranged requests several in flight on an
object store); their seconds over their number are the store's per-request cost."""
PROBE_RUNS = 256
"""Runs in the per-request probe: a column window of 256 rows, so that a call's own cost is shared as a
strided read shares it (with 32 runs, the call's hop through the I/O loop made up most of a run's cost on the
busy 2-core VM: 70-180 us a run, where a load's strided runs cost a few)."""
PROBE_REMOTE_RUNS = 32
"""Runs in the per-request probe of a store that is not a local path (an object store: each run a ranged
request, whose round trip is the cost, no hop to amortise), taken once: 768 ranged GETs made the first load
from radosgw on the 2-core VM take 7 s longer."""
PROBE_MIN_FILE_BYTES = 256 << 10
"""Below this a data file says too little about bytes/s: the store's costs keep the prior."""
PROBE_SEND_BYTES = 1 << 20
"""Bytes each rank sends to each peer in the exchange probes."""
MIN_BYTES_SHARE = 0.25
"""The least share of a sized all-to-all's seconds taken to be its bytes' (:func:`_bytes_share`)."""
EXCHANGE_TRIES = 3
"""Timed all-to-alls per exchange probe, the fastest counts."""
MIN_SPENT_S = 1e-6
"""The least seconds a probe's bytes are taken to cost (a timer's noise may leave less or nothing after the
collective's latency): a measured cost is never zero."""

MeasureKey = tuple[str, bool, str, int]
"""What a measurement is kept for: the store's scheme, whether it is a local path, the group's backend and
its size (and, beside it, the group's nodes)."""

_kept: dict[MeasureKey, tuple[tuple[str, ...], dict[str, float]]] = {}
"""The measurements this process took, by :data:`MeasureKey`, each with the nodes of its group: the job's
own record of its machines (a probe is taken once, not per load)."""


def override_text() -> str:
    """``$TIERCKPT_ROUTE_COSTS`` as this rank sees it (every rank must see the same)."""
    return os.environ.get(ROUTE_COSTS_ENV, "").strip()


def parse_override(text: str) -> tuple[bool, dict[str, float]]:
    """``(skip the probe, costs)`` from an override's text (see the module docstring)."""
    names = {n for fields in COST_FIELDS.values() for n in fields}
    skip, costs = False, {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item == CONSTANTS:
            skip = True
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        try:
            seconds = float(value) if sep and name in names else -1.0
        except ValueError:
            seconds = -1.0
        if not seconds >= 0.0 or seconds == float("inf"):
            raise RouteCostsError(
                f"${ROUTE_COSTS_ENV} item {item!r}: write name=seconds (a finite number >= 0) with a name of "
                f"{sorted(names)}, or {CONSTANTS!r} to use the default costs unmeasured"
            )
        costs[name] = seconds
    return skip, costs


def measure_key(backend: Backend, comm: Comm) -> MeasureKey:
    scheme = backend.root_uri.split("://", 1)[0] if "://" in backend.root_uri else ""
    return (scheme, backend.capabilities.local_path, comm.backend, comm.world_size)


def kept_share(backend: Backend, comm: Comm) -> tuple[str, Any]:
    """What this rank shares with the load's first agreement: its override's text and what it kept for this
    store and group (``None``: nothing yet)."""
    return override_text(), _kept.get(measure_key(backend, comm))


def measured_topology(prior: Topology, comm: Comm, backend: Backend, ckpt: Checkpoint, shares: Sequence[Any],
                      *, routes_open: bool = True) -> Topology:
    """``prior`` with the costs measured for this job (kept, or probed now on every rank) and the override
    over them; ``shares``: every rank's :func:`kept_share`. Every rank returns the same.


    ``routes_open``: whether some slab of this load has a route to choose (some tensor is needed by several
    ranks, :meth:`~tierckpt.planner.group_needs.GroupNeeds.one_rank_per_tensor`, the same on every rank).
    Without one every slab is read by the rank that needs it whatever the costs: nothing is probed (a
    one-rank load, ranks that each load their own tensors) and the next load that has a choice measures."""
    check_same_on_every_rank(f"${ROUTE_COSTS_ENV}", [s[0] for s in shares], "choosing the load routes")
    skip, override = parse_override(shares[0][0])
    topo = prior
    if not skip and routes_open:
        kept = [s[1] for s in shares]
        if kept[0] is not None and all(k == kept[0] for k in kept) and tuple(kept[0][0]) == prior.nodes:
            costs = dict(kept[0][1])
        else:
            costs = _probe(prior, comm, backend, ckpt)
            if "byte_s" in costs:  # a checkpoint too small to measure the store with is probed again next time
                _kept[measure_key(backend, comm)] = (prior.nodes, costs)
        topo = with_costs(topo, costs, tuple(costs))
    return with_costs(topo, override, tuple(override)) if override else topo


def _probe(prior: Topology, comm: Comm, backend: Backend, ckpt: Checkpoint) -> dict[str, float]:
    """The costs the group measures now (every rank, collectively); see the module docstring."""
    sample = _sample(ckpt)
    costs: dict[str, float] = {}
    if sample is not None:
        path, size = sample
        nbytes = min(PROBE_READ_BYTES, size)
        start = (comm.rank * nbytes) % (size - nbytes + 1) // 4096 * 4096
        # Each step ends in the all-gather that agrees on it: the next one starts on every rank together.
        _, first_reads = comm.exchange_agreed(lambda: (None, _first_read(backend, path, start, nbytes)),
                                              "measuring the store")
        unreadable = [(rank, why) for rank, (_, why) in enumerate(first_reads) if why is not None]
        if unreadable:
            # A rank whose chain cannot read the sample (a replacement node recovering from its peers' memory
            # tiers while the store is away) measures no store: the store keeps the prior, and the load reads
            # what each rank can. The probe never fails a load that the load itself would not fail.
            log.info("the store's costs keep the prior: rank %d cannot read %s to measure it (%s)",
                     unreadable[0][0], path, unreadable[0][1])
            return _exchange_costs(prior, comm) if comm.world_size > 1 else {}
        first = [seconds for seconds, _ in first_reads]
        local = backend.capabilities.local_path
        count = PROBE_RUNS if local else PROBE_REMOTE_RUNS
        runs = [start + k * (nbytes // count) for k in range(count)]
        small = max(nbytes // 8, 1)

        def repeats() -> tuple[float, float]:
            """Per-byte seconds of a page-cached repeat (the slope between two sizes; only where the store's
            repeats are node copies, ``cached_byte_s``), and of one run."""
            per_byte = 0.0
            if prior.store.node_cached:
                large_s = min(_timed_read(backend, path, start, nbytes) for _ in range(2))
                small_s = min(_timed_read(backend, path, start, small) for _ in range(2))
                per_byte = (large_s - small_s) / (nbytes - small) if nbytes > small else large_s / nbytes
            run_s = min(_timed_runs(backend, path, runs) for _ in range(3 if local else 1)) / count
            return max(per_byte, MIN_SPENT_S / nbytes), run_s

        _, again = comm.exchange_agreed(lambda: (None, repeats()), "measuring the store")
        costs.update(_store_costs(prior, nbytes, first, [a[0] * nbytes for a in again], [a[1] for a in again]))
    if comm.world_size > 1:
        costs.update(_exchange_costs(prior, comm))
    return costs


def _first_read(backend: Backend, path: str, start: int, nbytes: int) -> tuple[float, str | None]:
    """:func:`_timed_read`'s seconds, or why this rank's chain cannot read the sample (then ``0.0``)."""
    try:
        return _timed_read(backend, path, start, nbytes), None
    except CheckpointError as exc:
        return 0.0, describe_error(exc)


def _timed_read(backend: Backend, path: str, start: int, nbytes: int) -> float:
    """Seconds to read ``nbytes`` at ``start`` as a load reads them: by the backend's segment read, into a
    buffer whose pages are already touched (a load's targets are)."""
    out = np.ones(nbytes, dtype=np.uint8)
    began = time.perf_counter()
    get_scheduler().run(backend.read_segments(path, [([start], nbytes, memoryview(out))]))
    return time.perf_counter() - began


def _timed_runs(backend: Backend, path: str, offsets: list[int]) -> float:
    """Seconds to read :data:`PROBE_SMALL_BYTES` at each of ``offsets`` in one call, as a load reads a strided
    box's runs."""
    out = np.ones(len(offsets) * PROBE_SMALL_BYTES, dtype=np.uint8)
    began = time.perf_counter()
    get_scheduler().run(backend.read_segments(path, [(offsets, PROBE_SMALL_BYTES, memoryview(out))]))
    return time.perf_counter() - began


def _store_costs(prior: Topology, nbytes: int, first: Sequence[float], again: Sequence[float],
                 small: Sequence[float]) -> dict[str, float]:
    """Store costs from every rank's seconds: ``first`` and ``again`` reading ``nbytes`` (all ranks at once),
    ``small`` a run of the per-request probe."""
    by_node: dict[str, list[float]] = {}
    for rank, seconds in enumerate(first):
        by_node.setdefault(prior.nodes[rank], []).append(seconds)
    costs = {
        "request_s": statistics.median(small),
        "byte_s": max(max(times) / (len(times) * nbytes) for times in by_node.values()),
    }
    if prior.store.group_byte_s > 0:
        costs["group_byte_s"] = max(first) / (len(first) * nbytes)
    if prior.store.node_cached:
        costs["cached_byte_s"] = max(again) / nbytes
    return costs


def _exchange_costs(prior: Topology, comm: Comm) -> dict[str, float]:
    """Exchange costs from three timed all-to-alls (every rank); converted with
    :func:`~tierckpt.planner.routes.exchange_seconds`' overlap: deliveries to ranks of the same node overlap
    as far as the nodes' cores allow, those across nodes over every sender."""
    world, nodes = comm.world_size, prior.nodes
    local_turns = min(world, prior.cores * prior.num_nodes) if prior.cores > 0 else world
    same = [r != comm.rank and nodes[r] == nodes[comm.rank] for r in range(world)]
    other = [nodes[r] != nodes[comm.rank] for r in range(world)]
    tiny = _best_all_to_all(comm, [0 if r == comm.rank else 1 for r in range(world)])
    local = _best_all_to_all(comm, [PROBE_SEND_BYTES if x else 0 for x in same])
    remote = _best_all_to_all(comm, [PROBE_SEND_BYTES if x else 0 for x in other]) if prior.num_nodes > 1 else 0.0
    times = comm.all_gather_object((tiny, local, remote))
    messages = world * (world - 1)
    message_s = max(t[0] for t in times) * local_turns / messages
    costs = {"message_s": message_s}
    # The bytes' share of an all-to-all: its seconds beyond the tiny one's (the same collective's latency).
    latency = max(t[0] for t in times)
    local_peers = sum(nodes[a] == nodes[b] for a in range(world) for b in range(world) if a != b)
    if local_peers:
        spent = _bytes_share(max(t[1] for t in times), latency)
        costs["local_byte_s"] = spent * local_turns / (local_peers * PROBE_SEND_BYTES)
    remote_peers = messages - local_peers
    if remote_peers:
        spent = _bytes_share(max(t[2] for t in times), latency)
        costs["remote_byte_s"] = spent * world / (remote_peers * PROBE_SEND_BYTES)
    return costs


def _bytes_share(seconds: float, latency: float) -> float:
    """The seconds an all-to-all of ``seconds`` spent on its bytes: beyond the one-byte all-to-all's
    ``latency``, and at least :data:`MIN_BYTES_SHARE` of the whole. On a busy machine the one-byte
    all-to-all can take as long as the sized one; the bare difference then made moving a byte between two
    ranks of a node look 1,000x cheaper than the prior and sent a replicated 4-rank load to the exchange
    at 0.68x DCP (direct reads: 2.3x)."""
    return max(seconds - latency, MIN_BYTES_SHARE * seconds, MIN_SPENT_S)


def _best_all_to_all(comm: Comm, send_sizes: list[int]) -> float:
    """The least seconds of :data:`EXCHANGE_TRIES` timed all-to-alls (the one least disturbed)."""
    return min(_timed_all_to_all(comm, send_sizes) for _ in range(EXCHANGE_TRIES))


def _timed_all_to_all(comm: Comm, send_sizes: list[int]) -> float:
    """Seconds of one all-to-all sending ``send_sizes[r]`` bytes to each rank ``r`` (and receiving as much from
    it: the pattern is symmetric), started together after a barrier."""
    send = torch.zeros(sum(send_sizes), dtype=torch.uint8)
    comm.barrier()
    began = time.perf_counter()
    comm.all_to_all_bytes(send, send_sizes, send_sizes)
    return time.perf_counter() - began


def _sample(ckpt: Checkpoint) -> tuple[str, int] | None:
    """The largest data file and its size (``None``: none is large enough to measure with)."""
    files = [f for f in ckpt.meta.files if f.size >= PROBE_MIN_FILE_BYTES]
    if not files:
        return None
    f = max(files, key=lambda f: (f.size, f.key))
    return layout.in_generation(ckpt.meta.generation, f.key), f.size
