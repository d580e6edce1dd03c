"""The node cache's local pieces that know nothing of remotes: the in-process LRU of small objects
(:class:`SmallObjects`, not the node memory tier of :mod:`tierckpt.node.memory`) and checked reads of cached
files (worker-thread helpers)."""

from __future__ import annotations

import collections
import os
import threading

from tierckpt.node.written import file_crc


class SmallObjects:
    """A thread-safe LRU of whole small objects within one process (``CacheConfig.memory_bytes``): the
    node cache's hot small reads (records, metadata) without a file read. Not the node memory tier."""

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


class VerifiedFiles:
    """Which versions of cached whole files this process has already checked (a file's CRC is read
    once per version: path, inode, mtime, size)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int, int, int, int]] = set()
        self._lock = threading.Lock()

    def check(self, path: str, size: int, crc: int | None) -> bool | None:
        """``None``: no file; ``False``: wrong size or CRC; ``True``: good. Runs in a worker thread."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if st.st_size != size:
            return False
        ident = (path, st.st_ino, st.st_mtime_ns, st.st_size, crc if crc is not None else -1)
        with self._lock:
            if ident in self._seen or crc is None:
                return True
        if file_crc(path).crc32c != crc:
            return False
        with self._lock:
            self._seen.add(ident)
        return True


def read_file(path: str, size: int) -> bytes | None:
    """The cached file at ``path`` if it holds exactly ``size`` bytes (``None``: missing, or another size:
    a damaged copy, never read whole)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != size:
                return None
            return f.read(size + 1)
    except FileNotFoundError:
        return None
