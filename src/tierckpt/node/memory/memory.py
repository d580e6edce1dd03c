"""The node memory tier: the newest checkpoints in a tmpfs directory shared by the node's processes.

It outlives the training processes (a restart on the same node reads from memory) and is what
replication, disk write-back and upload read from. On disk::

    <TIERCKPT_MEMORY_DIR>/
      .lock                                   serializes admissions (eviction) across the node
      <sha256 of the URI, 32 hex>/            one checkpoint URI
        URI                                   the URI itself, so a scan can name it
        objects/                              the checkpoint's keys: COMMIT, g-.../meta/..., g-.../data/...
        manifests/<generation>/<origin>.json  size and CRC-32C of the files one origin (node) put there
        manifests/<generation>/<origin>.arriving  a peer's manifest while its replica arrives (expect)

:class:`MemoryTier` is a :class:`~tierckpt.backends.local.LocalBackend` rooted in ``objects/``, so it
passes the backend contract (atomic writes: temp file + rename); it also records each file's
CRC-32C as it is written (:class:`~.written.WrittenCrc`: computed on the way, or stated by a save's
stream, which has it from its pieces' checksums) as a stamp on the file (:mod:`.stamps`), so sealing a
generation (:meth:`MemoryTier.seal`), in whichever process of the node, re-reads only files no writer
stamped. :class:`NodeMemory` is the whole directory: the copies it holds and the
admission of a new checkpoint under the budget (the policy is the pure :mod:`.eviction`).

Management methods (``seal``, ``held``, ``verify``, ``evict``, receiving files) are synchronous: a few
system calls on tmpfs, which never waits on a device, so an event loop calls them in its own thread (a hop
to a worker costs ten times such a call, :attr:`MemoryTier.inline_calls`), as replication's threads do.
What may wait on another process (the node-wide admission lock, a ``COMMIT``'s lock), move or free many
bytes (large writes, deletions and evictions) or read files whole (a seal of files no writer stamped) still
goes to a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from collections.abc import Iterable

import crc32c

from tierckpt.backends.base import UNCONDITIONAL, ObjectWriter, Unconditional
from tierckpt.node.face import NodeTier
from tierckpt.backends.file_open import open_shared
from tierckpt.backends.files import commit_if, is_lock_name, is_temp_name, write_atomic as write_file
from tierckpt.backends.local import LocalBackend, os_error
from tierckpt.backends.bounded import MAX_RECORD_BYTES, MAX_URI_FILE_BYTES, read_capped, read_fd_capped
from tierckpt.errors import CheckpointError, CorruptCheckpointError
from tierckpt.native.layout import COMMIT, CommitRecord, is_superseded
from tierckpt.native.metadata import validate_generation
from tierckpt.node.memory.config import DIR_ENV, MemoryConfig
from tierckpt.node.memory.eviction import TierCopy, copy_id
from tierckpt.node.memory import pagepool, stamps
from tierckpt.node.memory.incoming import IncomingFile
from tierckpt.node.memory.manifest import FileEntry, Manifest, read_manifest
from tierckpt.node.private import private_directory
from tierckpt.node import ledger
from tierckpt.node.ledger import Tier
from tierckpt.node.written import CrcWriter, WrittenCrc, file_crc

SPARE_PREFIX = "g-00000000-0000000000000-"
"""Generation names of the memory link's spare files (:mod:`.mapped`) and of the page pool
(:data:`~.pagepool.POOL_GENERATION`): commit sequence 0, always evictable."""


def uri_digest(uri: str) -> str:
    """The directory name of ``uri`` in the tier: 32 hex digits of its SHA-256."""
    return hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:32]


def _origin_file(origin: str, suffix: str = ".json") -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in origin)[:64]
    return f"{safe}-{hashlib.sha256(origin.encode()).hexdigest()[:8]}{suffix}"


ARRIVING = ".arriving"
"""The suffix of a peer's manifest declared before its files arrive (:meth:`MemoryTier.expect`); not a manifest."""


def write_atomic(path: str, data: bytes) -> None:
    """Write a small file of the tier whole: a temp file next to it, renamed over it (no fsync: tmpfs)."""
    write_file(path, data, durable=False)


