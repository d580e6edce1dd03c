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

Durability (:class:`tierckpt.node.durability.Durable`), deletes below and ``withdraw`` are the write-back
link core's (:class:`~tierckpt.node.link.WriteBackLink`), over the tier's write-down log: ``wait_durable``
waits for the write-down and then for the chain below's own durability; ``sync`` copies down what the
tier's committed generation still owes the chain below, including what a dead process left; ``status``
reports each level (:meth:`MemoryLink.status`). This module answers the core's hooks.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from tierckpt.backends.bounded import MAX_RECORD_BYTES, oversized, read_capped
from tierckpt.backends.base import (
    UNCONDITIONAL, Backend, Capabilities, ObjectWriter, Segment, Unconditional,
)
from tierckpt.comm import describe_error
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, TransientStorageError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native.keys import validate_key
from tierckpt.native.layout import COMMIT, CommitRecord, is_generation, is_superseded, seq_of
from tierckpt.node.host import node_id
from tierckpt.node.runner import Entry
from tierckpt.node.memory.config import MemoryConfig, MemoryTierFullError, OnFull
from tierckpt.node.face import Spare
from tierckpt.node.link import SyncScope, Withdrawal, WriteBackLink, generation_name
from tierckpt.node.nodeview import check_node_view
from tierckpt.node.memory.commitbelow import CATCH_UP
from tierckpt.node.memory.downlog import MEMORY_ONLY, PERSIST, DownLog, durable_copies, generation_of, owed_copies
from tierckpt.node.status import LinkStatus, StoreStatus
from tierckpt.node.durability import durability_of
from tierckpt.node.levels import Level
from tierckpt.node.memory.incoming import IncomingFile
from tierckpt.node.memory.replica_record import recorded_level
from tierckpt.node.memory.mapped import MappedFile, SpareFile, is_spare, open_mapped, prepare_in_background, take_spare
from tierckpt.node.memory.memory import MemoryTier
from tierckpt.node.memory.nodememory import NodeMemory
from tierckpt.node.memory.roots import commit_seq, empty_tier, record_of, tier_uri
from tierckpt.node.memory.nospace import is_no_space, no_space_error
from tierckpt.node.memory.writedown import WriteDown, drop_tier

log = logging.getLogger(__name__)


