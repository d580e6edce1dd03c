"""The saver's durability levels and the loader's view of the node memory tiers, in one process.

``SaveHandle.wait(level)`` accepts ``memory``, ``replicated`` and ``remote``; ``replicated`` names why
it cannot be reached (memory tier off, no torch.distributed). :mod:`tierckpt.loading.locality` decides, the
same on every rank, which node serves each file: only copies whose size matches the checkpoint and
agree across nodes count. Multi-node behaviour is in ``tests/test_memory_recovery.py``.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt.errors import CheckpointBusyError, CheckpointError
from tierckpt.loading.api import read_checkpoint
from tierckpt.loading.locality import LocalReads, held_files, rereaders
from tierckpt.loading.locality import HeldFile
from tierckpt.store import open_store
from tierckpt.node.memory import MemoryConfig, NodeMemory
from tierckpt.node.memory.replication import ReplicationError


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 8, generator=gen), "extra": {"step": seed}}


def test_wait_levels_without_a_memory_tier(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    handle = tierckpt.async_save(uri, _state(1))
    meta = handle.wait()
    assert handle.wait("memory").generation == meta.generation == handle.result().generation
    assert handle.wait("remote").generation == meta.generation
    with pytest.raises(ReplicationError, match="cannot reach the level 'replicated'.*memory tier is off.*TIERCKPT_MEMORY=on"):
        handle.wait("replicated")
    with pytest.raises(CheckpointError, match=r"wait\(level='durable'\): use 'memory'.*'replicated'.*'remote'"):
        handle.wait("durable")
    with pytest.raises(ReplicationError, match="memory tier is off"):
        tierckpt.save(uri, _state(2), replicated=True)
    loaded = _state(0)
    tierckpt.load(uri, loaded)
    assert torch.equal(loaded["w"], _state(2)["w"])  # a sync save that could not replicate is still committed


def test_a_number_first_is_the_timeout(tmp_path: Path) -> None:
    """``handle.wait(30)``, as written before levels existed, is ``wait("memory", timeout_s=30)``."""
    from tierckpt.saving.api import _PROCESS

    uri = str(tmp_path / "ckpt")
    release = threading.Event()
    blocker = _PROCESS.executor().submit(release.wait)  # the save's background step queues behind it
    try:
        handle = tierckpt.async_save(uri, _state(1))
        started = time.monotonic()
        with pytest.raises(CheckpointBusyError, match=r"still running after 0.2s"):
            handle.wait(0.2)
        assert time.monotonic() - started < 5
    finally:
        release.set()
        blocker.result()
    meta = handle.wait(30)
    assert handle.wait(30.0).generation == meta.generation == handle.wait("memory", 30).generation
    assert handle.wait(level="remote", timeout_s=30).generation == meta.generation
    with pytest.raises(CheckpointError, match=r"wait\(5, timeout_s=6\): a number as the first argument is the timeout"):
        handle.wait(5, timeout_s=6)
    with pytest.raises(ReplicationError, match="memory tier is off"):
        handle.wait("replicated", 30)


def test_replicated_needs_torch_distributed(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    options = {"memory": MemoryConfig(directory=str(tmp_path / "shm"), budget_bytes=1 << 26)}
    handle = tierckpt.async_save(uri, _state(1), storage_options=options)
    handle.wait("memory")
    with pytest.raises(ReplicationError, match="torch.distributed is not initialised.*init_process_group"):
        handle.wait("replicated")
    handle.wait("remote")


def _tier_with(tmp_path: Path, uri: str, damaged: str | None = None):
    """A checkpoint saved to ``uri`` (a plain directory), copied file by file into a node memory tier and
    sealed there (``damaged``: one file copied short)."""
    tierckpt.save(uri, _state(3))
    store = open_store(uri)
    ckpt = read_checkpoint(store)
    tier = NodeMemory(MemoryConfig(directory=str(tmp_path / "shm"), budget_bytes=1 << 26)).tier(uri)
    root = Path(uri)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            key = path.relative_to(root).as_posix()
            data = path.read_bytes()
            if key == "COMMIT":
                asyncio.run(tier.commit(key, data))
            else:
                asyncio.run(tier.put(key, data[:-1] if key.endswith(damaged or "\0") else data))
    tier.seal(ckpt.meta.generation, origin="node-a")
    return tier, ckpt


def test_held_files_are_the_sealed_files_of_the_recorded_sizes(tmp_path: Path) -> None:
    uri = str(tmp_path / "remote" / "ckpt")
    tier, ckpt = _tier_with(tmp_path, uri, damaged="objects/rank-00000.bin")
    held = {f.name for f in held_files(tier, ckpt.meta, ckpt.record)}
    assert {"data/rank-00000.bin", "meta/pieces.parquet", "meta/header.json", "meta/tensors.parquet"} <= held
    assert "objects/rank-00000.bin" not in held  # its size is not the one the header records
    assert held_files(None, ckpt.meta, ckpt.record) is None


def test_a_tier_populated_directly_serves_a_load_with_the_remote_gone(tmp_path: Path) -> None:
    uri = str(tmp_path / "remote" / "ckpt")
    tier, _ = _tier_with(tmp_path, uri)
    shutil.rmtree(tmp_path / "remote")
    loaded = _state(0)
    tierckpt.load(uri, loaded, storage_options={"memory": tier.config})
    assert torch.equal(loaded["w"], _state(3)["w"]) and loaded["extra"] == {"step": 3}


def test_servers_and_rereaders_prefer_agreeing_holders() -> None:
    a = HeldFile("data/rank-00000.bin", 100, 7)
    b = HeldFile("data/rank-00001.bin", 100, 8)
    b_bad = HeldFile("data/rank-00001.bin", 100, 9)
    pieces = HeldFile("meta/pieces.parquet", 50, 1)
    reports = [("n0", (a, pieces)), ("n0", (a, pieces)), ("n1", (b,)), ("n1", (b,)), ("n2", (b_bad,)), ("n2", None)]
    local = LocalReads.of(2, None, reports)
    assert local.active and local.holds(0, a.name) and not local.holds(2, a.name)
    assert not any(local.holds(r, b.name) for r in range(6))  # n1 and n2 disagree: nobody's copy is read
    needs = [["meta/pieces.parquet"]] * 6
    assert local.servers(needs) == {"meta/pieces.parquet": 0}  # lowest rank of a holding node
    assert local.servers([["meta/pieces.parquet"], ["meta/pieces.parquet"]] + [["nowhere"]] * 4) == {}
    assert not local.here(a.name)  # this rank has no tier
    assert rereaders([a.name, a.name, a.name, b.name, b.name], local, 6) == [0, 1, 0, 0, 1]
    assert not LocalReads.of(0, None, [("n0", None), ("n1", None)]).active
