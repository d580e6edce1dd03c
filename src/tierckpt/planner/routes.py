"""Cost model of load routes: every rank reads what it needs, or one rank reads and the group exchanges.

A slab of a saved piece that several ranks need can reach them by two routes:

* ``direct`` — each rank reads its own part from storage. Parts needed by several ranks are read
  several times: on one node, from a local file, the repeats come from the page cache (a memory
  copy); from an object store, each repeat is storage traffic again.
* ``exchange`` — one rank reads the union once and sends the others their parts in the round's
  all-to-all: storage sees each byte once, the interconnect carries the rest.

:func:`choose_route` compares the estimated seconds of both from explicit inputs (:class:`Topology`:
what the store costs, what the exchange costs, which node each rank is on) and is pure, so every rank
takes the same decision without communication. The estimates are bottleneck sums, not simulations:

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

With the default constants a replicated target (a DDP model and its optimizer) read from a file on
the ranks' own node goes direct — every rank reads the file, nothing is exchanged — while across
nodes or from an object store the group reads each byte once and exchanges. Disjoint needs go
direct when their runs are long enough to amortize a request (about 1 KiB on a local disk, about
1 MiB on an object store).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import CheckpointError

Route = Literal["direct", "exchange"]
DIRECT: Route = "direct"
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
    """Node identity of each rank of the loading group (see :mod:`tierckpt.node`)."""
    cores: int = 0
    """CPU cores per node (the fewest any rank sees; 0: unknown, as many as ranks). Node-local exchange
    messages are CPU work (socket copies): at most this many run at once on a node, so where ranks
    outnumber cores the sends of readers taking turns add up instead of overlapping."""

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))


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


def choose_route(
    reads: Sequence[RankRead], union_bytes: int, union_requests: int, topo: Topology, union_passed: int = 0,
) -> Route:
    """``direct`` when it is estimated strictly faster than ``exchange`` (ties read once); a slab only
    one rank needs is always read by that rank."""
    if len({r.rank for r in reads}) <= 1:
        return DIRECT
    if direct_seconds(reads, union_bytes, topo) < exchange_seconds(reads, union_bytes, union_requests, topo, union_passed):
        return DIRECT
    return EXCHANGE
