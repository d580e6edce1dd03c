"""Reads of the node cache (a mixin of :class:`~tierckpt.node.disk.tiered.TieredBackend`): read-through.

Tiers, fastest first: the in-process memory tier (whole small immutable objects), the local disk
(objects written through this node whole; remote objects up to ``block_bytes`` whole, larger ones as
aligned blocks, each with its CRC-32C checked on every read), then the remote through the store's
scheduling link. A failing cached copy that the remote holds is dropped and fetched again; one that
has not reached the remote raises.

What is fetched is recorded with the CRC-32C of the bytes as they arrived, which guards the copy against
the local disk but cannot tell a download corrupted on the way: the cache does not know a checkpoint's
checksums. Those bytes are verified on first read instead: every load (and ``verify``) checks each byte it
reads against the CRCs recorded at save time, and a mismatch in bytes a node cache served drops that copy
(:meth:`ReadThroughMixin.forget_cached`) and reads them again from the remote; only a mismatch there is
corruption. This costs nothing on the hot path — the load's own check is the verification, where checking
at fetch time would checksum every fetched byte a second time against a piece table the cache would have
to read — and a bad download poisons nothing: its first reader drops it. ``COMMIT`` records are the only mutable objects: with nothing
pending they are read from the remote (the cached copy serves only while the remote is unreachable).
"""

from __future__ import annotations

import asyncio
import logging
import os

import crc32c

from tierckpt.backends.bounded import MAX_RECORD_BYTES, oversized
from tierckpt.backends.files import check_prefix, check_range, range_past_end, unlink
from tierckpt.backends.local import LocalBackend
from tierckpt.native.keys import validate_key
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError, TransientStorageError
from tierckpt.node.disk.local_files import read_file
from tierckpt.node.disk.records import ObjRecord, Op, PendingOp, Tree
from tierckpt.node.disk.uploads import is_mutable

logger = logging.getLogger("tierckpt.node.disk")


def _offline(exc: BaseException) -> bool:
    """An error that means 'the remote cannot be reached now', where a cached copy may serve."""
    return isinstance(exc, TransientStorageError)


