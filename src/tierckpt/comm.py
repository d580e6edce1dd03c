"""Coordination over torch.distributed collectives — no extra servers.

:class:`Comm` wraps a process group (the default one unless another is passed) and degrades to a
single-process no-op when torch.distributed is not initialized. :meth:`Comm.agree` is how ranks
share failures: a step that fails on one rank makes every rank raise, naming the failing ranks,
instead of leaving the others blocked in the next collective.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import CheckpointError, CollectiveError

T = TypeVar("T")


class Comm:
    """The ranks taking part in one save or load."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not self.distributed:
            raise CheckpointError("a process group was passed but torch.distributed is not initialized")
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.backend = dist.get_backend(group) if self.distributed else "none"

    def all_gather_object(self, obj: T) -> list[T]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            raise CollectiveError(f"all_gather_object failed on rank {self.rank}: {exc}") from exc
        return out

    def broadcast_object(self, obj: T | None, src: int = 0) -> T:
        if self.world_size == 1:
            return obj  # type: ignore[return-value]
        box = [obj]
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        try:
            dist.broadcast_object_list(box, src=src_global, group=self.group)
        except RuntimeError as exc:
            raise CollectiveError(f"broadcast from rank {src} failed on rank {self.rank}: {exc}") from exc
        return box[0]

    def timeout_s(self) -> float:
        """The group's own collective timeout (what torch.distributed was initialized with)."""
        group = self.group if self.group is not None else dist.group.WORLD
        try:
            return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            return 1800.0

    def check_in(self, what: str, timeout_s: float | None = None) -> None:
        """Wait until every rank has arrived at ``what``; name the ranks that did not, after ``timeout_s``.

        Uses gloo's monitored barrier, which reports the missing ranks instead of a bare timeout;
        ``timeout_s`` defaults to the group's own timeout.
        Other backends (NCCL) skip the check and rely on their own timeouts.
        """
        if self.world_size == 1 or self.backend != "gloo":
            return
        timeout_s = self.timeout_s() if timeout_s is None else timeout_s
        try:
            dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as exc:
            missing = re.findall(r"\d+", str(exc).split("failed to pass monitoredBarrier")[0].rsplit("Ranks", 1)[-1])
            who = f"ranks {', '.join(missing)} of the group" if missing and "monitoredBarrier" in str(exc) else "some rank"
            raise CollectiveError(
                f"{what}: {who} did not arrive within {timeout_s:g}s (rank {self.rank} waited); every rank of the "
                f"group must call it. Cause: {exc}"
            ) from exc

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if ``error`` is set on any rank; else return on every rank."""
        messages = self.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if not failed:
            return
        if error is not None and self.world_size == 1:
            raise error
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
        exc_type = type(error) if isinstance(error, CheckpointError) else CheckpointError
        try:
            raised = exc_type(f"{what} failed on {len(failed)} of {self.world_size} ranks — {detail}")
        except TypeError:
            raised = CheckpointError(f"{what} failed on {len(failed)} of {self.world_size} ranks — {detail}")
        raise raised from error

    def all_to_all_bytes(self, send: Sequence[torch.Tensor], recv_sizes: Sequence[int]) -> list[torch.Tensor]:
        """Send ``send[r]`` (uint8, 1-D) to each rank ``r``; return what each rank sent here."""
        device = self._device()
        send_sizes = [int(t.numel()) for t in send]
        payload = torch.cat([t.reshape(-1) for t in send]) if send else torch.empty(0, dtype=torch.uint8)
        payload = payload.to(device)
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        try:
            dist.all_to_all_single(out, payload, list(recv_sizes), send_sizes, group=self.group)
        except RuntimeError as exc:
            raise CollectiveError(f"all_to_all failed on rank {self.rank}: {exc}") from exc
        out = out.cpu()
        return list(torch.split(out, list(recv_sizes)))

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
