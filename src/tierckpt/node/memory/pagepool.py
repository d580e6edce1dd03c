"""The memory tier's page pool: a retired generation's data files, kept to be written over.

Allocating tmpfs pages costs about 1 ms per MiB of CPU (the kernel zeroes each page; tmpfs has no huge
pages unless ``shmem_enabled`` says so), paid for every spare (:mod:`.mapped`) and every arriving replica,
while each commit retires the previous generation, whose files free exactly as many pages. So a
superseded generation's data files are not unlinked but moved (renamed: same directory tree, same tmpfs)
into the tier's pool, and a spare or a replica of about the same size *claims* one (renamed to its own
temp name and cut to its size: the pages below that size stay allocated) instead of creating a file.

**Nobody still reading a pooled file sees it change.** Every reader of the tier's files holds a shared
``flock`` on the file for as long as it reads it (:func:`~tierckpt.backends.file_open.hold_shared`: the tier's
own reads, the write-down, the replica sender, CRC checks, the loader's whole-file reads), taken after the
open and followed by a check that the path still names the file. :func:`retire` first renames a file away
from its path (new opens fail as after an unlink), then tries the exclusive lock without waiting: only a
file nobody holds is offered to claimers, any other one is unlinked as before (its readers keep their
bytes). A reader that opened the file before the rename but locks it after fails its path check and
reads nothing. A process that reads the tier without this lock (an older tierckpt, a tool) is not seen:
a load still checks every piece's CRC-32C, so it would fail loudly, never load changed bytes.

**Where the pool is.** The generation :data:`POOL_GENERATION` of the tier (commit sequence 0, like the
spares, whose prefix it shares): its bytes count in the tier's budget, eviction drops it first (it is
never committed), and listings, loads and the write-down leave it out as they leave out spares; one left
by a dead process is evictable garbage. It holds at most as many bytes as the generation being retired
had in data files. A process drops the pools it filled when it exits (:func:`drop`).

**Kept mappings.** Mapping a pooled file's pages writable still costs a fault per page through the file
system (about 1 µs each, 6 ms for 24 MiB), and an unmap after the copy.
A pooled file keeps its inode through every rename, so a process keeps the mappings it made for its
writes (:func:`writable_pages`: the spare, a replica arriving) and, when it claims the same file again,
writes through the mapping it has: its pages are mapped already. At most :data:`KEPT_FILES` per process.
A kept mapping holds the pages of a file that lost its last name (evicted, or dropped from the pool) outside
the tier's budget, so such mappings are let go where this process unlinks a tier file (:func:`let_go_unlinked`)
and before every claim; one another process unlinked (an admission evicting the pool for room) goes at
this process's next save or receive, so up to :data:`KEPT_FILES` files' pages may stay that long beyond
the budget.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import shutil
import threading
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierckpt.backends.files import is_temp_name, temp_name
from tierckpt.node import lifecycle
from tierckpt.node.memory import stamps

log = logging.getLogger(__name__)

POOL_GENERATION = "g-00000000-0000000000000-0"
"""The pool's generation name: the spares' prefix (commit sequence 0), and a pid no process has."""
MIN_BYTES = 1 << 20
"""Smaller files are unlinked: their pages cost less to allocate than a pool entry's bookkeeping."""
_SUFFIX = ".pool"

_filled: set[str] = set()
"""Pool directories this process put files into (dropped at exit)."""
_lock = threading.Lock()


def pool_dir(root: str) -> str:
    """The pool's directory in the tier whose objects lie under ``root``."""
    return os.path.join(root, POOL_GENERATION, "data")


def _pooled(directory: str) -> list[tuple[int, str]]:
    """(size, path) of each claimable pooled file: those this process keeps a mapping of first (see "Kept
    mappings"), then smallest first."""
    out = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if is_temp_name(name) or not name.endswith(_SUFFIX):
            continue
        path = os.path.join(directory, name)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            continue  # claimed meanwhile
        out.append(((stat.st_dev, stat.st_ino) not in _kept, stat.st_size, path))
    return [(size, path) for _, size, path in sorted(out)]


