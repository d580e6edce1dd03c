"""Never move unverified bytes between tiers (issue "Nothing silent, round 2", items 2 and 3).

Item 2: a node cache that was handed a corrupted download, or whose copy rotted on disk, heals: the
bad copy is dropped and the bytes read again from S3; only a mismatch there is corruption. Real parts:
moto S3 on loopback behind the fault-injecting proxy (which flips one bit of one GET body), the node
cache in a per-test directory, a fresh process and the ``tierckpt verify`` command for what follows.

Item 3: a file of the node memory tier that changed after its save is never written down and
committed: ``tierckpt sync`` fails naming the file, the tier and what to do, and S3 keeps its older
commit. Real parts: the memory tier in a per-test directory, S3 on moto, the ``tierckpt sync`` command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import tierckpt
from tierckpt.native import layout
from tierckpt.node.disk import CacheConfig
from tierckpt.cache_api import prefetch
from tierckpt.io.scheduler import get_scheduler
from tierckpt.node.memory import MemoryConfig
from tierckpt.node.memory.memory import MemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from fault_proxy import Rule  # noqa: E402

SRC = str(Path(tierckpt.__file__).resolve().parent.parent)
BIG = (2304, 1024)
"""9 MiB of float32: a data file larger than one cache block (8 MiB), so it is fetched in ranged GETs
(S3 checks no checksum of a range: a corrupted body arrives as is)."""
WHOLE = (1536, 1024)
"""6 MiB: a data file cached whole (above the in-process memory tier's 4 MiB objects)."""


def state(shape: tuple[int, int], seed: int = 1) -> dict[str, Any]:
    return {"w": torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), "step": seed}


def blank(shape: tuple[int, int]) -> dict[str, Any]:
    return {"w": torch.zeros(*shape), "step": -1}


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return torch.equal(got["w"], want["w"]) and got["step"] == want["step"]


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierckpt", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, *sys.path]), **extra}


def remote_bytes(uri: str, key: str) -> bytes:
    import boto3

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    client = boto3.client("s3", endpoint_url=os.environ["TIERCKPT_S3_ENDPOINT_URL"], region_name="us-east-1")
    return client.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()


def data_key(uri: str) -> str:
    record = layout.CommitRecord.decode(remote_bytes(uri, layout.COMMIT))
    return f"{record.generation}/data/rank-00000.bin"


# -- item 2: the node cache ------------------------------------------------------------------------------
LOAD_CHILD = """
import sys, torch, tierckpt
shape = (int(sys.argv[2]), int(sys.argv[3]))
got = {"w": torch.zeros(*shape), "step": -1}
tierckpt.load(sys.argv[1], got)
want = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
print("exact" if torch.equal(got["w"], want) and got["step"] == 1 else "DIFFERENT")
"""


