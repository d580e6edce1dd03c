"""The one place that assembles the storage chain of a URI: :func:`open_chain` (and :func:`open_store`).

A *store* is a :class:`~tierckpt.backends.base.Backend`: either the backend of the URI itself
(:mod:`tierckpt.backends`) or that backend wrapped in *links*, each a small ``Backend`` with one job
(:mod:`tierckpt.node.disk`: the node cache's write-back journal and read-through tiers;
:mod:`tierckpt.node.memory.link`: the node memory tier on top). Saver, loader, manager, CLI, verify and
convert get every store from :func:`open_store`, so "is this URI cached?" and "does it commit into
node memory first?" are decided here, once, each by one rule (:func:`cache_config_for`,
:func:`memory_config_for`). The chain, top first::

    MemoryLink (node memory tier, tmpfs)      when memory_config_for(uri, option "memory") says so
      TieredBackend (node disk cache)         when cache_config_for(uri, option "cache") says so
        ScheduledBackend (slots, retries)
          the URI's backend (local, memory://, S3, fsspec)

:func:`open_chain` returns the chain's top (the *store*) beside its node face
(:class:`~tierckpt.node.face.NodeFace`): what the saver, the loader, the manager and the formats ask of the
node tiers (the memory tier's read view, snapshot spares, keep-in-memory, the chain below the tiers,
durability) they ask the face; the store is a plain backend to them. :func:`open_store` is the store
alone, for callers that only read and write.

Both write-back links run on the engine of :mod:`tierckpt.node`: its one durability answer
(:class:`Durable`, asked with :func:`durability_of`), its one exit drain (:func:`drain_write_back`) and
its one level type. A store without the protocol is durable where its URI points when a write returns.

Adding a link: write it as a ``Backend`` wrapper (one file, under ``cache/`` or beside it) and add one
line to :func:`open_store` that wraps the chain built so far.
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

from tierckpt.backends import Backend, LocalBackend, backend_of_scheme, open_plain_backend, split_uri
from tierckpt.node.disk.config import CacheConfig
from tierckpt.node.disk.tiered import TieredBackend
from tierckpt.node.disk.uploader import Uploader
from tierckpt.errors import CheckpointError, StorageError
from tierckpt.io.scheduled import ScheduledBackend
from tierckpt.io.scheduler import get_scheduler
from tierckpt.node.memory.config import MemoryConfig, memory_enabled_from_env
from tierckpt.node.memory.link import MemoryLink
from tierckpt.node.memory.roots import committed_under, tier_uri
from tierckpt.node.memory.memory import MemoryTier
from tierckpt.node.memory.nodememory import NodeMemory
from tierckpt.node import drain as exit_drain
from tierckpt.node import lifecycle
from tierckpt.node.durability import Durable, Revocable, durability_of, revocable_of
from tierckpt.node.face import NodeFace

__all__ = [
    "Chain", "Durable", "LOCAL_SCHEMES", "Revocable", "cache_config_for", "drain_write_back", "durability_of", "exit_wait_s",
    "forget_cached", "identity_of", "memory_config_for", "memory_config_held", "memory_keys_under", "memory_levels",
    "memory_tier_of", "node_cache_over", "node_face", "node_only_reason", "open_cached_store", "open_chain",
    "open_durable_chain", "open_store", "read_in_place", "revocable_of", "uploader_of", "without_node_cache",
]

LOCAL_SCHEMES = ("", "file", "memory")

"""Schemes that are never cached: the URI's own store is already on this node (or in this process)."""

_UPLOADERS: dict[str, Uploader] = {}
"""This process's uploader of each node-cache directory (by real path), shared by every store open_store
builds over it (its catalogue handle, one task per pending key, one upload limit, one exit drain).
Dropped in a forked child."""
_INHERITED: dict[str, Uploader] = {}
"""In a forked child: the parent's uploaders, kept untouched (their LMDB handles are unusable here)."""