def _unread(path: str) -> bool:
    """Whether no reader holds ``path``'s shared lock (the exclusive one is free); released at once."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def retire(root: str, generation: str) -> int:
    """Move ``generation``'s data files that nobody reads into the pool, up to as many bytes as they hold
    together (the pool's bound); the caller then removes the rest of the generation as usual. Call it
    only for a generation the tier may drop, under the node's admission lock (a usage walk never sees a
    file in two places). Returns the bytes pooled."""
    source = os.path.join(root, generation, "data")
    try:
        names = [n for n in os.listdir(source) if not is_temp_name(n)]
    except FileNotFoundError:
        return 0
    files = []
    for name in names:
        try:
            size = os.stat(os.path.join(source, name)).st_size
        except FileNotFoundError:
            continue
        if size >= MIN_BYTES:
            files.append((size, name))
    target = pool_dir(root)
    held = sum(size for size, _ in _pooled(target))
    limit = sum(size for size, _ in files)
    pooled = 0
    for size, name in sorted(files, reverse=True):
        if held + size > limit:
            continue
        staged = os.path.join(target, temp_name("retired"))  # claimers skip temp names
        try:
            os.makedirs(target, exist_ok=True)
            os.rename(os.path.join(source, name), staged)
        except OSError:
            continue  # gone meanwhile (or the pool was dropped): the caller removes what is left
        try:
            if not _unread(staged):
                os.unlink(staged)  # a reader holds it: its bytes stay its own, as with an unlink
                continue
            os.rename(staged, os.path.join(target, f"{uuid.uuid4().hex}{_SUFFIX}"))
        except OSError as exc:
            log.debug("not pooling %s of %s: %s", name, generation, exc)
            _unlink(staged)
            continue
        held += size
        pooled += size
    if pooled:
        with _lock:
            _filled.add(target)
    let_go_unlinked()
    return pooled


def claim(root: str, nbytes: int, dest: str) -> bool:
    """Rename a pooled file of at least ``nbytes`` to ``dest`` (a new temp file of the same tier): one this
    process keeps a mapping of first, else the smallest; ``False`` when there is none. The caller cuts it
    to its size and writes all of it."""
    if nbytes < MIN_BYTES:
        return False
    let_go_unlinked()
    try:
        pooled = _pooled(pool_dir(root))
    except OSError:
        return False
    for size, path in pooled:
        if size < nbytes:
            continue
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            continue  # another process claimed it first
        except OSError as exc:
            log.debug("not claiming %s: %s", path, exc)
            return False
        stamps.forget(dest)  # its CRC-32C stamp is the old bytes'
        return True
    return False


def drop(root: str) -> None:
    """Remove the tier's pool (its pages are freed)."""
    shutil.rmtree(os.path.dirname(pool_dir(root)), ignore_errors=True)
    let_go_unlinked()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _drop_filled() -> None:
    """At exit: the pools this process filled leave the tier (they hold no checkpoint)."""
    with _lock:
        filled = list(_filled)
        _filled.clear()
    for directory in filled:
        shutil.rmtree(os.path.dirname(directory), ignore_errors=True)


def _forget_after_fork() -> None:
    """A forked child did not fill its parent's pools nor made its mappings (and no thread of it holds the lock)."""
    global _lock
    _lock = threading.Lock()
    _filled.clear()
    _kept.clear()  # the child's copies of the mappings go with it


lifecycle.at_exit(_drop_filled)
lifecycle.after_fork_in_child(_forget_after_fork)


MADV_POPULATE_WRITE = 23
"""``madvise`` advice (Linux 5.14+): fault every page of a range in, writable, allocating what is missing."""


def _load_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, or ``None`` where there is none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _load_madvise()


