"""The storage interface every backend implements.

A backend is bound to one root URI; keys are ``/``-separated paths relative to that root
(``"g-1a2b/data/rank-00000.bin"``). The interface is small and async: a few abstract primitives
plus defaults built on them (``read_into``, ``read_runs``, ``delete_prefix``), in the style of zarr's ``Store``.

Lifecycle of a data object written by a save (every rank, for its own files):

1. ``open_writer(key)`` returns an :class:`ObjectWriter`.
2. ``writer.write(chunk)`` is called with consecutive chunks, in order.
3. ``writer.close()`` makes the whole object visible at once (rename on POSIX, multipart
   completion on S3); ``writer.abort()`` instead leaves nothing behind.

The commit of a checkpoint (one rank, last): ``commit(key, data, expected=...)`` is a compare-and-swap:
it writes a small object atomically and durably only if the object still holds ``expected`` (``None``:
only if there is none yet), else it raises :class:`~tierckpt.errors.CheckpointBusyError` and leaves
it untouched. A reader sees either the old object or the new one, never a torn one. How each backend
makes the check and the write one step: local files, a ``flock`` held across read, compare and rename
(released by process death); memory, a lock; S3, conditional writes (``If-None-Match: *``,
``If-Match: <ETag>``). Other fsspec file systems can do neither: they check, then write (a documented
limitation: two writers racing there may both succeed).

A store is a chain: the URI's backend, wrapped in *links* (:class:`Link`, zarr's ``WrapperStore``), each
with one job (scheduling, the node disk cache, the node memory tier). Every backend answers two chain
hooks, :meth:`Backend.uri_of` (for messages) and :meth:`Backend.next_link`; what only the node tiers have
is asked of the chain's node face (:class:`tierckpt.node.face.NodeFace`), which
:func:`tierckpt.store.open_chain` returns beside the store: a backend knows no node.
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tierckpt.backends.bounded import oversized
from tierckpt.errors import CheckpointError


class Unconditional(enum.Enum):
    """Type of :data:`UNCONDITIONAL`."""

    UNCONDITIONAL = "unconditional"


UNCONDITIONAL = Unconditional.UNCONDITIONAL
"""``expected`` for :meth:`Backend.commit` that replaces whatever is there (pointers such as ``LATEST``)."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do natively, so callers can pick the fast path."""

    local_path: bool = False
    """Keys map to files on this machine (positional reads without a network hop)."""


