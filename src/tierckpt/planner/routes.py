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


STORES: dict[str, StoreCost] = {
    "node_local": StoreCost(kind="node_local", request_s=1e-6, byte_s=0.5e-9, group_byte_s=0.0,
                            node_cached=True, cached_byte_s=0.1e-9),
    "shared_fs": StoreCost(kind="shared_fs", request_s=100e-6, byte_s=0.4e-9, group_byte_s=1e-9,
                           node_cached=True, cached_byte_s=0.1e-9),
    "object_store": StoreCost(kind="object_store", request_s=3e-3, byte_s=0.8e-9, group_byte_s=1e-9,
                              node_cached=False, cached_byte_s=0.1e-9),
    "memory": StoreCost(kind="memory", request_s=0.2e-6, byte_s=0.1e-9, group_byte_s=0.0,
                        node_cached=True, cached_byte_s=0.1e-9),
}
"""Defaults per store kind: a node's NVMe disk (~2 GB/s, page cache ~10 GB/s), a shared file system
(~2.5 GB/s per node, ~1 GB/s for the job), an object store (~1.2 GB/s per node, ~1 GB/s for the job,
~20 ms per GET over ~8 in flight), a process's memory."""


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


def topology(store: str, exchange: str, nodes: Sequence[str]) -> Topology:
    """A :class:`Topology` with the default costs of ``store`` (a key of :data:`STORES`) and of the
    process-group backend ``exchange`` (``"gloo"``, ``"nccl"``; anything else is costed as gloo)."""
    return Topology(store=STORES[store], exchange=EXCHANGES.get(exchange, EXCHANGES["gloo"]), nodes=tuple(nodes))


def default_topology(world_size: int) -> Topology:
    """One node reading an object store over gloo: each byte is read once unless reading directly is
    cheaper even there (disjoint needs in runs of about 1 MiB or more)."""
    return topology("object_store", "gloo", ("",) * world_size)


@dataclass(frozen=True, slots=True)
class RankRead:
    """What one rank would read of a slab by the direct route."""

    rank: int
    nbytes: int
    requests: int


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
    return max(rank_s, node_s, group_s)


def exchange_seconds(reads: Sequence[RankRead], union_bytes: int, union_requests: int, topo: Topology) -> float:
    """Estimated seconds for one rank (the one needing most) to read the union and send the others their parts."""
    store, xchg = topo.store, topo.exchange
    reader = max(reads, key=lambda r: (r.nbytes, -r.rank))
    turns = len(reads)
    read_s = max(union_requests * store.request_s / turns, union_bytes * store.byte_s, union_bytes * store.group_byte_s)
    send_s = 0.0
    for r in reads:
        if r.rank == reader.rank:
            continue
        per_byte = xchg.local_byte_s if topo.nodes[r.rank] == topo.nodes[reader.rank] else xchg.remote_byte_s
        send_s += r.nbytes * per_byte + xchg.message_s
    return read_s + send_s / turns


def choose_route(reads: Sequence[RankRead], union_bytes: int, union_requests: int, topo: Topology) -> Route:
    """``direct`` when it is estimated strictly faster than ``exchange`` (ties read once); a slab only
    one rank needs is always read by that rank."""
    if len({r.rank for r in reads}) <= 1:
        return DIRECT
    if direct_seconds(reads, union_bytes, topo) < exchange_seconds(reads, union_bytes, union_requests, topo):
        return DIRECT
    return EXCHANGE