class MemoryLink(WriteBackLink[Withdrawal]):
    """The node memory tier in front of ``below``, on the write-back link core (see the module docstring)."""

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
        self.journal = self.down
        self.writedown = WriteDown(self.memory_tier, self.down, below, self.origin, self.seal)
        self._written: set[str] = set()
        self._readable: set[str] = set()
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
        if self.memory.take_credit(nbytes):
            return True

        def admit() -> bool:
            admission = self.memory.admit(self.memory_tier.uri, generation, nbytes, lambda: durable_copies(self.memory),
                                          owed_below=lambda: owed_copies(self.memory, self.origin))
            if not admission.fits and generation in self.memory_only:
                raise MemoryTierFullError(
                    f"{self.memory_tier.uri} {generation} was saved with persist=False (the node memory tier only) "
                    f"and does not fit: {admission.reason}. Save it with persist=True, or raise the budget"
                )
            if not admission.fits:
                self.fallback[generation] = admission.reason or "the memory tier is full"
                log.warning("%s %s goes to the next tier: %s", self.memory_tier.uri, generation, admission.reason)
                return False
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
            prepare_in_background(self.memory, self.memory_tier, wanted)

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
        incoming = self.memory_tier.receive(key)
        return LinkWriter(self, key, generation, incoming)

    def take_spare(self, nbytes: int) -> Spare | None:
        """This process's spare file of the tier, for a snapshot to be copied into (see :mod:`.mapped`)."""
        return take_spare(self.memory_tier, nbytes)

    def mapped_writer(self, key: str, nbytes: int, spare: Spare | None) -> MappedFile | None:
        """``spare`` (from :meth:`take_spare`) made the tier's file of ``key``, or ``None``: use
        :meth:`open_writer` (and a spare is prepared for the next save once ``key`` is written)."""
        return open_mapped(self.memory, self.memory_tier, validate_key(key), nbytes, cast("SpareFile | None", spare),
                           fallback=self.fallback, spare_wanted=self.spare_wanted, wrote=self.wrote)

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
        tier_current = self._tier_commit_bytes()
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
            # A worker thread: a file no writer stamped is read whole for its CRC-32C (:mod:`.stamps`).
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
        if self._in_tier(key):
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
            mine = self._tier_commit_bytes()
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
        return self._in_tier(key) or await self.below.exists(key)

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
        if self._in_tier(key):
            return await self.memory_tier.size(key)
        return await self.below.size(key)

    async def list(self, prefix: str = "") -> list[str]:
        """The union of the tier's generation files and the chain below's keys under ``prefix``."""
        below = await self.below.list(prefix)
        mine = [k for k in await self.memory_tier.list(prefix) if generation_of(k) is not None and not is_spare(k)]
        return sorted(set(below) | set(mine))

    # -- deletes ---------------------------------------------------------------------------------------
    async def delete(self, key: str) -> None:
        validate_key(key)
        await self._delete(key, exact=True)

    async def delete_prefix(self, prefix: str) -> None:
        await self._delete(prefix, exact=False)

    async def _delete(self, what: str, *, exact: bool) -> None:
        """Drop ``what`` (a key with ``exact``, else a prefix) from the tier now, and from the chain below by
        the link core's rule (:meth:`~tierckpt.node.link.WriteBackLink._delete_below`): after a pending
        ``COMMIT`` write-down, so the chain below never names what is deleted there."""
        generation = generation_of(what) or (what.rstrip("/") if is_generation(what.rstrip("/")) else None)
        whole = not exact and generation is not None and generation == what.rstrip("/")
        tier_only = whole and self.down.newest_is_memory_only()
        if tier_only and await self.writedown.owed_below(generation):
            log.info("%s %s stays in the node memory tier until it is written down: the newer commit was saved "
                     "with persist=False, so this one is what the chain below is to hold", self.memory_tier.uri, generation)
            return
        await self.writedown.cancel(what, exact=exact)
        if exact:
            await self.memory_tier.delete(what)
            self.forget_prefix(what, exact=True)
        else:
            if whole:
                # A whole generation (the sweep's superseded one): evicted, its unread pages to the pool.
                await self._retire(generation)
            else:
                await self.memory_tier.delete_prefix(what)
                if generation:
                    await asyncio.to_thread(self.memory_tier.evict, generation)  # frees its pages
                self.forget_prefix(what)
                if generation:
                    self.down.forget(generation)
            for gen in self.memory_tier.generations() if not what else []:
                await asyncio.to_thread(self.memory_tier.evict, gen)
                self.down.forget(gen)
            await self._delete_nested(what)
        if tier_only:
            return  # the chain below still serves its own newest commit, whichever generation that is
        await self._delete_below(what, exact=exact, superseded=generation if whole else None)

    async def _retire(self, generation: str, committed: CommitRecord | None = None) -> None:
        """Drop a whole superseded ``generation`` from the tier, this process's write-downs of it stopped: its
        data files nobody reads go to the node's page pool (:meth:`.nodememory.NodeMemory.retire`, superseded
        by ``committed``, else by the tier's own ``COMMIT``)."""
        await asyncio.to_thread(self.memory.retire, self.memory_tier, generation, committed)
        self.forget_prefix(f"{generation}/")
        self.down.forget(generation)

    async def drop_superseded(self, committed: CommitRecord) -> None:
        """Retire from this node's tier every generation of the URI that ``committed`` superseded, and nothing
        below: every rank but the committing one, once it knows the commit (the committing rank's sweep does
        it on its own node with the chain below). Without it a node other than the committing rank's would
        keep superseded generations until an admission evicted them, and allocate fresh pages for every spare
        and every replica instead of reusing theirs."""
        generations = self.memory_tier.generations()
        newest_memory_only = self.down.newest_is_memory_only()
        for generation in generations:
            if generation == committed.generation or is_spare(generation) or not is_superseded(generation, committed):
                continue
            if newest_memory_only and await self.writedown.owed_below(generation):
                continue  # what the chain below is to hold while the newest commit stays in memory (see _delete)
            await self.writedown.cancel(f"{generation}/", exact=False)
            await self._retire(generation, committed)

    async def _delete_nested(self, prefix: str) -> None:
        """Drop from the node's tier every URI rooted under ``prefix`` of this one (a root deleting a
        step: the step's own tier), stopping this process's write-downs of them first."""
        base = f"{self.memory_tier.uri.rstrip('/')}/{prefix}"
        for tier in await asyncio.to_thread(self.memory.tiers):
            if tier.uri == self.memory_tier.uri or not f"{tier.uri}/".startswith(base):
                continue
            await drop_tier(tier.home)
            await asyncio.to_thread(empty_tier, tier)

    def _commit_pending(self, what: str) -> bool:
        """Whether this process's newest ``COMMIT`` write-down of the tier still runs."""
        last = self.writedown.last_commit()
        return last is not None and last.running()

    async def _delete_now(self, what: str, *, exact: bool, superseded: str | None) -> None:
        """Delete ``what`` below, unless it is the ``superseded`` generation and the newest ``COMMIT``
        write-down failed: the chain below may still name that generation, so it is kept there (a leftover
        for ``tierckpt gc``) rather than deleted under its commit."""
        last = self.writedown.last_commit()
        failed = superseded is not None and last is not None and last.failure
        if failed:
            log.warning("%s: generation %s is kept below: the write-down of the newer COMMIT failed (%s)",
                        self.memory_tier.uri, superseded, describe_error(failed))
            return
        await (self.below.delete(what) if exact else self.below.delete_prefix(what))

    async def _delete_after_commit(self, what: str, *, exact: bool, superseded: str | None) -> None:
        """Delete ``what`` below in the background, once the pending ``COMMIT`` write-down settled."""
        last = self.writedown.last_commit()

        async def deferred() -> None:
            if last is not None:
                await last.settled()
            try:
                await self._delete_now(what, exact=exact, superseded=superseded)
            except CheckpointError as exc:
                log.warning("a delete below %s after its write-down failed: %s", self.memory_tier.uri, exc)

        self.writedown.deferred.append(get_scheduler().submit(deferred(), background=True))

    # -- durability (tierckpt.node.durability.Durable, on the link core) -----------------------------------
    async def _wait_own(self, generation: str | None, timeout_s: float | None, *, through_outage: bool) -> None:
        """Wait until the write-down (of ``generation``) is done (:meth:`.writedown.WriteDown.wait`)."""
        await self.writedown.wait(generation, timeout_s, through_outage=through_outage)

    async def _sync_scope(self) -> SyncScope | None:
        """A ``sync`` writes down the tier's committed generation (a ``persist=False`` one too: it is logged
        as persisted first); ``None`` when the tier holds no commit."""
        record = self.memory_tier.committed()
        if record is None:
            return None
        generation = record.generation
        if self.down.state(generation).memory_only:
            self.down.append(generation, PERSIST, generation)
            self.memory_only.discard(generation)
        return SyncScope(generation, generation)

    async def _take_over(self, scope: SyncScope, key: str) -> None:
        """Copy ``key`` of the synced generation down (its ``COMMIT``: committed below, caught up), unless a
        write-down of this process runs it already."""
        generation = scope.journal
        if key != COMMIT:
            if not _running(self.writedown.runner.entry(key)):
                self.writedown.file(key)
            return
        if _running(self.writedown.runner.entry((COMMIT, generation))):
            return
        data = read_capped(self.memory_tier.path_of(COMMIT), MAX_RECORD_BYTES)
        record = CommitRecord.decode(data)
        if record.generation == generation:
            self.writedown.commit(data, record, CATCH_UP, None)

    async def status(self) -> LinkStatus:
        """Each level of the newest checkpoint of this URI on this node (reads the tier, its logs, and the chain
        below): ``memory`` (committed in this node's memory tier), ``replicated`` (and acknowledged by the peer
        nodes; the reason when not, as the replicator recorded it; see :class:`~.replica_record.Level`),
        ``local`` (in the node disk cache, when the chain has one) and ``remote`` (the URI's own store holds
        its ``COMMIT``). ``memory`` < ``replicated``; ``local`` and ``remote`` are reported separately."""
        tier, down = self.memory_tier, self.down
        record = tier.committed()
        memory_generation = record.generation if record is not None else None
        durable = durability_of(self.below)
        below: StoreStatus | None = await durable.status() if durable is not None else None
        if below is not None:
            below_generation, remote_generation, remote_error = below.generation, below.remote_generation, below.remote_error
            unreachable = below.remote_unreachable
        else:
            below_generation, remote_error, unreachable = await self._below_commit()
            remote_generation = below_generation
        generation = memory_generation
        if below_generation is not None and (generation is None or (seq_of(below_generation) or 0) > (seq_of(generation) or 0)):
            generation = below_generation
        pending: list[str] = []
        errors: list[str] = []
        memory_only = False
        if memory_generation is not None:
            state = down.state(memory_generation)
            memory_only = state.memory_only
            pending = down.pending(memory_generation, state)
            errors = [f"{k}: {why}" for k, why in sorted(state.errors.items())]
            if pending and memory_generation == below_generation:
                # Committed below, so every file of it is there: its COMMIT and the files this node does not
                # write down itself (replicas it holds, or what a sync of another process or node wrote) were
                # written down by another node, which this node's log never records.
                pending, errors = [], []
        written_down = generation is not None and (generation != memory_generation or not pending)
        if generation is None:
            state_now: Level | None = Level.STAGED if pending else None
        elif generation == memory_generation and pending:
            state_now = Level.LOCAL
        elif below is not None and below.generation == generation:
            state_now = below.state
        else:
            state_now = Level.REMOTE if remote_generation == generation else Level.LOCAL
        replica = recorded_level(tier, generation) if generation is not None else None
        return LinkStatus(
            uri=self.memory_tier.uri,
            generation=generation,
            state=state_now,
            pending_keys=(() if memory_only else tuple(pending)) + (below.pending_keys if below is not None else ()),
            pending_bytes=below.pending_bytes if below is not None else 0,
            errors=tuple(errors) + (below.errors if below is not None else ()),
            remote_generation=remote_generation,
            remote_error=remote_error,
            remote_unreachable=unreachable,
            memory_generation=memory_generation,
            memory_directory=tier.home,
            replicated=replica is not None and replica.level is Level.REPLICATED,
            replica_reason=None if replica is None else replica.reason,
            replica_nodes=() if replica is None else replica.acknowledged,
            node_disk=None if below is None else below.generation == generation,
            written_down=written_down,
            memory_only=memory_only,
        )

    async def _below_commit(self) -> tuple[str | None, str | None, bool]:
        """The generation the chain below's ``COMMIT`` names, why it could not be read, and whether that is
        because the store did not answer."""
        try:
            return CommitRecord.decode(await self.below.get_capped(COMMIT, MAX_RECORD_BYTES)).generation, None, False
        except CheckpointNotFoundError:
            return None, None, False
        except (CorruptCheckpointError, CheckpointError) as exc:
            return None, describe_error(exc), isinstance(exc, TransientStorageError)

    # -- withdrawal (the link core's steps) ---------------------------------------------------------------
    async def _stop_copies(self, name: str) -> Withdrawal:
        """Stop this process's write-downs of generation ``name`` and of its ``COMMIT``; why they failed."""
        failures = [f"{self.uri_of(key)}: {why}" for key, (why, _) in sorted(self.writedown.failures.items())
                    if generation_of(key) == name or key == COMMIT]
        await self.writedown.cancel(f"{name}/", exact=False)  # its files' and its COMMIT's write-downs
        return Withdrawal(name, failures)

    async def _landed(self, record: bytes, withdrawal: Withdrawal) -> bool:
        """Whether the chain below's ``COMMIT`` is ``record`` (a chain below that is not write-back)."""
        try:
            return await self.below.get(COMMIT) == record
        except CheckpointError:
            return False

    async def _drop_withdrawn(self, withdrawal: Withdrawal, record: bytes, base: bytes | None) -> None:
        """The tier's ``COMMIT`` is the save's base again when the tier holds that generation (a checkpoint
        saved with ``persist=False`` stays committed in memory), else it goes; the generation's files,
        manifests and write-down log leave the tier."""
        await asyncio.to_thread(self._drop_from_tier, withdrawal.name, record, base)

    def _drop_from_tier(self, name: str, record: bytes, base: bytes | None) -> None:
        tier = self.memory_tier
        previous = CommitRecord.decode(base).generation if base is not None else None
        if previous is not None and previous != name and tier.keys_of(previous):
            tier.commit_in_thread(COMMIT, base, record)  # type: ignore[arg-type]  # back to the save's base
        tier.evict(name)  # COMMIT first when it still names the generation
        self.down.forget(name)
        self.forget_keys(name)

    async def drop_uncommitted(self, generation: str) -> None:
        """A save of ``generation`` failed on its committing rank (which withdraws the commit on its own node):
        on every other node the generation's write-downs stop and its files leave the tier, unless the tier's
        ``COMMIT`` names it (then it was committed after all: nothing is dropped). The chain below is left to
        the committing rank."""
        name = generation_name(generation)
        record = self.memory_tier.committed()
        if record is not None and record.generation == name:
            return
        await self.writedown.cancel(f"{name}/", exact=False)
        await asyncio.to_thread(self.memory_tier.evict, name)
        self.down.forget(name)
        self.forget_keys(name)

    async def close(self) -> None:
        """Nothing to release: write-downs keep running in the background (see :meth:`wait_durable`)."""