@pytest.mark.multiproc
def test_a_download_corrupted_on_the_way_does_not_poison_the_node_cache(uri: str, proxy: Any, tmp_path: Path) -> None:
    tierckpt.save(uri, state(BIG), storage_options={"cache": False})
    cache = tmp_path / "cache"
    options = {"endpoint_url": proxy.endpoint, "cache": CacheConfig(directory=str(cache), exit_wait_s=0)}
    proxy.add_rule(Rule("flip", method="GET", path="/data/"))
    got = tierckpt.load(uri, blank(BIG), storage_options=options)
    assert proxy.hits["flip"] == 1  # the cache was handed a corrupted block ...
    assert same(got, state(BIG))  # ... which failed its checksum, was dropped and read again from S3
    proxy.reset_counters()
    env = child_env(TIERCKPT_CACHE_DIR=str(cache), TIERCKPT_S3_ENDPOINT_URL=proxy.endpoint)
    done = subprocess.run([sys.executable, "-c", LOAD_CHILD, uri, *map(str, BIG)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "exact", done.stderr[-2000:]
    assert not [p for m, p, _ in proxy.log if m == "GET" and "/data/" in p]  # served by the healed cache
    verified = cli("verify", uri, env=env)
    assert verified.returncode == 0 and verified.stdout.startswith("ok:"), verified.stdout + verified.stderr


@pytest.mark.multiproc
def test_verify_drops_a_corrupted_prefetch_and_reads_it_again(uri: str, proxy: Any, tmp_path: Path) -> None:
    """A prefetch reads no checksums: what it cached is verified by its first reader, here ``verify``."""
    tierckpt.save(uri, state(BIG), storage_options={"cache": False})
    cache = tmp_path / "cache"
    proxy.add_rule(Rule("flip", method="GET", path="/data/"))
    prefetch(uri, progress=False, config=CacheConfig(directory=str(cache), exit_wait_s=0),
             endpoint_url=proxy.endpoint).result()
    assert proxy.hits["flip"] == 1
    env = child_env(TIERCKPT_CACHE_DIR=str(cache), TIERCKPT_S3_ENDPOINT_URL=proxy.endpoint)
    verified = cli("verify", uri, "--node", env=env)  # this node's copy: the prefetched one
    assert verified.returncode == 0 and verified.stdout.startswith("ok:"), verified.stdout + verified.stderr
    proxy.reset_counters()
    done = subprocess.run([sys.executable, "-c", LOAD_CHILD, uri, *map(str, BIG)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "exact", done.stderr[-2000:]
    assert not [p for m, p, _ in proxy.log if m == "GET" and "/data/" in p]


def load_on_every_rank(uri: str, endpoint: str, env: dict[str, str], cache: str) -> bool:
    """A dist_pool scenario: every rank loads the whole tensor through one node cache (the ranks share the
    reads and exchange what they read); whether it came back bit-exact."""
    os.environ.update(env)
    got = tierckpt.load(uri, blank(BIG), storage_options={
        "endpoint_url": endpoint, "cache": CacheConfig(directory=cache, exit_wait_s=0)})
    return same(got, state(BIG))


@pytest.mark.multiproc
def test_every_rank_reads_again_when_one_rank_got_a_corrupted_download(
    dist_pool: Any, uri: str, proxy: Any, tmp_path: Path,
) -> None:
    """The rank that checks the corrupted block raises; the group agrees, every rank drops what its own
    error names, and all of them read again together (no rank left waiting in a collective)."""
    tierckpt.save(uri, state(BIG), storage_options={"cache": False})
    proxy.add_rule(Rule("flip", method="GET", path="/data/"))
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_") or k in ("TIERCKPT_S3_ENDPOINT_URL", "NO_PROXY")}
    assert dist_pool.run(load_on_every_rank, uri, proxy.endpoint, env, str(tmp_path / "cache")) == [True] * 4
    assert proxy.hits["flip"] == 1


def test_a_real_corruption_on_s3_is_still_reported(uri: str, tmp_path: Path) -> None:
    """Dropping the cached copy is tried once: bytes that are bad on S3 itself fail the load as corrupt."""
    import boto3

    tierckpt.save(uri, state(BIG), storage_options={"cache": False})
    key = data_key(uri)
    data = bytearray(remote_bytes(uri, key))
    data[len(data) // 2] ^= 0x01
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    boto3.client("s3", endpoint_url=os.environ["TIERCKPT_S3_ENDPOINT_URL"], region_name="us-east-1").put_object(
        Bucket=bucket, Key=f"{prefix}/{key}", Body=bytes(data))
    options = {"cache": CacheConfig(directory=str(tmp_path / "cache"), exit_wait_s=0)}
    with pytest.raises(tierckpt.errors.CorruptCheckpointError, match="checksum mismatch in data file"):
        tierckpt.load(uri, blank(BIG), storage_options=options)


def _flip(path: Path, at: int) -> None:
    """Flip one bit of the byte at ``at`` (a changed file: its modification time moves)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x04]))


def _flip_keeping_mtime(path: Path, at: int) -> None:
    """Flip one bit as rot does: the file's modification time stays as it was."""
    st = path.stat()
    _flip(path, at)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("shape", [WHOLE, BIG], ids=["whole", "blocks"])
def test_a_cached_copy_that_rots_on_disk_is_fetched_again(uri: str, tmp_path: Path, shape: tuple[int, int]) -> None:
    """Rot keeps the modification time: the cache's own check of a whole file (once per process and file
    version) passed already, so the load's check finds it; cached blocks are checked on every read."""
    tierckpt.save(uri, state(shape), storage_options={"cache": False})
    cache = tmp_path / "cache"
    options = {"cache": CacheConfig(directory=str(cache), exit_wait_s=0)}
    for _ in range(2):  # fetched, then read from the cache (a whole file's CRC is then known good in-process)
        assert same(tierckpt.load(uri, blank(shape), storage_options=options), state(shape))
    tree = "fetched" if shape == WHOLE else "blocks"
    copies = sorted(p for p in (cache / tree).rglob("*") if p.is_file() and ("data" in p.parts or tree == "blocks"))
    assert copies, list(cache.rglob("*"))
    _flip_keeping_mtime(copies[0], 4096)
    assert same(tierckpt.load(uri, blank(shape), storage_options=options), state(shape))
    good = remote_bytes(uri, data_key(uri))
    if shape == WHOLE:
        assert copies[0].read_bytes() == good  # the rotten copy was replaced
    else:
        assert copies[0].read_bytes() == good[: len(copies[0].read_bytes())]


# -- item 3: the memory tier's write-down ----------------------------------------------------------------
def _memory(memdir: Path) -> dict[str, Any]:
    return {"memory": MemoryConfig(directory=str(memdir), budget_bytes=1 << 30, exit_wait_s=0), "cache": False}


@pytest.fixture(autouse=True)
def _forget_memory_only_at_exit() -> Any:
    from tierckpt.node.memory import writedown

    yield
    writedown._MEMORY_ONLY.clear()


@pytest.mark.multiproc
@pytest.mark.parametrize("shape", [WHOLE, BIG], ids=["read-whole", "streamed"])
def test_sync_never_writes_down_a_memory_tier_file_that_changed_since_its_save(
    uri: str, tmp_path: Path, shape: tuple[int, int],
) -> None:
    """A persisted checkpoint, then a memory-only one over it; a bit of the memory-only one's data file
    flips in node memory. ``tierckpt sync`` must fail naming the file and the fix, and S3 must keep
    the older commit, whole."""
    memdir = tmp_path / "memory-tier"
    opts = _memory(memdir)
    first = tierckpt.save(uri, state(shape, 1), storage_options=opts)
    second = tierckpt.save(uri, state(shape, 2), storage_options=opts, persist=False)
    tier_file = next(memdir.rglob(f"{second.generation}/data/rank-00000.bin"))
    with open(tier_file, "r+b") as f:
        f.seek(tier_file.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x20]))
    env = child_env(TIERCKPT_MEMORY="on", TIERCKPT_MEMORY_DIR=str(memdir), TIERCKPT_CACHE="off",
                    TIERCKPT_CACHE_DIR=str(tmp_path / "node-cache"))
    done = cli("sync", uri, env=env)
    assert done.returncode == 5, done.stdout + done.stderr
    said = done.stderr
    assert f"{second.generation}/data/rank-00000.bin" in said and str(tier_file) in said, said
    assert "corrupted in node memory" in said and "keeps its previous commit" in said, said
    assert "synced" not in done.stdout
    below = layout.CommitRecord.decode(remote_bytes(uri, layout.COMMIT))
    assert below.generation == first.generation
    got = tierckpt.load(uri, blank(shape), storage_options={"memory": False, "cache": False})
    assert same(got, state(shape, 1))
    verified = cli("verify", uri, env={**env, "TIERCKPT_MEMORY": "off"})
    assert verified.returncode == 0, verified.stdout + verified.stderr


WRITE_BACK_CHILD = """
import sys, torch, tierckpt
from tierckpt.node.disk import CacheConfig
want = {"w": torch.randn(512, 1024, generator=torch.Generator().manual_seed(2)), "step": 2}
handle = tierckpt.async_save(sys.argv[1], want,
                             storage_options={"cache": CacheConfig(directory=sys.argv[2], exit_wait_s=0)})
handle.wait()  # committed in the node cache; the uploads stay pending (S3 is down) when the process exits
"""


@pytest.mark.multiproc
def test_sync_never_uploads_a_node_cache_file_that_changed_since_its_save(uri: str, proxy: Any, tmp_path: Path) -> None:
    """The node cache's write-back: a save committed in the cache while S3 is down (its process exits
    with the uploads pending); one bit of its data file flips in the cache; ``tierckpt sync`` with S3 back
    must fail naming the file, and S3 keep the older commit."""
    small = (512, 1024)
    first = tierckpt.save(uri, state(small, 1), storage_options={"cache": False})
    cache = tmp_path / "cache"
    env = child_env(TIERCKPT_S3_ENDPOINT_URL=proxy.endpoint, TIERCKPT_CACHE_DIR=str(cache))
    proxy.add_rule(Rule("503", count=None))  # S3 down
    done = subprocess.run([sys.executable, "-c", WRITE_BACK_CHILD, uri, str(cache)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "tierckpt sync" in done.stderr, done.stderr[-2000:]
    proxy.clear()  # S3 back
    cached = next((cache / "objects").rglob("data/rank-00000.bin"))
    _flip(cached, at=1000)
    synced = cli("sync", uri, "--timeout", "60", env=env)
    assert synced.returncode != 0 and "synced" not in synced.stdout, synced.stdout + synced.stderr
    assert str(cached) in synced.stderr and "fails its CRC-32C check" in synced.stderr, synced.stderr
    assert layout.CommitRecord.decode(remote_bytes(uri, layout.COMMIT)).generation == first.generation
    assert same(tierckpt.load(uri, blank(small), storage_options={"cache": False}), state(small, 1))


def test_a_clean_write_down_through_the_node_cache_states_the_crc_it_checked(uri: str, tmp_path: Path) -> None:
    """The streamed copy hands the CRC-32C it checked to the node cache's writer (no second pass there):
    the cache records it, uploads the file with it checked, and S3 holds the checkpoint bit-exactly."""
    memdir = tmp_path / "memory-tier"
    opts = {"memory": MemoryConfig(directory=str(memdir), budget_bytes=1 << 30, exit_wait_s=0),
            "cache": CacheConfig(directory=str(tmp_path / "cache"), exit_wait_s=0)}
    tierckpt.save(uri, state(BIG, 3), storage_options=opts, persist=False)
    assert tierckpt.sync(uri, timeout_s=120, **opts) == [uri]
    assert same(tierckpt.load(uri, blank(BIG), storage_options={"memory": False, "cache": False}), state(BIG, 3))


MEMORY_CHILD = """
import sys, torch, tierckpt
from tierckpt.io.scheduler import get_scheduler
from tierckpt.node.memory import MemoryConfig
from tierckpt.node.memory.memory import MemoryTier
want = {"w": torch.randn(512, 1024, generator=torch.Generator().manual_seed(2)), "step": 2}
memory = MemoryConfig(directory=sys.argv[2], budget_bytes=1 << 30, exit_wait_s=0)
tierckpt.async_save(sys.argv[1], want, storage_options={"memory": memory}).wait()  # committed in memory; S3 down
"""


@pytest.mark.multiproc
def test_a_writer_killed_after_its_memory_commit_leaves_nothing_corrupt_to_sync(
    uri: str, proxy: Any, tmp_path: Path,
) -> None:
    """The issue's scenario: the writer's process ends right after its memory-tier commit while S3 is down;
    one bit of the tier file flips; ``tierckpt sync`` with S3 back exits 5 and commits nothing on S3."""
    memdir = tmp_path / "memory-tier"
    env = child_env(TIERCKPT_S3_ENDPOINT_URL=proxy.endpoint, TIERCKPT_MEMORY="on", TIERCKPT_MEMORY_DIR=str(memdir),
                    TIERCKPT_CACHE="off", TIERCKPT_CACHE_DIR=str(tmp_path / "node-cache"))
    proxy.add_rule(Rule("503", count=None))  # S3 down
    done = subprocess.run([sys.executable, "-c", MEMORY_CHILD, uri, str(memdir)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    proxy.clear()  # S3 back
    tier_file = next(memdir.rglob("data/rank-00000.bin"))
    _flip(tier_file, at=1000)
    synced = cli("sync", uri, "--timeout", "60", env=env)
    assert synced.returncode == 5 and "synced" not in synced.stdout, synced.stdout + synced.stderr
    assert str(tier_file) in synced.stderr and "corrupted in node memory" in synced.stderr, synced.stderr
    with pytest.raises(Exception, match="NoSuchKey"):
        remote_bytes(uri, layout.COMMIT)


def test_a_seal_records_what_the_writer_wrote_not_what_the_file_holds_now(tmp_path: Path) -> None:
    """A tier file changed in place after its writer stamped it is sealed with the writer's CRC-32C, so
    the manifest never vouches for the changed bytes (a file replaced under its name is read afresh)."""
    tier = MemoryTier("s3://bucket/ckpt", MemoryConfig(directory=str(tmp_path), budget_bytes=1 << 30))
    key = "g-00000001-0000000000000-000000000000/data/rank-00000.bin"
    get_scheduler().run(tier.put(key, b"a" * 4096))
    path = Path(tier.path_of(key))
    with open(path, "r+b") as f:
        f.write(b"b")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    manifest = tier.seal(key.split("/")[0], origin="node-0")
    assert dict(manifest.files)[key].crc32c == crc32c.crc32c(b"a" * 4096)
    assert tier.verify(key.split("/")[0]) and key in tier.verify(key.split("/")[0])[0]
