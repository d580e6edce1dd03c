"""Uploading a node-cache file while it is still being written (``CacheConfig.upload_while_writing``).

A streamed data file reaches the remote sooner when its upload follows the local write instead of
starting after the file is closed. :class:`TailUpload` reads what has landed in the local temp file,
part by part, and streams it to a remote writer — so the write to the fast tier and the upload
overlap, and no extra memory holds the data (it is read back from the page cache).

Nothing becomes visible early: the remote object is published (its writer closed) only by the
regular upload step, after the local copy is published and recorded as pending, and only when the
size and CRC-32C of what was sent match the catalogue's record. Otherwise the remote writer is
aborted and the regular step uploads the file from the local copy. A crash at any moment leaves at
most an unfinished multipart upload (invisible on the remote) and a pending op that ``sync()`` uploads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import crc32c

from tierckpt.backends.base import Backend, ObjectWriter
from tierckpt.errors import CheckpointError
from tierckpt.node import ledger
from tierckpt.node.ledger import Tier
from tierckpt.io.scheduler import OpRecord, Priority, get_scheduler

logger = logging.getLogger("tierckpt.node.disk")


class TailUpload:
    """Follows one growing local file and streams it to ``remote/key`` (see the module docstring).

    Lifecycle, on the I/O loop: created when the local writer opens; :meth:`advance` after each
    local write; :meth:`seal` when the local file is complete; :meth:`mark_published` once the local
    copy is published and has a catalogue version; then :meth:`complete` (publish the remote object
    if the record matches) or :meth:`cancel`, either of which ends it.
    """

    def __init__(self, remote: Backend, key: str, path: str, part_bytes: int, slots: asyncio.Semaphore) -> None:
        self._remote, self._key = remote, key
        self._version: int | None = None
        self._settled = asyncio.Event()  # the local publish succeeded (version set) or the tail ended
        self._ended = False
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._written = 0
        self._sealed = False
        self._abandoned = False
        self._more = asyncio.Event()
        self._started = time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._send(part_bytes, slots))

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more bytes are in the local file."""
        self._written += nbytes
        self._more.set()

    def seal(self) -> None:
        """The local file is complete: send the rest."""
        self._sealed = True
        self._more.set()

    @property
    def sealed(self) -> bool:
        return self._sealed

    def mark_published(self, version: int) -> None:
        """The local copy is published as catalogue version ``version``."""
        self._version = version
        self._settled.set()

    async def published_version(self) -> int | None:
        """The catalogue version of the followed write once published; ``None`` if the tail ended first.

        Call only once sealed: the local publish is then under way (or failed, which ends the tail).
        """
        await self._settled.wait()
        return None if self._ended else self._version

    async def _send(self, part_bytes: int, slots: asyncio.Semaphore) -> tuple[ObjectWriter, int, int]:
        """Stream parts as they land; return the open remote writer, the bytes sent and their CRC."""
        async with slots:
            if self._abandoned:  # while waiting for a slot
                raise CheckpointError(f"the upload of {self._key!r} while it was written was abandoned")
            writer = await self._remote.open_writer(self._key)
            sent, crc = 0, 0
            try:
                while True:
                    if self._abandoned:
                        raise CheckpointError(f"the upload of {self._key!r} while it was written was abandoned")
                    ready = self._written - sent
                    if ready >= part_bytes or (self._sealed and ready > 0):
                        data = await asyncio.to_thread(os.pread, self._fd, min(ready, part_bytes), sent)
                        ledger.read_back(Tier.NODE_DISK, len(data))
                        if not data:
                            raise CheckpointError(f"the node-cache copy of {self._key!r} shrank while it was uploaded")
                        crc = crc32c.crc32c(data, crc)
                        await writer.write(data)
                        sent += len(data)
                    elif self._sealed:
                        return writer, sent, crc
                    else:
                        self._more.clear()
                        await self._more.wait()
            except BaseException:
                with contextlib.suppress(Exception):
                    await writer.abort()
                raise

    async def complete(self, size: int, crc: int) -> bool:
        """Publish the remote object if exactly the recorded file was sent; ``False``: upload it anew."""
        try:
            writer, sent, sent_crc = await self._task
        except Exception as exc:  # noqa: BLE001 - the regular upload (with retries) takes over
            logger.info("upload of %s while it was written failed (%s); uploading it again", self._key, exc)
            return False
        finally:
            self._end()
        if sent != size or sent_crc != crc:
            with contextlib.suppress(Exception):
                await writer.abort()
            return False
        try:
            await writer.close()
        except CheckpointError as exc:
            logger.info("publishing %s after uploading it while written failed (%s); uploading it again", self._key, exc)
            return False
        get_scheduler().metrics.record(OpRecord(
            op="upload", backend=self._remote.root_uri, key=self._key, nbytes=sent,
            seconds=time.perf_counter() - self._started, attempts=1, priority=Priority.BACKGROUND, ok=True,
        ))
        return True

    async def cancel(self) -> None:
        """Abandon the upload (the local write was aborted, replaced or deleted); nothing is published.

        Cooperative: the sender stops after the request in flight (cancelling it inside a remote
        call could orphan what that call creates, such as a temp file or a multipart upload).
        """
        if self._ended:
            return
        self._abandoned = True
        self._more.set()
        try:
            writer, _, _ = await self._task
        except Exception:  # noqa: BLE001 - stopped or failed: _send aborted its writer
            pass
        else:
            with contextlib.suppress(Exception):
                await writer.abort()
        finally:
            self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            os.close(self._fd)
            self._settled.set()