def cache_config_for(uri: str, cache: Any = None, *, scheme: str | None = None) -> CacheConfig | None:
    """The node-cache configuration of ``uri``'s chain, or ``None`` for no cache. The one rule:

    * local paths, ``file://`` and ``memory://`` are never cached;
    * ``cache=False`` disables the cache, ``cache=True`` enables it (whatever ``TIERCKPT_CACHE`` says);
    * a :class:`CacheConfig` is used as given (``enabled=False`` disables the cache);
    * ``cache=None`` (the default): :meth:`CacheConfig.from_env` (``TIERCKPT_CACHE=off`` disables it).

    ``scheme``: ``uri``'s, when the caller already split it off (:func:`open_chain` splits a URI once).
    """
    if cache is not None and not isinstance(cache, (bool, CacheConfig)):
        raise CheckpointError(
            f"storage option cache={cache!r} for {uri!r}: pass True or False (node cache on or off), "
            "or a tierckpt.node.disk.CacheConfig"
        )
    if cache is False or (split_uri(uri)[0] if scheme is None else scheme) in LOCAL_SCHEMES:
        return None
    if cache is True:
        config = CacheConfig.from_env()
        return config if config.enabled else CacheConfig.from_env(enabled=True)
    config = cache if isinstance(cache, CacheConfig) else CacheConfig.from_env()
    return config if config.enabled else None


def read_in_place(uri: str) -> bool:
    """Whether ``uri`` is a local path, ``file://`` or ``memory://`` (:data:`LOCAL_SCHEMES`): its store is
    already on this node, so the node cache never holds it (nothing to prefetch, nothing to upload)."""
    return split_uri(uri)[0] in LOCAL_SCHEMES


def memory_config_for(uri: str, memory: Any = None, *, scheme: str | None = None) -> MemoryConfig | None:
    """The node memory tier configuration of ``uri``'s chain, or ``None`` for no memory tier. The one rule:

    * ``memory://`` URIs never get one (the store is already in this process's memory);
    * ``memory=False`` leaves it out, ``memory=True`` puts it in (:meth:`MemoryConfig.from_env`), whatever
      ``TIERCKPT_MEMORY`` says; a :class:`~tierckpt.node.memory.MemoryConfig` is used as given;
    * ``memory=None`` (the default): on when ``TIERCKPT_MEMORY=on`` (default ``off``).

    ``scheme``: ``uri``'s, when the caller already split it off (:func:`open_chain` splits a URI once).
    """
    if memory is not None and not isinstance(memory, (bool, MemoryConfig)):
        raise CheckpointError(
            f"storage option memory={memory!r} for {uri!r}: pass True or False (node memory tier on or off), "
            "or a tierckpt.node.memory.MemoryConfig"
        )
    if memory is False or (split_uri(uri)[0] if scheme is None else scheme) == "memory":
        return None
    if isinstance(memory, MemoryConfig):
        return memory
    if memory is True or memory_enabled_from_env():
        return MemoryConfig.from_env()
    return None


class Chain(NamedTuple):
    """A URI's chain as :func:`open_chain` assembles it: the store and its node face."""

    store: Backend
    """The chain's top: a plain backend to everyone above it."""
    node: NodeFace
    """What the chain's node tiers offer (every answer "not here" when it has none)."""


def open_chain(uri: str, options: dict[str, Any] | None = None) -> Chain:
    """The chain of ``uri``, built once: its backend (``options`` go to it, e.g. S3 credentials), behind
    the node cache when :func:`cache_config_for` says so (option ``cache``), behind the node memory tier
    when :func:`memory_config_for` says so (option ``memory``); with the chain's node face. The URI is
    split once, here."""
    options = dict(options or {})
    scheme = split_uri(uri)[0]
    memory = memory_config_for(uri, options.pop("memory", None), scheme=scheme)
    config = cache_config_for(uri, options.pop("cache", None), scheme=scheme)
    plain = backend_of_scheme(scheme, uri, options)
    cache = node_cache_over(plain, config) if config is not None else None
    store: Backend = cache if cache is not None else ScheduledBackend(plain)
    link = MemoryLink(store, memory, uri) if memory is not None else None  # node memory first, written down behind
    return Chain(link or store, NodeFace(link or store, memory=link, cache=cache))


def open_store(uri: str, options: dict[str, Any] | None = None) -> Backend:
    """The store of ``uri``'s chain (:func:`open_chain`), for callers that ask nothing of the node tiers."""
    return open_chain(uri, options).store


def node_face(store: Backend) -> NodeFace:
    """The node face of a chain this module assembled (:func:`open_chain`, :func:`open_durable_chain`,
    :func:`node_cache_over`), found from its top ``store``: for code handed a store without its face."""
    memory = cache = None
    link: Backend | None = store
    while link is not None:
        if isinstance(link, MemoryLink):
            memory = link
        elif isinstance(link, TieredBackend):
            cache = link
        link = link.next_link()
    return NodeFace(store, memory=memory, cache=cache)


