"""``TieredBackend``: a remote backend behind a node-local write-back, read-through cache.

Tiers, fastest first: an in-process memory tier (whole small immutable objects, e.g. metadata),
the local disk tier under ``<cache dir>`` (shared by every process on the node), the remote.

Disk layout, ``rh`` being a hash of the remote root URI and the service that holds it (:func:`root_hash`)::

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
3. A ``COMMIT`` (``commit``) is uploaded only after every object its writer listed in ``after`` is on
   the remote (this node's pending uploads first; files written by ranks on other nodes go through
   their own caches, so the remote is asked for each with its size), as a compare-and-swap against
   the remote state it was built on. The generation then moves ``staged`` -> ``local`` -> ``remote``.
4. ``delete`` while a commit is pending is deferred on the remote until that commit is uploaded,
   so a remote reader never follows a COMMIT to a deleted generation (the saver deletes the
   previous generation right after committing).
5. A process that dies leaves its pending ops in the catalogue; :meth:`TieredBackend.sync` (or
   ``tierckpt.sync``) in any later process adopts and finishes them.

This module holds the store and its writes; reads are in ``readthrough.py``, uploads in
``uploads.py``, the durability API in ``durable.py`` (``sync``, ``wait_durable``, ``withdraw`` and the
delete's deferral are the write-back link core's, :class:`~tierckpt.node.link.WriteBackLink`, whose hooks
those answer); this process's upload tasks belong to the
``Uploader`` passed in (``uploader.py``; :func:`tierckpt.store.uploader_of` keeps one per directory).

``COMMIT`` records are the only mutable objects of the layout: reads of them go to the remote
(falling back to the cached copy when the remote is unreachable); every other object is treated as
immutable once cached, except for overwrites made through this cache.
"""

from __future__ import annotations

from collections.abc import Mapping

import asyncio
import hashlib
import os
from types import MappingProxyType

import crc32c

from tierckpt.native import layout
from tierckpt.backends.base import UNCONDITIONAL, Backend, ObjectWriter, ReadsInto, Unconditional
from tierckpt.backends.commit_check import commit_refused
from tierckpt.backends.files import copy_range, discard, fsync_dir, open_temp, unlink, write_all
from tierckpt.backends.local import LocalBackend
from tierckpt.errors import (
    CheckpointBusyError, CheckpointError, CheckpointNotFoundError,
)
from tierckpt.io.scheduled import ScheduledBackend
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native.keys import validate_key
from tierckpt.node import ledger
from tierckpt.node.ledger import Tier
from tierckpt.node.link import WriteBackLink
from tierckpt.node.nodeview import check_node_view
from tierckpt.node.written import CrcWriter, WrittenCrc
from tierckpt.node.disk.config import CacheConfig, cache_error
from tierckpt.node.disk.durable import CacheWithdrawal, DurableMixin
from tierckpt.node.disk.local_files import SmallObjects
from tierckpt.node.disk.readthrough import ReadThroughMixin
from tierckpt.node.disk.records import CommitOrder, Op, PendingOp, Tree
from tierckpt.node.disk.tail_upload import TailUpload
from tierckpt.node.disk.uploader import Uploader
from tierckpt.node.disk.uploads import UPLOAD_PART_BYTES, UploadsMixin

def root_hash(root_uri: str, service: str) -> str:
    """Name of a remote root's directory in the cache: the root URI where the bytes go, ``service`` (the
    backend's :attr:`~tierckpt.backends.base.Backend.service`, e.g. a bucket at its endpoint) included, so
    one bucket and path on two S3 endpoints never share an entry, a pending upload or a read."""
    return hashlib.sha256(f"{root_uri.rstrip('/')}\0{service}".encode()).hexdigest()[:24]


def block_key(key: str, idx: int) -> str:
    """Name of block ``idx`` of object ``key`` under a root's ``blocks/`` directory."""
    h = hashlib.sha1(key.encode()).hexdigest()
    return f"{h[:2]}/{h}.{idx:08d}"


def cached_path(directory: str, rh: str, key: str, tree: Tree, idx: int | None) -> str:
    """Where the cache in ``directory`` keeps ``key`` of root ``rh``: written or fetched whole, or block ``idx``."""
    if tree == Tree.BLOCK:
        return os.path.join(directory, "blocks", rh, *block_key(key, idx or 0).split("/"))
    return os.path.join(directory, "objects" if tree == Tree.WRITTEN else "fetched", rh, *key.split("/"))


