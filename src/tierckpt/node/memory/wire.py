"""The replicator's control messages: :class:`Wire`, point-to-point transfers between its ranks, each step bounded.

Sizes, byte strings (a transfer's header, which offers its data stream) and fixed-size answers (``ok``
or the reason of a refusal) between two ranks of the replicator's group (:mod:`.replica`; the files
themselves go on that data stream, :mod:`.transfer`); a step that takes longer than the timeout fails (gloo
then closes the pair). They go over the group's side group (:mod:`.sidegroup`: the replicators' device, on
the tags of the replicator's channel), or, where the group has none, over a gloo group of the replicator's
own.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as PostTimeout

import torch
import torch.distributed as dist

from tierckpt.node.memory.sidegroup import SideGroup

_REPLY_BYTES = 4096


class Wire:
    """Transfers between ``ranks`` (global ranks, the replicator's group in order), each step waited for at
    most ``timeout``: over ``side`` on replicator ``channel``, else over ``own`` (a group of their own).
    Messages are of a ``kind`` (``0 <= kind <`` :data:`~.sidegroup.REPLICA_KINDS`), which names their tag."""

    def __init__(
        self, ranks: list[int], timeout: datetime.timedelta, *,
        side: SideGroup | None = None, channel: int = 0, own: dist.ProcessGroup | None = None,
    ) -> None:
        self._group_rank = {rank: i for i, rank in enumerate(ranks)}
        self._timeout, self._side, self._channel, self._own = timeout, side, channel, own

    def isend(self, tensor: torch.Tensor, dst: int, kind: int) -> dist.Work:
        """Post ``tensor`` to global rank ``dst`` (not waited for)."""
        if self._side is None:
            return dist.isend(tensor, dst, group=self._own, tag=kind)
        return self._side.send(tensor, self._group_rank[dst], self._side.replica_tag(self._channel, kind))

    def irecv(self, tensor: torch.Tensor, src: int, kind: int) -> dist.Work:
        """Post the receive of ``tensor`` from global rank ``src`` (not waited for)."""
        if self._side is None:
            return dist.irecv(tensor, src, group=self._own, tag=kind)
        return self._side.recv(tensor, self._group_rank[src], self._side.replica_tag(self._channel, kind))

    def connect(self, peers: Iterable[int], kind: int) -> dict[int, str]:
        """Connect this rank with each of ``peers`` (global ranks) now, each pair within the timeout, with one
        message of ``kind`` each way; every peer calls it alike, at the same point. Returns why, for each
        peer that did not answer in time (empty when all did): the caller uses that pair no more.

        A pair of the side group connects on its first message, and that first post waits for the peer's
        side, up to the group's timeout: connected here, where every rank is (as a group of the
        replicator's own connects when it is made), a peer lost later fails a transfer step at once or
        within the replicator's timeout. Each message is posted from a thread of its own, so that no pair
        waits on another. Over a group of the replicator's own, the pairs are connected already."""
        if self._side is None:
            return {}
        peers = sorted(set(peers))
        posting = ThreadPoolExecutor(max(1, 2 * len(peers)), thread_name_prefix="tierckpt-replica-connect")
        posts = [(peer, posting.submit(self.isend, torch.ones(1, dtype=torch.uint8), peer, kind)) for peer in peers]
        posts += [(peer, posting.submit(self.irecv, torch.zeros(1, dtype=torch.uint8), peer, kind)) for peer in peers]
        posting.shutdown(wait=False)
        deadline = time.monotonic() + self._timeout.total_seconds()
        failed: dict[int, str] = {}
        for peer, post in posts:
            if peer in failed:
                continue
            try:
                self.wait(post.result(max(0.0, deadline - time.monotonic())))
            except (PostTimeout, RuntimeError) as exc:
                failed[peer] = (
                    f"it did not connect to rank {dist.get_rank()} over the side group within "
                    f"{self._timeout.total_seconds():g}s when the replicators were built ({type(exc).__name__}: {exc}); "
                    f"the interfaces the group uses (GLOO_SOCKET_IFNAME, else the host name's address) must reach "
                    f"between nodes"
                )
        return failed

    def wait(self, work: dist.Work) -> None:
        """Wait for a transfer step, at most the timeout (then gloo fails it and closes the pair)."""
        work.wait(self._timeout)

    def send(self, tensor: torch.Tensor, dst: int, kind: int) -> None:
        self.wait(self.isend(tensor, dst, kind))

    def recv(self, tensor: torch.Tensor, src: int, kind: int) -> None:
        self.wait(self.irecv(tensor, src, kind))

    def send_bytes(self, data: bytes, dst: int, kind: int) -> None:
        self.send(torch.tensor([len(data)], dtype=torch.int64), dst, kind)
        self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, kind)

    def recv_bytes(self, src: int, kind: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        self.recv(size, src, kind)
        out = torch.empty(int(size.item()), dtype=torch.uint8)
        self.recv(out, src, kind)
        return out.numpy().tobytes()

    def reply(self, text: str, dst: int, kind: int) -> None:
        """A fixed-size answer: ``ok`` or the reason of a refusal, truncated to fit."""
        buf = torch.zeros(_REPLY_BYTES, dtype=torch.uint8)
        data = text.encode()[: _REPLY_BYTES - 1]
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.send(buf, dst, kind)

    def answer(self, src: int, kind: int) -> str:
        buf = torch.zeros(_REPLY_BYTES, dtype=torch.uint8)
        self.recv(buf, src, kind)
        return buf.numpy().tobytes().rstrip(b"\0").decode(errors="replace")
