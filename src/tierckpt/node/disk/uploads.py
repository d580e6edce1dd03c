"""Uploads of the node cache's write-back journal (a mixin of :class:`~tierckpt.node.disk.tiered.TieredBackend`).

The engine's task runner (:mod:`tierckpt.node.runner`, the :class:`~tierckpt.node.disk.uploader.Uploader`'s)
runs one task per key; what is the cache's own is its job, :class:`_Upload`: the catalogue's record of
the key is its journal, the record's op its action. Lifecycle of a pending op:

1. :meth:`UploadsMixin.schedule` makes sure a task handles the key; it claims the catalogue's record.
2. ``put``: the file is streamed to the remote (or the upload that followed it while it was written is
   published), its CRC-32C checked on the way. ``commit``: first every pending object under its
   generation must be on the remote (and, when its header lists files, the remote must hold each with
   the right size); then the record is uploaded as a compare-and-swap against the remote state it was
   built on. ``delete``: after every commit recorded before it.
3. Done: the record is cleared (unless a newer op replaced it: then that one is uploaded). A transient
   failure is recorded and retried with a growing pause, so write-back covers an outage; any other
   failure is recorded and ends the task (``sync`` retries it, ``sync --drop`` discards it).

The ordering a commit needs is stated by its writer: the generation the commit record names (the
saver's ``COMMIT``) is what it waits for; a record that is not a commit record waits for everything
pending under its directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping

import crc32c

from tierckpt.native import layout
from tierckpt.backends.base import UNCONDITIONAL, Unconditional
from tierckpt.comm import describe_error
from tierckpt.errors import (
    CheckpointBusyError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError,
)
from tierckpt.node.copy import CopySource, copy_checked
from tierckpt.node.journal import pid_alive
from tierckpt.node.ledger import Tier
from tierckpt.backends.retry import UPLOAD, RetryPolicy
from tierckpt.node.written import FileEntry
from tierckpt.node.disk.records import Finish, Op, PendingOp

logger = logging.getLogger("tierckpt.node.disk")

UPLOAD_PART_BYTES = 16 * 2**20


def is_mutable(key: str) -> bool:
    """Whether ``key`` is a commit record (rewritten by every save); everything else is immutable."""
    return key.rpartition("/")[2] == layout.COMMIT


class _Upload:
    """The node cache's job for one key on the engine's runner (:class:`~tierckpt.node.runner.Job`):
    its journal is the store's catalogue record of the key, its action the record's op."""

    retry = UPLOAD

    def __init__(self, store: UploadsMixin, key: str) -> None:
        self.store, self.key = store, key
        poll_s = store.config.poll_s
        self._node = RetryPolicy(first_s=poll_s, max_s=poll_s)
        self._remote = RetryPolicy(first_s=max(poll_s, 0.5), max_s=max(poll_s, 0.5))
        self.poll = self._node
        """Set by :meth:`ready`: the node's other processes' uploads are checked every ``poll_s``; the
        remote (for other nodes' files: a request each time) every 0.5 s at most."""

    async def take(self, attempt: int) -> PendingOp | None:
        """The key's pending op, claimed (``None``: none left, or another live process of the node has it)."""
        catalog, rh = self.store.catalog, self.store.rh
        while True:
            rec = catalog.pending(rh, self.key)
            if rec is None or not rec.mine():
                return None  # none, or another user's: never uploaded with this user's credentials
            if rec.owner != os.getpid() and pid_alive(rec.owner):
                return None  # another live process on this node uploads it
            if catalog.claim(rh, self.key, rec.ver):
                return rec

    async def ready(self, rec: PendingOp) -> set[tuple[str, str]] | None:
        waits = await self.store._waits_for(self.key, rec)
        if waits is None:
            return None
        keys, on_remote = waits
        self.poll = self._remote if on_remote else self._node
        return keys

    async def perform(self, rec: PendingOp) -> bool:
        return await self.store._perform(self.key, rec)

    async def failed(self, rec: PendingOp, exc: Exception, retrying: bool, attempt: int) -> bool:
        store = self.store
        current = store.catalog.pending(store.rh, self.key)
        if current is None or current.ver != rec.ver:
            return False  # superseded while it was uploading (rewritten or deleted)
        message = describe_error(exc) or ""
        store.catalog.fail(store.rh, self.key, rec.ver, message, retrying=retrying)
        logger.warning("upload of %s failed%s: %s", store.uri_of(self.key),
                       f" (retrying in {self.retry.pause_s(attempt):.0f} s)" if retrying else "", message)
        return True

    async def done(self, rec: PendingOp) -> bool:
        store, key = self.store, self.key
        outcome = store.catalog.finish(store.rh, key, rec.ver)
        if outcome == Finish.GONE and rec.op != Op.DELETE and store.catalog.obj(store.rh, key) is None:
            try:  # deleted while it was uploading: do not leave it behind on the remote
                await store.link.delete(key)
            except CheckpointError as exc:
                logger.warning("could not remove %s after a delete: %s", store.uri_of(key), exc)
        return outcome == Finish.CHANGED


class UploadsMixin:
    """The upload actions of a tiered store; see the module docstring. It uses the store's ``catalog``,
    ``rh``, ``link`` (the remote behind its scheduling link), ``remote``, ``written``, ``config``,
    ``uploader`` and ``uri_of``/``get``/``_drop_tail``."""

    def schedule(self, key: str) -> None:
        """Make sure an upload task of this process handles the pending op of ``key`` (from any thread)."""
        self.uploader.runner.ensure((self.rh, key), _Upload(self, key))

    def _adopt(self, records: dict[str, PendingOp]) -> None:
        """Schedule this user's ops whose owner is this process or dead (a crashed save)."""
        me = os.getpid()
        for key, rec in records.items():
            if rec.mine() and (rec.owner == me or not pid_alive(rec.owner)):
                self.schedule(key)

    async def _waits_for(self, key: str, rec: PendingOp) -> tuple[set[tuple[str, str]], bool] | None:
        """What the op ``rec`` of ``key`` still waits for (runner keys, and whether it is the remote that
        is asked for them; ``None``: it was superseded).

        A put waits for nothing; a delete for every commit recorded before it. A commit for what its
        writer stated (``after``: keys and sizes); a record without it (an older writer) waits for
        everything pending under its directory. Objects pending in this node's catalogue go first; then
        the remote must hold each listed object with its size (ranks on other nodes upload through their
        own caches)."""
        if rec.op == Op.PUT:
            return set(), False
        current = self.catalog.pending(self.rh, key)
        if current is None or current.ver != rec.ver:
            return None
        if rec.op == Op.DELETE:
            commits = {k: r for k, r in self.catalog.pending_under(self.rh).items()
                       if r.op == Op.COMMIT and r.ver < rec.ver}
            self._adopt(commits)
            return {(self.rh, k) for k in commits}, False
        after = None if rec.order is None else rec.order.after
        base = key.rpartition("/")[0]
        pending = self.catalog.pending_under(self.rh, f"{base}/" if base else "")
        deps = {k: r for k, r in pending.items()
                if k != key and r.op != Op.DELETE and not is_mutable(k) and (after is None or k in after)}
        failed = sorted((k, r.error) for k, r in deps.items() if r.error and not r.retrying)
        if failed:
            raise StorageError(f"not uploaded: {self.uri_of(failed[0][0])} failed ({failed[0][1]})")
        if deps:
            self._adopt(deps)
            return {(self.rh, k) for k in deps}, False
        missing = None if after is None else await self._remote_lacks(after)
        return (set(), False) if missing is None else ({(self.rh, missing)}, True)

    async def _perform(self, key: str, rec: PendingOp) -> bool:
        """Apply one pending op to the remote (what it waits for is below); False if it was superseded."""
        if rec.op == Op.PUT:
            if await self._complete_tail(key, rec):
                return True
            async with self._upload_slots():
                await self.link.call("upload", self._upload_file, key, rec, nbytes=rec.size)
            return True
        if rec.op == Op.COMMIT:
            data = await self.written.get(key)
            obj = self.catalog.obj(self.rh, key)
            if obj is None or crc32c.crc32c(data) != obj.crc:
                return False  # rewritten meanwhile
            return await self.link.call("commit", self._upload_commit, key, data, rec, nbytes=len(data))
        await self.link.delete(key)
        return True

    async def _upload_commit(self, key: str, data: bytes, rec: PendingOp) -> bool:
        """Upload a commit as a compare-and-swap against the remote state it was built on (``base``);
        ``False``: a newer commit of the node replaced ``rec`` meanwhile (that one is uploaded instead).

        A refusal is accepted only when the remote holds this very record (a retried request whose
        first attempt landed) or one of the commits ``rec`` replaced on the node before they were
        uploaded (:attr:`~.records.CommitOrder.replaced`: an upload of it in flight landed after ``rec``
        was recorded) while ``rec`` is still the key's pending op; then it is retried against that. A
        replaced ``rec`` is never retried: its newer commit (another job's, perhaps, already on the
        remote) must not be overwritten by the older one it was built on. Anything else is another
        writer's commit, even one another job uploaded through this same node cache: the upload fails
        and the checkpoint stays committed on this node only."""
        expected: bytes | None | Unconditional = UNCONDITIONAL
        if rec.order is not None and rec.order.cas:
            expected = rec.order.base
        try:
            await self.remote.commit(key, data, expected=expected)
        except CheckpointBusyError:
            try:
                current: bytes | None = await self.remote.get(key)
            except CheckpointNotFoundError:
                current = None
            if current != data:
                overtaken = () if rec.order is None else rec.order.replaced
                if current is None or layout.CommitRecord.generation_in(current) not in overtaken:
                    raise
                pending = self.catalog.pending(self.rh, key)
                if pending is None or pending.ver != rec.ver:
                    return False
                await self.remote.commit(key, data, expected=current)
        gen_path = self._generation_path(key, data)
        if gen_path is not None:
            self.catalog.mark_remote(self.rh, gen_path)
        return True

    def _generation_path(self, key: str, record: bytes) -> str | None:
        """``dir/generation`` that the commit record ``record`` of ``key`` names (``None``: not a record)."""
        generation = layout.CommitRecord.generation_in(record)
        if generation is None:
            return None
        base = key.rpartition("/")[0]
        return f"{base}/{generation}" if base else generation

    async def _complete_tail(self, key: str, rec: PendingOp) -> bool:
        """Publish the upload that followed this very write of ``key``, if there is one and it sent
        exactly the recorded bytes; ``False``: upload the file from the local copy."""
        tkey = (self.rh, key)
        tail = self.uploader.tails.get(tkey)
        if tail is None or not tail.sealed:
            return False  # none, or it follows a newer write still in progress
        version = await tail.published_version()
        if version != rec.ver:
            if version is None or version < rec.ver:
                await self._drop_tail(key, tail)  # its write failed or was superseded
            return False
        del self.uploader.tails[tkey]
        obj = self.catalog.obj(self.rh, key)
        if obj is None or obj.size != rec.size:
            await tail.cancel()
            return False
        return await tail.complete(rec.size, obj.crc)

    async def _upload_file(self, key: str, rec: PendingOp) -> None:
        """Copy the local copy of ``key`` to the remote through the engine's one checked copy
        (:func:`~tierckpt.node.copy.copy_checked`): its CRC-32C is checked before it is published."""
        path = self.written.path_of(key)
        obj = self.catalog.obj(self.rh, key)

        def gone() -> CorruptCheckpointError:
            return CorruptCheckpointError(
                f"the node-cache copy of {self.uri_of(key)} at {path} vanished before its upload; save again")

        # A record of another size (rewritten meanwhile) is no check: the catalogue's newer op follows.
        recorded = None if obj is None or obj.size != await asyncio.to_thread(_size_or_none, path) else \
            FileEntry(obj.size, obj.crc)
        source = CopySource(path, Tier.NODE_DISK, recorded, lambda _got: self._corrupt_upload(key, path), gone)
        await copy_checked(source, self.remote, key, chunk=UPLOAD_PART_BYTES)

    def _corrupt_upload(self, key: str, path: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"the node-cache copy of {self.uri_of(key)} at {path} fails its CRC-32C check; it was not uploaded. "
            "Save the checkpoint again"
        )

    async def _remote_lacks(self, after: Mapping[str, int | None]) -> str | None:
        """An object of ``after`` the remote does not hold (with its size where given) yet; ``None``: none."""
        for k, size in sorted(after.items()):
            if k in self._files_checked:
                continue
            try:
                actual = await self.link.size(k)
            except CheckpointNotFoundError:
                return k  # not there yet (a rank on another node still uploads it)
            if size is not None and actual != size:
                return k
            self._files_checked.add(k)
        return None


def _size_or_none(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None
