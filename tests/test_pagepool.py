"""The memory tier's page pool: a superseded generation's data files written over instead of fresh pages,
never while anyone (this or another process) still reads them."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import tierckpt
from tierckpt.saving import cleanup
from tierckpt.backends.file_open import hold_shared, open_shared
from tierckpt.backends.local import LocalBackend
from tierckpt.native.layout import COMMIT, CommitRecord, new_generation
from tierckpt.node.memory import MemoryConfig, MemoryTier, NodeMemory
from tierckpt.node.memory import mapped, pagepool
from tierckpt.node.memory.link import MemoryLink
from tierckpt.node.memory.manifest import FileEntry
from tierckpt.node.memory.memory import SPARE_PREFIX
from tierckpt.node.memory.pagepool import MIN_BYTES, POOL_GENERATION, claim, pool_dir
from tierckpt.node.memory.copydown import map_file as _map

URI = "s3://bucket/run/pool"
MIB = 1 << 20


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory on tmpfs where the machine has one (block counts are then the pages held)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = tempfile.mkdtemp(prefix="tierckpt-pool-", dir=base)
    yield Path(directory)
    shutil.rmtree(directory, ignore_errors=True)


def config(shm: Path, budget: int = 1 << 30) -> MemoryConfig:
    return MemoryConfig(directory=str(shm / "tier"), budget_bytes=budget, exit_wait_s=0)


async def commit_generation(tier: MemoryTier, seq: int, files: dict[str, bytes]) -> str:
    generation = new_generation(seq)
    for name, data in files.items():
        await tier.put(f"{generation}/{name}", data)
    await tier.commit(COMMIT, CommitRecord(generation, time.time(), seq).encode())
    return generation


def pooled(tier: MemoryTier) -> list[os.stat_result]:
    directory = pool_dir(tier.root)
    return [os.stat(os.path.join(directory, n)) for n in sorted(os.listdir(directory))] if os.path.isdir(directory) else []


def receive(tier: MemoryTier, key: str, data: bytes) -> bool:
    """A replica of ``key`` arriving (as the replica receiver writes it); whether it reused a pooled file."""
    incoming = tier.receive(key, len(data))
    for i in range(0, len(data), 3 * MIB):
        incoming.write(memoryview(data)[i: i + 3 * MIB])
    incoming.finish(FileEntry(len(data), crc32c.crc32c(data)))
    return incoming.reused


def test_the_pool_is_a_spare_generation() -> None:
    """So every rule for spares holds for it: commit sequence 0, evicted first, out of listings."""
    assert POOL_GENERATION.startswith(SPARE_PREFIX)


async def test_a_retired_file_is_written_over_by_a_replica(shm: Path) -> None:
    memory = NodeMemory(config(shm))
    tier = memory.tier(URI)
    old = await commit_generation(tier, 1, {"data/rank-00000.bin": os.urandom(6 * MIB), "meta/header.json": b"{}",
                                            "data/small.bin": os.urandom(MIN_BYTES // 2)})
    await commit_generation(tier, 2, {"data/rank-00000.bin": os.urandom(6 * MIB)})
    inode = os.stat(tier.path_of(f"{old}/data/rank-00000.bin")).st_ino

    assert memory.retire(tier, old) == 6 * MIB
    assert old not in tier.generations()  # gone from the tier, its COMMIT-less files too
    (entry,) = pooled(tier)
    assert entry.st_ino == inode and entry.st_size == 6 * MIB
    if str(shm).startswith("/dev/shm"):
        assert entry.st_blocks * 512 >= 6 * MIB  # its pages are still allocated

    third = new_generation(3)
    data = os.urandom(5 * MIB + 123)
    assert receive(tier, f"{third}/data/rank-00001.bin", data)
    published = os.stat(tier.path_of(f"{third}/data/rank-00001.bin"))
    assert published.st_ino == inode and published.st_size == len(data)  # the same file: no new pages
    assert Path(tier.path_of(f"{third}/data/rank-00001.bin")).read_bytes() == data
    assert pooled(tier) == []
    # Nothing reusable left: the next replica gets a fresh file.
    assert not receive(tier, f"{third}/data/rank-00002.bin", os.urandom(2 * MIB))


async def test_only_superseded_generations_are_pooled_and_the_pool_is_bounded(shm: Path) -> None:
    memory = NodeMemory(config(shm))
    tier = memory.tier(URI)
    first = await commit_generation(tier, 1, {"data/a.bin": os.urandom(2 * MIB), "data/b.bin": os.urandom(3 * MIB)})
    second = await commit_generation(tier, 2, {"data/a.bin": os.urandom(4 * MIB)})
    assert memory.retire(tier, second) == 0  # the committed generation: dropped, never reused
    assert pooled(tier) == [] and second not in tier.generations()
    third = await commit_generation(tier, 3, {"data/a.bin": os.urandom(2 * MIB)})
    assert memory.retire(tier, first) == 5 * MIB
    await commit_generation(tier, 4, {"data/a.bin": os.urandom(MIB)})
    assert memory.retire(tier, third) == 0  # the pool holds as much as the generation retired had: full
    assert sorted(s.st_size for s in pooled(tier)) == [2 * MIB, 3 * MIB]
    # The closest size is claimed (a smaller file cannot hold it; a bigger one would free its tail).
    dest = os.path.join(tier.root, ".claimed.tmp")
    assert claim(tier.root, 2 * MIB + 1, dest) and os.path.getsize(dest) == 3 * MIB
    assert not claim(tier.root, 3 * MIB, dest + "2")


async def test_pooled_bytes_count_in_the_budget_and_go_first(shm: Path) -> None:
    memory = NodeMemory(config(shm, budget=12 * MIB))
    tier = memory.tier(URI)
    old = await commit_generation(tier, 1, {"data/a.bin": os.urandom(4 * MIB)})
    new = await commit_generation(tier, 2, {"data/a.bin": os.urandom(4 * MIB)})
    memory.retire(tier, old)
    pool = {c.copy_id: c for c in memory.copies()}[f"{URI}/{POOL_GENERATION}"]
    assert pool.nbytes == 4 * MIB and pool.superseded
    assert sum(c.nbytes for c in memory.copies()) == 8 * MIB
    admission = memory.admit(URI, new_generation(3), 6 * MIB, durable_below=())
    assert admission.fits and admission.evict == (f"{URI}/{POOL_GENERATION}",)
    assert pooled(tier) == [] and tier.generations() == [new]


async def test_listings_and_loads_never_see_the_pool(shm: Path) -> None:
    cfg = config(shm)
    below = LocalBackend(str(shm / "below"))
    link = MemoryLink(below, cfg, URI)
    tier = link.memory_tier
    old = await commit_generation(tier, 1, {"data/a.bin": os.urandom(2 * MIB)})
    await commit_generation(tier, 2, {"data/a.bin": os.urandom(2 * MIB)})
    await link.delete_prefix(f"{old}/")  # the sweep after a commit
    assert len(pooled(tier)) == 1 and POOL_GENERATION in tier.generations()
    assert all(not k.startswith(SPARE_PREFIX) for k in await link.list(""))
    assert not await link.exists(f"{POOL_GENERATION}/data/{os.listdir(pool_dir(tier.root))[0]}")
    # A spare claims it: the pages of the old generation become the next snapshot's.
    inode = pooled(tier)[0].st_ino
    mapped._make(link.memory, tier, 2 * MIB - 4096)
    try:
        spare = mapped._SPARES[tier.home]
        assert os.fstat(spare.fd).st_ino == inode and spare.buffer.numel() == 2 * MIB - 4096
        assert os.path.getsize(spare.path) == 2 * MIB - 4096
        assert pooled(tier) == []
    finally:
        mapped._drop_spares()


def test_a_file_renamed_away_or_over_before_the_lock(shm: Path) -> None:
    """A reader that opened a file before it was retired but locks it after reads nothing of it; a path
    renamed over meanwhile (``COMMIT`` replaced) is opened again."""
    path, away = str(shm / "f"), str(shm / "g")
    Path(path).write_bytes(b"old")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.rename(path, away)
        with pytest.raises(FileNotFoundError, match="left its path"):
            hold_shared(fd, path)
        Path(path).write_bytes(b"new")  # another file under the same path
        assert not hold_shared(fd, path)
    finally:
        os.close(fd)
    fd = open_shared(path)
    try:
        assert os.pread(fd, 16, 0) == b"new"
    finally:
        os.close(fd)


async def test_a_mapping_keeps_its_lock_after_its_descriptor_closed(shm: Path) -> None:
    memory = NodeMemory(config(shm))
    tier = memory.tier(URI)
    old = await commit_generation(tier, 1, {"data/a.bin": os.urandom(2 * MIB)})
    await commit_generation(tier, 2, {"data/a.bin": os.urandom(2 * MIB)})
    mapping = _map(tier.path_of(f"{old}/data/a.bin"))  # the write-down's read (its file object closed)
    try:
        assert memory.retire(tier, old) == 0 and pooled(tier) == []
        assert len(bytes(mapping[:16])) == 16
    finally:
        mapping.close()


def _hold_and_read(path: str, ready: Any, go: Any, out: Any) -> None:
    """Another process of the node reading a tier file through the tier's reads."""
    fd = open_shared(path)
    ready.set()
    go.wait(30)
    size = os.fstat(fd).st_size
    out.put(crc32c.crc32c(os.pread(fd, size, 0)))
    os.close(fd)