class _CrcWriter(CrcWriter):
    """Delegates to the local writer and records the file's CRC-32C (:class:`WrittenCrc`)."""

    def __init__(self, tier: MemoryTier, key: str, inner: ObjectWriter) -> None:
        self._uri = tier.uri_of(key)
        self._tier, self._key, self._inner = tier, key, inner
        self._written = WrittenCrc(self._uri, Tier.MEMORY)

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open()
        # The checksum (in its own thread when large) runs beside the write's thread.
        await asyncio.gather(self._inner.write(data), self._written.add_async(data))

    async def close(self) -> None:
        self._check_open()
        self._done = True
        try:
            entry = self._written.entry()
        except CheckpointError:
            await self._inner.abort()
            raise
        await self._inner.close()
        self._tier._remember(self._key, entry)

    async def abort(self) -> None:
        self._done = True
        await self._inner.abort()


class MemoryTier(LocalBackend, NodeTier):
    """One checkpoint URI's files in the node memory tier (a backend rooted in its ``objects/``)."""

    durable_writes = False
    """tmpfs: nothing to sync. What makes a tier file last is its replica on a peer and its write-down."""
    inline_calls = True
    """tmpfs never waits on a device: its small calls (puts and writes up to 1 MiB, opens, sizes, reads of
    records) run in the event loop's thread, not through a worker thread that costs ten times the call."""
    links_checked = False
    """The tier's tree is a private directory of this user (0700, its owner checked: :mod:`tierckpt.node.private`):
    no other user can plant a link in it, so its paths are not looked at component by component."""
    shared_reads = True
    """Reads hold each file's shared lock: the tier reuses a retired file's pages (:mod:`.pagepool`),
    cutting its size, never while a reader holds the lock. That also makes the inherited mapped reads
    safe here (:mod:`..backends.mapped_read`; eviction only unlinks, and a mapping keeps its pages): on
    tmpfs, 256 MiB in 1 MiB runs copied with their CRC-32Cs in 98 ms against ``pread`` + CRC's 127 ms."""

    def __init__(self, uri: str, config: MemoryConfig | None = None) -> None:
        self.config = config if config is not None else MemoryConfig.from_env()
        self.uri = uri.rstrip("/")
        private_directory(self.config.directory, "node memory tier", DIR_ENV, create=False)
        self.home = os.path.join(self.config.directory, uri_digest(uri))
        super().__init__(os.path.join(self.home, "objects"))
        self._claimed = False

    def __repr__(self) -> str:
        return f"MemoryTier({self.uri!r} in {self.home!r})"

    # -- writes: claim the directory, remember CRCs ---------------------------------------------------
    def _claim(self) -> None:
        """Create the URI's directory and its ``URI`` file; refuse a directory that names another URI."""
        if self._claimed:
            return
        private_directory(self.config.directory, "node memory tier", DIR_ENV)
        path = os.path.join(self.home, "URI")
        if not os.path.exists(path):
            write_atomic(path, self.uri.encode())
        found = read_capped(path, MAX_URI_FILE_BYTES).decode(errors="replace")
        if found != self.uri:
            raise CheckpointError(
                f"the memory tier directory {self.home} belongs to {found!r}, not {self.uri!r}; remove it "
                f"(or point {DIR_ENV} elsewhere)"
            )
        self._claimed = True

    def _remember(self, key: str, entry: FileEntry) -> None:
        stamps.remember(self.path_of(key), entry)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        self._claim()
        await super().put(key, data)
        ledger.landed(Tier.MEMORY, memoryview(data).nbytes)
        self._remember(key, FileEntry(memoryview(data).nbytes, crc32c.crc32c(data)))

    async def open_writer(self, key: str) -> ObjectWriter:
        self._claim()
        return _CrcWriter(self, key, await super().open_writer(key))

    async def commit(self, key: str, data: bytes, *, expected: bytes | None | Unconditional = UNCONDITIONAL) -> None:
        self._claim()
        await super().commit(key, data, expected=expected)

    def commit_in_thread(self, key: str, data: bytes, expected: bytes | None) -> bool:
        """:meth:`commit` in the calling thread, for a thread with no event loop of its own (a replica's
        receiver); ``False`` when ``key`` no longer holds ``expected``."""
        self._claim()
        path = self.path_of(key)
        try:
            return commit_if(path, data, expected, self.durable_writes)[0]
        except OSError as exc:
            raise os_error(exc, f"committing {path}") from exc

    def receive(self, key: str, size: int | None = None) -> IncomingFile:
        """Start writing a replica of ``key`` (of ``size`` bytes, when known: see :class:`IncomingFile`)."""
        self._claim()
        return IncomingFile(self.path_of(key), f"{self.uri}/{key}", WrittenCrc(self.uri_of(key), Tier.MEMORY), self.root, size)

    # -- generations and manifests --------------------------------------------------------------------
    def committed(self) -> CommitRecord | None:
        """The record ``COMMIT`` holds in this tier (``None``: none)."""
        try:
            return CommitRecord.decode(read_capped(self.path_of(COMMIT), MAX_RECORD_BYTES))
        except FileNotFoundError:
            return None

    def generations(self) -> list[str]:
        """Generations with files or manifests in this tier."""
        names: set[str] = set()
        for sub in (self.root, os.path.join(self.home, "manifests")):
            if os.path.isdir(sub):
                names.update(n for n in os.listdir(sub) if n.startswith("g-"))
        return sorted(names)

    def keys_of(self, generation: str) -> list[str]:
        """Every complete file of ``generation`` (temp files and locks left out), sorted."""
        base = os.path.join(self.root, validate_generation(generation))
        keys = []
        for directory, _, files in os.walk(base):
            rel = os.path.relpath(directory, self.root).replace(os.sep, "/")
            keys.extend(f"{rel}/{n}" for n in files if not (is_temp_name(n) or is_lock_name(n)))
        return sorted(keys)

    def _manifest_dir(self, generation: str) -> str:
        return os.path.join(self.home, "manifests", validate_generation(generation))

    def manifests(self, generation: str, suffix: str = ".json") -> list[Manifest]:
        """The manifests of ``generation`` (one per origin), sorted by origin (``suffix=ARRIVING``: those
        declared by :meth:`expect` and not yet recorded). One listed but gone when read was dropped meanwhile:
        a declaration :meth:`record` replaced, or a generation evicted; it is left out."""
        directory = self._manifest_dir(generation)
        if not os.path.isdir(directory):
            return []
        out = []
        for name in sorted(os.listdir(directory)):
            if name.endswith(suffix) and not is_temp_name(name):
                try:
                    out.append(read_manifest(os.path.join(directory, name)))
                except FileNotFoundError:
                    continue
        return sorted(out, key=lambda m: m.origin)

    def listed(self, generation: str, *, besides: Iterable[str]) -> set[str]:
        """The keys of ``generation`` that origins other than ``besides`` put here: listed by their manifests,
        or arriving from them (:meth:`expect`). What the node's own seal leaves out, and its write-down too.

        The declarations are read before the manifests: :meth:`record` writes an origin's manifest before it
        drops its declaration, so a declaration gone when read is found as a manifest after it."""
        mine = set(besides)
        return {key for suffix in (ARRIVING, ".json") for m in self.manifests(generation, suffix)
                if m.origin not in mine for key, _ in m.files}

    def held(self, generation: str) -> dict[str, FileEntry]:
        """Every sealed file of ``generation`` on this node and its size and CRC-32C (union of the manifests)."""
        out: dict[str, FileEntry] = {}
        for manifest in self.manifests(generation):
            for key, entry in manifest.files:
                if out.setdefault(key, entry) != entry:
                    raise CorruptCheckpointError(
                        f"the memory tier's manifests of {self.uri} generation {generation} disagree about {key} "
                        f"({out[key]} and {entry}); delete {self._manifest_dir(generation)} to drop them"
                    )
        return out

    def seal(self, generation: str, *, origin: str, keys: Iterable[str] | None = None) -> Manifest:
        """Write the manifest of the files ``origin`` put in ``generation``: ``keys``, or by default every
        file of the generation that no other origin's manifest lists. Each file's entry is what its writer
        stamped it with (:func:`.stamps.written`: a file changed in place since keeps its writer's CRC, so
        the change is caught by every later check); unstamped files are read once."""
        listed = self.listed(generation, besides=(origin,))
        chosen = sorted(keys) if keys is not None else [k for k in self.keys_of(generation) if k not in listed]
        files = []
        for key in chosen:
            if not key.startswith(f"{generation}/"):
                raise CheckpointError(f"cannot seal {key!r} into generation {generation!r}: it is not one of its files")
            files.append((key, self._entry(key)))
        manifest = Manifest(uri=self.uri, generation=generation, origin=origin, created_unix=time.time(), files=tuple(files))
        self.record(manifest)
        return manifest

    def read_file(self, key: str, cap: int) -> bytes:
        """The whole file ``key`` under its shared lock (see :attr:`shared_reads`), refused past ``cap``."""
        path = self.path_of(key)
        fd = open_shared(path)
        try:
            return read_fd_capped(fd, cap, path)
        finally:
            os.close(fd)

    def file_size(self, key: str) -> int:
        """One stat of the file ``key`` (no I/O loop: the tier is this node's tmpfs)."""
        return os.path.getsize(self.path_of(key))

    def _entry(self, key: str) -> FileEntry:
        path = self.path_of(key)
        return stamps.written(path) or file_crc(path, shared=True)

    def record(self, manifest: Manifest) -> None:
        """Write ``manifest`` (atomically; it replaces an earlier one of the same origin, and its files'
        declaration as arriving)."""
        self._check_uri(manifest)
        self._claim()
        directory = self._manifest_dir(manifest.generation)
        write_atomic(os.path.join(directory, _origin_file(manifest.origin)), manifest.encode())
        try:
            os.unlink(os.path.join(directory, _origin_file(manifest.origin, ARRIVING)))
        except FileNotFoundError:
            pass

    def expect(self, manifest: Manifest) -> None:
        """Declare the files of a peer's ``manifest`` as arriving, before the first of them is published here.

        A replica's files are published one by one as they arrive and its manifest is recorded after the
        last; in between, a file no manifest lists looked like one of this node's own: the node's seal listed
        it as its own and its write-down copied it too (the sender's node copies it: twice the upload traffic).
        The declaration stays if the transfer fails: the files that did arrive are still the sender's."""
        self._check_uri(manifest)
        self._claim()
        write_atomic(os.path.join(self._manifest_dir(manifest.generation), _origin_file(manifest.origin, ARRIVING)),
                     manifest.encode())

    def _check_uri(self, manifest: Manifest) -> None:
        if manifest.uri != self.uri:
            raise CheckpointError(f"a manifest of {manifest.uri!r} cannot be recorded in the tier of {self.uri!r}")

    def verify(self, generation: str) -> list[str]:
        """Re-read every sealed file of ``generation``; one line per file that is missing or differs."""
        problems = []
        for key, entry in sorted(self.held(generation).items()):
            try:
                got = file_crc(self.path_of(key), shared=True)
            except FileNotFoundError:
                problems.append(f"{key}: missing from {self.root}")
                continue
            if got != entry:
                problems.append(f"{key}: {got.size} bytes with CRC-32C {got.crc32c:#010x}, sealed as {entry.size} with {entry.crc32c:#010x}")
        return problems

    def evict(self, generation: str) -> None:
        """Drop ``generation`` from the tier: ``COMMIT`` first when it names it (no reader is led into
        a half-deleted generation), then its files and manifests."""
        record = self.committed()
        if record is not None and record.generation == generation:
            os.unlink(self.path_of(COMMIT))
        files = os.path.join(self.root, validate_generation(generation))
        shutil.rmtree(files, ignore_errors=True)
        shutil.rmtree(self._manifest_dir(generation), ignore_errors=True)
        stamps.forget_under(files)
        pagepool.let_go_unlinked()  # a mapping this process kept of an evicted file would hold its pages

    def copies(self) -> list[TierCopy]:
        """Each generation in this tier as a :class:`~.eviction.TierCopy` (sizes as on disk)."""
        record = self.committed()
        out = []
        for generation in self.generations():
            manifests = self.manifests(generation)
            sizes, mtimes = _usage(os.path.join(self.root, generation))
            out.append(TierCopy(
                copy_id=copy_id(self.uri, generation),
                nbytes=sizes,
                created_unix=max((m.created_unix for m in manifests), default=mtimes),
                sealed=bool(manifests),
                superseded=generation.startswith(SPARE_PREFIX) or (
                    record is not None and generation != record.generation and is_superseded(generation, record)),
            ))
        return out


def _usage(directory: str) -> tuple[int, float]:
    """Bytes of the files under ``directory`` (temp files included: they occupy memory) and the newest mtime.
    One ``scandir`` per directory (every admission walks the node's whole tier)."""
    total, newest = 0, 0.0
    pending = [directory]
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir():
                            if not entry.is_symlink():
                                pending.append(entry.path)
                            continue
                        st = entry.stat()
                    except FileNotFoundError:
                        continue  # removed meanwhile
                    total += st.st_size
                    newest = max(newest, st.st_mtime)
        except (FileNotFoundError, NotADirectoryError):
            continue
    return total, newest