class _TieredWriter(CrcWriter):
    """Streams into a temp file of the local tier; ``close`` publishes it and records the upload."""

    def __init__(self, store: TieredBackend, key: str, fd: int, tmp: str, tail: TailUpload | None) -> None:
        self._store, self._key, self._fd, self._tmp, self._tail = store, key, fd, tmp, tail
        self._uri = store.uri_of(key)
        self._written = WrittenCrc(self._uri, Tier.NODE_DISK)

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open()
        view = memoryview(data).cast("B")
        await self._written.add_async(view)
        try:
            await asyncio.to_thread(write_all, self._fd, view)
        except OSError as exc:
            raise cache_error(self._store.config.directory, f"writing the cached copy of {self._uri}", exc) from exc
        if self._tail is not None:
            self._tail.advance(len(view))

    async def write_file(self, fd: int, offset: int, length: int, pages: memoryview | None = None) -> None:
        """Append ``length`` bytes of the local file ``fd`` kernel-side (a :class:`~tierckpt.node.copy.FileSink`:
        the memory tier's write-down lands so, its CRC-32C stated). Not from ``pages`` with ``O_DIRECT``:
        the cache file is read again by its upload, which its page cache serves."""
        self._check_open()
        self._written.copied(length)
        try:
            await asyncio.to_thread(copy_range, fd, self._fd, offset, length)
        except OSError as exc:
            raise cache_error(self._store.config.directory, f"writing the cached copy of {self._uri}", exc) from exc
        if self._tail is not None:
            self._tail.advance(length)

    async def close(self) -> None:
        self._check_open()
        try:
            entry = self._written.entry()
        except CheckpointError:
            await self.abort()
            raise
        self._done = True
        if self._tail is not None:
            self._tail.seal()
        try:
            await self._store._publish_written(
                self._key, self._fd, self._tmp, entry.size, entry.crc32c, Op.PUT, None, self._tail
            )
        except BaseException:
            await self._store._drop_tail(self._key, self._tail)
            raise

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        await self._store._drop_tail(self._key, self._tail)
        await asyncio.to_thread(discard, self._fd, self._tmp)


