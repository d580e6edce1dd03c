"""One CRC-32C pass per save into the node memory tier.

The tier records each data file's CRC-32C in its manifest, which peers check every replica against. A
save's stream computes its pieces' block CRCs anyway; the whole file's CRC is combined from those and
the bytes between pieces (:class:`tierckpt.io.staging.FileRuns`) and stated to the tier's writer, which
then skips its own pass. Every test compares the manifest's CRC with a fresh CRC of the published file,
checks that the CRC was stated (not computed by the writer, not re-read when sealing), and loads the
checkpoint back bit-exact.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import tierckpt
from tierckpt.errors import CheckpointError
from tierckpt.io import staging
from tierckpt.io.crc import concat_crc
from tierckpt.io.staging import Chunk, FileStream
from tierckpt.store import memory_tier_of, open_store
from tierckpt.node.memory import MemoryConfig, mapped
from tierckpt.node.memory import memory as memory_module
from tierckpt.node.memory.manifest import FileEntry
from tierckpt.node.memory.memory import MemoryTier, file_crc
from tierckpt.node.written import WrittenCrc

GEN = "g-00000001-0000000000001-abcdef012345"


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MemoryConfig:
    directory = tmp_path / "memory-tier"
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(directory))
    return MemoryConfig(directory=str(directory), budget_bytes=1 << 30, exit_wait_s=0)


def wait_for_spare(home: str) -> None:
    deadline = time.monotonic() + 60
    while home not in mapped._SPARES and time.monotonic() < deadline:
        time.sleep(0.05)  # the next save's spare is made in the background


class Spy:
    """CRCs stated to the tier's writers, and files the tier re-read to checksum them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.stated: list[int] = []
        self.reread: list[str] = []
        state, reread = WrittenCrc.state, memory_module.file_crc

        def stating(written: WrittenCrc, crc: int) -> None:
            self.stated.append(crc)
            state(written, crc)

        def rereading(path: str) -> FileEntry:
            self.reread.append(path)
            return reread(path)

        monkeypatch.setattr(WrittenCrc, "state", stating)
        monkeypatch.setattr(memory_module, "file_crc", rereading)

    def check(self, path: str, config: MemoryConfig, want: dict[str, Any]) -> dict[str, FileEntry]:
        """The committed checkpoint's data files in the tier: each one's manifest entry equals a fresh CRC
        of the file and is the CRC stated by the save; nothing was re-read; it loads back bit-exact."""
        tier = memory_tier_of(open_store(path, {"memory": config}))
        record = tier.committed()
        assert record is not None
        held = tier.held(record.generation)
        data = {k: e for k, e in held.items() if "/data/" in k}
        for key, entry in held.items():
            assert entry == file_crc(tier.path_of(key)), key
        assert sorted(e.crc32c for e in data.values()) == sorted(self.stated)
        assert not [p for p in self.reread if "/data/" in p]
        got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in want.items()}
        tierckpt.load(path, got, storage_options={"memory": config})
        for k, v in want.items():
            assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
        self.stated.clear()
        self.reread.clear()
        return data


