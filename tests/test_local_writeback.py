"""The local writer starts the writeback of a streamed file in page-aligned batches as it is written."""

from __future__ import annotations

import asyncio
import os

from tierckpt.backends.files import WRITEBACK_BATCH_BYTES, WRITEBACK_PAGE_BYTES
from tierckpt.backends.local import LocalBackend


def test_streamed_file_is_exact_and_written_back_in_page_aligned_batches(tmp_path):
    backend = LocalBackend(str(tmp_path))
    chunks = [os.urandom(n) for n in (100, 5000, 3 << 20, 7, WRITEBACK_BATCH_BYTES + 1234, 1, 9 << 20)]

    async def stream() -> list[int]:
        writer = await backend.open_writer("gen/data.bin")
        flushed = []
        for chunk in chunks:
            await writer.write(memoryview(chunk))
            flushed.append(writer._flushed)
        await writer.close()
        return flushed

    flushed = asyncio.run(stream())
    assert (tmp_path / "gen" / "data.bin").read_bytes() == b"".join(chunks)
    ends = [sum(map(len, chunks[: i + 1])) for i in range(len(chunks))]
    page = lambda n: n - n % WRITEBACK_PAGE_BYTES  # noqa: E731
    # under one batch nothing starts; past it, every whole page written so far (never a partial one)
    assert flushed == [0, 0, 0, 0, page(ends[4]), page(ends[4]), page(ends[6])]