class TieredBackend(ReadThroughMixin, UploadsMixin, DurableMixin, ReadsInto, WriteBackLink[CacheWithdrawal]):
    """A write-back, read-through cache in front of ``remote``, on the write-back link core; see the module docstring."""

    schedules_itself = True
    """Its remote calls go through its scheduling link; callers add no slots or retries of their own."""

    def __init__(self, remote: Backend, config: CacheConfig, uploader: Uploader) -> None:
        link = remote if isinstance(remote, ScheduledBackend) else ScheduledBackend(remote)
        super().__init__(link, remote.root_uri)
        self.link = link
        """The remote behind its scheduling link (every network call of this tier goes through it)."""
        self.remote = self.link.inner
        self.config = config
        self.capabilities = remote.capabilities
        self.rh = root_hash(remote.root_uri, self.remote.service)
        if os.path.realpath(uploader.directory) != os.path.realpath(config.directory):
            raise ValueError(f"the uploader of {uploader.directory} cannot serve the cache {config.directory}")
        self.uploader = uploader
        """This process's uploads and catalogue of the cache directory (one per directory: store.uploader_of)."""
        self.catalog = uploader.catalog
        self.journal = self.catalog
        self.catalog.register_root(self.rh, remote.root_uri, self.remote.service)
        d = self.config.directory
        self.written = LocalBackend(os.path.join(d, "objects", self.rh))
        self.fetched = LocalBackend(os.path.join(d, "fetched", self.rh))
        self._blocks = LocalBackend(os.path.join(d, "blocks", self.rh))
        self._small = SmallObjects(self.config.memory_bytes, self.config.memory_object_bytes)
        self._files_checked: set[str] = set()

    def __repr__(self) -> str:
        return f"TieredBackend({self.remote!r}, cache={self.config.directory!r})"

    def _tree(self, tree: Tree) -> LocalBackend:
        return self.written if tree == Tree.WRITTEN else self.fetched

    @staticmethod
    def _block_key(key: str, idx: int) -> str:
        return block_key(key, idx)

    def _unlink_dropped(self, key: str, dropped: list[tuple[Tree, int | None]], rh: str | None = None) -> None:
        """Delete the cached files of ``key`` (of this store, or of root ``rh``) the catalogue dropped."""
        for tree, idx in dropped:
            unlink(cached_path(self.config.directory, rh or self.rh, key, tree, idx))

    def _evict(self) -> None:
        if self.catalog.usage() <= self.config.disk_bytes:
            return
        for rh, key, tree, idx in self.catalog.evict(self.config.disk_bytes):
            unlink(cached_path(self.config.directory, rh, key, tree, idx))
            if rh == self.rh:
                self._small.drop(key)

    # -- writes ------------------------------------------------------------------------------------
    async def _publish_written(self, key: str, fd: int, tmp: str, size: int, crc: int, op: Op,
                               generation: str | None, tail: TailUpload | None = None,
                               order: CommitOrder | None = None,
                               replaces: int | None | Unconditional = UNCONDITIONAL) -> None:
        """Put the written temp file ``tmp`` in place and record it (``replaces``: see
        :meth:`~tierckpt.node.disk.catalog.Catalog.record_write`), then schedule its upload."""
        path = self.written.path_of(key)

        def publish() -> int:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

            def rename() -> None:
                os.replace(tmp, path)
                fsync_dir(os.path.dirname(path))

            version, dropped = self.catalog.record_write(self.rh, key, size, crc, op, generation, publish=rename,
                                                         order=order, replaces=replaces)
            self._unlink_dropped(key, dropped)
            return version

        try:
            version = await asyncio.to_thread(publish)
        except (OSError, CheckpointBusyError) as exc:
            await asyncio.to_thread(unlink, tmp)
            if isinstance(exc, CheckpointBusyError):
                raise
            raise cache_error(self.config.directory, f"publishing the cached copy of {self.uri_of(key)} at {path}", exc) from exc
        if tail is not None:
            tail.mark_published(version)
        self._small.drop(key)
        self._evict()
        self.schedule(key)

    async def _write_whole(self, key: str, data: bytes | memoryview, op: Op, generation: str | None,
                           order: CommitOrder | None = None,
                           replaces: int | None | Unconditional = UNCONDITIONAL) -> None:
        path = self.written.path_of(key)
        await self._drop_tail(key, self.uploader.tails.get((self.rh, key)))  # superseded by this write
        view = memoryview(data).cast("B")
        try:
            fd, tmp = await asyncio.to_thread(open_temp, path)
        except OSError as exc:
            raise cache_error(self.config.directory, f"opening the cached copy of {self.uri_of(key)} at {path}", exc) from exc
        try:
            await asyncio.to_thread(write_all, fd, view)
            ledger.landed(Tier.NODE_DISK, view.nbytes)
        except BaseException as exc:
            await asyncio.to_thread(discard, fd, tmp)
            if isinstance(exc, OSError):
                raise cache_error(self.config.directory, f"writing the cached copy of {self.uri_of(key)}", exc) from exc
            raise
        await self._publish_written(key, fd, tmp, len(view), crc32c.crc32c(view), op, generation, order=order,
                                    replaces=replaces)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self._write_whole(validate_key(key), data, Op.PUT, None)

    async def open_writer(self, key: str) -> ObjectWriter:
        path = self.written.path_of(validate_key(key))
        try:
            fd, tmp = await asyncio.to_thread(open_temp, path)
        except OSError as exc:
            raise cache_error(self.config.directory, f"opening the cached copy of {self.uri_of(key)} at {path}", exc) from exc
        tail = None
        if self.config.upload_while_writing and asyncio.get_running_loop() is get_scheduler().loop:  # where uploads run
            tkey = (self.rh, key)
            await self._drop_tail(key, self.uploader.tails.get(tkey))  # an earlier write of the key is superseded
            tail = self.uploader.tails[tkey] = TailUpload(self.remote, key, tmp, UPLOAD_PART_BYTES, self._upload_slots())
        return _TieredWriter(self, key, fd, tmp, tail)

    def _upload_slots(self) -> asyncio.Semaphore:
        return self.uploader.slots()

    async def _drop_tail(self, key: str, tail: TailUpload | None, rh: str | None = None) -> None:
        """Abandon ``tail`` (if it is still the key's, of this root or of root ``rh``) without publishing anything."""
        if tail is None:
            return
        tkey = (rh or self.rh, key)
        if self.uploader.tails.get(tkey) is tail:
            del self.uploader.tails[tkey]
        sched = get_scheduler()
        if asyncio.get_running_loop() is sched.loop:
            await tail.cancel()
        else:  # tails live on the I/O loop, where uploads run
            await asyncio.wrap_future(sched.submit(tail.cancel()))

    async def commit(
        self, key: str, data: bytes | memoryview, *, expected: bytes | None | Unconditional = UNCONDITIONAL,
        after: Mapping[str, int | None] | None = None,
    ) -> None:
        """Commit in the node cache if this node's view of ``key`` holds ``expected``; upload behind,
        once every object in ``after`` (the writer's statement of what the commit depends on) is on the
        remote — written through this node or any other. Without ``after``, everything pending under
        ``key``'s directory goes first.

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
        generation = layout.CommitRecord.generation_in(data)  # None: it waits for everything under its directory
        replaced: tuple[str, ...] = ()
        if old is not None and old.op == Op.COMMIT and old.order is not None:
            cas, base = old.order.cas, old.order.base  # still the remote's state: inherit it
            replaced = (*old.order.replaced, old.gen) if old.gen else old.order.replaced
        else:
            cas, base = expected is not UNCONDITIONAL, expected if isinstance(expected, bytes) else None
        order = CommitOrder(cas=cas, base=base, after=None if after is None else MappingProxyType(dict(after)),
                            replaced=replaced)
        replaces = UNCONDITIONAL if expected is UNCONDITIONAL else None if old is None else old.ver
        try:
            await self._write_whole(key, data, Op.COMMIT, generation, order, replaces)
        except CheckpointBusyError as exc:  # another job of this node committed since the check
            raise commit_refused(self.uri_of(key), None if expected is UNCONDITIONAL else expected,
                                 "another job's commit, recorded on this node meanwhile") from exc

    async def _check_node_view(self, key: str, expected: bytes | None | Unconditional,
                               pending: PendingOp | None) -> None:
        """The engine's check (:func:`~tierckpt.node.nodeview.check_node_view`) against this node's view of
        ``key``: its pending commit, else the remote's (the upload's CAS decides while it is unreachable)."""

        async def node_view() -> bytes | None:
            if pending is not None and pending.op == Op.COMMIT:
                return await self.written.get(key)
            try:
                return await self.get(key)
            except CheckpointNotFoundError:
                return None

        await check_node_view(self.uri_of(key), expected, node_view)

    async def delete(self, key: str) -> None:
        """Drop ``key`` from this node's cache now, and from the remote by the link core's one rule: after a
        pending ``COMMIT`` (:meth:`~tierckpt.node.link.WriteBackLink._delete_below`)."""
        validate_key(key)
        self._small.drop(key)
        await self._drop_tail(key, self.uploader.tails.get((self.rh, key)))
        await self._delete_below(key, exact=True)

    def _commit_pending(self, what: str) -> bool:
        """Whether the catalogue holds a pending ``COMMIT`` of this store other than ``what``."""
        return any(r.op == Op.COMMIT and k != what for k, r in self.catalog.pending_under(self.rh).items())

    async def _delete_now(self, what: str, *, exact: bool, superseded: str | None) -> None:
        """Forget the cached ``what``, let an upload of it in flight land, then delete it on the remote."""
        await self._forget_cached(what, deferred=False)
        await self._upload_settled(what)  # an upload in flight must not land after the remote delete
        await self.link.delete(what)

    async def _delete_after_commit(self, what: str, *, exact: bool, superseded: str | None) -> None:
        """Forget the cached ``what`` and record its delete as a pending op: its upload waits for every
        ``COMMIT`` recorded before it (:meth:`~tierckpt.node.disk.uploads.UploadsMixin._waits_for`)."""
        await self._forget_cached(what, deferred=True)
        self.schedule(what)

    async def _forget_cached(self, key: str, *, deferred: bool) -> None:
        """Drop the cached copies and pending op of ``key``; ``deferred``: record its delete as pending."""
        dropped = self.catalog.record_delete(self.rh, key, deferred)
        await asyncio.to_thread(self._unlink_dropped, key, dropped)

    async def _upload_settled(self, key: str) -> None:
        """Wait for this process's upload task of ``key``, if any, to finish."""
        tkey = (self.rh, key)
        await self.uploader.runner.settle(lambda k: k == tkey)

    async def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix``: on the remote, in this node's cache, and what stores rooted
        under it (each step's own URI under a run's root) wrote through this cache. Their pending ops are
        dropped (an upload in flight removes what it landed: the catalogue says the key is gone) and their
        cached files deleted, so no caller needs to know the cache's scopes, no upload lands after the
        remote delete, and a deleted checkpoint is never read back from the cache."""
        for rh in self._roots_under(prefix):
            await self._forget_root(rh)
        await super().delete_prefix(prefix)

    def _roots_under(self, prefix: str) -> list[str]:
        """Hashes of the other roots of this cache whose URI lies under ``prefix`` of this root."""
        base = self.root_uri.rstrip("/") + "/" + prefix
        return [rh for rh, uri in self.catalog.roots(self.remote.service).items()
                if rh != self.rh and (uri.rstrip("/") + "/").startswith(base)]

    async def _forget_root(self, rh: str) -> None:
        """Forget everything this node's cache holds or owes for root ``rh``, then let this process's
        uploads of it settle (each removes from the remote what it landed after being forgotten)."""
        for key in self.catalog.keys_of_root(rh):
            tail = self.uploader.tails.get((rh, key))
            if tail is not None:
                await self._drop_tail(key, tail, rh)
            dropped = self.catalog.record_delete(rh, key, deferred=False)
            await asyncio.to_thread(self._unlink_dropped, key, dropped, rh)
        self.catalog.forget_generations(rh, "")
        await self.uploader.runner.settle(lambda tkey: tkey[0] == rh)

    async def close(self) -> None:
        """Nothing to release: uploads keep running in the background (see :meth:`wait_durable`)."""


