"""Cost model of load routes: every rank reads what it needs, each node reads once and shares, or one rank
reads and the group exchanges.

A slab of a saved piece that several ranks need can reach them by three routes:

* ``direct`` — each rank reads its own part from storage. Parts needed by several ranks are read
  several times: on one node, from a local file, the repeats come from the page cache (a memory
  copy); from an object store, each repeat is storage traffic again.
* ``node`` — with ranks on several nodes, one rank of each node reads the union of what its node needs
  and sends its node's other ranks their parts (node-local delivery): storage sees each byte once per
  node, not once per rank and not once per group plus a network exchange across nodes.
* ``exchange`` — one rank reads the union once and sends the others their parts in the round's
  all-to-all: storage sees each byte once, the interconnect carries the rest.

:func:`choose_route` compares the estimated seconds of both from explicit inputs (:class:`Topology`:
what the store costs, what the exchange costs, which node each rank is on) and is pure, so every rank
takes the same decision from the same inputs. The inputs are the constants below as a prior, replaced
by what the job measured of the store and the exchange it actually uses (:mod:`tierckpt.loading.route_costs`,
agreed by every rank) and by an operator's override. The estimates are bottleneck sums, not simulations:

* storage: per request ``request_s`` on the rank that issues it; per byte ``byte_s`` through each node's
  link to the store (shared by the node's ranks) and ``group_byte_s`` through the store's share for
  the whole group (shared file systems and object stores serve every node; a node's own disk does
  not); repeats on a node are page-cache copies at ``cached_byte_s`` when the store is ``node_cached``.
* the span walked: a rank's strided read passes over every page between its first and last run (the
  mapping faults them in, the kernel's read-ahead covers them); each byte it passes without needing it
  costs ``walk_byte_s``, and the walks of a node's ranks add up (they share its memory system), where
  the exchange route reads the union, a contiguous box when the needs tile the slab. At N ranks a
  row -> column reshard passes over each slab N - 1 times directly, not at all by exchange: with the default
  constants and a core per rank, direct up to 4 ranks per node, exchange from about 6 (its walks then
  cost more than the exchange's messages, which overlap across the readers); where ranks outnumber
  the node's cores (:attr:`Topology.cores`), the messages do not overlap and direct stays cheaper.
* exchange: readers take turns across units (the planner spreads them), so the reader's requests and
  its sends count once per needing rank; each byte sent costs ``local_byte_s`` to a rank of the same
  node (loopback, shared memory) and ``remote_byte_s`` across nodes, each delivery ``message_s``.

* node: as the exchange, per node — each node's reader reads the union through its node's link
  (``byte_s``; the store's group share sees it once per node) and sends only to its own node's ranks
  (``local_byte_s``); the nodes work at once.

With the default constants a replicated target (a DDP model and its optimizer) read from a file on
the ranks' own node goes direct — every rank reads the file, nothing is exchanged — while across
nodes or from an object store the group reads each byte once and exchanges. Disjoint needs go
direct when their runs are long enough to amortize a request (about 1 KiB on a local disk, about
1 MiB on an object store).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

from tierckpt.errors import CheckpointError

Route = Literal["direct", "node", "exchange"]
DIRECT: Route = "direct"
NODE: Route = "node"
EXCHANGE: Route = "exchange"


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreCost:
    """What reading from one kind of store costs (seconds)."""

    kind: str
    request_s: float
    """One read request on the rank that issues it (a positional read, a ranged GET's share of the
    latency once the scheduler keeps several in flight)."""
    byte_s: float
    """One byte through a node's link to the store, shared by the node's ranks."""
    group_byte_s: float
    """One byte of the whole group's traffic: the store's share for this job (0: each node has its own)."""
    node_cached: bool
    """A repeat read of the same bytes on the same node is served from the node's memory (page cache)."""
    cached_byte_s: float
    """One byte copied out of the node's cache."""
    walk_byte_s: float = 0.0
    """One byte of the span a rank's read passes over in the node's cache: a strided read (a column
    window of each row) maps and faults the pages between its runs too, in 64 KiB windows, and unmaps them
    after. Ranks of one node walking the same span share the node's memory system (and, 8 at a time,
    contend for the same pages), so the node's walks add up. 0 where reads are network requests."""


