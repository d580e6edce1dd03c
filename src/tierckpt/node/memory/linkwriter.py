"""The memory link's streamed writer: :class:`LinkWriter` (a file streamed into the tier, chunk by chunk).

Each chunk is admitted first (the budget is checked against what really arrives); when the tier is
full and ``OnFull.FALLBACK`` is set, the file moves to the chain below with what it had written.
"""

from __future__ import annotations

import asyncio

from tierckpt.backends.base import ObjectWriter
from tierckpt.node.memory.linkview import LinkView
from tierckpt.node.memory.incoming import IncomingFile

_COPY_CHUNK = 8 << 20


class LinkWriter(ObjectWriter):
    """Streams into the tier (admitting each chunk); moves to the chain below if the tier is full."""

    def __init__(self, link: LinkView, key: str, generation: str, incoming: IncomingFile) -> None:
        self._link, self._key, self._generation = link, key, generation
        self._incoming: IncomingFile | None = incoming
        self._below: ObjectWriter | None = None
        self._uri = link.memory_tier.uri_of(key)

    def use_stated_crc32c(self) -> bool:
        return self._incoming is not None and self._incoming.use_stated_crc32c()

    def state_crc32c(self, crc32c: int) -> None:
        if self._incoming is not None:  # else the file went to the chain below, which needs no CRC
            self._incoming.state_crc32c(crc32c)

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open()
        view = memoryview(data).cast("B")
        if self._below is None and not await self._link.admit(self._generation, view.nbytes):
            await self._move_below()
        if self._below is None:
            try:
                await asyncio.to_thread(self._incoming.write, view)  # type: ignore[union-attr]
                return
            except OSError as exc:
                if not self._link.fall_back(self._generation, self._uri, exc):
                    raise
                await self._move_below()
        assert self._below is not None
        await self._below.write(view)

    async def _move_below(self) -> None:
        """The tier is full (fallback): continue in the chain below, starting with what was written (the
        writes that completed: one the file system refused left an unknown part of itself)."""
        incoming = self._incoming
        assert incoming is not None
        self._below = await self._link.below.open_writer(self._key)
        left = incoming.size
        with open(incoming.tmp_path, "rb", buffering=0) as f:
            while left and (chunk := await asyncio.to_thread(f.read, min(_COPY_CHUNK, left))):
                await self._below.write(chunk)
                left -= len(chunk)
        await asyncio.to_thread(incoming.abort)
        self._incoming = None

    async def close(self) -> None:
        self._check_open()
        self._done = True
        if self._below is not None:
            await self._below.close()
            return
        await asyncio.to_thread(self._incoming.publish)  # type: ignore[union-attr]
        self._link.wrote(self._key)

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._below is not None:
            await self._below.abort()
        if self._incoming is not None:
            await asyncio.to_thread(self._incoming.abort)
