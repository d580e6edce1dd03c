"""The replicator's transport: :class:`Wire`, point-to-point transfers over its gloo group, each step bounded.

Sizes, byte strings and fixed-size answers (``ok`` or the reason of a refusal) between two ranks of
the replicator's group (:mod:`.replica`); a step that takes longer than the timeout fails (gloo then
closes the pair).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_REPLY_BYTES = 4096


class Wire:
    """Transfers over ``group``, each step waited for at most ``timeout``."""

    def __init__(self, group: dist.ProcessGroup, timeout: datetime.timedelta) -> None:
        self._pg, self._timeout = group, timeout

    def wait(self, work: dist.Work) -> None:
        """Wait for a transfer step, at most the timeout (then gloo fails it and closes the pair)."""
        work.wait(self._timeout)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.wait(dist.isend(tensor, dst, group=self._pg, tag=tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        self.wait(dist.irecv(tensor, src, group=self._pg, tag=tag))

    def send_bytes(self, data: bytes, dst: int, tag: int) -> None:
        self.send(torch.tensor([len(data)], dtype=torch.int64), dst, tag)
        self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, tag)

    def recv_bytes(self, src: int, tag: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        self.recv(size, src, tag)
        out = torch.empty(int(size.item()), dtype=torch.uint8)
        self.recv(out, src, tag)
        return out.numpy().tobytes()

    def reply(self, text: str, dst: int, tag: int) -> None:
        """A fixed-size answer: ``ok`` or the reason of a refusal, truncated to fit."""
        buf = torch.zeros(_REPLY_BYTES, dtype=torch.uint8)
        data = text.encode()[: _REPLY_BYTES - 1]
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.send(buf, dst, tag)

    def answer(self, src: int, tag: int) -> str:
        buf = torch.zeros(_REPLY_BYTES, dtype=torch.uint8)
        self.recv(buf, src, tag)
        return buf.numpy().tobytes().rstrip(b"\0").decode(errors="replace")
