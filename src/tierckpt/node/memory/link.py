"""``MemoryLink``: the node memory tier at the top of a URI's storage chain.

:func:`tierckpt.store.open_store` puts it over whatever chain is below (the node disk cache in front of
a remote, or the URI's own scheduled backend) when :func:`tierckpt.store.memory_config_for` says so.

Writes of a checkpoint generation (keys ``<generation>/...``) go into the URI's
:class:`~.memory.MemoryTier` first, each after :meth:`~.memory.NodeMemory.admit` made room for its bytes
(a streamed file admits each chunk before writing it, so the budget is checked against what really
arrives). A generation that does not fit raises :class:`~.config.MemoryTierFullError`, or with
``OnFull.FALLBACK`` goes to the chain below from then on (a file being streamed moves there with what
it had written). Every file put into the tier is then copied down in the background (the
*write-down*, logged in :mod:`.downlog`); a ``COMMIT`` is committed in the tier, and committed below
only after every file it depends on (``after=``) is there, as a compare-and-swap against the base
the saver gave (``expected=``). Other keys pass straight through to the chain below. A generation
the saver marked :meth:`~MemoryLink.keep_in_memory` (``persist=False``) is not written down at all:
it stays in the tier (and on the peers) until ``sync`` takes it down, eviction may drop it, and it
must fit (:class:`~.config.MemoryTierFullError` whatever ``on_full`` says).

Reads take a generation's file from the tier when it is complete there and the generation is
committed in the tier, sealed there (a manifest lists it, with its size checked), or written by this
link; otherwise from below. ``COMMIT`` is the newer (by commit sequence) of the tier's and the
chain below's, the tier's alone while the chain below cannot be read. ``delete``/``delete_prefix`` apply
to both; the chain below's part waits for a pending ``COMMIT`` write-down, so the chain below never
names a generation that is gone.

Durability (:class:`tierckpt.node.durability.Durable`): ``wait_durable`` waits for the write-down and then for
the chain below's own durability; ``status`` reports each level; ``sync`` copies down what the tier
holds that the chain below lacks, including what a dead process left.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from tierckpt.backends.bounded import MAX_RECORD_BYTES, oversized, read_capped
from tierckpt.backends.base import (
    UNCONDITIONAL, Backend, Capabilities, Link, ObjectWriter, Segment, Unconditional,
)
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, TransientStorageError
from tierckpt.native.keys import validate_key
from tierckpt.native.layout import COMMIT
from tierckpt.node.host import node_id
from tierckpt.node.memory.config import MemoryConfig, MemoryTierFullError, OnFull
from tierckpt.node.durability import durability_of
from tierckpt.node.face import Spare
from tierckpt.node.nodeview import check_node_view
from tierckpt.node.memory.downlog import MEMORY_ONLY, DownLog, durable_copies, generation_of
from tierckpt.node.status import LinkStatus
from tierckpt.node.memory.linkstatus import link_status
from tierckpt.node.memory.linkwriter import LinkWriter
from tierckpt.node.memory.mapped import MappedFile, SpareFile, is_spare, open_mapped, prepare_in_background, take_spare
from tierckpt.node.memory.memory import MemoryTier
from tierckpt.node.memory.nodememory import NodeMemory
from tierckpt.node.memory.roots import commit_seq, record_of, tier_uri
from tierckpt.node.memory.withdraw import drop_uncommitted, withdraw
from tierckpt.node.memory.nospace import is_no_space, no_space_error
from tierckpt.node.memory.linkdeletes import delete_from
from tierckpt.node.memory.writedown import WriteDown

log = logging.getLogger(__name__)

_CREDIT_SHARE = 16
_CREDIT_MAX = 1 << 30
"""After an admission, a process may write up to 1/16 of the tier's free room (at most 1 GiB) of the same
generation before the next check (a check walks the node's tier); 16 processes writing at once at most
fill the free room, so the budget holds for up to 16 writers of a node."""


class MemoryLink(Link):
    """The node memory tier in front of ``below`` (see the module docstring)."""

    schedules_itself = True
    """Its calls reach the chain below, which schedules its own remote calls."""

    def __init__(self, below: Backend, config: MemoryConfig, uri: str | None = None) -> None:
        super().__init__(below)
        """The chain this link wraps (node disk cache + remote, or the URI's scheduled backend)."""
        self.memory = NodeMemory(config)
        """The node's whole memory tier directory (admission and eviction across URIs)."""
        self.memory_tier: MemoryTier = self.memory.tier(tier_uri(uri or below.root_uri))
        """This URI's files in the node memory tier."""
        self.capabilities = Capabilities()  # a read may be served by the tier or by the chain below
        self.origin = node_id()
        self.down = DownLog(self.memory_tier)
        self.writedown = WriteDown(self)
        self._written: set[str] = set()
        self._readable: set[str] = set()
        self._credit: dict[str, int] = {}
        self.spare_wanted: dict[str, int] = {}
        """Keys of async saves that found no spare -> the size of the spare to make once they are written."""
        self.fallback: dict[str, str] = {}
        """Generations written to the chain below because the tier was full -> why."""
        self.memory_only: set[str] = set()
        """Generations this process saves with ``persist=False`` (:meth:`keep_in_memory`)."""

    def __repr__(self) -> str:
        return f"MemoryLink({self.below!r}, tier={self.memory_tier.home!r})"

    # -- admission -------------------------------------------------------------------------------------
    async def admit(self, generation: str, nbytes: int) -> bool:
        """Make room for ``nbytes`` more of ``generation``; ``False``: it falls back to the chain below."""
        if generation in self.fallback:
            return False
        credit = self._credit.get(generation, 0)
        if nbytes <= credit:
            self._credit[generation] = credit - nbytes
            return True

        def admit() -> bool:
            admission = self.memory.admit(self.memory_tier.uri, generation, nbytes, lambda: durable_copies(self.memory))
            if not admission.fits and generation in self.memory_only:
                raise MemoryTierFullError(
                    f"{self.memory_tier.uri} {generation} was saved with persist=False (the node memory tier only) "
                    f"and does not fit: {admission.reason}. Save it with persist=True, or raise the budget"
                )
            if not admission.fits:
                self.fallback[generation] = admission.reason or "the memory tier is full"
                log.warning("%s %s goes to the next tier: %s", self.memory_tier.uri, generation, admission.reason)
                return False
            free = self.memory.config.budget_bytes - admission.used_bytes - nbytes
            self._credit[generation] = max(0, min(free // _CREDIT_SHARE, _CREDIT_MAX))
            return True

        return await asyncio.to_thread(admit)

    def fall_back(self, generation: str, what: str, exc: BaseException) -> bool:
        """The tier's file system refused to write ``what`` of ``generation`` (``exc``). ``False``: it is not
        a lack of space (raise ``exc``). With ``TIERCKPT_MEMORY_FULL=fallback`` the generation goes to the
        chain below from now on (``True``); otherwise, or when it must stay in memory (``persist=False``),
        :class:`~.config.MemoryTierFullError` names the tier, its size and the settings."""
        if not is_no_space(exc):
            return False
        error = no_space_error(self.memory.config, what, exc)
        if self.memory.config.on_full is not OnFull.FALLBACK or generation in self.memory_only:
            raise error from exc
        self.fallback[generation] = str(error)
        log.warning("%s %s goes to the next tier: %s", self.memory_tier.uri, generation, error)
        return True

    def keep_in_memory(self, generation: str) -> bool:
        """Hold ``generation`` in the node memory tier (and on the peers) only: none of its files, nor its
        ``COMMIT``, is written down until a ``sync``. Logged for the node's other processes, ``status`` and
        eviction (which may drop it like a copy held below). Called by the saver before any file is written."""
        self.memory_only.add(generation)
        self.down.append(generation, MEMORY_ONLY, generation)
        return True

    def wrote(self, key: str) -> None:
        """``key`` is complete in the tier: remember it and start copying it down (unless memory-only)."""
        self._written.add(key)
        if generation_of(key) not in self.memory_only:
            self.writedown.file(key)
        wanted = self.spare_wanted.pop(key, None)
        if wanted is not None:
            prepare_in_background(self, wanted)

    def forget_keys(self, generation: str) -> None:
        """Forget which keys of ``generation`` this link wrote or found readable (it left the tier)."""
        for keys in (self._written, self._readable):
            keys.difference_update({key for key in keys if generation_of(key) == generation})

    def forget_prefix(self, what: str, *, exact: bool = False) -> None:
        """Forget what this link remembers of the key ``what`` (``exact``) or of every key under it."""
        if exact:
            self._written.discard(what)
            self._readable.discard(what)
        else:
            self._written = {k for k in self._written if not k.startswith(what)}
            self._readable = {k for k in self._readable if not k.startswith(what)}

    # -- writes ----------------------------------------------------------------------------------------
    async def put(self, key: str, data: bytes | memoryview) -> None:
        generation = generation_of(validate_key(key))
        if generation is None or not await self.admit(generation, memoryview(data).nbytes):
            await self.below.put(key, data)
            return
        try:
            await self.memory_tier.put(key, data)
        except (OSError, CheckpointError) as exc:
            if not self.fall_back(generation, self.memory_tier.uri_of(key), exc):
                raise
            await self.below.put(key, data)
            return
        self.wrote(key)

    async def open_writer(self, key: str) -> ObjectWriter:
        generation = generation_of(validate_key(key))
        if generation is None or generation in self.fallback:
            return await self.below.open_writer(key)
        incoming = await asyncio.to_thread(self.memory_tier.receive, key)
        return LinkWriter(self, key, generation, incoming)

    def take_spare(self, nbytes: int) -> Spare | None:
        """This process's spare file of the tier, for a snapshot to be copied into (see :mod:`.mapped`)."""
        return take_spare(self, nbytes)

    def mapped_writer(self, key: str, nbytes: int, spare: Spare | None) -> MappedFile | None:
        """``spare`` (from :meth:`take_spare`) made the tier's file of ``key``, or ``None``: use
        :meth:`open_writer` (and a spare is prepared for the next save once ``key`` is written)."""
        return open_mapped(self, validate_key(key), nbytes, cast("SpareFile | None", spare))

    def want_spare(self, key: str, nbytes: int) -> None:
        """A spare of ``nbytes`` is prepared in the background once ``key`` is written (see :mod:`.mapped`)."""
        self.spare_wanted[validate_key(key)] = nbytes

    async def commit(
        self, key: str, data: bytes | memoryview, *, expected: bytes | None | Unconditional = UNCONDITIONAL,
        after: Mapping[str, int | None] | None = None,
    ) -> None:
        """``COMMIT`` of a generation written into the tier: a compare-and-swap against this node's view
        (:meth:`get`), committed in the tier, written down behind. Anything else goes below."""
        validate_key(key)
        data = bytes(data)
        record = record_of(data) if key == COMMIT else None
        if record is None:
            await self.below.commit(key, data, expected=expected, after=after)
            return
        if record.generation in self.fallback or not self.memory_tier.keys_of(record.generation):
            # Written to the chain below (the tier was full): its files that did reach the tier go first.
            await self.writedown.wait(record.generation, None, through_outage=True, commit=False)
            await self.writedown.commit_below(data, record, expected, after)
            return
        await check_node_view(self.uri_of(key), expected, lambda: self._get_or_none(COMMIT))
        tier_current = await asyncio.to_thread(self._tier_commit_bytes)
        await self.memory_tier.commit(COMMIT, data, expected=tier_current)
        if record.generation in self.memory_only:
            await self.seal(record.generation)  # what the write-down of the commit does first
            self.writedown.held_in_memory(record.generation)
        else:
            self.writedown.commit(data, record, expected, after)

    async def seal(self, generation: str) -> None:
        """Record the manifest of the node's files of ``generation`` (all ranks wrote them before the commit),
        so a restart and eviction see it whole."""
        try:
            await asyncio.to_thread(self.memory_tier.seal, generation, origin=self.origin)
        except CheckpointError as exc:  # reads then go below for other processes' files; nothing is lost
            log.warning("cannot seal %s %s in the memory tier: %s", self.memory_tier.uri, generation, exc)

    # -- reads -----------------------------------------------------------------------------------------
    def _tier_commit_bytes(self) -> bytes | None:
        try:
            return read_capped(self.memory_tier.path_of(COMMIT), MAX_RECORD_BYTES)
        except FileNotFoundError:
            return None

    def _in_tier(self, key: str) -> bool:
        """Whether a read of ``key`` is served by the tier (see the module docstring); a yes is remembered
        (a file of a committed generation never changes; a read that finds it gone goes below)."""
        if key in self._readable:
            return True
        generation = generation_of(key)
        if generation is None or not os.path.isfile(self.memory_tier.path_of(key)):
            return False
        if key in self._written:
            return True
        held = self.memory_tier.held(generation).get(key)
        if held is not None:
            readable = os.path.getsize(self.memory_tier.path_of(key)) == held.size
        else:
            record = self.memory_tier.committed()
            readable = record is not None and record.generation == generation
        if readable:
            self._readable.add(key)
        return readable

    async def _read(self, key: str, tier_read: Any, below_read: Any) -> Any:
        """``tier_read()`` when the tier serves ``key``, else (or when it was evicted meanwhile) ``below_read()``."""
        if await asyncio.to_thread(self._in_tier, key):
            try:
                return await tier_read()
            except CheckpointNotFoundError:
                self._readable.discard(key)
                self._written.discard(key)
        return await below_read()

    async def _get_or_none(self, key: str) -> bytes | None:
        try:
            return await self.get(key)
        except CheckpointNotFoundError:
            return None

    async def _commit_view(self) -> bytes:
        """The newer ``COMMIT`` of the tier and the chain below (the tier's while below is unreachable);
        both read at once (an async save's call waits for this on rank 0)."""
        below = asyncio.ensure_future(self.below.get_capped(COMMIT, MAX_RECORD_BYTES))
        try:
            mine = await asyncio.to_thread(self._tier_commit_bytes)
        except BaseException:
            below.cancel()
            raise
        try:
            theirs: bytes | None = await below
        except CheckpointNotFoundError:
            theirs = None
        except TransientStorageError:
            if mine is None:
                raise
            return mine
        if mine is None or theirs is None:
            if mine is None and theirs is None:
                raise CheckpointNotFoundError(f"no object at {self.uri_of(COMMIT)} (neither in the node memory tier nor below)")
            return mine if theirs is None else theirs  # type: ignore[return-value]
        return mine if commit_seq(mine) > commit_seq(theirs) else theirs

    async def get(self, key: str) -> bytes:
        if validate_key(key) == COMMIT:
            return await self._commit_view()
        return await self._read(key, lambda: self.memory_tier.get(key), lambda: self.below.get(key))

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        return await self._read(validate_key(key), lambda: self.memory_tier.get_range(key, start, end),
                                lambda: self.below.get_range(key, start, end))

    async def read_into(self, key: str, start: int, out: memoryview) -> None:
        await self._read(validate_key(key), lambda: self.memory_tier.read_into(key, start, out),
                         lambda: self.below.read_into(key, start, out))

    async def read_runs(
        self, key: str, offsets: Any, run_bytes: int, out: memoryview, digest: Callable[[memoryview], int] | None = None,
    ) -> list[int] | None:
        return await self._read(validate_key(key), lambda: self.memory_tier.read_runs(key, offsets, run_bytes, out, digest),
                                lambda: self.below.read_runs(key, offsets, run_bytes, out, digest))

    async def read_segments(
        self, key: str, segments: Sequence[Segment], digest: Callable[[memoryview], int] | None = None,
    ) -> list[list[int] | None]:
        return await self._read(validate_key(key), lambda: self.memory_tier.read_segments(key, segments, digest),
                                lambda: self.below.read_segments(key, segments, digest))

    async def exists(self, key: str) -> bool:
        if validate_key(key) == COMMIT:
            return await self._get_or_none(COMMIT) is not None
        return await asyncio.to_thread(self._in_tier, key) or await self.below.exists(key)

    async def get_capped(self, key: str, cap: int) -> bytes:
        """``COMMIT`` in one read (this link reads it capped); anything else as the base does."""
        if validate_key(key) != COMMIT:
            return await super().get_capped(key, cap)
        data = await self.get(COMMIT)
        if len(data) > cap:
            raise oversized(self.uri_of(key), len(data), cap)
        return data

    async def size(self, key: str) -> int:
        if validate_key(key) == COMMIT:
            return len(await self.get(COMMIT))
        if await asyncio.to_thread(self._in_tier, key):
            return await self.memory_tier.size(key)
        return await self.below.size(key)

    async def list(self, prefix: str = "") -> list[str]:
        """The union of the tier's generation files and the chain below's keys under ``prefix``."""
        below = await self.below.list(prefix)
        mine = [k for k in await self.memory_tier.list(prefix) if generation_of(k) is not None and not is_spare(k)]
        return sorted(set(below) | set(mine))

    # -- deletes (.linkdeletes) ---------------------------------------------------------------------------
    async def delete(self, key: str) -> None:
        validate_key(key)
        await delete_from(self, key, exact=True)

    async def delete_prefix(self, prefix: str) -> None:
        await delete_from(self, prefix, exact=False)

    # -- durability (tierckpt.store.Durable) -----------------------------------------------------------
    async def wait_durable(self, generation: str | None = None, timeout_s: float | None = None, *,
                           through_outage: bool = True) -> None:
        """Wait until the write-down (of ``generation``) is done, then for the chain below's durability."""
        await self.writedown.wait(generation, timeout_s, through_outage=through_outage)
        durable = durability_of(self.below)
        if durable is not None:
            await durable.wait_durable(generation, timeout_s, through_outage=through_outage)

    async def drop_uncommitted(self, generation: str) -> None:
        """This node's part of a failed save leaves the tier (see :func:`.withdraw.drop_uncommitted`)."""
        await drop_uncommitted(self, generation)

    async def withdraw(self, generation: str, record: bytes, base: bytes | None) -> list[str] | None:
        """Take back a commit that was not written down (:class:`tierckpt.store.Revocable`; :mod:`.withdraw`)."""
        return await withdraw(self, generation, record, base)

    async def status(self) -> LinkStatus:
        """Each level of the newest checkpoint (see :class:`~.linkstatus.LinkStatus`)."""
        return await link_status(self)

    async def sync(self, timeout_s: float | None = None) -> None:
        """Copy down what the tier holds and the chain below lacks (left by this or a dead process),
        ``COMMIT`` last, then wait for the chain below's own sync."""
        await self.writedown.sync(timeout_s)
        durable = durability_of(self.below)
        if durable is not None:
            await durable.sync(timeout_s)

    async def close(self) -> None:
        """Nothing to release: write-downs keep running in the background (see :meth:`wait_durable`)."""
