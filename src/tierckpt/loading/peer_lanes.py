"""Several connections per pair of ranks for peer recovery's streamed chunks.

A gloo process group moves a pair's messages over one TCP connection per device, and a group made by
``init_process_group`` has one device (one per interface named in ``GLOO_SOCKET_IFNAME``): one socket and
one I/O thread carry all of a lost node's bytes from its peer, about 3.8 GB/s on a 16-core VM's loopback
(`benchmarks/bench_wire.py`). Peer recovery streams hundreds of MiB per rank in large chunks
(:mod:`tierckpt.loading.peer_stream`), so it sends them over a group of its own with :data:`LANES` devices, each
with its own connection and I/O thread; gloo runs a message tagged ``t`` on device ``t mod devices``,
so the ``j``-th chunk between two ranks goes on lane ``j mod LANES``: both sides post a pair's chunks in
the same order, and messages of one pair and tag arrive in the order posted.

The lanes' group spans the same ranks as the load's group and is made once per process and group, with
devices that connect lazily: making it exchanges nothing, and only the pairs that stream ever connect
(a replacement rank and the peer holding its replica), on their first chunk. It is made from the
group's own store, under a key of its own, with the group's timeout and the interfaces the group's
devices use (``GLOO_SOCKET_IFNAME``, else the host name's address, as torch's own constructor does).

Where the lanes cannot be made alike on every rank (a torch without lazily connecting devices, a
group without a store torch shares) every rank streams over the load's group itself, as one lane: the
choice depends only on the torch build and the group, never on one rank's state.
"""

from __future__ import annotations

import datetime
import os
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from tierckpt.comm import Comm

LANES = 4
"""Connections per pair for streamed chunks: on a 16-core VM two processes moved 256 MiB in 70 ms over one,
64 ms over two and 40 ms over four lanes, in 32 MiB chunks (`benchmarks/bench_wire.py`, docs/benchmarks.md)."""
STORE_PREFIX = "tierckpt/peer-lanes"
"""The lanes' keys in the group's store (beside torch's own)."""
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""A chunk's timeout when the group does not say its own (torch's default for gloo)."""

_made: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup | None] = weakref.WeakKeyDictionary()
"""Each group's lanes group (``None``: the group streams over itself), made once per process."""


class Lanes:
    """One load's streamed chunks: ``count`` connections per pair (1: the load's own group, under ``tag``).

    A lane connects on its first message, and gloo's first post on a lane blocks until the peer's side has
    connected too (a replacement rank still planning its load, say): each lane posts from a thread of its
    own, so neither the caller (a holder about to read its own units) nor the other lanes wait for it, and
    the lanes connect at once. A lane's messages are posted in the order asked, the order both sides agree on.
    """

    def __init__(self, comm: Comm, pg: dist.ProcessGroup | None, count: int, tag: int) -> None:
        self.comm, self._pg, self.count, self.tag = comm, pg, count, tag
        self._posted: Counter[tuple[str, int]] = Counter()
        self._posters = [] if pg is None else [
            ThreadPoolExecutor(1, thread_name_prefix=f"tierckpt-lane-{k}") for k in range(count)
        ]

    def send(self, data: torch.Tensor, to: int) -> Posted:
        """Post the next chunk to group rank ``to``."""
        if self._pg is None:
            return Posted(dist.isend(data, self._global(to), group=self.comm.group, tag=self.tag))
        lane, pg = self._lane("send", to), self._pg
        return Posted(self._posters[lane].submit(lambda: pg.send([data], to, lane)))

    def recv(self, into: torch.Tensor, frm: int) -> Posted:
        """Post the receive of the next chunk from group rank ``frm`` into ``into``."""
        if self._pg is None:
            return Posted(dist.irecv(into, self._global(frm), group=self.comm.group, tag=self.tag))
        lane, pg = self._lane("recv", frm), self._pg
        return Posted(self._posters[lane].submit(lambda: pg.recv([into], frm, lane)))

    def close(self) -> None:
        """Let the lanes' posting threads end (every message asked for is posted first)."""
        for poster in self._posters:
            poster.shutdown(wait=False)

    def _lane(self, way: str, peer: int) -> int:
        """The lane (tag) of the next chunk between this rank and ``peer`` in direction ``way``."""
        lane = self._posted[way, peer] % self.count
        self._posted[way, peer] += 1
        return lane

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.comm.group, rank) if self.comm.group is not None else rank


class Posted:
    """A chunk's message: posted already (a gloo work) or about to be (on its lane's thread)."""

    def __init__(self, work: dist.Work | Future[dist.Work]) -> None:
        self._work = work

    def wait(self) -> None:
        """Until the message moved; raises what posting or moving it raised."""
        work = self._work.result() if isinstance(self._work, Future) else self._work
        work.wait()


def lanes_of(comm: Comm, tag: int) -> Lanes:
    """The lanes of one load over ``comm``'s group, whose lanes group is made on first use (every rank of a
    load that streams asks alike); ``tag``: the chunks' tag where they go over the group itself."""
    group = comm.group if comm.group is not None else dist.group.WORLD
    if group is None or comm.backend != "gloo":
        return Lanes(comm, None, 1, tag)
    if group not in _made:
        _made[group] = _lane_group(group, comm.rank, comm.world_size)
    pg = _made[group]
    return Lanes(comm, pg, LANES, tag) if pg is not None else Lanes(comm, None, 1, tag)


def _lane_group(group: dist.ProcessGroup, rank: int, size: int) -> dist.ProcessGroup | None:
    """A gloo group of :data:`LANES` lazily connecting devices over ``group``'s ranks, or ``None``."""
    from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

    store = _store_of(group)
    if store is None:
        return None
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    options = ProcessGroupGloo._Options()
    try:
        options._devices = [
            ProcessGroupGloo.create_device(interface=interfaces[k % len(interfaces)], lazy_init=True)
            if interfaces else ProcessGroupGloo.create_default_device(lazy_init=True)
            for k in range(LANES)
        ]
    except TypeError:  # a torch whose devices always connect every pair when the group is made
        return None
    options._timeout = _timeout_of(group)
    return ProcessGroupGloo(PrefixStore(STORE_PREFIX, store), rank, size, options)


def _store_of(group: dist.ProcessGroup) -> dist.Store | None:
    """The store ``group``'s ranks share (torch keeps it beside the group), or ``None``."""
    try:
        return dist.distributed_c10d._world.pg_map[group][1]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


def _timeout_of(group: dist.ProcessGroup) -> datetime.timedelta:
    """``group``'s own timeout where its gloo backend tells it, else :data:`DEFAULT_TIMEOUT`."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return DEFAULT_TIMEOUT