def memory_tier_of(store: Backend) -> MemoryTier | None:
    """The node memory tier of ``store``'s chain (its node face's), or ``None`` when the tier is off."""
    tier = node_face(store).memory_tier
    return tier if isinstance(tier, MemoryTier) else None


def open_cached_store(uri: str, options: dict[str, Any], config: CacheConfig) -> TieredBackend:
    """The chain of ``uri`` behind the node cache ``config``, whatever :func:`cache_config_for` says (the
    node cache's own commands: status, sync, prefetch, gc on any URI). ``options`` go to the backend."""
    options = {k: v for k, v in options.items() if k != "memory"}  # the memory tier is open_store's
    return node_cache_over(open_plain_backend(uri, **options), config)


def memory_config_held(uri: str, memory: Any = None) -> MemoryConfig | None:
    """The memory tier of ``uri`` for the durability commands (status, wait, sync): on by
    :func:`memory_config_for`, or because this node's tier (``TIERCKPT_MEMORY_DIR``) holds the URI — what a
    save left there is reported and synced even by a process that did not turn the tier on; ``memory=False``
    leaves it out."""
    config = memory_config_for(uri, memory)
    if config is None and memory is not False and split_uri(uri)[0] != "memory":
        env = MemoryConfig.from_env()
        if os.path.isdir(MemoryTier(tier_uri(uri), env).home):
            config = env
    return config


def open_durable_chain(uri: str, options: dict[str, Any], cache: CacheConfig) -> Backend:
    """The chain the durability commands act on: behind the node cache ``cache`` whatever
    :func:`cache_config_for` says (local paths too), or straight to where ``uri`` points when ``cache`` is
    off; behind the memory link when :func:`memory_config_held` says so."""
    options = dict(options)
    memory = memory_config_held(uri, options.pop("memory", None))
    options.pop("cache", None)
    chain: Backend = (open_cached_store(uri, options, cache) if cache.enabled
                      else ScheduledBackend(open_plain_backend(uri, **options)))
    return MemoryLink(chain, memory, uri) if memory is not None else chain


def node_cache_over(remote: Backend, config: CacheConfig) -> TieredBackend:
    """The node cache ``config`` (write-back journal + read-through tiers) in front of the open backend
    ``remote``, behind its scheduling link (slots, retries, metrics)."""
    return TieredBackend(ScheduledBackend(remote), config, uploader_of(config))


def uploader_of(config: CacheConfig) -> Uploader:
    """This process's one :class:`Uploader` of the node cache ``config`` names, with the directory's
    catalogue: every store and command of the directory goes through it (LMDB allows one handle per
    process)."""
    directory = os.path.realpath(config.directory)
    uploader = _UPLOADERS.get(directory)
    if uploader is None:
        if directory in _INHERITED:
            raise StorageError(
                f"the node cache {config.directory} was opened by this process's parent before it forked, and "
                "its catalogue (LMDB) cannot be used across a fork: start processes that save or load with "
                "the 'spawn' or 'forkserver' start method, or give the child its own TIERCKPT_CACHE_DIR"
            )
        uploader = _UPLOADERS[directory] = Uploader(config.directory, config.upload_concurrency, config.exit_wait_s)
    uploader.exit_wait_s = max(uploader.exit_wait_s, config.exit_wait_s)
    return uploader


def identity_of(uri: str, store: Backend) -> str:
    """How ranks tell that they address one checkpoint (compared before a save or load writes or reads):
    the URI without a trailing slash and, when it differs, where the chain ends: a local root's absolute
    path (a relative path is relative to each process's working directory), a remote's bucket at its
    endpoint (ranks given different endpoints would write different stores)."""
    while (below := store.next_link()) is not None:  # down the chain to the URI's own backend
        store = below
    name = uri.rstrip("/") or uri
    if not isinstance(store, LocalBackend):
        return f"{name} ({store.service})"
    return name if store.root == name else f"{name} (at {store.root})"


def without_node_cache(store: Backend) -> Backend:
    """``store``'s chain below the node tiers (:attr:`NodeFace.below_node`): its scheduling link over the
    URI's own backend (what reads a torch DCP directory in place, which DCP rewrites in place, so cached
    bytes could be stale)."""
    return node_face(store).below_node