STORES: dict[str, StoreCost] = {
    "node_local": StoreCost(kind="node_local", request_s=1e-6, byte_s=0.5e-9, group_byte_s=0.0,
                            node_cached=True, cached_byte_s=0.1e-9, walk_byte_s=0.025e-9),
    "shared_fs": StoreCost(kind="shared_fs", request_s=100e-6, byte_s=0.4e-9, group_byte_s=1e-9,
                           node_cached=True, cached_byte_s=0.1e-9, walk_byte_s=0.025e-9),
    "object_store": StoreCost(kind="object_store", request_s=3e-3, byte_s=0.8e-9, group_byte_s=1e-9,
                              node_cached=False, cached_byte_s=0.1e-9),
    "memory": StoreCost(kind="memory", request_s=0.2e-6, byte_s=0.1e-9, group_byte_s=0.0,
                        node_cached=True, cached_byte_s=0.1e-9, walk_byte_s=0.025e-9),
}
"""Defaults per store kind: a node's NVMe disk (~2 GB/s, page cache ~10 GB/s), a shared file system
(~2.5 GB/s per node, ~1 GB/s for the job), an object store (~1.2 GB/s per node, ~1 GB/s for the job,
~20 ms per GET over ~8 in flight), a process's memory. Walking a span of the page cache: 64 MiB with
2 KiB runs every 16 KiB in 1.6 ms through one mapping on the 2-core test VM (0.025 ns per byte)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExchangeCost:
    """What moving bytes between ranks costs (seconds)."""

    kind: str
    local_byte_s: float
    """One byte to a rank on the same node."""
    remote_byte_s: float
    """One byte to a rank on another node."""
    message_s: float
    """One delivery: packing, unpacking and its share of the collective's latency."""


EXCHANGES: dict[str, ExchangeCost] = {
    "gloo": ExchangeCost(kind="gloo", local_byte_s=0.5e-9, remote_byte_s=0.4e-9, message_s=20e-6),
    "nccl": ExchangeCost(kind="nccl", local_byte_s=0.1e-9, remote_byte_s=0.15e-9, message_s=10e-6),
}
"""gloo: TCP over loopback (~2 GB/s, bound by socket copies) or a 25 GbE link; NCCL: NVLink within a
node, InfiniBand across, plus the host-to-device and device-to-host copies of the exchange buffers
(~25 GB/s each way). Other backends (a mixed ``cpu:gloo,cuda:nccl`` group exchanges on the CPU) are
costed as gloo."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """The inputs of the route decision: the store, the exchange, and each rank's node."""

    store: StoreCost
    exchange: ExchangeCost
    nodes: tuple[str, ...]
    """Node identity of each rank of the loading group (see :mod:`tierckpt.node.host`)."""
    cores: int = 0
    """CPU cores per node (the fewest any rank sees; 0: unknown, as many as ranks). Node-local exchange
    messages are CPU work (socket copies): at most this many run at once on a node, so where ranks
    outnumber cores the sends of readers taking turns add up instead of overlapping."""

    measured: tuple[str, ...] = ()
    """Names of the costs (fields of :class:`StoreCost` and :class:`ExchangeCost`) that were measured on
    this job's machines or set by an operator, not taken from the defaults."""

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    def describe(self) -> str:
        """The route inputs in one line (logs, benchmarks): each cost, ``*`` marking the measured ones."""
        def cell(name: str, value: float) -> str:
            return f"{name}={value:.3g}{'*' if name in self.measured else ''}"
        costs = {**asdict(self.store), **asdict(self.exchange)}
        store = [cell(n, costs[n]) for n in COST_FIELDS["store"]]
        xchg = [cell(n, costs[n]) for n in COST_FIELDS["exchange"]]
        return (f"store {self.store.kind} ({', '.join(store)}); {self.exchange.kind} exchange ({', '.join(xchg)}); "
                f"{self.num_nodes} node(s), {self.cores or '?'} cores")