async def test_a_reader_in_another_process_blocks_reuse(shm: Path) -> None:
    memory = NodeMemory(config(shm))
    tier = memory.tier(URI)
    data = os.urandom(4 * MIB)
    old = await commit_generation(tier, 1, {"data/a.bin": data})
    await commit_generation(tier, 2, {"data/a.bin": os.urandom(4 * MIB)})
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_hold_and_read, args=(tier.path_of(f"{old}/data/a.bin"), ready, go, out))
    reader.start()
    try:
        assert ready.wait(60)
        assert memory.retire(tier, old) == 0  # held: unlinked as before, not pooled
        assert pooled(tier) == []
        new, key = os.urandom(4 * MIB), f"{new_generation(3)}/data/a.bin"
        assert not receive(tier, key, new)  # a fresh file
        go.set()
        assert out.get(timeout=60) == crc32c.crc32c(data)  # the reader's bytes are the old ones, intact
        assert Path(tier.path_of(key)).read_bytes() == new
    finally:
        go.set()
        reader.join(30)
    assert reader.exitcode == 0


def _retire_and_exit(directory: str, crash: bool) -> None:
    """A process that fills a pool, then exits (``crash``: dies, its exit hooks never run)."""
    import asyncio

    memory = NodeMemory(MemoryConfig(directory=directory, budget_bytes=1 << 30))
    tier = memory.tier(URI)
    old = asyncio.run(commit_generation(tier, 1, {"data/a.bin": os.urandom(2 * MIB)}))
    asyncio.run(commit_generation(tier, 2, {"data/a.bin": os.urandom(2 * MIB)}))
    assert memory.retire(tier, old) == 2 * MIB
    if crash:
        os._exit(0)


