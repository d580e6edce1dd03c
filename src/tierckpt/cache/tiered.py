"""``TieredBackend``: a remote backend behind a node-local write-back, read-through cache.

Tiers, fastest first: an in-process memory tier (whole small immutable objects, e.g. metadata),
the local disk tier under ``<cache dir>`` (shared by every process on the node), the remote.

Disk layout, ``rh`` being a hash of the remote root URI::

    <cache dir>/catalog.lmdb                        the catalogue (see catalog.py)
    <cache dir>/objects/<rh>/<key>                  objects written through the cache (whole)
    <cache dir>/fetched/<rh>/<key>                  remote objects up to ``block_bytes``, whole
    <cache dir>/blocks/<rh>/<h[:2]>/<h>.<index>     aligned ``block_bytes`` blocks of larger remote
                                                    objects (``h`` = sha1 of the key)

Design choice: written objects are kept whole (they are produced whole, and must be uploaded
whole); remote objects larger than one block are cached as aligned blocks, so a load or a
``prefetch(only=...)`` that reads a few tensors of a huge data file caches only those ranges.
Every cached block carries its CRC-32C and is checked on every read; whole files are checked
(size always, CRC once per process per file version). A failing entry that the remote holds is
dropped and re-fetched; a failing entry that has not reached the remote raises.

Lifecycle of a write (the process that saves; uploads may be finished by another process):

1. ``put``/``open_writer``/``commit`` write a temp file in the local tier and fsync it; inside one
   catalogue write transaction the file is renamed into place and a pending op is recorded, so the
   call returns once the local copy is durable.
2. An upload task on the I/O scheduler's loop (BACKGROUND priority) sends the object to the remote
   and clears the pending op (unless a newer write replaced it: then it uploads again).
3. A ``COMMIT`` (``commit``) is uploaded only after every pending object of its generation has
   reached the remote (and, when the generation's header lists its files, after the remote holds
   each of them with the right size: files written by ranks on other nodes go through their own
   caches). The generation then moves ``staged`` -> ``local`` -> ``remote`` in the catalogue.
4. ``delete`` while a commit is pending is deferred on the remote until that commit is uploaded,
   so a remote reader never follows a COMMIT to a deleted generation (the saver deletes the
   previous generation right after committing).
5. A process that dies leaves its pending ops in the catalogue; :meth:`TieredBackend.sync` (or
   ``tierckpt.cache.sync``) in any later process adopts and finishes them.

``COMMIT`` records are the only mutable objects of the layout: reads of them go to the remote
(falling back to the cached copy when the remote is unreachable); every other object is treated as
immutable once cached, except for overwrites made through this cache.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os
import threading
import time

import crc32c

from .. import layout
from ..backends.base import (
    UNCONDITIONAL, Backend, ObjectWriter, ReadsInto, Unconditional, commit_refused, validate_key,
)
from ..backends.local import (
    LocalBackend, _discard, _fsync_dir, _open_temp, _unlink, _write_all, check_prefix, check_range, range_past_end,
)
from ..comm import describe_error
from ..errors import (
    CheckpointBusyError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError,
    TransientStorageError,
)
from ..io.scheduled import ScheduledBackend, set_background
from ..io.scheduler import get_scheduler
from ..metadata import decode_header
from .catalog import Catalog, generation_path, pid_alive
from .config import CacheConfig
from .status import Durability, StoreStatus
from .tail_upload import TailUpload

logger = logging.getLogger("tierckpt.cache")

UPLOAD_PART_BYTES = 16 * 2**20
RETRY_PAUSE_S = 1.0
"""First pause before an upload that failed transiently (after the scheduler's own retries) is tried again."""
MAX_RETRY_PAUSE_S = 30.0
EXIT_STALL_S = 5.0
"""The exit drain stops waiting once uploads fail and none has finished for this long (it then reports)."""

# Process-wide state, touched only on the scheduler's loop: one upload task per (catalogue, root, key).
_TASKS: dict[tuple[str, str, str], asyncio.Task] = {}
# Uploads that follow a local file while it is written (same keys), until the upload step takes them.
_TAILS: dict[tuple[str, str, str], TailUpload] = {}
_UPLOAD_SLOTS: dict[str, asyncio.Semaphore] = {}
_verified: set[tuple[str, int, int, int, int]] = set()
_verified_lock = threading.Lock()
# Cache directories this process opened, with the longest exit wait configured for them (the exit drain).
_CATALOGS: dict[str, float] = {}


def root_hash(root_uri: str) -> str:
    """Name of a remote root's directory in the cache."""
    return hashlib.sha256(root_uri.rstrip("/").encode()).hexdigest()[:24]


def is_mutable(key: str) -> bool:
    """Whether ``key`` is a commit record (rewritten by every save); everything else is immutable."""
    return key.rpartition("/")[2] == layout.COMMIT


def _offline(exc: BaseException) -> bool:
    """An error that means 'the remote cannot be reached now', where a cached copy may serve."""
    return isinstance(exc, TransientStorageError)


class _MemoryTier:
    """A thread-safe LRU of whole small objects within one process."""

    def __init__(self, budget: int, max_object: int) -> None:
        self._budget = budget
        self._max = min(max_object, budget)
        self._items: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._items.get(key)
            if data is not None:
                self._items.move_to_end(key)
            return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self._max:
            return
        with self._lock:
            self._drop(key)
            self._items[key] = data
            self._bytes += len(data)
            while self._bytes > self._budget:
                _, old = self._items.popitem(last=False)
                self._bytes -= len(old)

    def drop(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def _drop(self, key: str) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= len(old)


# -- file helpers (worker threads) ------------------------------------------------------------------
def _crc_of_file(path: str) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 * 2**20):
            crc = crc32c.crc32c(chunk, crc)
    return crc


def _verify_file(path: str, size: int, crc: int | None) -> bool | None:
    """``None``: no file; ``False``: wrong size or CRC; ``True``: good (CRC checked once per version)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if st.st_size != size:
        return False
    ident = (path, st.st_ino, st.st_mtime_ns, st.st_size, crc if crc is not None else -1)
    with _verified_lock:
        if ident in _verified or crc is None:
            return True
    if _crc_of_file(path) != crc:
        return False
    with _verified_lock:
        _verified.add(ident)
    return True


def _read_file(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


class _TieredWriter(ObjectWriter):
    """Streams into a temp file of the local tier; ``close`` publishes it and records the upload."""

    def __init__(self, store: TieredBackend, key: str, fd: int, tmp: str, tail: TailUpload | None) -> None:
        self._store, self._key, self._fd, self._tmp, self._tail = store, key, fd, tmp, tail
        self._uri = store.uri_of(key)
        self._crc = 0
        self._size = 0

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open()
        view = memoryview(data).cast("B")
        self._crc = crc32c.crc32c(view, self._crc)
        self._size += len(view)
        try:
            await asyncio.to_thread(_write_all, self._fd, view)
        except OSError as exc:
            raise StorageError(f"writing the cached copy of {self._uri}: {exc}") from exc
        if self._tail is not None:
            self._tail.advance(len(view))

    async def close(self) -> None:
        self._check_open()
        self._done = True
        if self._tail is not None:
            self._tail.seal()
        try:
            await self._store._publish_written(
                self._key, self._fd, self._tmp, self._size, self._crc, "put", None, self._tail
            )
        except BaseException:
            await self._store._drop_tail(self._key, self._tail)
            raise

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        await self._store._drop_tail(self._key, self._tail)
        await asyncio.to_thread(_discard, self._fd, self._tmp)


class TieredBackend(ReadsInto, Backend):
    """A write-back, read-through cache in front of ``remote``; see the module docstring."""

    schedules_itself = True
    """Its remote calls go through its scheduling link; callers add no slots or retries of their own."""

    def __init__(self, remote: Backend, config: CacheConfig | None = None) -> None:
        super().__init__(remote.root_uri)
        self.link = remote if isinstance(remote, ScheduledBackend) else ScheduledBackend(remote)
        """The remote behind its scheduling link (every network call of this tier goes through it)."""
        self.remote = self.link.inner
        self.config = config or CacheConfig.from_env()
        self.capabilities = remote.capabilities
        self.rh = root_hash(remote.root_uri)
        self.catalog = Catalog(self.config.directory)
        self.catalog.register_root(self.rh, remote.root_uri)
        d = self.config.directory
        self.written = LocalBackend(os.path.join(d, "objects", self.rh))
        self.fetched = LocalBackend(os.path.join(d, "fetched", self.rh))
        self._blocks = LocalBackend(os.path.join(d, "blocks", self.rh))
        self._memory = _MemoryTier(self.config.memory_bytes, self.config.memory_object_bytes)
        self._files_checked: set[str] = set()
        _CATALOGS[self.config.directory] = max(_CATALOGS.get(self.config.directory, 0.0), self.config.exit_wait_s)

    def __repr__(self) -> str:
        return f"TieredBackend({self.remote!r}, cache={self.config.directory!r})"

    def uri_of(self, key: str) -> str:
        uri_of = getattr(self.remote, "uri_of", None)
        return uri_of(key) if uri_of is not None else f"{self.root_uri.rstrip('/')}/{key}"

    def _tree(self, tree: str) -> LocalBackend:
        return self.written if tree == "w" else self.fetched

    @staticmethod
    def _block_key(key: str, idx: int) -> str:
        h = hashlib.sha1(key.encode()).hexdigest()
        return f"{h[:2]}/{h}.{idx:08d}"

    def _unlink_dropped(self, key: str, dropped: list[tuple[str, int | None]]) -> None:
        for tree, idx in dropped:
            path = self._blocks.path_of(self._block_key(key, idx)) if tree == "b" else self._tree(tree).path_of(key)
            _unlink(path)

    def _evict(self) -> None:
        if self.catalog.usage() <= self.config.disk_bytes:
            return
        d = self.config.directory
        for rh, key, tree, idx in self.catalog.evict(self.config.disk_bytes):
            if tree == "b":
                path = os.path.join(d, "blocks", rh, *self._block_key(key, idx).split("/"))
            else:
                path = os.path.join(d, "objects" if tree == "w" else "fetched", rh, *key.split("/"))
            _unlink(path)
            if rh == self.rh:
                self._memory.drop(key)

    # -- writes ------------------------------------------------------------------------------------
    async def _publish_written(self, key: str, fd: int, tmp: str, size: int, crc: int, op: str,
                               generation: str | None, tail: TailUpload | None = None,
                               extra: dict | None = None) -> None:
        path = self.written.path_of(key)

        def publish() -> int:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

            def rename() -> None:
                os.replace(tmp, path)
                _fsync_dir(os.path.dirname(path))

            version, dropped = self.catalog.record_write(self.rh, key, size, crc, op, generation, publish=rename,
                                                         extra=extra)
            self._unlink_dropped(key, dropped)
            return version

        try:
            version = await asyncio.to_thread(publish)
        except OSError as exc:
            await asyncio.to_thread(_unlink, tmp)
            raise StorageError(f"publishing the cached copy of {self.uri_of(key)} at {path}: {exc}") from exc
        if tail is not None:
            tail.mark_published(version)
        self._memory.drop(key)
        self._evict()
        self.schedule(key)

    async def _write_whole(self, key: str, data: bytes | memoryview, op: str, generation: str | None,
                           extra: dict | None = None) -> None:
        path = self.written.path_of(key)
        await self._drop_tail(key, _TAILS.get((self.catalog.path, self.rh, key)))  # superseded by this write
        view = memoryview(data).cast("B")
        try:
            fd, tmp = await asyncio.to_thread(_open_temp, path)
        except OSError as exc:
            raise StorageError(f"opening the cached copy of {self.uri_of(key)} at {path}: {exc}") from exc
        try:
            await asyncio.to_thread(_write_all, fd, view)
        except BaseException:
            await asyncio.to_thread(_discard, fd, tmp)
            raise
        await self._publish_written(key, fd, tmp, len(view), crc32c.crc32c(view), op, generation, extra=extra)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self._write_whole(validate_key(key), data, "put", None)

    async def open_writer(self, key: str) -> ObjectWriter:
        path = self.written.path_of(validate_key(key))
        try:
            fd, tmp = await asyncio.to_thread(_open_temp, path)
        except OSError as exc:
            raise StorageError(f"opening the cached copy of {self.uri_of(key)} at {path}: {exc}") from exc
        tail = None
        if self.config.upload_while_writing and asyncio.get_running_loop() is get_scheduler().loop:  # where uploads run
            tkey = (self.catalog.path, self.rh, key)
            await self._drop_tail(key, _TAILS.get(tkey))  # an earlier write of the key is superseded
            tail = _TAILS[tkey] = TailUpload(self.remote, key, tmp, UPLOAD_PART_BYTES, self._upload_slots())
        return _TieredWriter(self, key, fd, tmp, tail)

    def _upload_slots(self) -> asyncio.Semaphore:
        return _UPLOAD_SLOTS.setdefault(self.catalog.path, asyncio.Semaphore(self.config.upload_concurrency))

    async def _drop_tail(self, key: str, tail: TailUpload | None) -> None:
        """Abandon ``tail`` (if it is still the key's) without publishing anything."""
        if tail is None:
            return
        tkey = (self.catalog.path, self.rh, key)
        if _TAILS.get(tkey) is tail:
            del _TAILS[tkey]
        sched = get_scheduler()
        if asyncio.get_running_loop() is sched.loop:
            await tail.cancel()
        else:  # tails live on the I/O loop, where uploads run
            await asyncio.wrap_future(sched.submit(tail.cancel()))

    async def commit(
        self, key: str, data: bytes | memoryview, *, expected: bytes | None | Unconditional = UNCONDITIONAL
    ) -> None:
        """Commit in the node cache if this node's view of ``key`` holds ``expected``; upload behind.

        The node's view is its pending commit of ``key`` if there is one (the compare-and-swap base of
        a write-back save is what this node committed last, uploaded or not), else the remote's (or
        its cached copy while the remote is unreachable). A key this node never saw, while the remote
        is unreachable, is accepted when ``expected`` is ``None``: the upload itself is a
        compare-and-swap against the remote state this commit builds on (``base`` in the catalogue),
        so a remote that holds another writer's commit refuses it then, and the upload fails loudly.
        """
        validate_key(key)
        data = bytes(data)
        old = self.catalog.pending(self.rh, key)
        await self._check_node_view(key, expected, old)
        try:
            generation: str | None = layout.CommitRecord.decode(data).generation
        except CorruptCheckpointError:
            generation = None  # not a tierckpt commit record: it waits for everything under its directory
        if old is not None and old["op"] == "commit":
            cas, base = old.get("cas", False), old.get("base")  # still the remote's state: inherit it
        else:
            cas, base = expected is not UNCONDITIONAL, expected.hex() if isinstance(expected, bytes) else None
        await self._write_whole(key, data, "commit", generation, {"cas": cas, "base": base})

    async def _check_node_view(self, key: str, expected: bytes | None | Unconditional, pending: dict | None) -> None:
        if expected is UNCONDITIONAL:
            return
        if pending is not None and pending["op"] == "commit":
            current: bytes | None = await self.written.get(key)
        else:
            try:
                current = await self.get(key)
            except CheckpointNotFoundError:
                current = None
            except TransientStorageError:
                if expected is None:
                    return  # a URI this node never saw, remote unreachable: the upload's CAS decides
                raise
        if current != expected:
            raise commit_refused(self.uri_of(key), expected, current)

    async def delete(self, key: str) -> None:
        validate_key(key)
        self._memory.drop(key)
        await self._drop_tail(key, _TAILS.get((self.catalog.path, self.rh, key)))
        deferred = any(
            r["op"] == "commit" and k != key for k, r in self.catalog.pending_under(self.rh).items()
        )
        dropped = self.catalog.record_delete(self.rh, key, deferred)
        await asyncio.to_thread(self._unlink_dropped, key, dropped)
        if deferred:
            self.schedule(key)
            return
        await self._upload_settled(key)  # an upload in flight must not land after the remote delete
        await self.link.delete(key)

    async def _upload_settled(self, key: str) -> None:
        """Wait for this process's upload task of ``key``, if any, to finish."""
        tkey = (self.catalog.path, self.rh, key)

        async def settle() -> None:
            task = _TASKS.get(tkey)
            if task is not None and task is not asyncio.current_task():
                await asyncio.wait([task])

        sched = get_scheduler()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is sched.loop:
            await settle()
        else:
            await asyncio.wrap_future(sched.submit(settle()))

    # -- reads -------------------------------------------------------------------------------------
    def _not_found(self, key: str) -> CheckpointNotFoundError:
        return CheckpointNotFoundError(f"{self.uri_of(key)}: no such object (deleted through the node cache)")

    async def _local_whole(self, key: str) -> tuple[LocalBackend, dict] | None:
        """The verified whole local copy of ``key``, or ``None`` (a bad copy is dropped first)."""
        for _ in range(3):
            rec = self.catalog.obj(self.rh, key)
            if rec is None:
                return None
            lb = self._tree(rec["tree"])
            path = lb.path_of(key)
            ok = await asyncio.to_thread(_verify_file, path, rec["size"], rec.get("crc"))
            if ok:
                self.catalog.touch(self.rh, key, rec=rec)
                return lb, rec
            if self.catalog.obj(self.rh, key) != rec:
                continue  # rewritten meanwhile: look again
            if rec["tree"] == "w" and self.catalog.pending(self.rh, key) is not None:
                raise CorruptCheckpointError(
                    f"the node-cache copy of {self.uri_of(key)} at {path} fails its size/CRC-32C check and has "
                    "not reached the remote yet: the local disk corrupted it; save the checkpoint again"
                )
            logger.warning("dropping corrupt cached copy of %s at %s; fetching it again", self.uri_of(key), path)
            if self.catalog.drop(self.rh, key, tree=rec["tree"]):
                await asyncio.to_thread(_unlink, path)
        return None

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
            data = await self.link.get(key)
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
            return await local[0].get(key)
        await self._store_fetched(key, data)
        return data

    async def get(self, key: str) -> bytes:
        validate_key(key)
        pending = self.catalog.pending(self.rh, key)
        if pending is not None and pending["op"] == "delete":
            raise self._not_found(key)
        if is_mutable(key) and pending is None:
            return await self._remote_commit_record(key)
        data = self._memory.get(key)
        if data is not None:
            return data
        local = await self._local_whole(key)
        if local is not None:
            try:
                data = await local[0].get(key)
            except CheckpointNotFoundError:
                data = None  # evicted under us
            if data is not None:
                if not is_mutable(key):
                    self._memory.put(key, data)
                return data
        size = self.catalog.known_size(self.rh, key)
        if size is not None and size > self.config.block_bytes:
            return await self._range_from_blocks(key, 0, size, size)
        data = await self.link.get(key)
        await self._store_fetched(key, data)
        self._memory.put(key, data)
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
        if pending is not None and pending["op"] == "delete":
            raise self._not_found(key)
        data = self._memory.get(key) if not is_mutable(key) else None
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
            if end > rec["size"]:
                raise range_past_end(self.uri_of(key), start, end, rec["size"])
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
            data = await asyncio.to_thread(_read_file, self._blocks.path_of(bkey))
            if data is not None and len(data) == rec["len"] == length and crc32c.crc32c(data) == rec["crc"]:
                self.catalog.touch(self.rh, key, idx, rec=rec)
                return data
            logger.warning("dropping bad cached block %d of %s; fetching it again", idx, self.uri_of(key))
            self.catalog.drop(self.rh, key, idx)
            await asyncio.to_thread(_unlink, self._blocks.path_of(bkey))
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
            return pending["op"] != "delete"
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
        if pending is not None and pending["op"] == "delete":
            raise self._not_found(key)
        if is_mutable(key) and pending is None:
            return len(await self.get(key))
        rec = self.catalog.obj(self.rh, key)
        if rec is not None and os.path.isfile(self._tree(rec["tree"]).path_of(key)):
            return rec["size"]
        return await self._remote_size(key)

    async def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        pending = self._pending_with_nested(prefix)
        try:
            keys = set(await self.link.list(prefix))
        except StorageError as exc:
            if not _offline(exc):
                raise
            logger.warning("remote unreachable (%s); listing %s from the node cache", exc, self.root_uri)
            keys = self.catalog.cached_keys(self.rh, prefix)
        keys |= {k for k, r in pending.items() if r["op"] != "delete"}
        keys -= {k for k, r in pending.items() if r["op"] == "delete"}
        return sorted(keys)

    def _pending_with_nested(self, prefix: str) -> dict[str, dict]:
        """Pending ops under ``prefix``: this root's, and those of roots nested in it (e.g. each step's
        own URI under a run's root), as keys of this root — so a listing shows what is committed in
        the node cache but not uploaded yet, wherever it was written from."""
        pending = self.catalog.pending_under(self.rh, prefix)
        base = self.root_uri.rstrip("/") + "/"
        for rh, uri in self.catalog.roots().items():
            if rh == self.rh or not uri.startswith(base):
                continue
            nested = uri[len(base):].strip("/")
            for key, rec in self.catalog.pending_under(rh).items():
                full = f"{nested}/{key}"
                if full.startswith(prefix):
                    pending.setdefault(full, rec)
        return pending

    # -- uploads (on the scheduler's loop) -----------------------------------------------------------
    def schedule(self, key: str) -> None:
        """Make sure an upload task of this process handles the pending op of ``key``."""
        loop = get_scheduler().loop
        loop.call_soon_threadsafe(self._ensure_task, key)

    def _ensure_task(self, key: str) -> None:
        tkey = (self.catalog.path, self.rh, key)
        if tkey not in _TASKS:
            _TASKS[tkey] = asyncio.get_running_loop().create_task(self._drain(key, tkey))

    def _adopt(self, records: dict[str, dict]) -> None:
        """Schedule ops whose owner is this process or dead (a crashed save)."""
        me = os.getpid()
        for key, rec in records.items():
            if rec["owner"] == me or not pid_alive(rec["owner"]):
                self.schedule(key)

    async def _drain(self, key: str, tkey: tuple[str, str, str]) -> None:
        """Upload the pending op of ``key`` (and any that replaces it meanwhile). A transient failure
        (an outage) is recorded and retried with a growing pause, so write-back covers an outage; any
        other failure is recorded and ends the task (``sync`` retries it, ``sync --drop`` discards it)."""
        pause = RETRY_PAUSE_S
        set_background()  # this task's remote calls queue behind loads
        try:
            while True:
                rec = self.catalog.pending(self.rh, key)
                if rec is None:
                    return
                if rec["owner"] != os.getpid() and pid_alive(rec["owner"]):
                    return  # another live process on this node uploads it
                if not self.catalog.claim(self.rh, key, rec["ver"]):
                    continue
                try:
                    performed = await self._perform(key, rec)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - recorded; wait()/sync() report it
                    current = self.catalog.pending(self.rh, key)
                    if current is None or current["ver"] != rec["ver"]:
                        continue  # superseded while it was uploading (rewritten or deleted)
                    message = describe_error(exc)
                    retrying = isinstance(exc, TransientStorageError)
                    self.catalog.fail(self.rh, key, rec["ver"], message, retrying=retrying)
                    logger.warning("upload of %s failed%s: %s", self.uri_of(key),
                                   f" (retrying in {pause:.0f} s)" if retrying else "", message)
                    if not retrying:
                        return
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, MAX_RETRY_PAUSE_S)
                    continue
                if not performed:
                    continue
                outcome = self.catalog.finish(self.rh, key, rec["ver"])
                if outcome == "gone" and rec["op"] != "delete":
                    try:  # deleted while it was uploading: do not leave it behind on the remote
                        await self.link.delete(key)
                    except CheckpointError as exc:
                        logger.warning("could not remove %s after a delete: %s", self.uri_of(key), exc)
                if outcome != "changed":
                    return
        finally:
            if _TASKS.get(tkey) is asyncio.current_task():
                del _TASKS[tkey]

    async def _perform(self, key: str, rec: dict) -> bool:
        """Apply one pending op to the remote; False if it was superseded while waiting."""
        op = rec["op"]
        if op == "put":
            if await self._complete_tail(key, rec):
                return True
            async with self._upload_slots():
                await self.link.call("upload", self._upload_file, key, rec, nbytes=rec["size"])
            return True
        if op == "commit":
            if not await self._wait_for_generation(key, rec):
                return False
            data = await self.written.get(key)
            if crc32c.crc32c(data) != (self.catalog.obj(self.rh, key) or {}).get("crc"):
                return False  # rewritten meanwhile
            await self.link.call("commit", self._upload_commit, key, data, rec, nbytes=len(data))
            return True
        while True:  # delete: after every commit recorded before it
            current = self.catalog.pending(self.rh, key)
            if current is None or current["ver"] != rec["ver"]:
                return False
            commits = {k: r for k, r in self.catalog.pending_under(self.rh).items()
                       if r["op"] == "commit" and r["ver"] < rec["ver"]}
            if not commits:
                break
            self._adopt(commits)
            await asyncio.sleep(self.config.poll_s)
        await self.link.delete(key)
        return True

    async def _upload_commit(self, key: str, data: bytes, rec: dict) -> None:
        """Upload a commit as a compare-and-swap against the remote state it was built on (``base``).

        A refusal is accepted only when the remote holds this very record (a retried request whose
        first attempt landed) or a commit this node uploaded after ``base`` was recorded (its earlier
        commit overtook this one's record); then it is retried against that. Anything else is another
        writer's commit: the upload fails and the checkpoint stays committed on this node only."""
        expected: bytes | None | Unconditional = UNCONDITIONAL
        if rec.get("cas"):
            expected = None if rec.get("base") is None else bytes.fromhex(rec["base"])
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
        return gen_path is not None and self.catalog.generation_state(self.rh, gen_path) == "remote"

    async def _complete_tail(self, key: str, rec: dict) -> bool:
        """Publish the upload that followed this very write of ``key``, if there is one and it sent
        exactly the recorded bytes; ``False``: upload the file from the local copy."""
        tkey = (self.catalog.path, self.rh, key)
        tail = _TAILS.get(tkey)
        if tail is None or not tail.sealed:
            return False  # none, or it follows a newer write still in progress
        version = await tail.published_version()
        if version != rec["ver"]:
            if version is None or version < rec["ver"]:
                await self._drop_tail(key, tail)  # its write failed or was superseded
            return False
        del _TAILS[tkey]
        obj = self.catalog.obj(self.rh, key)
        if obj is None or obj["size"] != rec["size"]:
            await tail.cancel()
            return False
        return await tail.complete(rec["size"], obj["crc"])

    async def _upload_file(self, key: str, rec: dict) -> None:
        """Stream the local copy of ``key`` to the remote, checking its CRC before publishing it."""
        path = self.written.path_of(key)
        obj = self.catalog.obj(self.rh, key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"the node-cache copy of {self.uri_of(key)} at {path} vanished before its upload; save again"
            ) from None
        try:
            size = os.fstat(fd).st_size
            expected = None if obj is None or obj["size"] != size else obj.get("crc")
            if size <= UPLOAD_PART_BYTES:
                data = await asyncio.to_thread(os.pread, fd, size, 0)
                if expected is not None and crc32c.crc32c(data) != expected:
                    raise self._corrupt_upload(key, path)
                await self.remote.put(key, data)
                return
            writer = await self.remote.open_writer(key)
            try:
                crc = 0
                for offset in range(0, size, UPLOAD_PART_BYTES):
                    chunk = await asyncio.to_thread(os.pread, fd, min(UPLOAD_PART_BYTES, size - offset), offset)
                    crc = crc32c.crc32c(chunk, crc)
                    await writer.write(chunk)
                if expected is not None and crc != expected:
                    raise self._corrupt_upload(key, path)
            except BaseException:
                await writer.abort()
                raise
            await writer.close()
        finally:
            os.close(fd)

    def _corrupt_upload(self, key: str, path: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"the node-cache copy of {self.uri_of(key)} at {path} fails its CRC-32C check; it was not uploaded. "
            "Save the checkpoint again"
        )

    async def _wait_for_generation(self, key: str, rec: dict) -> bool:
        """Wait until the generation a commit names is complete on the remote; False if superseded."""
        base = key.rpartition("/")[0]
        gen = rec.get("gen")
        gen_path = (f"{base}/{gen}" if base else gen) if gen else None
        prefix = f"{gen_path}/" if gen_path else (f"{base}/" if base else "")
        while True:
            current = self.catalog.pending(self.rh, key)
            if current is None or current["ver"] != rec["ver"]:
                return False
            deps = {k: r for k, r in self.catalog.pending_under(self.rh, prefix).items()
                    if k != key and r["op"] != "delete" and not is_mutable(k)}
            failed = sorted((k, r["error"]) for k, r in deps.items() if r.get("error") and not r.get("retrying"))
            if failed:
                raise StorageError(f"not uploaded: {self.uri_of(failed[0][0])} failed ({failed[0][1]})")
            if not deps and (gen_path is None or await self._remote_has_generation(gen_path)):
                return True
            self._adopt(deps)
            await asyncio.sleep(self.config.poll_s if deps else max(self.config.poll_s, 0.5))

    async def _remote_has_generation(self, gen_path: str) -> bool:
        """Whether the remote holds the metadata and every file the generation's header lists."""
        if gen_path in self._files_checked:
            return True
        try:
            header = decode_header(await self.get(layout.header_key(gen_path)))
        except CheckpointNotFoundError:
            return True  # no header: nothing to check beyond the local pending ops
        except CorruptCheckpointError:
            return True
        wanted = {layout.header_key(gen_path): None, layout.tensors_key(gen_path): None,
                  layout.pieces_key(gen_path): None}
        wanted.update({f"{gen_path}/{f.key}": f.size for f in header.files})
        for k, size in wanted.items():
            try:
                actual = await self.link.size(k)
            except CheckpointNotFoundError:
                return False  # not there yet (a rank on another node still uploads it)
            if size is not None and actual != size:
                return False
        self._files_checked.add(gen_path)
        return True

    # -- durability --------------------------------------------------------------------------------
    def _relevant(self, generation: str | None) -> dict[str, dict]:
        pending = self.catalog.pending_under(self.rh)
        if generation is None:
            return pending
        name = generation.rstrip("/").rpartition("/")[2]
        return {k: r for k, r in pending.items()
                if (generation_path(k) or "").rpartition("/")[2] == name or r.get("gen") == name}

    async def wait_durable(self, generation: str | None = None, timeout_s: float | None = None, *,
                           through_outage: bool = True) -> None:
        """Wait until every pending op (of ``generation``, a name or ``dir/name``) reached the remote.

        Raises :class:`StorageError` when an upload failed for good (a missing bucket, denied access), and
        :class:`TransientStorageError` at ``timeout_s``; with ``through_outage=False`` (a synchronous save)
        also as soon as an upload failed transiently (it goes on retrying in the background)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        adopted = False
        while True:
            pending = self._relevant(generation)
            if not pending:
                return
            failed = {k: r["error"] for k, r in pending.items()
                      if r.get("error") and not (through_outage and r.get("retrying"))}
            if failed:
                key, error = sorted(failed.items())[0]
                raise StorageError(
                    f"upload of {self.uri_of(key)} failed ({error}); {len(pending)} object(s) of the checkpoint are "
                    f"committed in this node's cache only. Fix the remote, then run: tierckpt sync {self.root_uri} "
                    f"(or drop them: tierckpt sync --drop {self.root_uri})"
                )
            if not adopted:
                self._adopt(pending)
                adopted = True
            if deadline is not None and time.monotonic() > deadline:
                raise TransientStorageError(
                    f"{len(pending)} object(s) of {self.root_uri} did not reach the remote within {timeout_s} s "
                    f"(e.g. {sorted(pending)[0]!r}); they stay in the node cache and upload in the background"
                )
            await asyncio.sleep(self.config.poll_s)

    async def sync(self, timeout_s: float | None = None) -> None:
        """Resume every pending op of this store (left by this or a dead process), then wait for them."""
        me = os.getpid()
        for key, rec in self.catalog.pending_under(self.rh).items():
            if rec.get("error") or rec["owner"] == me or not pid_alive(rec["owner"]):
                self.catalog.claim(self.rh, key, rec["ver"])
                self.schedule(key)
        await self.wait_durable(None, timeout_s)

    async def status(self) -> StoreStatus:
        """What is committed on this node and on the remote, and what is still pending (see :class:`StoreStatus`)."""
        pending = self.catalog.pending_under(self.rh)
        generation: str | None = None
        state: Durability | None = None
        remote_generation, remote_error = await self._remote_generation()
        commit = pending.get(layout.COMMIT)
        if commit is not None and commit["op"] == "commit":
            generation = commit.get("gen")
        else:
            try:
                generation = layout.CommitRecord.decode(await self.get(layout.COMMIT)).generation
            except (CheckpointNotFoundError, TransientStorageError):
                generation = None
        if generation is not None:
            # no pending commit: this COMMIT came from the remote (uploaded, or fetched from it)
            state = Durability.LOCAL if commit is not None else Durability.REMOTE
        elif any(r["op"] == "put" for r in pending.values()):
            state = Durability.STAGED
        return StoreStatus(
            uri=self.root_uri,
            generation=generation,
            state=state,
            pending_keys=tuple(sorted(pending)),
            pending_bytes=sum(r.get("size", 0) for r in pending.values()),
            errors=tuple(f"{k}: {r['error']}" for k, r in sorted(pending.items()) if r.get("error")),
            remote_generation=remote_generation,
            remote_error=remote_error,
        )

    async def _remote_generation(self) -> tuple[str | None, str | None]:
        """The generation the remote's own COMMIT names, and why it could not be read (else ``None``)."""
        try:
            data = await self.link.call("get", self.remote.get, layout.COMMIT, retries=2)
        except CheckpointNotFoundError as exc:
            return None, (str(exc) if "bucket" in str(exc) else None)
        except CheckpointError as exc:
            return None, describe_error(exc)
        try:
            return layout.CommitRecord.decode(data).generation, None
        except CorruptCheckpointError as exc:
            return None, describe_error(exc)

    async def drop_pending(self) -> list[str]:
        """Discard every upload still pending to this store (e.g. to a mistyped bucket): the objects stay
        readable in the node cache until evicted, but never reach the remote. Returns the keys dropped."""
        await self.cancel_uploads()
        pending = self.catalog.pending_under(self.rh)
        for key in pending:
            self.catalog.drop_pending(self.rh, key)
        return sorted(pending)

    async def cancel_uploads(self) -> None:
        """Stop this process's upload tasks for this store; the ops stay pending for ``sync()``."""

        async def cancel() -> None:
            for (path, rh, key), tail in list(_TAILS.items()):
                if path == self.catalog.path and rh == self.rh:
                    await self._drop_tail(key, tail)
            tasks = [t for (path, rh, _), t in list(_TASKS.items()) if path == self.catalog.path and rh == self.rh]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        await asyncio.wrap_future(get_scheduler().submit(cancel()))

    async def close(self) -> None:
        """Nothing to release: uploads keep running in the background (see :meth:`wait_durable`)."""


# -- draining at exit -----------------------------------------------------------------------------
def exit_wait_s() -> float:
    """How long the exit drain may wait: the longest ``exit_wait_s`` of the caches this process opened."""
    return max(_CATALOGS.values(), default=0.0)


def _live_catalogs() -> list[str]:
    """The cache directories this process opened that still exist (tests remove theirs)."""
    return sorted(d for d in _CATALOGS if os.path.exists(os.path.join(d, "catalog.lmdb")))


def drain_uploads(timeout_s: float) -> list[str]:
    """Wait up to ``timeout_s`` for this process's uploads to finish (on the scheduler's loop, which
    must still run); return one line per store left with pending ops owned by this process, naming the
    command that finishes them. Called by the exit drain (see :mod:`tierckpt.saver`)."""

    me = os.getpid()

    def mine() -> list[dict]:
        return [rec for d in _live_catalogs() for _, _, rec in Catalog(d).pending_all() if rec["owner"] == me]

    async def wait() -> None:
        deadline = time.monotonic() + timeout_s
        last, since = -1, time.monotonic()
        while _TASKS and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(list(_TASKS.values()), timeout=min(left, 0.5))
            recs = mine()
            if len(recs) != last:
                last, since = len(recs), time.monotonic()
            elif any(r.get("error") for r in recs) and time.monotonic() - since > EXIT_STALL_S:
                return  # failing, and nothing reached the remote for a while: report instead of waiting

    if _TASKS:
        get_scheduler().run(wait())
    lines = []
    for directory in _live_catalogs():
        catalog = Catalog(directory)
        roots = catalog.roots()
        mine: dict[str, list[dict]] = {}
        for rh, _, rec in catalog.pending_all():
            if rec["owner"] == me and rh in roots:
                mine.setdefault(roots[rh], []).append(rec)
        for uri, recs in sorted(mine.items()):
            errors = [r["error"] for r in recs if r.get("error")]
            why = f"failed: {errors[0]}" if errors else "not finished"
            lines.append(
                f"tierckpt: {len(recs)} upload(s) to {uri} did not finish before exit ({why}); what they hold is "
                f"committed in this node's cache only. Finish them: TIERCKPT_CACHE_DIR={directory} tierckpt sync "
                f"{uri} (or discard them: tierckpt sync --drop {uri})"
            )
    return lines