class ReadThroughMixin:
    """See the module docstring; it uses the store's ``catalog``, ``rh``, ``link``, ``config``,
    ``written``/``fetched``/``_blocks`` trees, ``_small``, ``uploader`` and ``uri_of``/``_tree``/
    ``_block_key``/``_unlink_dropped``/``_evict``."""

    def _not_found(self, key: str) -> CheckpointNotFoundError:
        return CheckpointNotFoundError(f"{self.uri_of(key)}: no such object (deleted through the node cache)")

    async def _local_whole(self, key: str) -> tuple[LocalBackend, ObjRecord] | None:
        """The verified whole local copy of ``key``, or ``None`` (a bad copy is dropped first)."""
        for _ in range(3):
            rec = self.catalog.obj(self.rh, key)
            if rec is None:
                return None
            lb = self._tree(rec.tree)
            path = lb.path_of(key)
            ok = await asyncio.to_thread(self.uploader.verified.check, path, rec.size, rec.crc)
            if ok:
                self.catalog.touch(self.rh, key, rec=rec)
                return lb, rec
            if self.catalog.obj(self.rh, key) != rec:
                continue  # rewritten meanwhile: look again
            if rec.tree == Tree.WRITTEN and self.catalog.pending(self.rh, key) is not None:
                raise CorruptCheckpointError(
                    f"the node-cache copy of {self.uri_of(key)} at {path} fails its size/CRC-32C check and has "
                    "not reached the remote yet: the local disk corrupted it; save the checkpoint again"
                )
            logger.warning("dropping corrupt cached copy of %s at %s; fetching it again", self.uri_of(key), path)
            if self.catalog.drop(self.rh, key, tree=rec.tree):
                await asyncio.to_thread(unlink, path)
        return None

    async def forget_cached(self, key: str, start: int, end: int) -> bool:
        """Drop this node's cached copies of bytes ``[start, end)`` of ``key`` (the blocks holding them, or
        the whole object) that the remote holds, so the next read fetches them again; ``True`` if any was
        dropped. Called when the bytes failed the checksums recorded at save time (see the module
        docstring). A copy that has not reached the remote yet is kept: it is the only one."""
        validate_key(key)
        if is_mutable(key):
            return False
        dropped = self._small.get(key) is not None
        self._small.drop(key)
        rec = self.catalog.obj(self.rh, key)
        if rec is not None and not (rec.tree == Tree.WRITTEN and self.catalog.pending(self.rh, key) is not None):
            if self.catalog.drop(self.rh, key, tree=rec.tree):
                await asyncio.to_thread(unlink, self._tree(rec.tree).path_of(key))
                dropped = True
        b = self.config.block_bytes
        for idx in range(start // b, max(start, end - 1) // b + 1):
            if self.catalog.drop(self.rh, key, idx):
                await asyncio.to_thread(unlink, self._blocks.path_of(self._block_key(key, idx)))
                dropped = True
        if dropped:
            logger.warning("bytes %d..%d of %s failed their checksum: dropped the node-cache copy; reading them "
                           "again from the remote", start, end, self.uri_of(key))
        return dropped

    async def _store_fetched(self, key: str, data: bytes) -> None:
        if len(data) <= self.config.block_bytes:
            await self.fetched.put(key, data)
            if not self.catalog.record_fetch(self.rh, key, len(data), crc32c.crc32c(data)):
                return
        else:
            self.catalog.record_size(self.rh, key, len(data))
            b = self.config.block_bytes
            for idx in range(0, (len(data) + b - 1) // b):
                await self._store_block(key, idx, data[idx * b : (idx + 1) * b])
        self._evict()

    async def _store_block(self, key: str, idx: int, data: bytes) -> None:
        await self._blocks.put(self._block_key(key, idx), data)
        self.catalog.record_block(self.rh, key, idx, len(data), crc32c.crc32c(data))

    async def _remote_commit_record(self, key: str) -> bytes:
        """A COMMIT with nothing pending: the remote's, or the cached one when the remote is offline."""
        try:
            data = await self.link.get_capped(key, MAX_RECORD_BYTES)
        except CheckpointNotFoundError:
            dropped = self.catalog.record_delete(self.rh, key, deferred=False)
            self._unlink_dropped(key, dropped)
            raise
        except StorageError as exc:
            if not _offline(exc):
                raise
            local = await self._local_whole(key)
            if local is None:
                raise
            logger.warning("remote unreachable (%s); using the node-cache copy of %s", exc, self.uri_of(key))
            return await local[0].get_capped(key, MAX_RECORD_BYTES)
        await self._store_fetched(key, data)
        return data

    async def get(self, key: str) -> bytes:
        validate_key(key)
        pending = self.catalog.pending(self.rh, key)
        if pending is not None and pending.op == Op.DELETE:
            raise self._not_found(key)
        if is_mutable(key) and pending is None:
            return await self._remote_commit_record(key)
        data = self._small.get(key)
        if data is not None:
            return data
        local = await self._local_whole(key)
        if local is not None:
            try:
                data = await (local[0].get_capped(key, MAX_RECORD_BYTES) if is_mutable(key) else local[0].get(key))
            except CheckpointNotFoundError:
                data = None  # evicted under us
            if data is not None:
                if not is_mutable(key):
                    self._small.put(key, data)
                return data
        size = self.catalog.known_size(self.rh, key)
        if size is not None and size > self.config.block_bytes:
            return await self._range_from_blocks(key, 0, size, size)
        data = await self.link.get(key)
        await self._store_fetched(key, data)
        self._small.put(key, data)
        return data

    async def get_capped(self, key: str, cap: int) -> bytes:
        """A commit record in one read (:meth:`get` reads it capped); any other object as the base does."""
        if not is_mutable(key):
            return await super().get_capped(key, cap)  # type: ignore[misc]
        data = await self.get(key)
        if len(data) > cap:
            raise oversized(self.uri_of(key), len(data), cap)  # type: ignore[attr-defined]
        return data

    async def _remote_size(self, key: str) -> int:
        size = self.catalog.known_size(self.rh, key)
        if size is None:
            size = await self.link.size(key)
            self.catalog.record_size(self.rh, key, size)
        return size

    async def _read_range(self, key: str, start: int, end: int, out: memoryview) -> None:
        validate_key(key)
        check_range(self.uri_of(key), start, end)
        pending = self.catalog.pending(self.rh, key)
        if pending is not None and pending.op == Op.DELETE:
            raise self._not_found(key)
        data = self._small.get(key) if not is_mutable(key) else None
        if data is None and is_mutable(key):
            data = await self.get(key)
        if data is not None:
            if end > len(data):
                raise range_past_end(self.uri_of(key), start, end, len(data))
            out[:] = data[start:end]
            return
        local = await self._local_whole(key)
        if local is not None:
            lb, rec = local
            if end > rec.size:
                raise range_past_end(self.uri_of(key), start, end, rec.size)
            try:
                await lb.read_into(key, start, out)
                return
            except CheckpointNotFoundError:
                pass  # evicted under us: fetch it
        size = await self._remote_size(key)
        if end > size:
            raise range_past_end(self.uri_of(key), start, end, size)
        if size <= self.config.block_bytes:
            out[:] = (await self.get(key))[start:end]
        else:
            out[:] = await self._range_from_blocks(key, start, end, size)

    async def _range_from_blocks(self, key: str, start: int, end: int, size: int) -> bytes:
        if start == end:
            return b""
        b = self.config.block_bytes
        first, last = start // b, (end - 1) // b
        parts = await asyncio.gather(*(self._block(key, i, size) for i in range(first, last + 1)))
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        return joined[start - first * b : end - first * b]

    async def _block(self, key: str, idx: int, size: int) -> bytes:
        b = self.config.block_bytes
        length = min(b, size - idx * b)
        bkey = self._block_key(key, idx)
        rec = self.catalog.block(self.rh, key, idx)
        if rec is not None:
            data = await asyncio.to_thread(read_file, self._blocks.path_of(bkey), length)
            if data is not None and len(data) == rec.size == length and crc32c.crc32c(data) == rec.crc:
                self.catalog.touch(self.rh, key, idx, rec=rec)
                return data
            logger.warning("dropping bad cached block %d of %s; fetching it again", idx, self.uri_of(key))
            self.catalog.drop(self.rh, key, idx)
            await asyncio.to_thread(unlink, self._blocks.path_of(bkey))
        data = await self.link.get_range(key, idx * b, idx * b + length)
        await self._store_block(key, idx, data)
        self._evict()
        return data

    async def prefetch_range(self, key: str, start: int, end: int) -> None:
        """Bring bytes ``[start, end)`` of ``key`` into the local tier (blocks or the whole object)."""
        validate_key(key)
        if self.catalog.obj(self.rh, key) is not None:
            return
        size = await self._remote_size(key)
        end = min(end, size)
        if size <= self.config.block_bytes:
            await self.get(key)
            return
        b = self.config.block_bytes
        if start < end:
            await asyncio.gather(*(self._block(key, i, size) for i in range(start // b, (end - 1) // b + 1)))

    async def exists(self, key: str) -> bool:
        validate_key(key)
        pending = self.catalog.pending(self.rh, key)
        if pending is not None:
            return pending.op != Op.DELETE
        if not is_mutable(key) and (
            self.catalog.obj(self.rh, key) is not None or self.catalog.known_size(self.rh, key) is not None
        ):
            return True
        try:
            return await self.link.exists(key)
        except StorageError as exc:
            if _offline(exc) and self.catalog.obj(self.rh, key) is not None:
                return True
            raise

    async def size(self, key: str) -> int:
        validate_key(key)
        pending = self.catalog.pending(self.rh, key)
        if pending is not None and pending.op == Op.DELETE:
            raise self._not_found(key)
        if is_mutable(key) and pending is None:
            return len(await self.get(key))
        rec = self.catalog.obj(self.rh, key)
        if rec is not None and os.path.isfile(self._tree(rec.tree).path_of(key)):
            return rec.size
        return await self._remote_size(key)

    async def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        pending = self._pending_with_nested(prefix)
        try:
            keys = set(await self.link.list(prefix))
        except StorageError as exc:
            if not _offline(exc):
                raise
            keys = set(self.catalog.cached_keys(self.rh, prefix))
            if not keys and not any(r.op != Op.DELETE for r in pending.values()):
                raise  # the node holds nothing there: an empty listing would say "there is nothing", not "unreachable"
            logger.warning("remote unreachable (%s); listing %s from the node cache", exc, self.root_uri)
        keys |= {k for k, r in pending.items() if r.op != Op.DELETE}
        keys -= {k for k, r in pending.items() if r.op == Op.DELETE}
        return sorted(keys)

    def _pending_with_nested(self, prefix: str) -> dict[str, PendingOp]:
        """Pending ops under ``prefix``: this root's, and those of roots nested in it (e.g. each step's
        own URI under a run's root), as keys of this root — so a listing shows what is committed in
        the node cache but not uploaded yet, wherever it was written from."""
        pending = self.catalog.pending_under(self.rh, prefix)
        base = self.root_uri.rstrip("/") + "/"
        for rh, uri in self.catalog.roots(self.remote.service).items():
            if rh == self.rh or not uri.startswith(base):
                continue
            nested = uri[len(base):].strip("/")
            for key, rec in self.catalog.pending_under(rh).items():
                full = f"{nested}/{key}"
                if full.startswith(prefix):
                    pending.setdefault(full, rec)
        return pending