@pytest.mark.parametrize("crash", [False, True])
async def test_a_pool_after_its_process_exits(shm: Path, crash: bool) -> None:
    """Dropped at exit; after a crash, plain evictable garbage that no listing or load sees."""
    cfg = config(shm)
    proc = mp.get_context("spawn").Process(target=_retire_and_exit, args=(cfg.directory, crash))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    memory = NodeMemory(cfg)
    tier = memory.tier(URI)
    committed = tier.committed()
    assert committed is not None
    copies = {c.copy_id: c for c in memory.copies()}
    pool_id = f"{URI}/{POOL_GENERATION}"
    assert os.path.exists(pool_dir(tier.root)) == crash and (pool_id in copies) == crash
    if not crash:
        return
    assert copies[pool_id].superseded and copies[pool_id].nbytes == 2 * MIB
    link = MemoryLink(LocalBackend(str(shm / "below")), cfg, URI)
    assert all(not k.startswith(SPARE_PREFIX) for k in await link.list(""))
    admission = memory.admit(URI, new_generation(3), (1 << 30) - 3 * MIB, durable_below=())
    assert admission.fits and admission.evict == (pool_id,)
    assert tier.generations() == [committed.generation]


def test_async_saves_reuse_the_superseded_generation_pages(shm: Path, monkeypatch: pytest.MonkeyPatch,
                                                            no_sweep_grace: None) -> None:
    """Through the saver: each sweep pools the superseded generation's file, the next spare claims it,
    and every checkpoint loads bit-exact."""
    claims: list[bool] = []

    def spy(*args: Any) -> bool:
        claims.append(claim(*args))
        return claims[-1]

    monkeypatch.setattr(mapped, "claim", spy)
    uri = str(shm / "ckpt")
    opts = {"memory": config(shm)}
    for step in range(5):
        state = {"w": torch.full((512, 1024), float(step)), "step": step}
        tierckpt.async_save(uri, state, storage_options=opts).wait()
        cleanup.wait_pending()  # the sweep of the superseded generation
        mapped_spare_ready(shm)
        target = {"w": torch.zeros(512, 1024), "step": -1}
        tierckpt.load(uri, target, storage_options=opts)
        assert torch.equal(target["w"], state["w"]) and target["step"] == step
    assert any(claims), claims
    mapped._drop_spares()