def populate_writable(buffer: torch.Tensor) -> None:
    """Map every page of ``buffer`` (a shared mapping of a tier file) writable, each page allocated, so the
    snapshot copy into it takes no page fault.

    One ``madvise(MADV_POPULATE_WRITE)``, called through ctypes, which releases the GIL (``MAP_POPULATE``
    would hold it through ``mmap()``, stalling training's Python). A pooled file's pages already exist and
    are only mapped: 256 MiB in 16 ms of CPU, against about 90 ms for writing zeros over them with
    ``fill_`` (which also borrows training's intra-op threads); fresh pages cost the kernel their
    allocation and clearing either way (85 against 140 ms). Where the kernel does not know the advice,
    zeros are written. A refusal (no memory left for the pages) raises ``OSError``: the caller then
    makes no spare, where touching the pages would have died of ``SIGBUS``.
    """
    if _MADVISE is not None:
        if _MADVISE(buffer.data_ptr(), buffer.numel(), MADV_POPULATE_WRITE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(code, f"populating a file of the memory tier: {os.strerror(code)}")
    buffer.fill_(0)


KEPT_FILES = 16
"""Mappings a process keeps (:func:`writable_pages`): its spare's file, and the latest replicas it received."""


@dataclass(eq=False)
class _Kept:
    mapping: mmap.mmap
    fd: int
    """A descriptor of its own: ``fstat`` says whether the file still has a name."""

    def let_go(self) -> None:
        """Close the descriptor and drop the mapping: it is unmapped with its last tensor. Never ``close()``d
        here: a tensor made by ``torch.frombuffer`` holds the mapping object, not a buffer export, so a
        closed mapping would leave a snapshot or a replica still in use pointing at unmapped memory."""
        os.close(self.fd)

    def unlinked(self) -> bool:
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True


_kept: OrderedDict[tuple[int, int], _Kept] = OrderedDict()
"""(device, inode) -> this process's mapping of that file, least recently used first."""


def writable_pages(fd: int, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of the tier file open (read-write) as ``fd``, mapped shared, every page mapped
    writable (:func:`populate_writable`: an ``OSError`` where tmpfs has no room, never a ``SIGBUS``): through
    the mapping this process kept of the same file when it has one (its pages are mapped already, so the
    populate only checks them), else a new mapping, kept for the next claim of the file (see
    "Kept mappings" above). The file must hold ``nbytes``; the caller is its only writer."""
    if nbytes < MIN_BYTES:  # never pooled: mapped for this write alone (unmapped with its last view)
        pages = _tensor_of(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), nbytes)
        populate_writable(pages)
        return pages
    stat = os.fstat(fd)
    key = (stat.st_dev, stat.st_ino)
    with _lock:
        kept = _kept.pop(key, None)
    if kept is not None and len(kept.mapping) < nbytes:
        kept.let_go()
        kept = None
    if kept is None:
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        kept = _Kept(mapping, os.dup(fd))
    pages = _tensor_of(kept.mapping, nbytes)
    try:
        populate_writable(pages)
    except OSError:
        kept.let_go()
        raise
    with _lock:
        _kept[key] = kept
        while len(_kept) > KEPT_FILES:
            _kept.popitem(last=False)[1].let_go()
    return pages


def _tensor_of(mapping: mmap.mmap, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of a writable ``mapping`` as a tensor, which holds the mapping object."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # about read-only buffers; this mapping is writable
        return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]


def let_go_unlinked() -> None:
    """Let go of the kept mappings whose files have no name left (their pages are outside every budget)."""
    with _lock:
        gone = [key for key, kept in _kept.items() if kept.unlinked()]
        dropped = [_kept.pop(key) for key in gone]
    for kept in dropped:
        kept.let_go()


def kept_pages(fd: int, nbytes: int) -> memoryview | None:
    """The first ``nbytes`` of the file open as ``fd`` through the mapping this process keeps of it, or
    ``None`` (see "Kept mappings"): for a reader, the write-down, that holds the file's shared lock through
    ``fd`` itself (a kept mapping holds no lock) and so reads it with no mapping to make and unmap."""
    if nbytes < MIN_BYTES:
        return None
    stat = os.fstat(fd)
    key = (stat.st_dev, stat.st_ino)
    with _lock:
        kept = _kept.get(key)
        if kept is None or len(kept.mapping) < nbytes or stat.st_size < nbytes:
            return None
        _kept.move_to_end(key)
        return memoryview(kept.mapping)[:nbytes]
