"""Uploads of the node cache's write-back journal (a mixin of :class:`~tierckpt.cache.tiered.TieredBackend`).

Lifecycle of a pending op (on the I/O scheduler's loop, one task per key, owned by the store's
:class:`~tierckpt.cache.uploader.Uploader`):

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

from .. import layout
from ..backends.base import UNCONDITIONAL, Unconditional
from ..comm import describe_error
from ..errors import (
    CheckpointBusyError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError,
    TransientStorageError,
)
from ..io.scheduled import set_background
from ..io.scheduler import get_scheduler
from ..writeback.copy import CopySource, copy_checked
from ..writeback.journal import pid_alive
from ..writeback.ledger import Tier
from ..writeback.retry import UPLOAD
from ..writeback.written import FileEntry
from .records import Finish, GenState, Op, PendingOp

logger = logging.getLogger("tierckpt.cache")

UPLOAD_PART_BYTES = 16 * 2**20


def is_mutable(key: str) -> bool:
    """Whether ``key`` is a commit record (rewritten by every save); everything else is immutable."""
    return key.rpartition("/")[2] == layout.COMMIT


class UploadsMixin:
    """The upload engine of a tiered store; see the module docstring. It uses the store's ``catalog``,
    ``rh``, ``link`` (the remote behind its scheduling link), ``remote``, ``written``, ``config``,
    ``uploader`` and ``uri_of``/``get``/``_drop_tail``."""

    def schedule(self, key: str) -> None:
        """Make sure an upload task of this process handles the pending op of ``key``."""
        loop = get_scheduler().loop
        loop.call_soon_threadsafe(self._ensure_task, key)

    def _ensure_task(self, key: str) -> None:
        tkey = (self.rh, key)
        if tkey not in self.uploader.tasks:
            self.uploader.tasks[tkey] = asyncio.get_running_loop().create_task(self._drain(key, tkey))

    def _adopt(self, records: dict[str, PendingOp]) -> None:
        """Schedule ops whose owner is this process or dead (a crashed save)."""
        me = os.getpid()
        for key, rec in records.items():
            if rec.owner == me or not pid_alive(rec.owner):
                self.schedule(key)

    async def _drain(self, key: str, tkey: tuple[str, str]) -> None:
        """Upload the pending op of ``key`` (and any that replaces it meanwhile). A transient failure
        (an outage) is recorded and retried with a growing pause, so write-back covers an outage; any
        other failure is recorded and ends the task (``sync`` retries it, ``sync --drop`` discards it)."""
        attempt = 1
        set_background()  # this task's remote calls queue behind loads
        try:
            while True:
                rec = self.catalog.pending(self.rh, key)
                if rec is None:
                    return
                if rec.owner != os.getpid() and pid_alive(rec.owner):
                    return  # another live process on this node uploads it
                if not self.catalog.claim(self.rh, key, rec.ver):
                    continue
                try:
                    performed = await self._perform(key, rec)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - recorded; wait()/sync() report it
                    current = self.catalog.pending(self.rh, key)
                    if current is None or current.ver != rec.ver:
                        continue  # superseded while it was uploading (rewritten or deleted)
                    message = describe_error(exc)
                    retrying = isinstance(exc, TransientStorageError)
                    self.catalog.fail(self.rh, key, rec.ver, message, retrying=retrying)
                    logger.warning("upload of %s failed%s: %s", self.uri_of(key),
                                   f" (retrying in {UPLOAD.pause_s(attempt):.0f} s)" if retrying else "", message)
                    if not retrying:
                        return
                    await UPLOAD.wait(attempt)
                    attempt += 1
                    continue
                if not performed:
                    continue
                outcome = self.catalog.finish(self.rh, key, rec.ver)
                if outcome == Finish.GONE and rec.op != Op.DELETE and self.catalog.obj(self.rh, key) is None:
                    try:  # deleted while it was uploading: do not leave it behind on the remote
                        await self.link.delete(key)
                    except CheckpointError as exc:
                        logger.warning("could not remove %s after a delete: %s", self.uri_of(key), exc)
                if outcome != Finish.CHANGED:
                    return
        finally:
            if self.uploader.tasks.get(tkey) is asyncio.current_task():
                del self.uploader.tasks[tkey]

    async def _perform(self, key: str, rec: PendingOp) -> bool:
        """Apply one pending op to the remote; False if it was superseded while waiting."""
        if rec.op == Op.PUT:
            if await self._complete_tail(key, rec):
                return True
            async with self._upload_slots():
                await self.link.call("upload", self._upload_file, key, rec, nbytes=rec.size)
            return True
        if rec.op == Op.COMMIT:
            if not await self._wait_for_generation(key, rec):
                return False
            data = await self.written.get(key)
            obj = self.catalog.obj(self.rh, key)
            if obj is None or crc32c.crc32c(data) != obj.crc:
                return False  # rewritten meanwhile
            await self.link.call("commit", self._upload_commit, key, data, rec, nbytes=len(data))
            return True
        while True:  # delete: after every commit recorded before it
            current = self.catalog.pending(self.rh, key)
            if current is None or current.ver != rec.ver:
                return False
            commits = {k: r for k, r in self.catalog.pending_under(self.rh).items()
                       if r.op == Op.COMMIT and r.ver < rec.ver}
            if not commits:
                break
            self._adopt(commits)
            await asyncio.sleep(self.config.poll_s)
        await self.link.delete(key)
        return True

    async def _upload_commit(self, key: str, data: bytes, rec: PendingOp) -> None:
        """Upload a commit as a compare-and-swap against the remote state it was built on (``base``).

        A refusal is accepted only when the remote holds this very record (a retried request whose
        first attempt landed) or a commit this node uploaded after ``base`` was recorded (its earlier
        commit overtook this one's record); then it is retried against that. Anything else is another
        writer's commit: the upload fails and the checkpoint stays committed on this node only."""
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
                if current is None or self._uploaded_by_this_node(key, current) is False:
                    raise
                await self.remote.commit(key, data, expected=current)
        gen_path = self._generation_path(key, data)
        if gen_path is not None:
            self.catalog.mark_remote(self.rh, gen_path)

    def _generation_path(self, key: str, record: bytes) -> str | None:
        """``dir/generation`` that the commit record ``record`` of ``key`` names (``None``: not a record)."""
        try:
            generation = layout.CommitRecord.decode(record).generation
        except CorruptCheckpointError:
            return None
        base = key.rpartition("/")[0]
        return f"{base}/{generation}" if base else generation

    def _uploaded_by_this_node(self, key: str, record: bytes) -> bool:
        gen_path = self._generation_path(key, record)
        return gen_path is not None and self.catalog.generation_state(self.rh, gen_path) == GenState.REMOTE

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
        (:func:`~tierckpt.writeback.copy.copy_checked`): its CRC-32C is checked before it is published."""
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

    async def _wait_for_generation(self, key: str, rec: PendingOp) -> bool:
        """Wait until what a commit depends on is on the remote; ``False`` if it was superseded meanwhile.

        The writer stated it (``after``: keys and sizes); a record without it (an older writer) waits for
        everything pending under its directory. Objects pending in this node's catalogue go first; then
        the remote must hold each listed object with its size (ranks on other nodes upload through their
        own caches)."""
        after = None if rec.order is None else rec.order.after
        base = key.rpartition("/")[0]
        prefix = f"{base}/" if base else ""
        while True:
            current = self.catalog.pending(self.rh, key)
            if current is None or current.ver != rec.ver:
                return False
            pending = self.catalog.pending_under(self.rh, prefix)
            deps = {k: r for k, r in pending.items()
                    if k != key and r.op != Op.DELETE and not is_mutable(k) and (after is None or k in after)}
            failed = sorted((k, r.error) for k, r in deps.items() if r.error and not r.retrying)
            if failed:
                raise StorageError(f"not uploaded: {self.uri_of(failed[0][0])} failed ({failed[0][1]})")
            if not deps and (after is None or await self._remote_has_all(after)):
                return True
            self._adopt(deps)
            await asyncio.sleep(self.config.poll_s if deps else max(self.config.poll_s, 0.5))

    async def _remote_has_all(self, after: Mapping[str, int | None]) -> bool:
        """Whether the remote holds every object of ``after`` (with its size where given)."""
        for k, size in sorted(after.items()):
            if k in self._files_checked:
                continue
            try:
                actual = await self.link.size(k)
            except CheckpointNotFoundError:
                return False  # not there yet (a rank on another node still uploads it)
            if size is not None and actual != size:
                return False
            self._files_checked.add(k)
        return True


def _size_or_none(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None
