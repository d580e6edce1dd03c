"""Public functions of the node cache (synchronous; re-exported from ``tierckpt``). They sit above
:mod:`tierckpt.store` and open every store through :func:`~tierckpt.store.open_store`, so they share the
process's uploads with the saves that started them.

* :func:`open_tiered` — the backend for a URI, cached when the scheme is remote.
* :func:`status` / :func:`wait` / :func:`sync` — durability of write-back saves (with the node memory tier
  on top when it is on for the URI, or holds the URI on this node: its levels too).
* :func:`prefetch` — pull a committed checkpoint (or some tensors of it) into the node cache.
* :func:`gc` — retention over a directory of checkpoints.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fnmatch
import os
import threading
import time
from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any


from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.call_args import merged_options, uri_text
from tierckpt.backends.bounded import MAX_RECORD_BYTES
from tierckpt.node.disk.config import CacheConfig
from tierckpt.node.levels import Level
from tierckpt.node.status import StoreStatus
from tierckpt.node.disk.tiered import TieredBackend
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, TransientStorageError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.loading.api import read_checkpoint, read_pieces
from tierckpt.progress import ByteProgress, wanted
from tierckpt.store import (
    durability_of, memory_config_held, open_cached_store, open_durable_chain, open_store, read_in_place, uploader_of,
)
from tierckpt.node.memory.config import MemoryConfig
from tierckpt.node.memory.downlog import DownLog
from tierckpt.node.memory.nodememory import NodeMemory

def open_tiered(uri: str | os.PathLike[str], config: CacheConfig | None = None, *, storage_options: Mapping[str, Any] | None = None,
                **options_kw: Any) -> Backend:
    """The store for ``uri`` (:func:`~tierckpt.store.open_store`), with ``config`` as its node cache.

    Every function of this module takes the storage options as ``storage_options=`` (as ``save``/``load``
    do) or, as before, as keyword arguments."""
    uri = uri_text("open_tiered", uri)
    options = merged_options("open_tiered", storage_options, options_kw)
    if config is not None:
        options["cache"] = config
    return open_store(uri, options)


def _tiered(uri: str, config: CacheConfig | None, storage_options: dict[str, Any]) -> TieredBackend:
    """The store for ``uri`` behind the node cache, even where :func:`open_store` would not cache (local
    paths); ``config``, else a :class:`CacheConfig` passed as the storage option ``cache``, configures it."""
    options = dict(storage_options)
    cache = options.pop("cache", None)
    config = config or (cache if isinstance(cache, CacheConfig) else None) or CacheConfig.from_env()
    return open_cached_store(uri, options, config)


def status(uri: str | os.PathLike[str], config: CacheConfig | None = None, *, storage_options: Mapping[str, Any] | None = None,
           **options_kw: Any) -> StoreStatus:
    """Where the checkpoint at ``uri`` stands on this node and on the remote: the generation committed
    on each, what is still pending upload, and the upload errors; with the node memory tier (see
    :func:`~tierckpt.store.memory_config_held`) a :class:`~tierckpt.node.status.LinkStatus`, which adds each level.

    With the node cache off (``TIERCKPT_CACHE=off``, ``config`` with ``enabled=False``, or the storage
    option ``cache=False``) the cache is not opened: without a memory tier holding ``uri``, nothing is
    committed or pending on this node, and the remote's ``COMMIT`` is read as it is.

    A local path (or ``file://``) never goes through the node cache, so it is not opened: the path is where
    the checkpoint is durable (its "remote", in the fields' terms), and what its ``COMMIT`` names is both
    ``generation`` and ``remote_generation``, at level ``remote`` (``durable``), with nothing pending."""
    uri = uri_text("status", uri)
    options = merged_options("status", storage_options, options_kw)
    cache = CacheConfig.from_env(enabled=False) if read_in_place(uri) else _cache_config(config, options)
    chain = open_durable_chain(uri, options, cache)
    durable = durability_of(chain)
    if durable is not None:
        return get_scheduler().run(durable.status())
    found = get_scheduler().run(_remote_status(uri, chain))
    if read_in_place(uri) and found.remote_generation is not None:  # committed where it is, nothing to upload
        return dataclasses.replace(found, generation=found.remote_generation, state=Level.REMOTE)
    return found


def wait(uri: str | os.PathLike[str], timeout_s: float | None = None, config: CacheConfig | None = None, *,
         storage_options: Mapping[str, Any] | None = None, **options_kw: Any) -> None:
    """Block until everything written to ``uri`` through the node cache is on the remote (COMMIT last).

    Raises :class:`~tierckpt.errors.TransientStorageError` on timeout and
    :class:`~tierckpt.errors.StorageError` when an upload failed (fix the remote, then :func:`sync`).
    With the node cache off (see :func:`status`) the cache is not opened; unless this node's memory tier
    holds ``uri`` (then its write-down is waited for), a :class:`~tierckpt.errors.CheckpointError` says there
    is nothing on this node to wait for (never a silent "durable" while a cache-on process may have left
    uploads pending).
    """
    uri = uri_text("wait", uri)
    options = merged_options("wait", storage_options, options_kw)
    durable = durability_of(open_durable_chain(uri, options, _cache_config(config, options)))
    if durable is None:
        raise CheckpointError(
            f"tierckpt wait {uri}: the node cache is off ({_setting(config, options)}) and this node's memory tier "
            f"holds nothing of {uri}: writes from this node go straight to where it points, so there is nothing here "
            f"to wait for (the node cache was not opened). Uploads that processes with the cache on left pending "
            f"finish with `TIERCKPT_CACHE=on tierckpt wait {uri}`"
        )
    get_scheduler().run(durable.wait_durable(None, timeout_s))


def sync(uri: str | os.PathLike[str] | None = None, config: CacheConfig | None = None, timeout_s: float | None = None, *,
         storage_options: Mapping[str, Any] | None = None, **options_kw: Any) -> list[str]:
    """Resume the uploads the catalogue records as pending and the write-downs the node memory tier
    holds (for ``uri``, or every store of the node) and wait for them; returns the URIs synced. A
    restarted process calls this after a crash.

    With the node cache off (``TIERCKPT_CACHE=off``, or ``config`` with ``enabled=False``) the cache is
    not opened: what the memory tier holds is written straight to where its URI points, and when it
    holds nothing to write down a :class:`~tierckpt.errors.CheckpointError` says so (never a silent
    "nothing synced" while a cache-on process may have left uploads pending).

    ``storage_options`` open every remote (credentials are never stored in the catalogue).
    """
    uri = None if uri is None else uri_text("sync", uri)
    options = merged_options("sync", storage_options, options_kw)
    setting = _setting(config)
    config = config or CacheConfig.from_env()
    if not config.enabled:
        return _sync_cache_off(uri, config, options, timeout_s, setting)
    if uri is not None:
        uris = [uri]
    else:
        catalog = uploader_of(config).catalog
        roots = catalog.roots()
        uris = sorted({roots[rh] for rh, _, _ in catalog.pending_all() if rh in roots} | set(_memory_only()))
    return _sync_each(uris, config, options, timeout_s)


def _sync_each(uris: list[str], config: CacheConfig, options: dict[str, Any], timeout_s: float | None) -> list[str]:
    """Write back each of ``uris`` in turn, all within ``timeout_s`` together; the URIs synced."""
    sched = get_scheduler()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for u in uris:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        sched.run(open_durable_chain(u, options, config).sync(left), left)
    return uris


def _sync_cache_off(uri: str | None, config: CacheConfig, options: dict[str, Any], timeout_s: float | None,
                    setting: str) -> list[str]:
    """:func:`sync` with the node cache off: write down what this node's memory tier holds for ``uri`` (or for
    every URI) straight to where it points, opening no node cache; raise when the tier holds nothing to
    write down (a success that did nothing would hide the uploads a cache-on process left pending)."""
    uris = [u for u in ([uri] if uri is not None else _memory_only()) if memory_config_held(u, options.get("memory"))]
    if not uris:
        target = f" {uri}" if uri else ""
        raise CheckpointError(
            f"tierckpt sync{target}: the node cache is off ({setting}) and this node's memory tier holds nothing "
            f"of {uri or 'any store'} to write down, so nothing was synced (the node cache was not opened). Uploads "
            f"that processes with the cache on left pending finish with `TIERCKPT_CACHE=on tierckpt sync{target}`"
        )
    return _sync_each(uris, config, options, timeout_s)


def _setting(config: CacheConfig | None, options: Mapping[str, Any] | None = None) -> str:
    """What turned the node cache off: the ``config`` passed, the storage option, else the environment."""
    cache = (options or {}).get("cache")
    if config is not None or isinstance(cache, CacheConfig):
        return "CacheConfig(enabled=False)"
    return "storage option cache=False" if cache is False else f"TIERCKPT_CACHE={os.environ.get('TIERCKPT_CACHE')}"


def _cache_config(config: CacheConfig | None, options: Mapping[str, Any]) -> CacheConfig:
    """The node cache the durability commands act on: ``config``, else the storage option ``cache`` (a
    :class:`CacheConfig`, or ``True``/``False``), else the environment (``TIERCKPT_CACHE``)."""
    cache = options.get("cache")
    if config is not None:
        return config
    if isinstance(cache, CacheConfig):
        return cache
    if isinstance(cache, bool):
        return CacheConfig.from_env(enabled=cache)
    return CacheConfig.from_env()


async def _remote_status(uri: str, chain: Backend) -> StoreStatus:
    """The status of ``uri`` through a chain with no write-back link (the node cache off, no memory tier):
    nothing committed or pending on this node; the generation its ``COMMIT`` names where it points."""
    generation, error, unreachable = None, None, False
    try:
        generation = layout.CommitRecord.decode(await chain.get_capped(layout.COMMIT, MAX_RECORD_BYTES)).generation
    except CheckpointNotFoundError:
        pass
    except CheckpointError as exc:
        error, unreachable = str(exc), isinstance(exc, TransientStorageError)
    return StoreStatus(uri, None, None, (), 0, remote_generation=generation, remote_error=error,
                       remote_unreachable=unreachable)


def _memory_only() -> list[str]:
    """URIs whose committed generation the node memory tier (``TIERCKPT_MEMORY_DIR``) holds and has not
    written down whole."""
    out = []
    for tier in NodeMemory(MemoryConfig.from_env()).tiers():
        record = tier.committed()
        if record is not None and DownLog(tier).pending(record.generation):
            out.append(tier.uri)
    return out


def drop(uri: str | os.PathLike[str], config: CacheConfig | None = None, *, storage_options: Mapping[str, Any] | None = None,
         **options_kw: Any) -> list[str]:
    """Discard the uploads pending from this node to ``uri`` (a mistyped bucket, a store given up on);
    returns the keys dropped. What they held stays readable in the node cache until evicted."""
    uri = uri_text("drop", uri)
    config = _enabled(config, "drop", uri)
    return get_scheduler().run(_tiered(uri, config, merged_options("drop", storage_options, options_kw)).drop_pending())


def _enabled(config: CacheConfig | None, call: str, uri: str) -> CacheConfig:
    """``config`` (else the environment's) when it turns the node cache on; raise when it is off: :func:`drop`
    acts on the uploads recorded in the node cache, and with the cache off it must not open (and so create) it."""
    setting = _setting(config)
    config = config or CacheConfig.from_env()
    if not config.enabled:
        raise CheckpointError(
            f"tierckpt {call} {uri}: the node cache is off ({setting}), so it was not opened and nothing was "
            f"dropped; to drop the uploads that processes with the cache on left pending, run "
            f"`TIERCKPT_CACHE=on tierckpt sync --drop {uri}`"
        )
    return config


class PrefetchHandle:
    """A background prefetch: ``result(timeout)``, ``done()``, ``cancel()``, ``bytes_done``/``bytes_total``.

    ``in_place``: the URI is read where it is (a local path, ``file://``, ``memory://``), so nothing is copied
    into the node cache and ``result()`` is 0."""

    def __init__(self, future: concurrent.futures.Future[int], total: int, progress: Any, *, in_place: bool = False) -> None:
        self._future = future
        self.bytes_total = total
        self.bytes_done = 0
        self.in_place = in_place
        self._progress = progress
        self._lock = threading.Lock()

    def _advance(self, n: int) -> None:
        with self._lock:
            self.bytes_done += n
            if self._progress is not None:
                self._progress.update(n)

    def result(self, timeout: float | None = None) -> int:
        """Bytes prefetched; re-raises what the prefetch raised."""
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done() and self._progress is not None:
                self._progress.close()

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        return self._future.cancel()


def prefetch(uri: str | os.PathLike[str], only: Sequence[str] | None = None, progress: bool | None = None, config: CacheConfig | None = None, *,
             storage_options: Mapping[str, Any] | None = None, **options_kw: Any) -> PrefetchHandle:
    """Pull the committed checkpoint at ``uri`` into the node cache in the background.

    A local path (or ``file://``, ``memory://``) never goes through the node cache: its loads read it in
    place, so nothing is copied; the checkpoint's metadata is still read (a missing one raises) and the
    handle, already done, says ``in_place``.

    With ``only`` (fqn glob patterns such as ``"model.layers.0.*"``) only the metadata, the object
    files and the byte ranges of the matching tensors' pieces are fetched. The metadata is read
    before this returns; the data is fetched at background priority: call ``result()`` on the returned
    handle to wait for it (a process that exits first has fetched only the metadata). ``progress``: a
    progress bar on stderr (``None``: when stderr is a terminal; :func:`tierckpt.progress.wanted`).
    """
    uri = uri_text("prefetch", uri)
    if isinstance(only, str):
        only = [only]
    options = merged_options("prefetch", storage_options, options_kw)
    if read_in_place(uri):
        read_checkpoint(open_store(uri, options))
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        done.set_result(0)
        return PrefetchHandle(done, 0, None, in_place=True)
    backend = _tiered(uri, config, options)
    sched = get_scheduler()
    ckpt = read_checkpoint(backend)
    gen = ckpt.meta.generation
    ranges: list[tuple[str, int, int]] = [
        (layout.COMMIT, 0, 1 << 62),
        (layout.header_key(gen), 0, 1 << 62),
        (layout.tensors_key(gen), 0, 1 << 62),
        (layout.pieces_key(gen), 0, 1 << 62),
    ]
    ranges += [(layout.in_generation(gen, o.file), o.byte_offset, o.byte_offset + o.byte_length)
               for o in ckpt.meta.objects]
    if only is None:
        ranges += [(layout.in_generation(gen, f.key), 0, f.size) for f in ckpt.meta.files]
    else:
        fqns = [f for f in ckpt.tensors if any(fnmatch.fnmatchcase(f, p) for p in only)]
        if not fqns:
            names = sorted(ckpt.tensors)
            raise CheckpointError(
                f"prefetch {uri!r}: only={list(only)} matched no tensor of the checkpoint (nothing fetched); its "
                f"tensors include {', '.join(map(repr, names[:5]))}{' ...' if len(names) > 5 else ''}. Patterns are "
                "globs matched against whole names, e.g. 'model.layers.0.*'"
            )
        pieces = read_pieces(backend, ckpt, set(fqns))
        ranges += [(layout.in_generation(gen, p.file), p.byte_offset, p.byte_offset + p.byte_length)
                   for plist in pieces.values() for p in plist]
    data_total = sum(e - s for k, s, e in ranges if e < 1 << 62)
    bar = ByteProgress(f"prefetch {uri}", data_total) if wanted(progress) else None
    handle: PrefetchHandle

    async def run() -> int:
        async def one(key: str, start: int, end: int) -> None:
            await backend.prefetch_range(key, start, end)
            if end < 1 << 62:
                handle._advance(end - start)

        await asyncio.gather(*(one(*r) for r in ranges))
        return handle.bytes_done

    handle = PrefetchHandle(concurrent.futures.Future(), data_total, bar)
    handle._future = sched.submit(run())
    return handle


@dataclass(frozen=True, slots=True)
class GcResult:
    kept: tuple[str, ...]
    deleted: tuple[str, ...]
    leftovers: tuple[str, ...] = ()
    """Superseded generations (of crashed, failed or losing saves) removed from the kept checkpoints."""
    dry_run: bool = False
    """Nothing was deleted: ``deleted`` and ``leftovers`` are what would have been."""


def gc(root: str | os.PathLike[str], keep_last: int | None = None, keep_every: int | None = None, *, dry_run: bool = False,
       config: CacheConfig | None = None, storage_options: Mapping[str, Any] | None = None,
       **options_kw: Any) -> GcResult:
    """Retention over ``root``: a directory whose children are checkpoints (``<root>/step-100/COMMIT``).

    Needs an explicit policy: keeps the ``keep_last`` newest committed checkpoints and those whose
    step (:func:`tierckpt.native.layout.step_of`: ``step-<digits>``) is a multiple of ``keep_every`` (the newest
    one always; children without a step name count as older than every step); deletes every other
    committed checkpoint from the remote and from the node cache. Children without a COMMIT are left
    alone. In what is kept, generations that can never be committed are removed
    (:func:`tierckpt.native.layout.superseded_generations`: decided by commit sequence, never by a clock, so
    a save in flight keeps its generation). ``dry_run`` reports without deleting.
    """
    root = uri_text("gc", root)
    if keep_last is None and keep_every is None:
        raise CheckpointError(
            f"gc({root!r}) deletes nothing without a keep policy: pass keep_last=N (CLI: --keep-last N) to keep "
            "the N newest checkpoints and/or keep_every=K (--keep-every K) to keep every step that is a multiple of K"
        )
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"gc({root!r}): keep_last must be at least 1 (the newest checkpoint is never deleted)")
    storage_options = merged_options("gc", storage_options, options_kw)
    sched = get_scheduler()
    base = root.rstrip("/")
    parent = open_tiered(base, config, storage_options=storage_options)
    names = layout.committed_children(sched.run(parent.list("")))
    stores = {n: _tiered(f"{base}/{n}", config, storage_options) for n in names}
    order: list[tuple[int, float, str]] = []
    for n in names:
        try:
            committed = layout.CommitRecord.decode(sched.run(stores[n].get_capped(layout.COMMIT, MAX_RECORD_BYTES))).committed_unix
        except CheckpointNotFoundError:
            continue
        step = layout.step_of(n)
        order.append((-1 if step is None else step, committed, n))
    keep = layout.retention(order, keep_last, keep_every)
    deleted = [n for _, _, n in sorted(order) if n not in keep]
    kept = [n for _, _, n in sorted(order) if n in keep]
    if not dry_run:
        for n in deleted:
            store = stores[n]
            sched.run(store.delete_prefix(""))
            store.catalog.forget_generations(store.rh, "")
    leftovers = [f"{n}/{g}" for n in kept for g in _remove_leftovers(stores[n], dry_run)]
    leftovers += _remove_leftovers(parent, dry_run)
    return GcResult(kept=tuple(kept), deleted=tuple(deleted), leftovers=tuple(leftovers), dry_run=dry_run)


def _remove_leftovers(store: Backend, dry_run: bool) -> list[str]:
    """Delete (unless ``dry_run``) the generations of ``store`` that can never be committed; their names."""
    sched = get_scheduler()
    try:
        record = layout.CommitRecord.decode(sched.run(store.get_capped(layout.COMMIT, MAX_RECORD_BYTES)))
    except CheckpointNotFoundError:
        return []
    superseded = layout.superseded_generations(sched.run(store.list("")), record)
    if not dry_run:
        for generation in superseded:
            sched.run(store.delete_prefix(f"{generation}/"))
    return superseded
