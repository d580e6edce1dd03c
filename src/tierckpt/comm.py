"""Coordination over torch.distributed collectives — no extra servers.

:class:`Comm` wraps a process group (the default one unless another is passed) and degrades to a
single-process no-op when torch.distributed is not initialized or ``group="self"`` asks for this process alone. :meth:`Comm.agree` is how ranks
share failures: a step that fails on one rank makes every rank raise, naming the failing ranks,
instead of leaving the others blocked in the next collective.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, Union

import numpy as np
import torch
import torch.distributed as dist

from tierckpt import errors
from tierckpt.errors import CheckpointError, CollectiveError

logger = logging.getLogger("tierckpt")

OBJECT_SLOT_BYTES = 64 << 10
""":meth:`Comm.all_gather_object` gathers objects that pickle to less than this in one collective."""
GATHER_SLOTS_BYTES = 4 << 20
"""... with smaller slots in large groups, so that one rank receives at most this much in the first round."""
STAR_GATHER_MAX_RANKS = 64
"""Over gloo, groups of at most this many ranks all-gather objects as a gather to their first rank and a
broadcast of every slot (gloo's is a binomial tree): ``1 + log2(world_size)`` steps where gloo's all-gather is a
ring of ``world_size - 1`` (8 ranks on the 2-core test VM: 2-3 ms against 10-12 ms per all-gather, 0.3-0.4 ms
of CPU per rank against 0.7-1.3). Larger groups keep the ring: each of its steps moves one slot, each step of
the tree all of them."""
STAR_GATHER_BYTES = 256 << 10
"""... and the slots of such a gather are smaller (at most this much in all, 32 KiB a rank at 8 ranks, 4 KiB at
64): the tree's steps move every slot, so a larger object takes a second round rather than every object
carrying padding."""
_LENGTH = np.dtype("<i8")

SELF = "self"
"""``group="self"``: this process alone, with no collective, whatever the default process group is: a
rank-local save or load (a trainer that checkpoints on rank 0 only, e.g. Lightning under DDP)."""
Group = Union[dist.ProcessGroup, Literal["self"], None]
"""What ``group=`` accepts: a process group, :data:`SELF`, or ``None`` for the default group."""

T = TypeVar("T")
K = TypeVar("K")
S = TypeVar("S")


class Comm:
    """The ranks taking part in one save or load."""

    def __init__(self, group: Group = None) -> None:
        if isinstance(group, str):
            if group != SELF:
                raise CheckpointError(
                    f"group={group!r}: pass a torch.distributed ProcessGroup, None (the default group) or "
                    f"{SELF!r} (this process alone, a rank-local save or load)"
                )
            self.distributed, self.group, self.rank, self.world_size, self.backend = False, None, 0, 1, "none"
            return
        self.distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not self.distributed:
            raise CheckpointError("a process group was passed but torch.distributed is not initialized")
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.backend = dist.get_backend(group) if self.distributed else "none"

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order. Pickled, in one all-gather of a fixed slot per rank when
        every rank's fits (:data:`OBJECT_SLOT_BYTES`), else a second one of the largest size: torch's
        ``all_gather_object`` always takes two (the sizes, then the data), and the loader's and saver's
        agreements are small."""
        if self.world_size == 1:
            return [obj]
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        budget = STAR_GATHER_BYTES if self._star_gather() else GATHER_SLOTS_BYTES
        slot = max(_LENGTH.itemsize + 1024, min(OBJECT_SLOT_BYTES, budget // self.world_size))
        try:
            first = self._gather_slots(data, slot, with_length=True)
            sizes = [int(row[: _LENGTH.itemsize].view(_LENGTH)[0]) for row in first]
            if max(sizes) <= slot - _LENGTH.itemsize:
                return [pickle.loads(row[_LENGTH.itemsize : _LENGTH.itemsize + n]) for row, n in zip(first, sizes)]
            second = self._gather_slots(data, max(sizes), with_length=False)
        except RuntimeError as exc:
            raise CollectiveError(f"all_gather_object failed on rank {self.rank}: {exc}") from exc
        return [pickle.loads(row[:n]) for row, n in zip(second, sizes)]

    def _gather_slots(self, data: bytes, slot: int, *, with_length: bool) -> list[np.ndarray]:
        """All-gather one slot of ``slot`` bytes per rank holding ``data`` (after its length, with
        ``with_length``; cut off when it does not fit); every rank's slot, in rank order."""
        send = torch.zeros(slot, dtype=torch.uint8)
        view = send.numpy()
        at = 0
        if with_length:
            view[: _LENGTH.itemsize].view(_LENGTH)[0] = len(data)
            at = _LENGTH.itemsize
        fits = min(len(data), slot - at)
        view[at : at + fits] = np.frombuffer(data, dtype=np.uint8, count=fits)
        device = self._device()
        out = torch.empty(slot * self.world_size, dtype=torch.uint8, device=device)
        if self._star_gather():
            first = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.gather(send, list(out.chunk(self.world_size)) if self.rank == 0 else None, dst=first, group=self.group)
            dist.broadcast(out, src=first, group=self.group)
        else:
            all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the older name
            all_gather(out, send.to(device), group=self.group)
        return list(out.cpu().numpy().reshape(self.world_size, slot))

    def _star_gather(self) -> bool:
        """Whether this group all-gathers as a gather and a broadcast (:data:`STAR_GATHER_MAX_RANKS`)."""
        return self.backend == "gloo" and self.world_size <= STAR_GATHER_MAX_RANKS

    def broadcast_object(self, obj: T | None, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` on every rank (``src`` keeps its own). Pickled, in one broadcast of a
        fixed slot when it fits (:data:`OBJECT_SLOT_BYTES`), else a second one of the rest: torch's
        ``broadcast_object_list`` always takes two (the sizes, then the data), and what the loader and the
        saver broadcast is small."""
        if self.world_size == 1:
            return obj  # type: ignore[return-value]
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        device = self._device()
        head = OBJECT_SLOT_BYTES - _LENGTH.itemsize
        slot = torch.zeros(OBJECT_SLOT_BYTES, dtype=torch.uint8)
        data = b""
        if self.rank == src:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            view = slot.numpy()
            view[: _LENGTH.itemsize].view(_LENGTH)[0] = len(data)
            fits = min(len(data), head)
            view[_LENGTH.itemsize : _LENGTH.itemsize + fits] = np.frombuffer(data, dtype=np.uint8, count=fits)
        try:
            sent = slot.to(device)
            dist.broadcast(sent, src=src_global, group=self.group)
            first = sent.cpu().numpy()
            size = int(first[: _LENGTH.itemsize].view(_LENGTH)[0])
            tail = b""
            if size > head:  # the rest, whose size every rank now knows
                more = (torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8) if self.rank == src
                        else torch.empty(size - head, dtype=torch.uint8)).to(device)
                dist.broadcast(more, src=src_global, group=self.group)
                tail = more.cpu().numpy().tobytes()
        except RuntimeError as exc:
            raise CollectiveError(f"broadcast from rank {src} failed on rank {self.rank}: {exc}") from exc
        if self.rank == src:
            return obj  # type: ignore[return-value]
        return pickle.loads(first[_LENGTH.itemsize : _LENGTH.itemsize + min(size, head)].tobytes() + tail)

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

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        try:
            dist.gather_object(obj, out, dst=dst, group=self.group)
        except RuntimeError as exc:
            raise CollectiveError(f"gather failed on rank {self.rank}: {exc}") from exc
        return out

    def broadcast(self, obj: T | None) -> T:
        return self.broadcast_object(obj, 0)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if ``error`` is set on any rank; else return on every rank."""
        self.raise_failures(error, self.all_gather_object(describe_error(error)), what)

    def run_agreed(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` on every rank; if it failed on any rank, raise on all of them (none is left waiting)."""
        result, error = attempt(fn)
        self.agree(error, what)
        return result  # type: ignore[return-value]

    def exchange_agreed(
        self, fn: Callable[[], tuple[K, S]], what: str, same: tuple[str, Any] | None = None,
    ) -> tuple[K, list[S]]:
        """Run ``fn`` -> ``(kept, shared)`` on every rank; return this rank's ``kept`` and every rank's
        ``shared``, all-gathered in the same collective that agrees on failures (raised on every rank).

        ``same``: ``(name, value)`` that every rank must pass equal (the URI of a save or load), carried by
        the same collective and checked first, since a disagreement explains any other failure."""
        result, error = attempt(fn)
        kept, shared = result if result is not None else (None, None)
        return kept, self.share_attempt(shared, error, what, same)  # type: ignore[return-value]

    def share_attempt(
        self, shared: S | None, error: BaseException | None, what: str, same: tuple[str, Any] | None = None,
    ) -> list[S]:
        """Every rank's ``shared`` of a step each rank already attempted (``error``: how it failed here),
        in one all-gather that agrees on failures as :meth:`exchange_agreed` does."""
        gathered = self.all_gather_object((shared, describe_error(error), None if same is None else same[1]))
        if same is not None:
            check_same_on_every_rank(same[0], [value for _, _, value in gathered], what)
        self.raise_failures(error, [message for _, message, _ in gathered], what)
        return [s for s, _, _ in gathered]  # type: ignore[misc]

    def raise_failures(self, error: BaseException | None, messages: list[str | None], what: str) -> None:
        """Raise on this rank if any rank failed (``messages[r]``: :func:`describe_error` of rank ``r``'s
        ``error``, ``None`` if it did not fail); ``error`` is this rank's own, raised as it is alone."""
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if not failed:
            return
        if error is not None and self.world_size == 1:
            raise error
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
        exc_type = type(error) if isinstance(error, CheckpointError) else _shared_type([m for _, m in failed])
        try:
            raised = exc_type(f"{what} failed on {len(failed)} of {self.world_size} ranks — {detail}")
        except TypeError:
            raised = CheckpointError(f"{what} failed on {len(failed)} of {self.world_size} ranks — {detail}")
        raise raised from error

    def all_to_all_bytes(self, send: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int]) -> list[torch.Tensor]:
        """Send ``send``'s consecutive segments of ``send_sizes`` bytes to ranks 0, 1, ...; return what each sent here."""
        device = self._device()
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        try:
            dist.all_to_all_single(out, send.to(device), list(recv_sizes), list(send_sizes), group=self.group)
        except RuntimeError as exc:
            raise CollectiveError(f"all_to_all failed on rank {self.rank}: {exc}") from exc
        return list(torch.split(out.cpu(), list(recv_sizes)))

    def send_recv(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Point to point: each of ``sends`` (group rank, contiguous tensor) goes to its rank, each of
        ``recvs`` (group rank, contiguous tensor) is filled by one message from its rank. Between two
        ranks, messages are matched in the order both sides list them."""
        ops = [dist.P2POp(dist.irecv, t, self._global(r), self.group) for r, t in recvs]
        ops += [dist.P2POp(dist.isend, t, self._global(r), self.group) for r, t in sends]
        if not ops:
            return
        try:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        except RuntimeError as exc:
            raise CollectiveError(f"point-to-point exchange failed on rank {self.rank}: {exc}") from exc

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


SHOWN_VALUES = 4
"""A disagreement names at most this many distinct values (a rank-dependent path gives one per rank)."""


def check_same_on_every_rank(name: str, values: Sequence[Any], what: str) -> None:
    """Raise on every rank (each holds the same all-gathered ``values``, rank ``r``'s at ``values[r]``)
    when the ranks passed different values of ``name`` to ``what``; the message names them and their ranks."""
    distinct = list(dict.fromkeys(values))
    if len(distinct) <= 1:
        return
    shown = "; ".join(
        f"{value!r} on {_ranks([r for r, v in enumerate(values) if v == value])}" for value in distinct[:SHOWN_VALUES]
    )
    more = f"; and {len(distinct) - SHOWN_VALUES} other value(s)" if len(distinct) > SHOWN_VALUES else ""
    raise CheckpointError(
        f"{what}: ranks disagree on the {name}: {shown}{more}. Every rank of the group must pass the same {name} "
        "(a rank-dependent path is the usual cause); nothing was read or written"
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[:8]}" + (" ..." if len(ranks) > 8 else "")


def attempt(fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """``(fn(), None)``, or ``(None, error)`` when it raised: a rank's part of a step, kept to share."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - shared with every rank, then raised
        return None, exc


def _shared_type(messages: list[str]) -> type[CheckpointError]:
    """The error type every failing rank reported (from :func:`describe_error`), so that the ranks
    that did not fail raise the same kind (corrupt, transient, not found); else :class:`CheckpointError`."""
    names = {m.split(":", 1)[0] for m in messages}
    found = getattr(errors, names.pop(), None) if len(names) == 1 else None
    return found if isinstance(found, type) and issubclass(found, CheckpointError) else CheckpointError


def describe_error(error: BaseException | None) -> str | None:
    """``"TypeName: message"`` — how one rank's failure is reported to the others."""
    return None if error is None else f"{type(error).__name__}: {error}"


class StoreCoordinator:
    """Gather-to-rank-0 and broadcast for background work, through the group's key-value store.

    A background save must not issue collectives: they would race the training loop's own
    collectives on the same group, and a second process group created on the fly can collide with
    groups the application creates. The store (the TCPStore every process group rendezvoused
    through) is independent of both. Keys live under ``tierckpt/<namespace>/`` and are deleted once
    read, so nothing accumulates over many saves.
    """

    def __init__(self, comm: Comm, namespace: str) -> None:
        self.rank, self.world_size = comm.rank, comm.world_size
        self.prefix = f"tierckpt/{namespace}"
        self.timeout = datetime.timedelta(seconds=comm.timeout_s()) if comm.world_size > 1 else None
        self.store = dist.distributed_c10d._get_default_store() if comm.world_size > 1 else None

    def gather(self, obj: T) -> list[T] | None:
        if self.store is None:
            return [obj]
        self.store.set(f"{self.prefix}/gather/{self.rank}", pickle.dumps(obj))
        if self.rank != 0:
            return None
        keys = [f"{self.prefix}/gather/{r}" for r in range(self.world_size)]
        self._wait(keys, "gathering the save's records")
        out = [pickle.loads(self.store.get(k)) for k in keys]
        for key in keys:
            self.store.delete_key(key)
        return out

    def broadcast(self, obj: T | None) -> T:
        """Rank 0's ``obj`` on every rank. Rank 0 returns only once every other rank has read it: rank 0
        serves the store, and a process that exits right after its save committed must not take the
        outcome away from ranks that have not read it yet (they would report a committed save as failed).
        """
        if self.store is None:
            return obj  # type: ignore[return-value]
        key = f"{self.prefix}/outcome"
        if self.rank == 0:
            self.store.set(key, pickle.dumps(obj))
            try:
                self.store.wait([f"{key}/read"], self.timeout)
            except RuntimeError as exc:  # a rank died after reporting its records: its own process is gone
                logger.warning("not every rank read the outcome of %s within the timeout: %s", self.prefix, exc)
            for name in (key, f"{key}/readers", f"{key}/read"):
                self.store.delete_key(name)
            return obj  # type: ignore[return-value]
        self._wait([key], "waiting for rank 0's commit")
        value = pickle.loads(self.store.get(key))
        try:
            if self.store.add(f"{key}/readers", 1) == self.world_size - 1:  # the last reader tells rank 0
                self.store.set(f"{key}/read", b"1")
        except RuntimeError as exc:  # rank 0 gave up waiting and left: the outcome is known all the same
            logger.warning("could not tell rank 0 that the outcome of %s was read: %s", self.prefix, exc)
        return value

    def _wait(self, keys: list[str], what: str) -> None:
        try:
            self.store.wait(keys, self.timeout)
        except RuntimeError as exc:  # the store raises DistStoreError (a RuntimeError) on timeout
            raise CollectiveError(f"{what}: not every rank of the group reported in time ({exc})") from exc