def padded(seed: int = 0) -> dict[str, Any]:
    """Several pieces whose sizes are not multiples of the 64-byte alignment (padding between them), one
    larger than a 1 MiB checksum block, and an object."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(1000, generator=g),
        "b": torch.arange(7, dtype=torch.int8) + seed,
        "c": torch.randn(300, 1001, generator=g, dtype=torch.float64),
        "d": torch.randn(33, generator=g).to(torch.bfloat16),
        "step": seed,
    }


def test_concat_crc_is_the_crc_of_the_concatenation() -> None:
    rng = random.Random(5)
    for _ in range(200):
        parts = [rng.randbytes(rng.choice([0, 1, 3, 63, 64, 4096, 70001])) for _ in range(rng.randint(0, 9))]
        assert concat_crc([(crc32c.crc32c(p), len(p)) for p in parts]) == crc32c.crc32c(b"".join(parts))


def test_sync_save_states_the_file_crc(tmp_path: Path, config: MemoryConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    path = str(tmp_path / "ckpt")
    for seed in range(2):
        tierckpt.save(path, padded(seed), storage_options={"memory": config})
        data = spy.check(path, config, padded(seed))
        assert len(data) == 1 and next(iter(data.values())).size > (2 << 20)


def test_async_saves_state_the_file_crc_staged_and_through_the_spare(
    tmp_path: Path, config: MemoryConfig, monkeypatch: pytest.MonkeyPatch, mapped_uses: list[bool],
) -> None:
    """The first async save stages and streams into the tier; the later ones copy into the spare mapped file."""
    spy = Spy(monkeypatch)
    path = str(tmp_path / "ckpt")
    home = memory_tier_of(open_store(path, {"memory": config})).home
    try:
        for seed in range(3):
            handle = tierckpt.async_save(path, padded(seed), storage_options={"memory": config})
            handle.wait()
            spy.check(path, config, padded(seed))
            wait_for_spare(home)
        assert mapped_uses == [False, True, True]
    finally:
        mapped._drop_spares()


@pytest.mark.parametrize("through_spare", [False, True])
def test_many_chunks_state_the_file_crc(
    tmp_path: Path, config: MemoryConfig, monkeypatch: pytest.MonkeyPatch, mapped_uses: list[bool], through_spare: bool,
) -> None:
    """Pieces and padding cut across many chunks: the first async save of a process through a small staging
    buffer (ping-pong halves of 2 KiB), or a spare file streamed in chunks of 1000 bytes."""
    spy = Spy(monkeypatch)
    path = str(tmp_path / "ckpt")
    home = memory_tier_of(open_store(path, {"memory": config})).home
    try:
        if not through_spare:
            tierckpt.async_save(path, padded(1), storage_options={"memory": config}, staging_bytes=4096).wait()
            spy.check(path, config, padded(1))
            assert mapped_uses == []  # through the staging buffer's halves: no mapped file asked for
            return
        monkeypatch.setattr(staging, "STREAM_CHUNK_BYTES", 1000)
        tierckpt.async_save(path, padded(0), storage_options={"memory": config}).wait()
        spy.check(path, config, padded(0))
        wait_for_spare(home)
        tierckpt.async_save(path, padded(1), storage_options={"memory": config}).wait()
        spy.check(path, config, padded(1))
        assert mapped_uses == [False, True]
    finally:
        mapped._drop_spares()


def test_empty_tensors_and_no_tensors(tmp_path: Path, config: MemoryConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    mixed = {"e0": torch.empty(0), "a": torch.arange(5, dtype=torch.int16), "e1": torch.zeros(0, 3), "b": torch.ones(17)}
    path = str(tmp_path / "mixed")
    tierckpt.save(path, mixed, storage_options={"memory": config})
    assert len(spy.check(path, config, mixed)) == 1
    only_empty = {"e0": torch.empty(0), "e1": torch.zeros(0, 3, dtype=torch.int64)}
    path = str(tmp_path / "empty")
    tierckpt.save(path, only_empty, storage_options={"memory": config})
    assert [e.size for e in spy.check(path, config, only_empty).values()] in ([], [0])
    objects = {"step": 3, "name": "run-7"}
    path = str(tmp_path / "objects")
    tierckpt.save(path, objects, storage_options={"memory": config})
    assert spy.check(path, config, objects) == {}


def test_a_piece_streamed_in_parts_fails_the_file(tmp_path: Path) -> None:
    """The file CRC is combined from whole pieces: chunks that split one piece around other bytes fail the
    save with a clear error, and the tier keeps nothing."""
    tier = MemoryTier(str(tmp_path / "ckpt"), MemoryConfig(directory=str(tmp_path / "mem"), budget_bytes=1 << 20))
    key = f"{GEN}/data/rank-00000.bin"
    stream = FileStream(tier, key, 1)
    stream.put(Chunk(memoryview(b"abcd"), [(0, 0, 4)]))
    stream.put(Chunk(memoryview(b"\0\0")))
    stream.put(Chunk(memoryview(b"efgh"), [(0, 0, 4)]))
    with pytest.raises(CheckpointError, match="piece 0 of the file was streamed in separate parts"):
        stream.finish()
    assert tier.keys_of(GEN) == []


async def test_tier_writers_record_the_stated_crc_and_require_it(tmp_path: Path) -> None:
    tier = MemoryTier(str(tmp_path / "ckpt"), MemoryConfig(directory=str(tmp_path / "mem"), budget_bytes=1 << 20))
    data = os.urandom(3 << 20)
    key = f"{GEN}/data/rank-00000.bin"
    writer = await tier.open_writer(key)
    assert writer.use_stated_crc32c()
    await writer.write(data[:100])
    await writer.write(memoryview(data)[100:])
    writer.state_crc32c(crc32c.crc32c(data))
    await writer.close()
    assert tier.seal(GEN, origin="n").files == ((key, FileEntry(len(data), crc32c.crc32c(data))),)

    missing = f"{GEN}/data/rank-00001.bin"
    writer = await tier.open_writer(missing)
    assert writer.use_stated_crc32c()
    await writer.write(data)
    with pytest.raises(CheckpointError, match="was not; the file is discarded"):
        await writer.close()
    assert tier.keys_of(GEN) == [key]

    written = await tier.open_writer(f"{GEN}/data/rank-00002.bin")
    await written.write(b"x")
    assert not written.use_stated_crc32c()  # too late: it has checksummed bytes already
    await written.abort()

    replica = tier.receive(f"{GEN}/data/rank-00003.bin")
    assert replica.use_stated_crc32c()
    replica.write(memoryview(data))
    replica.state_crc32c(crc32c.crc32c(data))
    with pytest.raises(CheckpointError, match="must be computed where it arrives"):
        replica.finish(FileEntry(len(data), crc32c.crc32c(data)))
    assert tier.keys_of(GEN) == [key]