COST_FIELDS: dict[str, tuple[str, ...]] = {
    "store": ("request_s", "byte_s", "group_byte_s", "cached_byte_s", "walk_byte_s"),
    "exchange": ("local_byte_s", "remote_byte_s", "message_s"),
}
"""The costs a measurement or an override may set, by the record they belong to (all in seconds)."""


def with_costs(topo: Topology, costs: dict[str, float], measured: Sequence[str]) -> Topology:
    """``topo`` with ``costs`` (names of :data:`COST_FIELDS`) replacing its own; ``measured``: the names to
    mark as measured or overridden in :attr:`Topology.measured`."""
    store = {n: v for n, v in costs.items() if n in COST_FIELDS["store"]}
    xchg = {n: v for n, v in costs.items() if n in COST_FIELDS["exchange"]}
    return replace(topo, store=replace(topo.store, **store), exchange=replace(topo.exchange, **xchg),
                   measured=tuple(sorted({*topo.measured, *measured})))


def store_kind(*, local_path: bool, scheme: str, nodes: Sequence[str]) -> str:
    """The kind of store a backend is for a group on ``nodes``.

    A local path read by ranks of several nodes must be a shared file system mounted on each of them;
    read by the ranks of one node it is that node's own disk.
    """
    if local_path:
        return "node_local" if len(set(nodes)) <= 1 else "shared_fs"
    if scheme == "memory":
        return "memory"
    return "object_store"


def topology(store: str, exchange: str, nodes: Sequence[str], cores: int = 0) -> Topology:
    """A :class:`Topology` with the default costs of ``store`` (a key of :data:`STORES`) and of the
    process-group backend ``exchange`` (``"gloo"``, ``"nccl"``; anything else is costed as gloo), on nodes
    of ``cores`` CPU cores (0: unknown)."""
    return Topology(store=STORES[store], exchange=EXCHANGES.get(exchange, EXCHANGES["gloo"]), nodes=tuple(nodes),
                    cores=cores)


def default_topology(world_size: int) -> Topology:
    """One node reading an object store over gloo: each byte is read once unless reading directly is
    cheaper even there (disjoint needs in runs of about 1 MiB or more)."""
    return topology("object_store", "gloo", ("",) * world_size)


def topology_for(topo: Topology | None, world_size: int) -> Topology:
    """``topo`` (default :func:`default_topology`), refused unless it names one node per loading rank."""
    topo = topo if topo is not None else default_topology(world_size)
    if len(topo.nodes) != world_size:
        raise CheckpointError(
            f"the load topology names the nodes of {len(topo.nodes)} ranks but {world_size} ranks load: "
            "give one node id per rank of the loading group"
        )
    return topo


@dataclass(frozen=True, slots=True)
class RankRead:
    """What one rank would read of a slab by the direct route."""

    rank: int
    nbytes: int
    requests: int
    walked: int = 0
    """Bytes of the span its runs pass over, first byte to last (``nbytes`` when they are back to back;
    0: the same as ``nbytes``)."""

    @property
    def passed(self) -> int:
        """Bytes of its span it passes over without needing them (0 when its runs are back to back)."""
        return max(self.walked - self.nbytes, 0)


def direct_seconds(reads: Sequence[RankRead], union_bytes: int, topo: Topology) -> float:
    """Estimated seconds for every rank to read its own part of a slab (the group needs ``union_bytes``)."""
    store = topo.store
    by_node: dict[str, list[RankRead]] = defaultdict(list)
    for r in reads:
        by_node[topo.nodes[r.rank]].append(r)
    node_bytes = []
    for node_reads in by_node.values():
        total = sum(r.nbytes for r in node_reads)
        node_bytes.append(min(total, union_bytes) if store.node_cached else total)
    copy_s = store.cached_byte_s if store.node_cached else 0.0
    rank_s = max(r.requests * store.request_s + r.nbytes * copy_s for r in reads)
    node_s = max(n * store.byte_s for n in node_bytes)
    group_s = sum(node_bytes) * store.group_byte_s
    walk_s = max(sum(r.passed for r in node_reads) for node_reads in by_node.values()) * store.walk_byte_s
    return max(rank_s, node_s, group_s) + walk_s