def _running(entry: Entry | None) -> bool:
    return entry is not None and entry.running()


_COPY_CHUNK = 8 << 20
"""What a streamed file that moves to the chain below copies there in one write."""


class LinkWriter(ObjectWriter):
    """A file streamed into the tier, chunk by chunk (:meth:`MemoryLink.open_writer`). Each chunk is admitted
    first (the budget is checked against what really arrives); when the tier is full and ``OnFull.FALLBACK``
    is set, the file moves to the chain below with what it had written."""

    def __init__(self, link: MemoryLink, key: str, generation: str, incoming: IncomingFile) -> None:
        self._link, self._key, self._generation = link, key, generation
        self._incoming: IncomingFile | None = incoming
        self._below: ObjectWriter | None = None
        self._uri = link.memory_tier.uri_of(key)

    def use_stated_crc32c(self) -> bool:
        return self._incoming is not None and self._incoming.use_stated_crc32c()

    def state_crc32c(self, crc32c: int) -> None:
        if self._incoming is not None:  # else the file went to the chain below, which needs no CRC
            self._incoming.state_crc32c(crc32c)

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open()
        view = memoryview(data).cast("B")
        if self._below is None and not await self._link.admit(self._generation, view.nbytes):
            await self._move_below()
        if self._below is None:
            try:
                await self._link.memory_tier.blocking(self._incoming.write, view, nbytes=view.nbytes)  # type: ignore[union-attr]
                return
            except OSError as exc:
                if not self._link.fall_back(self._generation, self._uri, exc):
                    raise
                await self._move_below()
        assert self._below is not None
        await self._below.write(view)

    async def _move_below(self) -> None:
        """The tier is full (fallback): continue in the chain below, starting with what was written (the
        writes that completed: one the file system refused left an unknown part of itself)."""
        incoming = self._incoming
        assert incoming is not None
        self._below = await self._link.below.open_writer(self._key)
        left = incoming.size
        with open(incoming.tmp_path, "rb", buffering=0) as f:
            while left and (chunk := await asyncio.to_thread(f.read, min(_COPY_CHUNK, left))):
                await self._below.write(chunk)
                left -= len(chunk)
        await asyncio.to_thread(incoming.abort)
        self._incoming = None

    async def close(self) -> None:
        self._check_open()
        self._done = True
        if self._below is not None:
            await self._below.close()
            return
        self._incoming.publish()  # type: ignore[union-attr]
        self._link.wrote(self._key)

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._below is not None:
            await self._below.abort()
        if self._incoming is not None:
            await asyncio.to_thread(self._incoming.abort)
