"""A read-only, seekable file object over one stored object, fetching only the bytes asked for.

pyarrow reads a Parquet file's footer and then only the row groups it needs; handed this file object,
it issues those reads as ranged requests to the backend (through the scheduler, with retries), so a
rank loading a few tensors fetches a few row groups of the pieces table, not the whole table.
"""

from __future__ import annotations

import io

from tierckpt.backends import Backend
from tierckpt.io.scheduler import get_scheduler


class SeekableReader(io.RawIOBase):
    """The position bookkeeping of a read-only, seekable file of ``length`` bytes; subclasses read."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.length}[whence]
        self._position = max(0, base + offset)
        return self._position


class RangeFile(SeekableReader):
    """Reads ``key`` of ``backend`` on demand; ``bytes_read`` counts what was fetched."""

    def __init__(self, backend: Backend, key: str) -> None:
        super().__init__(get_scheduler().run(backend.size(key)))
        self._backend, self._key = backend, key
        self.bytes_read = 0

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        count = max(0, min(len(buffer), self.length - self._position))
        if count:
            out = memoryview(buffer).cast("B")[:count]
            get_scheduler().run(self._backend.read_into(self._key, self._position, out))
            self._position += count
            self.bytes_read += count
        return count