def mapped_spare_ready(shm: Path, timeout_s: float = 30) -> None:
    """Wait until no spare is being prepared (it is made in a background thread)."""
    deadline = time.monotonic() + timeout_s
    while mapped._PREPARING and time.monotonic() < deadline:
        time.sleep(0.01)


async def test_a_claimed_file_keeps_no_stamp_of_its_old_bytes(shm: Path) -> None:
    """A pooled file carries the CRC-32C stamp of the bytes it was written with (:mod:`tierckpt.node.memory.stamps`);
    claimed, it is the same inode and may get the same size — the stamp goes at the claim, so a seal that
    looked before the new bytes are published never takes the old CRC for the new bytes."""
    from tierckpt.node.memory import stamps

    memory = NodeMemory(config(shm))
    tier = memory.tier(URI)
    data = os.urandom(4 * MIB)
    old = await commit_generation(tier, 1, {"data/rank-00000.bin": data})
    await commit_generation(tier, 2, {"data/rank-00000.bin": os.urandom(MIB)})
    assert stamps.recall(tier.path_of(f"{old}/data/rank-00000.bin")) == FileEntry(len(data), crc32c.crc32c(data))
    assert memory.retire(tier, old) == len(data)
    dest = os.path.join(str(shm), "claimed.bin")
    assert claim(tier.root, len(data), dest)
    assert os.path.getsize(dest) == len(data)  # the old bytes, the old size, the old inode
    assert stamps.recall(dest) is None


