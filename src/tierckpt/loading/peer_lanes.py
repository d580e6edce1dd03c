"""Several connections per pair of ranks for peer recovery's streamed chunks: a load's lanes.

A gloo process group moves a pair's messages over one TCP connection per device, and a group made by
``init_process_group`` has one device (one per interface named in ``GLOO_SOCKET_IFNAME``): one socket and
one I/O thread would carry all of a lost node's bytes from its peer. Peer recovery streams hundreds of MiB
per rank in large chunks (:mod:`tierckpt.loading.peer_stream`), so it sends them over the lanes of the
group's side group (:mod:`tierckpt.node.memory.sidegroup`, which the replicator's transfers use too, on a
device of their own): :data:`~tierckpt.node.memory.sidegroup.LANES` devices, each with its own connection and
I/O thread, connecting lazily (only the pairs that stream ever connect: a replacement rank and the peer
holding its replica, on their first chunk). The ``j``-th chunk between two ranks goes on lane ``j mod LANES``:
both sides post a pair's chunks in the same order, and messages of one pair and tag arrive in the order posted.

Where the group has no side group every rank streams over the load's group itself, as one lane: the
choice depends only on the torch build and the group, never on one rank's state.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from tierckpt.comm import Comm
from tierckpt.node.memory.sidegroup import LANES, SideGroup, side_group_of


class Lanes:
    """One load's streamed chunks: ``count`` lanes of the side group ``side`` per pair (1: the load's own
    group, under ``tag``, where ``side`` is ``None``).

    A lane connects on its first message, and gloo's first post on a lane blocks until the peer's side has
    connected too (a replacement rank still planning its load, say): each lane posts from a thread of its
    own, so neither the caller (a holder about to read its own units) nor the other lanes wait for it, and
    the lanes connect at once. A lane's messages are posted in the order asked, the order both sides agree on.
    """

    def __init__(self, comm: Comm, side: SideGroup | None, count: int, tag: int) -> None:
        self.comm, self.side, self.count, self.tag = comm, side, count, tag
        self._posted: Counter[tuple[str, int]] = Counter()
        self._posters = [] if side is None else [
            ThreadPoolExecutor(1, thread_name_prefix=f"tierckpt-lane-{k}") for k in range(count)
        ]

    def send(self, data: torch.Tensor, to: int) -> Posted:
        """Post the next chunk to group rank ``to``."""
        if self.side is None:
            return Posted(dist.isend(data, self._global(to), group=self.comm.group, tag=self.tag))
        lane, side = self._lane("send", to), self.side
        return Posted(self._posters[lane].submit(lambda: side.send(data, to, lane)))

    def recv(self, into: torch.Tensor, frm: int) -> Posted:
        """Post the receive of the next chunk from group rank ``frm`` into ``into``."""
        if self.side is None:
            return Posted(dist.irecv(into, self._global(frm), group=self.comm.group, tag=self.tag))
        lane, side = self._lane("recv", frm), self.side
        return Posted(self._posters[lane].submit(lambda: side.recv(into, frm, lane)))

    def close(self) -> None:
        """Let the lanes' posting threads end (every message asked for is posted first)."""
        for poster in self._posters:
            poster.shutdown(wait=False)

    def _lane(self, way: str, peer: int) -> int:
        """The lane (tag, and device of the side group) of the next chunk between this rank and ``peer`` in
        direction ``way``."""
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
    """The lanes of one load over ``comm``'s group: its side group's (made on first use; every rank of a
    load that streams asks alike); ``tag``: the chunks' tag where they go over the group itself."""
    side = side_group_of(comm.group, "lanes") if comm.backend == "gloo" else None
    return Lanes(comm, side, LANES, tag) if side is not None else Lanes(comm, None, 1, tag)