def exchange_seconds(
    reads: Sequence[RankRead], union_bytes: int, union_requests: int, topo: Topology, union_passed: int = 0,
) -> float:
    """Estimated seconds for one rank (the one needing most) to read the union and send the others their parts.

    ``union_passed``: bytes the union's reads pass over without needing them (see
    :attr:`StoreCost.walk_byte_s`; 0 when the union is one contiguous box, as when the needs tile a slab)."""
    store, xchg = topo.store, topo.exchange
    reader = max(reads, key=lambda r: (r.nbytes, -r.rank))
    turns = len(reads)
    # Readers' sends to their own node's ranks (socket copies, CPU work) overlap only as far as the
    # node's cores allow; sends to other nodes go through each node's link and overlap across readers.
    local_turns = min(turns, topo.cores * topo.num_nodes) if topo.cores > 0 else turns
    read_s = max(union_requests * store.request_s / turns, union_bytes * store.byte_s, union_bytes * store.group_byte_s)
    local_s = remote_s = 0.0
    for r in reads:
        if r.rank == reader.rank:
            continue
        if topo.nodes[r.rank] == topo.nodes[reader.rank]:
            local_s += r.nbytes * xchg.local_byte_s + xchg.message_s
        else:
            remote_s += r.nbytes * xchg.remote_byte_s + xchg.message_s
    return read_s + local_s / local_turns + remote_s / turns + union_passed * store.walk_byte_s


def node_seconds(
    reads: Sequence[RankRead], union_bytes: int, union_requests: int, topo: Topology, union_passed: int = 0,
) -> float:
    """Estimated seconds for one rank of each node to read the union once and send its node's other
    ranks their parts (node-local deliveries only). The nodes work at once: the slowest sets the time,
    except for the store's share for the group, which every node's reads pass through."""
    store, xchg = topo.store, topo.exchange
    by_node: dict[str, list[RankRead]] = defaultdict(list)
    for r in reads:
        by_node[topo.nodes[r.rank]].append(r)
    group_s = len(by_node) * union_bytes * store.group_byte_s
    node_s = 0.0
    for node_reads in by_node.values():
        reader = max(node_reads, key=lambda r: (r.nbytes, -r.rank))
        turns = len(node_reads)
        local_turns = min(turns, topo.cores) if topo.cores > 0 else turns
        read_s = max(union_requests * store.request_s / turns, union_bytes * store.byte_s)
        local_s = sum(r.nbytes * xchg.local_byte_s + xchg.message_s for r in node_reads if r.rank != reader.rank)
        node_s = max(node_s, read_s + local_s / local_turns)
    return max(node_s, group_s) + union_passed * store.walk_byte_s


def choose_route(
    reads: Sequence[RankRead], union_bytes: int, union_requests: int, topo: Topology, union_passed: int = 0,
) -> Route:
    """The route estimated fastest; ties go to the one that reads fewer bytes from the store (exchange,
    then node, then direct). A slab only one rank needs is always read by that rank; ``node`` is a route
    of its own only where the needing ranks span several nodes and some node has several of them (on one
    node it is the exchange, with one needing rank per node it is direct)."""
    if len({r.rank for r in reads}) <= 1:
        return DIRECT
    costs: list[tuple[float, int, Route]] = [
        (exchange_seconds(reads, union_bytes, union_requests, topo, union_passed), 0, EXCHANGE),
        (direct_seconds(reads, union_bytes, topo), 2, DIRECT),
    ]
    per_node = [topo.nodes[r.rank] for r in reads]
    if 1 < len(set(per_node)) < len(per_node):
        costs.append((node_seconds(reads, union_bytes, union_requests, topo, union_passed), 1, NODE))
    return min(costs)[2]
