"""Loads whose metadata every rank reads from its node's memory tier (:mod:`tierckpt.loading.tier_metadata`), and
the one-collective object gather (:meth:`tierckpt.comm.Comm.all_gather_object`).

Real parts: saves through the memory tier into a per-test directory, real gloo ranks (the test pool, one
simulated node), documents damaged or grown in the tier as a fault would leave them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt.native import layout
from tierckpt.errors import CorruptCheckpointError
from tierckpt.loading.api import read_checkpoint
from tierckpt.native.metadata import MAX_TABLE_BYTES
from tierckpt.store import memory_tier_of, open_store
from tierckpt.loading.tier_metadata import read_from_tier
from tierckpt.node.memory import MemoryConfig

sys.path.insert(0, str(Path(__file__).parent))
import tier_metadata_child as child  # noqa: E402


@pytest.fixture
def memdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "memory-tier"
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(directory))
    return directory


def mem(memdir: Path) -> MemoryConfig:
    return MemoryConfig(directory=str(memdir), budget_bytes=1 << 30, exit_wait_s=0)


def tier_file(path: str, config: MemoryConfig, key: str) -> str:
    """The tier's file of ``key`` (relative to the committed generation)."""
    tier = memory_tier_of(open_store(path, {"memory": config}))
    return tier.path_of(layout.in_generation(tier.committed().generation, key))


def flip_byte(file: str) -> None:
    with open(file, "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))


def loaded(path: str, config: MemoryConfig | bool) -> dict[str, torch.Tensor]:
    got = {name: torch.zeros(64, 32) for name in "abcd"}
    tierckpt.load(path, got, storage_options={"memory": config})
    return got


def test_the_tier_copy_is_the_checkpoint_the_store_names(tmp_path: Path, memdir: Path) -> None:
    """What a rank reads from its tier is what the chain serves: the same header, tensors and commit,
    and the pieces table whole, with the size and CRC-32C COMMIT records."""
    path, config = str(tmp_path / "ckpt"), mem(memdir)
    child.save(path, config)
    store = open_store(path, {"memory": config})
    read = read_from_tier(memory_tier_of(store), store, leader=True)
    chain = read_checkpoint(store)
    assert read.why is None and read.ckpt is not None and read.token is not None
    assert (read.ckpt.meta, read.ckpt.tensors, read.ckpt.record) == (chain.meta, chain.tensors, chain.record)
    assert read.token[:2] == (chain.record.seq, chain.meta.generation)
    assert layout.FileChecksum.of(read.ckpt.pieces_table) == chain.record.checksum(layout.PIECES)


def test_a_tier_older_than_the_store_loads_the_newer_commit(tmp_path: Path, memdir: Path) -> None:
    """A newer checkpoint saved without the memory tier (the tier still names the older one): rank 0's
    look at the store's COMMIT wins, as when one rank read for the group."""
    path, config = str(tmp_path / "ckpt"), mem(memdir)
    child.save(path, config)
    newer = {name: -t for name, t in child.make().items()}
    tierckpt.save(path, newer, storage_options={"memory": False})
    store = open_store(path, {"memory": config})
    read = read_from_tier(memory_tier_of(store), store, leader=True)
    assert read.token is None and "the store's COMMIT names" in (read.why or "")
    assert all(torch.equal(t, newer[n]) for n, t in loaded(path, config).items())


def test_a_document_grown_past_its_bound_in_the_tier_is_not_read(tmp_path: Path, memdir: Path) -> None:
    """A tensor table in the tier larger than any may be is refused unread; the load falls back to the
    chain, which takes the intact copy where the URI points (the tier's no longer has its sealed size)."""
    path, config = str(tmp_path / "ckpt"), mem(memdir)
    child.save(path, config)
    os.truncate(tier_file(path, config, layout.TENSORS), MAX_TABLE_BYTES + 1)  # sparse: nothing is written
    store = open_store(path, {"memory": config})
    read = read_from_tier(memory_tier_of(store), store, leader=True)
    assert read.token is None and "more than such a file can" in (read.why or "") and "it is not read" in (read.why or "")
    assert all(torch.equal(t, child.make()[n]) for n, t in loaded(path, config).items())


def test_a_damaged_header_in_the_tier_fails_naming_it(tmp_path: Path, memdir: Path) -> None:
    path, config = str(tmp_path / "ckpt"), mem(memdir)
    child.save(path, config)
    flip_byte(tier_file(path, config, layout.HEADER))
    with pytest.raises(CorruptCheckpointError, match=r"meta/header\.json .* restore the checkpoint from a copy"):
        loaded(path, config)


@pytest.mark.multiproc
def test_ranks_of_a_node_read_the_metadata_from_its_tier_in_one_collective(dist_pool: Any, tmp_path: Path,
                                                                           memdir: Path) -> None:
    """Four ranks on one node: each reads the metadata from the node's tier, nothing is broadcast, and the
    load coordinates in five collectives (arrival; metadata and needs; file checks and objects; read; apply
    with the monitor's summaries), each but the first one all-gather of objects, besides the data's exchange.
    Over gloo a group this small all-gathers objects as a gather and a broadcast of the gathered slots
    (``comm.STAR_GATHER_MAX_RANKS``): a broadcast of the metadata would show as a fifth broadcast."""
    path, config = str(tmp_path / "ckpt"), mem(memdir)
    dist_pool.run(child.save, path, config)
    results = dist_pool.run(child.load_counting, path, config)
    assert all(r["exact"] for r in results)
    for r in results:
        r["collectives"].pop("all_to_all_single", None)  # the data's exchange, one per round
        assert r["collectives"] == {"monitored_barrier": 1, "gather": 4, "broadcast": 4}, r["collectives"]


@pytest.mark.multiproc
def test_without_a_tier_the_first_rank_reads_the_metadata_once_for_the_group(dist_pool: Any, tmp_path: Path) -> None:
    """No memory tier: rank 0 reads ``COMMIT``, the header and both tables (the small pieces table with them)
    and broadcasts them; the other ranks read no metadata document, only their data."""
    path = str(tmp_path / "ckpt")
    dist_pool.run(child.save, path, False)
    results = dist_pool.run(child.load_counting_reads, path)
    assert all(r["exact"] for r in results)
    metadata = ("COMMIT", "header.json", "tensors.parquet", "pieces.parquet")
    assert {name: results[0]["reads"].get(name) for name in metadata} == dict.fromkeys(metadata, 1), results[0]["reads"]
    for r in results[1:]:
        assert not set(r["reads"]) & set(metadata), r["reads"]


@pytest.mark.multiproc
def test_a_damaged_header_in_the_tier_fails_every_rank_naming_it(dist_pool: Any, tmp_path: Path, memdir: Path) -> None:
    path, config = str(tmp_path / "ckpt"), mem(memdir)
    dist_pool.run(child.save, path, config)
    flip_byte(tier_file(path, config, layout.HEADER))
    messages = dist_pool.run(child.load_error, path, config)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("CorruptCheckpointError") and "meta/header.json" in messages[0], messages[0]
    assert "restore the checkpoint from a copy" in messages[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("sizes", [[10, 0, 3, 7], [10, 200_000, -1, 70_000], [-1, -1, -1, -1]])
def test_all_gather_object_returns_every_ranks_object(dist_pool: Any, sizes: list[int]) -> None:
    """Small objects in one collective, objects larger than a slot in a second: every rank gets every
    rank's object, whole and in rank order."""
    want = [None if n < 0 else (rank, bytes([rank]) * n) for rank, n in enumerate(sizes)]
    assert dist_pool.run(child.gather, sizes) == [want] * 4