def mappings_of(inode: int) -> int:
    """How many mappings of this process map the file ``inode`` (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if len(fields := line.split()) > 4 and fields[4] == str(inode))


def receive_in_place(tier: MemoryTier, key: str, data: bytes) -> int:
    """A replica of ``key`` arriving as the replica stream writes it (straight into its mapped pages); its inode."""
    incoming = tier.receive(key, len(data))

    def fill(view: memoryview) -> None:
        view[:] = data

    incoming.write_in_place(len(data), fill)
    incoming.finish(FileEntry(len(data), crc32c.crc32c(data)))
    return os.stat(tier.path_of(key)).st_ino


async def test_a_pooled_file_is_written_again_through_the_mapping_this_process_kept(shm: Path) -> None:
    """A replica received into a file this process mapped before (now pooled) reuses that mapping: no second
    mapping, bit-exact bytes. Once the file has no name left, the kept mapping goes too (evicted here; or
    unlinked by another process, at this process's next claim), so it never holds pages outside the budget."""
    if not os.path.isfile("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps")
    memory = NodeMemory(config(shm))
    tier = memory.tier(URI)
    first, second = new_generation(1), new_generation(2)
    inode = receive_in_place(tier, f"{first}/data/rank-00001.bin", os.urandom(3 * MIB))
    assert mappings_of(inode) == 1  # kept for the next claim of the file
    await tier.commit(COMMIT, CommitRecord(first, time.time(), 1).encode())
    await commit_generation(tier, 2, {"data/rank-00000.bin": os.urandom(MIB)})
    assert memory.retire(tier, first) == 3 * MIB and [s.st_ino for s in pooled(tier)] == [inode]

    data = os.urandom(3 * MIB - 4096)
    assert receive_in_place(tier, f"{second}/data/rank-00001.bin", data) == inode  # claimed: the same file
    assert mappings_of(inode) == 1  # written through the kept mapping, not a new one
    assert Path(tier.path_of(f"{second}/data/rank-00001.bin")).read_bytes() == data

    tier.evict(second)  # unlinked by this process: the mapping goes at once
    assert mappings_of(inode) == 0

    key = f"{new_generation(3)}/data/rank-00001.bin"
    other = receive_in_place(tier, key, os.urandom(2 * MIB))
    os.unlink(tier.path_of(key))  # as another process would
    assert mappings_of(other) == 1
    assert not claim(tier.root, 2 * MIB, os.path.join(tier.root, ".next.tmp"))  # this process's next claim
    assert mappings_of(other) == 0


def test_letting_go_of_a_kept_mapping_never_unmaps_pages_still_in_use(shm: Path) -> None:
    """A kept mapping let go while a snapshot or a replica still uses its pages (the file unlinked under
    it) is dropped, not closed: the pages stay readable and writable until the last tensor goes (a
    ``close()`` would have unmapped them under the tensor: a segmentation fault, not an error)."""
    fd = os.open(shm / "kept.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 2 * MIB)
        pages = pagepool.writable_pages(fd, 2 * MIB)
        inode = os.fstat(fd).st_ino
        pages[:] = 5
        os.unlink(shm / "kept.bin")
        pagepool.let_go_unlinked()
        assert (os.fstat(fd).st_dev, inode) not in pagepool._kept
        pages[MIB:] = 6
        assert int(pages[:MIB].sum()) == 5 * MIB and int(pages[MIB:].sum()) == 6 * MIB
        assert mappings_of(inode) == 1  # still mapped: it is in use
        del pages
        assert mappings_of(inode) == 0  # unmapped with its last tensor
    finally:
        os.close(fd)


async def test_the_write_down_reads_through_the_kept_mapping_and_still_checks_the_bytes(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file this process wrote through a kept mapping is written down through it (no mapping made for the
    copy), bit-exact, and still checked against the CRC-32C its writer recorded: a byte changed in node
    memory since is refused, and nothing is published below."""
    from tierckpt.errors import ChecksumMismatchError
    from tierckpt.node import copy
    from tierckpt.node.memory.copydown import copy_down

    def no_new_mapping(fd: int, size: int) -> Any:
        raise AssertionError("the write-down mapped a file this process keeps mapped")

    monkeypatch.setattr(copy, "_mapped_crc", no_new_mapping)
    tier = NodeMemory(config(shm)).tier(URI)
    below = LocalBackend(str(shm / "below"))
    key = f"{new_generation(1)}/data/rank-00000.bin"
    data = os.urandom(copy.COPY_CHUNK + 5)  # larger files are copied from a mapping, smaller ones read whole
    inode = receive_in_place(tier, key, data)
    await copy_down(tier, below, key)
    assert Path(below.path_of(key)).read_bytes() == data

    other = f"{new_generation(2)}/data/rank-00000.bin"
    receive_in_place(tier, other, data)
    with open(tier.path_of(other), "r+b") as f:  # changed in node memory after its save
        f.seek(MIB)
        f.write(b"\xff" if data[MIB] != 0xFF else b"\x00")
    with pytest.raises(ChecksumMismatchError, match="corrupted in node memory"):
        await copy_down(tier, below, other)
    assert not os.path.exists(below.path_of(other)) and mappings_of(inode) == 1


def _mapped_file(shm: Path, nbytes: int) -> tuple[int, Any, torch.Tensor]:
    import mmap

    fd = os.open(shm / "spare.bin", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    return fd, mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def test_a_spare_is_populated_without_writing_it(shm: Path) -> None:
    """``populate_writable`` allocates every page of a fresh tmpfs file (its blocks grow from 0 to its size)
    and leaves its bytes as they are: zeros in a fresh file, the old bytes in a pooled one (the copy
    writes over all of them)."""
    if not pagepool._MADVISE or os.statvfs(shm).f_bsize != 4096:
        pytest.skip("needs libc's madvise and a tmpfs")
    nbytes = 3 * MIB + 4096
    fd, mapping, buffer = _mapped_file(shm, nbytes)
    try:
        assert os.fstat(fd).st_blocks == 0  # a sparse file: no page allocated yet
        pagepool.populate_writable(buffer)
        assert os.fstat(fd).st_blocks * 512 >= nbytes
        assert not bool(buffer.any())
        buffer[::4096] = 7
        pagepool.populate_writable(buffer)  # pages that exist are mapped, never cleared
        assert int(buffer[::4096].sum()) == 7 * (nbytes // 4096)
    finally:
        del buffer
        mapping.close()
        os.close(fd)


def test_populating_a_spare_falls_back_or_fails_cleanly(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel without ``MADV_POPULATE_WRITE`` (``EINVAL``): the pages are touched by writing zeros. Any
    other refusal (no memory for the pages) is an ``OSError``, which makes no spare — touching the pages
    would have been a ``SIGBUS``."""
    import ctypes
    import errno

    def refusing(code: int) -> Any:
        def madvise(address: int, length: int, advice: int) -> int:
            assert advice == pagepool.MADV_POPULATE_WRITE and length == 2 * MIB
            ctypes.set_errno(code)
            return -1
        return madvise

    fd, mapping, buffer = _mapped_file(shm, 2 * MIB)
    try:
        buffer[:] = 9
        monkeypatch.setattr(pagepool, "_MADVISE", refusing(errno.EINVAL))
        pagepool.populate_writable(buffer)
        assert not bool(buffer.any())  # the fallback wrote zeros over every page
        monkeypatch.setattr(pagepool, "_MADVISE", refusing(errno.ENOMEM))
        with pytest.raises(OSError, match="populating a file of the memory tier"):
            pagepool.populate_writable(buffer)
    finally:
        del buffer
        mapping.close()
        os.close(fd)


def _every_node_retires_scenario(workdir: str) -> dict:
    """Two nodes of two ranks save one URI three times through the memory tier, replicated: what each node
    ends with, the bytes its ranks' processes pooled and how often they claimed a pooled file."""
    import torch.distributed as dist

    from tierckpt.node.memory import incoming, nodememory

    rank = dist.get_rank()
    node = f"node-{rank // 2}"
    saved_node = os.environ.get("TIERCKPT_NODE_ID")
    os.environ["TIERCKPT_NODE_ID"] = node
    grace, cleanup.GRACE_S = cleanup.GRACE_S, 0.0
    retire, claim_spare, claim_replica = NodeMemory.retire, mapped.claim, incoming.claim
    counts = {"pooled": 0, "claimed": 0}

    def counting_retire(self: NodeMemory, *args: Any) -> int:
        counts["pooled"] += (n := retire(self, *args))
        return n

    def counting_claim(*args: Any) -> bool:
        counts["claimed"] += (hit := claim(*args))
        return hit

    nodememory.NodeMemory.retire = counting_retire  # type: ignore[method-assign]
    mapped.claim = incoming.claim = counting_claim
    try:
        cfg = MemoryConfig(directory=os.path.join(workdir, node), budget_bytes=1 << 30, exit_wait_s=5)
        uri = os.path.join(workdir, "ckpt")
        for step in range(4):
            state = {"w": torch.full((1 << 19,), float(step))}  # 2 MiB, saved by one rank, replicated
            tierckpt.async_save(uri, state, storage_options={"memory": cfg}).wait("replicated")
        dist.barrier()  # every replica of the last save is in
        cleanup.wait_pending(30)
        dist.barrier()
        tier = NodeMemory(cfg).tier(uri)
        committed = tier.committed()
        return {"committed": committed.generation if committed else None, **counts,
                "generations": [g for g in tier.generations() if not g.startswith(SPARE_PREFIX)]}
    finally:
        nodememory.NodeMemory.retire = retire  # type: ignore[method-assign]
        mapped.claim, incoming.claim = claim_spare, claim_replica
        cleanup.GRACE_S = grace
        os.environ.pop("TIERCKPT_NODE_ID", None) if saved_node is None else os.environ.__setitem__("TIERCKPT_NODE_ID", saved_node)


def test_every_node_retires_the_generations_a_commit_superseded(dist_pool, tmp_path: Path) -> None:
    """Not only the committing rank's node: every node keeps none of the generations a commit superseded,
    their data files (its ranks' and the replicas it received) go to its own pool, and its next files
    (spares, arriving replicas) are written over them instead of fresh pages."""
    results = dist_pool.run(_every_node_retires_scenario, str(tmp_path))
    committed = results[0]["committed"]
    assert committed is not None
    for rank, r in enumerate(results):
        assert r["committed"] == committed and r["generations"] == [committed], (rank, r)
    for node in (results[:2], results[2:]):
        assert sum(r["pooled"] for r in node) >= 2 * MIB and sum(r["claimed"] for r in node) >= 1, results