class ObjectWriter(abc.ABC):
    """A sequential writer for one object; nothing is visible until :meth:`close`.

    Implementations set ``_uri`` (for messages) and ``_done`` once closed or aborted, and call
    :meth:`_check_open` first in ``write`` and ``close``.
    """

    _uri: str
    _done: bool = False

    def _check_open(self) -> None:
        if self._done:
            raise CheckpointError(f"writer for {self._uri} is already closed or aborted")

    def use_stated_crc32c(self) -> bool:
        """Take the object's CRC-32C from the caller instead of computing it over the bytes written.

        Asked before the first write by a caller that knows the CRC-32C of everything it writes without
        another pass (a save's :class:`~tierckpt.io.staging.FileStream` combines it from its pieces'
        checksums). A writer that records the CRC (the node memory tier's) returns ``True``, skips its
        own pass, and expects :meth:`state_crc32c` before :meth:`close`; the default returns ``False``.
        """
        return False

    def state_crc32c(self, crc32c: int) -> None:
        """The CRC-32C of all the bytes written, after :meth:`use_stated_crc32c` returned ``True``."""
        raise CheckpointError(f"writer for {self._uri} takes no stated CRC-32C: it was not asked to")

    @abc.abstractmethod
    async def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` to the object."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish the object, durably, and make it visible as a whole."""

    @abc.abstractmethod
    async def abort(self) -> None:
        """Discard everything written; the key is left as it was before ``open_writer``."""


Segment = tuple[Sequence[int], int, memoryview]
"""Runs of one object packed into a buffer: ``(run offsets, run bytes, out)``, as :meth:`Backend.read_runs`
reads them; :meth:`Backend.read_segments` reads several."""


class ReadsInto:
    """For backends whose read primitive fills a caller's buffer: ``get_range`` and ``read_into`` from
    ``_read_range(key, start, end, out)``, so reads into tensors never go through a bytes copy."""

    async def _read_range(self, key: str, start: int, end: int, out: memoryview) -> None:
        raise NotImplementedError

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        buf = bytearray(max(end - start, 0))
        await self._read_range(key, start, end, memoryview(buf))
        return bytes(buf)

    async def read_into(self, key: str, start: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        await self._read_range(key, start, start + len(view), view)


class Backend(abc.ABC):
    """Async storage bound to a root URI. See the module docstring for the lifecycle."""

    capabilities: Capabilities = Capabilities()

    def __init__(self, root_uri: str) -> None:
        self.root_uri = root_uri

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root_uri!r})"

    @property
    def service(self) -> str:
        """What answers this store's requests (``scheme://host``), for the I/O scheduler's outage marks
        (:mod:`tierckpt.io.outages`): stores of one service are up or down together."""
        scheme, sep, rest = self.root_uri.partition("://")
        return f"{scheme}://{rest.split('/', 1)[0]}" if sep else "file://"

    @property
    def request_timeout_s(self) -> float | None:
        """How long one request may go without an answer (``None``: no limit, e.g. a local file system);
        the I/O scheduler bounds each attempt of a call by it plus the time to move its bytes."""
        return None

    # -- abstract primitives -------------------------------------------------------------------
    @abc.abstractmethod
    async def put(self, key: str, data: bytes | memoryview) -> None:
        """Write a whole object; readers never see a partial one."""

    @abc.abstractmethod
    async def open_writer(self, key: str) -> ObjectWriter:
        """Start a streamed write of ``key`` (see the lifecycle above)."""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """Read a whole object. Missing key: :class:`~tierckpt.errors.CheckpointNotFoundError`."""

    async def get_capped(self, key: str, cap: int) -> bytes:
        """:meth:`get`, refused unread (:class:`~tierckpt.errors.OversizedFileError`) when the object is
        larger than ``cap``: its size is asked first. Stores that can do it in one request override it."""
        where = f"{self.root_uri.rstrip('/')}/{key}"
        size = await self.size(key)
        if size > cap:
            raise oversized(where, size, cap)
        data = await self.get(key)
        if len(data) > cap:  # replaced by a larger object in between
            raise oversized(where, len(data), cap)
        return data

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Read bytes ``[start, end)``. ``end`` past the object's size is an error, never a short read."""

    @abc.abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether ``key`` names an object."""

    def size_at_once(self, key: str) -> int | None:
        """The size of ``key`` when this store tells it at once in the calling thread (a local file's ``stat``,
        no trip through the I/O loop); ``None`` when asking takes the I/O loop (an object store, a cache)."""
        return None

    @abc.abstractmethod
    async def size(self, key: str) -> int:
        """Size of an object in bytes."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (recursively), sorted, relative to the root."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Delete one object; deleting a missing key is not an error."""

    @abc.abstractmethod
    async def commit(
        self, key: str, data: bytes, *, expected: bytes | None | Unconditional = UNCONDITIONAL,
        after: Mapping[str, int | None] | None = None,
    ) -> None:
        """Atomically and durably write a small object (the commit record of a checkpoint), if ``key``
        holds ``expected`` (``None``: no object); otherwise raise :class:`CheckpointBusyError`.

        ``after``: the objects (key -> size, ``None`` when unknown) this commit depends on, stated by
        the writer. A store that acknowledges writes before they are durable where it points (the node
        cache's write-back) publishes the commit there only once each of them is; a store that is
        durable when a write returns (every backend here) has already got them and ignores it."""

    # -- defaults built on the primitives ------------------------------------------------------
    async def read_into(self, key: str, start: int, out: memoryview) -> None:
        """Read ``len(out)`` bytes at ``start`` straight into ``out`` (backends override to avoid a copy)."""
        out[:] = await self.get_range(key, start, start + len(out))

    async def read_runs(
        self, key: str, offsets: Sequence[int], run_bytes: int, out: memoryview,
        digest: Callable[[memoryview], int] | None = None,
    ) -> list[int] | None:
        """Read ``len(offsets)`` runs of ``run_bytes`` bytes each, packed one after another into ``out``.

        With ``digest``, return ``digest(run)`` of each run, in order, computed as each run lands (the
        load's checksums of short runs: one pass over the bytes while they are in the CPU cache).
        The default issues one ranged read per run, at most 16 at a time; local files override it
        with a loop of positional reads in one thread.
        """
        limit = asyncio.Semaphore(16)
        digests = [0] * len(offsets) if digest is not None else None

        async def one(i: int, offset: int) -> None:
            async with limit:
                view = out[i * run_bytes : (i + 1) * run_bytes]
                await self.read_into(key, offset, view)
                if digests is not None:
                    digests[i] = digest(view)  # type: ignore[misc]

        await asyncio.gather(*(one(i, o) for i, o in enumerate(offsets)))
        return digests

    async def read_segments(
        self, key: str, segments: Sequence[Segment], digest: Callable[[memoryview], int] | None = None,
    ) -> list[list[int] | None]:
        """:meth:`read_runs` of each ``(offsets, run_bytes, out)`` of ``segments``; each one's digests. A load
        reads a file's neighbouring units at once this way. The default reads the segments one after
        another; local files read them all in one worker thread with one open of the file."""
        return [await self.read_runs(key, offsets, run_bytes, out, digest) for offsets, run_bytes, out in segments]

    async def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix``."""
        await asyncio.gather(*(self.delete(k) for k in await self.list(prefix)))

    async def close(self) -> None:
        """Release connections and handles held by the backend."""

    # -- the chain (a plain backend ends it; links override) ----------------------------------------
    def uri_of(self, key: str) -> str:
        """The full URI of ``key`` (for messages)."""
        return f"{self.root_uri.rstrip('/')}/{key}"

    def next_link(self) -> Backend | None:
        """The store this one wraps (``None``: this is the URI's own backend, the end of the chain)."""
        return None


class Link(Backend):
    """A backend that wraps the chain :attr:`below` it (zarr's ``WrapperStore``): messages name the keys
    as the chain below does. The node tiers are links; a link's job methods
    (``put``, ``get``...) are its own."""

    def __init__(self, below: Backend, root_uri: str | None = None) -> None:
        super().__init__(root_uri if root_uri is not None else below.root_uri)
        self.below = below

    def uri_of(self, key: str) -> str:
        return self.below.uri_of(key)

    def next_link(self) -> Backend | None:
        return self.below
