"""The node memory tier: the backend contract, manifests with CRC-32C, config, and admission/eviction."""

from __future__ import annotations

import os
import time
from pathlib import Path

import crc32c
import pytest
from backend_contract import BackendContract

from tierckpt.errors import CheckpointError, CorruptCheckpointError
from tierckpt.native.layout import COMMIT, CommitRecord, new_generation
from tierckpt.node.memory import (
    MemoryConfig, MemoryTier, MemoryTierFullError, NodeMemory, OnFull, TierCopy, copy_id, plan_admission,
)
from tierckpt.node.memory.manifest import FileEntry, Manifest
from tierckpt.node.memory import memory
from tierckpt.node.memory.memory import uri_digest
from tierckpt.node.written import file_crc

URI = "s3://bucket/run/step-100"


def config(tmp_path: Path, budget: int = 1 << 30, **kw) -> MemoryConfig:
    return MemoryConfig(directory=str(tmp_path / "shm"), budget_bytes=budget, **kw)


class TestMemoryTierContract(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> MemoryTier:
        return MemoryTier(URI, config(tmp_path))


async def write_checkpoint(tier: MemoryTier, seq: int, sizes: dict[str, int]) -> tuple[str, dict[str, bytes]]:
    """Write a generation's files (streamed) and commit it; returns the generation and the contents."""
    generation = new_generation(seq)
    contents = {}
    for name, size in sizes.items():
        key = f"{generation}/{name}"
        data = os.urandom(size)
        writer = await tier.open_writer(key)
        step = 1000 if size < 10_000 else 3 << 19  # small writes, or 1.5 MiB ones (CRC in a thread)
        for i in range(0, size, step):
            await writer.write(memoryview(data)[i : i + step])
        await writer.close()
        contents[key] = data
    await tier.commit(COMMIT, CommitRecord(generation, time.time(), seq).encode())
    return generation, contents


# -- layout and manifests ---------------------------------------------------------------------------------
async def test_directory_is_derived_from_the_full_uri(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    a, b = MemoryTier(URI, cfg), MemoryTier("s3://other-bucket/run/step-100", cfg)
    await a.put("k", b"a")
    await b.put("k", b"b")
    assert a.home != b.home and os.path.basename(a.home) == uri_digest(URI)
    assert (Path(a.home) / "URI").read_text() == URI and (Path(a.root) / "k").read_bytes() == b"a"
    assert [t.uri for t in NodeMemory(cfg).tiers()] == sorted([URI, "s3://other-bucket/run/step-100"], key=uri_digest)
    assert not os.path.exists(MemoryTier("s3://never/written", cfg).home)  # constructing creates nothing


async def test_a_directory_of_another_uri_is_refused(tmp_path: Path) -> None:
    tier = MemoryTier(URI, config(tmp_path))
    os.makedirs(tier.home)
    Path(tier.home, "URI").write_text("s3://someone/else")
    with pytest.raises(CheckpointError, match="belongs to 's3://someone/else'.*TIERCKPT_MEMORY_DIR"):
        await tier.put("k", b"x")


async def test_small_calls_run_in_place_and_large_ones_or_commits_in_a_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tmpfs never waits on a device: the tier's small calls run in the event loop's thread (a hop costs ten
    times such a call); a write of more than INLINE_BYTES, a commit (its lock may be another process's) and a
    deletion go to a worker thread, and a directory on disk hops for every call."""
    import asyncio

    from tierckpt.backends.local import INLINE_BYTES, LocalBackend

    hops: list[str] = []
    original = asyncio.to_thread

    def to_thread(fn, *a, **k):  # this test's hops only: a sweep an earlier test left running hops too
        if any(str(tmp_path) in str(arg) for arg in a):
            hops.append(getattr(fn, "__name__", repr(fn)))
        return original(fn, *a, **k)

    monkeypatch.setattr(asyncio, "to_thread", to_thread)
    tier = MemoryTier(URI, config(tmp_path))
    generation = new_generation(1)
    small, large = os.urandom(4096), os.urandom(INLINE_BYTES + 1)
    await tier.put(f"{generation}/meta/header.json", small)
    writer = await tier.open_writer(f"{generation}/data/rank-00000.bin")
    await writer.write(small)
    await writer.close()
    assert await tier.get_capped(f"{generation}/meta/header.json", 1 << 20) == small
    assert await tier.size(f"{generation}/data/rank-00000.bin") == len(small)
    assert await tier.exists(f"{generation}/data/rank-00000.bin")
    assert hops == []
    await tier.put(f"{generation}/data/rank-00001.bin", large)
    await tier.commit(COMMIT, CommitRecord(generation, time.time(), 1).encode())
    assert tier.read_file(f"{generation}/data/rank-00001.bin", len(large)) == large
    await tier.delete(f"{generation}/data/rank-00001.bin")  # frees the file's pages: a worker's job too
    assert hops == ["write_atomic", "commit_if", "unlink"]
    assert not await tier.exists(f"{generation}/data/rank-00001.bin")

    hops.clear()
    disk = LocalBackend(str(tmp_path / "disk"))
    await disk.put("g/x", small)
    assert await disk.get_capped("g/x", 1 << 20) == small
    assert hops == ["write_atomic", "read_whole_capped"]


async def test_seal_records_each_files_crc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(tmp_path)
    tier = MemoryTier(URI, cfg)
    generation, contents = await write_checkpoint(
        tier, 1, {"data/rank-00000.bin": 5000, "data/rank-00002.bin": 5 << 20, "meta/header.json": 10})
    await MemoryTier(URI, cfg).put(f"{generation}/data/rank-00001.bin", b"second rank")  # another writer, stamped too
    contents[f"{generation}/data/rank-00001.bin"] = b"second rank"
    unstamped = f"{generation}/data/rank-00003.bin"  # placed by no writer of the tier: read for its CRC
    Path(tier.path_of(unstamped)).write_bytes(b"placed by hand")
    contents[unstamped] = b"placed by hand"
    read = []
    monkeypatch.setattr(memory, "file_crc", lambda path, **how: read.append(path) or file_crc(path, **how))
    manifest = MemoryTier(URI, cfg).seal(generation, origin="node-a")  # a fresh object, as a replication leader's
    assert read == [tier.path_of(unstamped)]  # every other CRC comes from its writer's stamp
    assert dict(manifest.files) == {k: FileEntry(len(v), crc32c.crc32c(v)) for k, v in contents.items()}
    assert tier.held(generation) == dict(manifest.files)
    assert MemoryTier(URI, cfg).manifests(generation) == [manifest]
    assert tier.verify(generation) == []


async def test_a_crc_remembered_from_writing_is_not_trusted_after_the_file_changed(tmp_path: Path) -> None:
    tier = MemoryTier(URI, config(tmp_path))
    generation, contents = await write_checkpoint(tier, 1, {"data/rank-00000.bin": 100})
    key = next(iter(contents))
    await MemoryTier(URI, tier.config).put(key, b"rewritten by another process")
    assert tier.seal(generation, origin="n").files == ((key, FileEntry(28, crc32c.crc32c(b"rewritten by another process"))),)


async def test_origins_keep_their_own_manifests(tmp_path: Path) -> None:
    tier = MemoryTier(URI, config(tmp_path))
    generation, contents = await write_checkpoint(tier, 1, {"data/rank-00000.bin": 10, "data/rank-00002.bin": 20})
    own = tier.seal(generation, origin="node-a", keys=[f"{generation}/data/rank-00000.bin"])
    rest = tier.seal(generation, origin="node-b")  # by default: what no other origin lists
    assert [k for k, _ in rest.files] == [f"{generation}/data/rank-00002.bin"]
    assert [m.origin for m in tier.manifests(generation)] == ["node-a", "node-b"]
    assert set(tier.held(generation)) == set(contents) and own.nbytes == 10
    with pytest.raises(CheckpointError, match="not one of its files"):
        tier.seal(generation, origin="x", keys=["g-other/data/rank-00000.bin"])


async def test_a_peers_files_are_its_own_from_the_first_one_that_arrives(tmp_path: Path) -> None:
    """A replica's files are published one by one and its manifest recorded after the last: declared arriving
    first, none of them is ever sealed as this node's, nor written down by this node (its log's replicas)."""
    from tierckpt.node.memory.downlog import DownLog

    tier = MemoryTier(URI, config(tmp_path))
    generation, contents = await write_checkpoint(tier, 1, {"data/rank-00000.bin": 10})
    own = f"{generation}/data/rank-00000.bin"
    theirs = {f"{generation}/data/rank-00002.bin": b"a" * 20, f"{generation}/data/rank-00003.bin": b"b" * 30}
    sent = Manifest(uri=URI, generation=generation, origin="node-b", created_unix=time.time(),
                    files=tuple((k, FileEntry(len(v), crc32c.crc32c(v))) for k, v in sorted(theirs.items())))
    tier.expect(sent)
    first = sorted(theirs)[0]
    Path(tier.path_of(first)).write_bytes(theirs[first])  # one file of the replica published, the other on its way
    assert [k for k, _ in tier.seal(generation, origin="node-a").files] == [own]
    assert DownLog(tier).replicas(generation, "node-a") == set(theirs)
    assert [m.origin for m in tier.manifests(generation)] == ["node-a"]  # a declaration is no manifest: nothing
    assert set(tier.held(generation)) == {own}  # of the replica is held (read from here) before it is whole
    tier.record(sent)  # every file arrived: the manifest replaces the declaration
    assert [m.origin for m in tier.manifests(generation)] == ["node-a", "node-b"]
    assert not list(Path(tier.home, "manifests", generation).glob("*" + memory.ARRIVING))
    assert DownLog(tier).replicas(generation, "node-a") == set(theirs)


async def test_verify_and_damaged_manifests_are_reported(tmp_path: Path) -> None:
    tier = MemoryTier(URI, config(tmp_path))
    generation, contents = await write_checkpoint(tier, 1, {"data/rank-00000.bin": 64, "data/rank-00001.bin": 64})
    tier.seal(generation, origin="node-a")
    first, second = sorted(contents)
    path = Path(tier.path_of(first))
    path.write_bytes(bytes([path.read_bytes()[0] ^ 1]) + path.read_bytes()[1:])
    os.unlink(tier.path_of(second))
    problems = tier.verify(generation)
    assert len(problems) == 2 and "sealed as 64" in problems[0] and "missing" in problems[1]
    manifest_file = next(Path(tier.home, "manifests", generation).iterdir())
    manifest_file.write_bytes(manifest_file.read_bytes().replace(b'"node-a"', b'"node-b"'))
    with pytest.raises(CorruptCheckpointError, match="manifest .* unreadable.*CRC-32C"):
        tier.manifests(generation)


def test_manifest_round_trip() -> None:
    m = Manifest(uri=URI, generation="g-1", origin="n", created_unix=1.5, files=(("g-1/a", FileEntry(3, 7)),))
    assert Manifest.decode(m.encode(), "here") == m
    with pytest.raises(CorruptCheckpointError, match="here"):
        Manifest.decode(b"{}", "here")


async def test_receive_checks_the_crc(tmp_path: Path) -> None:
    tier = MemoryTier(URI, config(tmp_path))
    incoming = tier.receive("g-1/data/rank-00000.bin")
    incoming.write(memoryview(b"hello"))
    with pytest.raises(CorruptCheckpointError, match="arrived with 5 bytes.*discarded"):
        incoming.finish(FileEntry(5, crc32c.crc32c(b"hellO")))
    assert await tier.list() == []
    incoming = tier.receive("g-1/data/rank-00000.bin")
    incoming.write(memoryview(b"hello"))
    incoming.finish(FileEntry(5, crc32c.crc32c(b"hello")))
    assert await tier.get("g-1/data/rank-00000.bin") == b"hello"


# -- configuration ----------------------------------------------------------------------------------------
def test_config_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(tmp_path / "m"))
    monkeypatch.setenv("TIERCKPT_MEMORY_BYTES", "3G")
    monkeypatch.setenv("TIERCKPT_MEMORY_FULL", "fallback")
    cfg = MemoryConfig.from_env()
    assert (cfg.directory, cfg.budget_bytes, cfg.on_full) == (str(tmp_path / "m"), 3 << 30, OnFull.FALLBACK)
    assert MemoryConfig.from_env(budget_bytes="512M").budget_bytes == 512 << 20
    monkeypatch.setenv("TIERCKPT_MEMORY_BYTES", "123")
    assert MemoryConfig.from_env().budget_bytes == 123
    monkeypatch.delenv("TIERCKPT_MEMORY_BYTES")
    st = os.statvfs(tmp_path)
    assert MemoryConfig.from_env().budget_bytes == st.f_blocks * st.f_frsize // 2  # half the file system


@pytest.mark.parametrize(("env", "value", "message"), [
    ("TIERCKPT_MEMORY_BYTES", "lots", "TIERCKPT_MEMORY_BYTES 'lots' as a byte size.*'512M'"),
    ("TIERCKPT_MEMORY_BYTES", "0", "TIERCKPT_MEMORY_BYTES must be at least 1 byte"),
    ("TIERCKPT_MEMORY_FULL", "maybe", "TIERCKPT_MEMORY_FULL='maybe'.*'fallback'"),
])
def test_bad_config_names_the_setting(monkeypatch: pytest.MonkeyPatch, env: str, value: str, message: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(CheckpointError, match=message):
        MemoryConfig.from_env()


# -- the eviction policy (pure) --------------------------------------------------------------------------
def copies(*specs: tuple[str, int, float]) -> list[TierCopy]:
    return [TierCopy(copy_id=c, nbytes=n, created_unix=t) for c, n, t in specs]


def test_nothing_is_evicted_when_it_fits() -> None:
    a = plan_admission(copies(("u/g-1", 40, 1.0)), 60, 100, set())
    assert a.fits and a.evict == () and a.used_bytes == 40


def test_the_oldest_durable_copies_go_first_and_the_newest_stay() -> None:
    held = copies(("u1/g-1", 40, 1.0), ("u2/g-1", 40, 2.0), ("u3/g-1", 40, 3.0))
    a = plan_admission(held, 50, 130, {"u1/g-1", "u2/g-1", "u3/g-1"})
    assert a.fits and a.evict == ("u1/g-1",)
    a = plan_admission(held, 90, 130, {"u1/g-1", "u2/g-1", "u3/g-1"})
    assert a.evict == ("u1/g-1", "u2/g-1")


def test_copies_no_lower_tier_holds_are_never_evicted() -> None:
    held = copies(("u1/g-1", 40, 1.0), ("u2/g-1", 40, 2.0))
    a = plan_admission(held, 50, 100, {"u2/g-1"})
    assert a.evict == ("u2/g-1",)  # the older one is not uploaded yet: the newer durable one goes
    with pytest.raises(MemoryTierFullError) as info:
        plan_admission(held, 70, 100, {"u2/g-1"}, incoming="s3://b/step-3/g-9")
    message = str(info.value)
    for part in ("s3://b/step-3/g-9 (70 bytes)", "TIERCKPT_MEMORY_BYTES is 100 bytes", "40 bytes are held by 1",
                 "evicting all 1 others frees only 40 bytes",
                 "TIERCKPT_MEMORY_FULL=fallback"):
        assert part in message


def test_fallback_instead_of_an_error() -> None:
    a = plan_admission(copies(("u1/g-1", 40, 1.0)), 70, 100, set(), on_full=OnFull.FALLBACK)
    assert not a.fits and a.evict == () and "TIERCKPT_MEMORY_BYTES" in a.reason
    assert not plan_admission([], 101, 100, set(), on_full=OnFull.FALLBACK).fits  # larger than the whole budget


def test_superseded_go_first_and_unsealed_copies_stay() -> None:
    held = [
        TierCopy(copy_id="u/g-2", nbytes=40, created_unix=5.0, superseded=True, sealed=False),
        TierCopy(copy_id="v/g-1", nbytes=40, created_unix=1.0),
        TierCopy(copy_id="w/g-1", nbytes=40, created_unix=0.5, sealed=False),
    ]
    assert plan_admission(held, 40, 120, {"v/g-1", "w/g-1"}).evict == ("u/g-2",)
    assert plan_admission(held, 80, 120, {"v/g-1", "w/g-1"}).evict == ("u/g-2", "v/g-1")
    with pytest.raises(MemoryTierFullError):
        plan_admission(held, 81, 120, {"v/g-1", "w/g-1"})


# -- admission on a real tier -----------------------------------------------------------------------------
async def test_budget_smaller_than_two_checkpoints(tmp_path: Path) -> None:
    cfg = config(tmp_path, budget=3000)
    node = NodeMemory(cfg)
    first = node.tier("s3://b/run/step-1")
    g1, _ = await write_checkpoint(first, 1, {"data/rank-00000.bin": 2000})
    first.seal(g1, origin="n")
    second_uri = "s3://b/run/step-2"
    # Nothing uploaded yet: the newest cannot fit, and nothing is evicted.
    with pytest.raises(MemoryTierFullError, match="cannot hold s3://b/run/step-2/g-x"):
        node.admit(second_uri, "g-x", 2000, durable_below=set())
    assert first.held(g1) and first.committed().generation == g1
    # Once the first is uploaded it makes room: its files, manifests and COMMIT leave the tier.
    admission = node.admit(second_uri, "g-x", 2000, durable_below={copy_id(first.uri, g1)})
    assert admission.fits and admission.evict == (copy_id(first.uri, g1),)
    assert first.committed() is None and first.manifests(g1) == [] and await first.list() == []
    fallback = NodeMemory(config(tmp_path, budget=3000, on_full=OnFull.FALLBACK))
    assert not fallback.admit("s3://b/run/step-3", "g-y", 5000, set()).fits


async def test_what_may_not_evict_is_admitted_only_into_free_room(tmp_path: Path) -> None:
    """A spare (``evict=False``) never makes room: where the budget holds it beside what is there it fits,
    else it is refused and the durable checkpoint that a checkpoint's admission would evict stays."""
    node = NodeMemory(config(tmp_path, budget=3000))
    first = node.tier("s3://b/run/step-1")
    g1, _ = await write_checkpoint(first, 1, {"data/rank-00000.bin": 2000})
    first.seal(g1, origin="n")
    durable = {copy_id(first.uri, g1)}
    assert node.admit("s3://b/spare", "g-s", 1000, durable, evict=False).fits
    refused = node.admit("s3://b/spare", "g-s", 1001, durable, evict=False)
    assert not refused.fits and refused.evict == () and refused.used_bytes == 2000
    assert first.held(g1) and first.committed().generation == g1
    assert node.admit("s3://b/run/step-2", "g-x", 1001, durable).evict == (copy_id(first.uri, g1),)


async def test_a_superseded_generation_is_dropped_first(tmp_path: Path) -> None:
    node = NodeMemory(config(tmp_path, budget=5000))
    tier = node.tier(URI)
    old, _ = await write_checkpoint(tier, 1, {"data/rank-00000.bin": 2000})
    new, _ = await write_checkpoint(tier, 2, {"data/rank-00000.bin": 2000})
    tier.seal(new, origin="n")
    by_id = {c.copy_id: c for c in node.copies()}
    assert by_id[copy_id(URI, old)].superseded and not by_id[copy_id(URI, old)].sealed
    assert not by_id[copy_id(URI, new)].superseded and by_id[copy_id(URI, new)].sealed
    assert node.admit("s3://b/other", "g-z", 2000, set()).evict == (copy_id(URI, old),)
    assert tier.generations() == [new] and tier.committed().generation == new


def test_a_superseded_copy_the_chain_below_is_owed_is_kept() -> None:
    held = [
        TierCopy(copy_id="u/g-1", nbytes=40, created_unix=1.0, superseded=True),
        TierCopy(copy_id="u/g-2", nbytes=40, created_unix=2.0),
    ]
    assert plan_admission(held, 40, 100, set()).evict == ("u/g-1",)
    with pytest.raises(MemoryTierFullError, match="never evicted"):
        plan_admission(held, 40, 100, set(), owed_below={"u/g-1"})


@pytest.mark.parametrize("newest_memory_only", [True, False])
async def test_eviction_keeps_a_persisted_generation_still_owed_below_while_the_newest_is_memory_only(
        tmp_path: Path, newest_memory_only: bool) -> None:
    """A ``persist=True`` save whose write-down is not done, superseded by a ``persist=False`` one: the chain
    below gets no newer commit of the node's files, so an admission that needs room keeps it (the memory tier
    is full instead, loudly) until its files are below. Superseded by a persisted save, it may go."""
    from tierckpt.node.memory.downlog import MEMORY_ONLY, DownLog, durable_copies, owed_copies

    node = NodeMemory(config(tmp_path, budget=5000))
    tier = node.tier(URI)
    down = DownLog(tier)
    old, _ = await write_checkpoint(tier, 1, {"data/rank-00000.bin": 2000})
    for key in await tier.list(f"{old}/"):
        down.append(old, "start", key)  # its write-down began (a slow disk, an outage), nothing is below yet
    new, _ = await write_checkpoint(tier, 2, {"data/rank-00000.bin": 2000})
    if newest_memory_only:
        down.append(new, MEMORY_ONLY, new)

    def admit() -> object:
        return node.admit("s3://b/other", "g-z", 2000, lambda: durable_copies(node),
                          owed_below=lambda: owed_copies(node, "node-a"))

    if not newest_memory_only:
        assert owed_copies(node, "node-a") == set()
        assert admit().evict == (copy_id(URI, old),)
        return
    assert owed_copies(node, "node-a") == {copy_id(URI, old)}
    with pytest.raises(MemoryTierFullError, match="cannot hold s3://b/other/g-z"):
        admit()
    assert old in tier.generations() and await tier.get(f"{old}/data/rank-00000.bin")
    for key in await tier.list(f"{old}/"):
        down.append(old, "done", key)  # written down now: what the chain below needs of it is there
    assert owed_copies(node, "node-a") == set()
    assert admit().evict == (copy_id(URI, old),)
    assert tier.generations() == [new]


async def test_a_replica_recorded_while_its_declaration_is_read_stays_a_replica(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver records a replica's manifest (its ``.json`` written, then its declaration unlinked) while the
    write-down asks which files are replicas: the declaration it listed is gone when it reads it. The keys are
    still the peer's (read from the manifest that replaced it), and nothing raises."""
    from tierckpt.node.memory.downlog import DownLog

    tier = MemoryTier(URI, config(tmp_path))
    generation, _ = await write_checkpoint(tier, 1, {"data/rank-00000.bin": 10})
    theirs = {f"{generation}/data/rank-00001.bin": b"a" * 20}
    sent = Manifest(uri=URI, generation=generation, origin="node-b", created_unix=time.time(),
                    files=tuple((k, FileEntry(len(v), crc32c.crc32c(v))) for k, v in theirs.items()))
    tier.expect(sent)
    read = memory.read_capped

    def recorded_meanwhile(path: str, limit: int) -> bytes:
        if path.endswith(memory.ARRIVING) and os.path.exists(path):
            tier.record(sent)  # the receiver's turn, between the listing and this read
        return read(path, limit)

    monkeypatch.setattr(memory, "read_capped", recorded_meanwhile)
    assert DownLog(tier).replicas(generation, "node-a") == set(theirs)


@pytest.mark.fast
def test_a_manifest_is_decoded_once_and_read_again_when_its_file_changes(tmp_path: Path) -> None:
    """Admissions and seals read every manifest of the tier many times: a process decodes each file once. A
    manifest replaced (a new file renamed over it) or rewritten in place is read again, a damaged one refused."""
    from tierckpt.node.memory import manifest as manifest_module

    generation = new_generation(1)

    def made(size: int) -> Manifest:
        return Manifest(uri="s3://b/k", generation=generation, origin="node-a", created_unix=1.0,
                        files=(("g/data/rank-00000.bin", FileEntry(size, 7)),))

    path = tmp_path / "node-a.json"
    path.write_bytes(made(10).encode())
    first = manifest_module.read_manifest(str(path))
    assert first == made(10) and manifest_module.read_manifest(str(path)) is first  # decoded once
    replacement = tmp_path / "tmp.json"
    replacement.write_bytes(made(20).encode())
    os.replace(replacement, path)
    assert manifest_module.read_manifest(str(path)) == made(20)
    with open(path, "r+b") as f:  # the same inode, other bytes
        f.write(made(300).encode())
    assert manifest_module.read_manifest(str(path)) == made(300)
    data = bytearray(path.read_bytes())
    data[5] ^= 1
    with open(path, "r+b") as f:
        f.write(bytes(data))
        f.truncate()
    os.utime(path, ns=(1, 1))
    with pytest.raises(CorruptCheckpointError, match="unreadable"):
        manifest_module.read_manifest(str(path))


@pytest.mark.fast
def test_an_admission_grants_a_short_lived_credit_that_later_admissions_spend_without_a_walk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk of the node's tier is paid once per burst of writes, whichever checkpoint they belong to:
    1/16 of the free room, for ``CREDIT_S``; past either, the next admission walks (and may evict) again."""
    from tierckpt.node.memory import nodememory

    node = NodeMemory(config(tmp_path, budget=16 * 1000 + 1000))
    walks: list[int] = []
    original = NodeMemory.tiers
    monkeypatch.setattr(NodeMemory, "tiers", lambda self: walks.append(1) or original(self))
    assert node.admit("s3://b/run/step-1", "g-1", 1000, ()).fits and len(walks) == 1  # credit: 16000 // 16
    spent = node.admit("s3://b/run/step-2", "g-2", 600, ())
    assert spent.fits and spent.used_bytes is None and len(walks) == 1  # another checkpoint, no walk
    assert node.admit("s3://b/run/step-2", "g-2", 401, ()).fits and len(walks) == 2  # the credit ran out
    now = [nodememory.time.monotonic()]
    monkeypatch.setattr(nodememory, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))
    node.admit("s3://b/run/step-3", "g-3", 1, ())
    assert len(walks) == 2  # within the credit's time
    now[0] += nodememory.CREDIT_S + 0.1
    node.admit("s3://b/run/step-3", "g-3", 1, ())
    assert len(walks) == 3  # expired: walked again