def forget_cached(node: NodeFace, ranges: set[tuple[str, int, int]]) -> bool:
    """Drop the node cache's copies of ``ranges`` (``(key, start, end)`` of the chain) that failed their
    checksums, so they are read again from below (:meth:`NodeFace.forget_cached`); ``True`` if the
    chain has a node cache and it dropped any."""
    if not ranges:
        return False
    sched = get_scheduler()
    return any([sched.run(node.forget_cached(key, start, end)) for key, start, end in sorted(ranges)])


class _NodeCacheDrain:
    """This process's uploads of every node-cache directory in the engine's exit drain (below the memory
    tier, whose write-downs feed them: drained after it)."""

    depth = 1

    def exit_wait_s(self) -> float:
        return max((u.exit_wait_s for u in _UPLOADERS.values()), default=0.0)

    def drain(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        lines: list[str] = []
        for uploader in list(_UPLOADERS.values()):
            lines += uploader.drain(max(0.0, deadline - time.monotonic()))
        return lines


exit_drain.register(_NodeCacheDrain())


def exit_wait_s() -> float:
    """How long the exit drain may wait: the longest ``exit_wait_s`` of this process's write-back links."""
    return exit_drain.exit_wait_s()


def drain_write_back(timeout_s: float) -> list[str]:
    """Wait up to ``timeout_s`` in all for this process's write-backs (the engine's one exit drain:
    memory tier write-downs first, then the node cache's uploads, which they feed); one line per store
    left pending, naming the command that finishes it (the saver's exit drain prints them)."""
    return exit_drain.drain(timeout_s)


def node_only_reason(store: Backend) -> str | None:
    """``None`` when what ``store`` shows as committed is committed where its URI points (or nothing
    is committed); otherwise one line saying that it is committed in this node's cache only, why, and
    the command that finishes it. ``ls`` and ``verify`` report it on the saving node."""
    durable = durability_of(store)
    if durable is None:
        return None
    st = get_scheduler().run(durable.status())
    if st.generation is None or st.committed_on_remote:
        return None
    if st.remote_generation is not None:
        remote = f"the remote's COMMIT names {st.remote_generation}"
    elif st.remote_error is not None and st.remote_unreachable:
        remote = f"the remote is unreachable: {st.remote_error}"
    elif st.remote_error is not None:
        remote = f"the remote's COMMIT cannot be read: {st.remote_error}"
    else:
        remote = "the remote has no COMMIT"
    uploads = f"{len(st.pending_keys)} upload(s) pending" + (f", failing: {st.errors[0]}" if st.errors else "")
    where = "memory tier" if st.only_in_memory else "cache"
    return (f"generation {st.generation} is committed in this node's {where} only ({remote}; {uploads}); "
            f"finish it with: tierckpt sync {st.uri}")


def memory_levels(store: Backend) -> dict[str, bool] | None:
    """``{level: reached}`` (memory, replicated, local, remote) of what ``store`` shows as committed, when
    its chain has the node memory tier (``None`` otherwise); ``ls`` and the manager report them."""
    durable = durability_of(store)
    if memory_tier_of(store) is None or durable is None:
        return None
    levels = get_scheduler().run(durable.status()).levels()
    return {level: reached for level, reached, _ in levels} if levels else None


def memory_keys_under(root: str, memory: Any = None) -> list[str]:
    """Keys (relative to ``root``) of the checkpoints under ``root`` committed in this node's memory tier,
    when the tier is on for ``root`` (:func:`memory_config_for`; ``memory`` is the storage option): what
    ``ls`` and the manager add to the chain's listing, so a checkpoint only in memory is found."""
    config = memory_config_for(root, memory)
    if config is None:
        return []
    found = committed_under(NodeMemory(config), root)
    return sorted(f"{path}/{key}" for path, keys in found.items() for key in keys)


def _forget_after_fork() -> None:
    """A forked child has none of its parent's upload tasks, and cannot use its parent's catalogue
    handles: LMDB handles must not cross a fork, the binding refuses a second handle in the process, and
    closing the inherited one can wait forever on an operation a parent thread had in flight. The child
    keeps them untouched (never closed, never freed, not even at its exit) and refuses their directories
    (:func:`uploader_of`)."""
    lifecycle.keep_in_child(_UPLOADERS.values())
    _INHERITED.update(_UPLOADERS)
    _UPLOADERS.clear()


lifecycle.after_fork_in_child(_forget_after_fork)
