"""Every flipped bit in the bytes a default load uses is caught in the read path, at read amplification 1.00.

Single-bit flips at random positions of the saved pieces (every bit position, every part of a block:
block starts and ends, slab edges, the short last block), for same-layout loads (whole blocks, and
blocks cut by read-unit edges), reshards on gloo (blocks split between ranks), strided direct reads
(each rank reads a third of every row), partial-tensor loads, and checkpoints written before block
checksums existed.
"""

from __future__ import annotations

import os
import random

import crc32c
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from tamper import reseal
from scenarios_integrity import SHAPE, flip, flips_on_reshard, full_tensor, generation_dir, piece_bits, random_flips

import tierckpt
from tierckpt.errors import CorruptCheckpointError
from tierckpt.io.crc import BLOCK_BYTES, BlockAccumulator, block_crcs, combine_blocks, finish_pieces, raw_crc, shift, zeros_crc
from tierckpt.sharded import ShardedTensor

FLIPS = 40


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"model": {"big": full_tensor(), "small": torch.randn(7, 5, generator=g), "bf": torch.randn(300, generator=g).bfloat16()}}


def _zeros() -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in _state()["model"].items()}}


def _assert_all_caught(root, load, flips) -> None:
    """Flip each bit, load, require an error naming the data file and tensor, flip it back."""
    missed = []
    for file, byte, bit, fqn in flips:
        flip(file, byte, bit)
        try:
            load()
        except CorruptCheckpointError as exc:
            if file.name not in str(exc) or repr(fqn) not in str(exc):
                missed.append((byte, bit, f"error does not name the file and tensor: {exc}"))
        else:
            missed.append((byte, bit, "loaded without an error"))
        finally:
            flip(file, byte, bit)
    assert not missed, f"{len(missed)} of {len(flips)} flips not caught: {missed[:5]}"


@pytest.mark.parametrize("chunk_bytes", [32 << 20, 300_000], ids=["whole-blocks", "blocks-cut-by-units"])
def test_every_flip_is_caught_by_a_default_same_layout_load(tmp_path, chunk_bytes) -> None:
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), _state())
    flips = random_flips(root, FLIPS, seed=chunk_bytes)
    _assert_all_caught(root, lambda: tierckpt.load(str(root), _zeros(), chunk_bytes=chunk_bytes), flips)
    target = _zeros()
    monitor = tierckpt.Monitor()
    tierckpt.load(str(root), target, chunk_bytes=chunk_bytes, monitor=monitor)
    for k, v in _state()["model"].items():
        assert torch.equal(target["model"][k], v)
    assert monitor.counters["bytes_read"] == sum(v.numel() * v.element_size() for v in _state()["model"].values())


def test_a_flip_in_each_bit_of_a_block_edge_is_caught(tmp_path) -> None:
    """The first and last byte of every block of the big tensor, each of the 8 bits."""
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), {"big": full_tensor()})
    (file, start, length, fqn), = [s for s in piece_bits(root) if s[3] == "big"]
    edges = sorted({b for k in range(0, length, BLOCK_BYTES) for b in (k, k + 1, min(k + BLOCK_BYTES, length) - 1)})
    flips = [(file, start + b, bit, fqn) for b in edges for bit in range(8)]
    _assert_all_caught(root, lambda: tierckpt.load(str(root), {"big": torch.zeros(SHAPE)}, chunk_bytes=200_000), flips)


def test_a_load_of_part_of_a_tensor_checks_the_blocks_it_uses(tmp_path) -> None:
    """Rows 100..229 of the big tensor: blocks at both ends are read whole once more (only then)."""
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), {"big": full_tensor()})
    row = SHAPE[1] * 4
    used = [f for f in random_flips(root, 400, seed=3) if 100 * row <= f[1] - piece_bits(root)[0][1] < 230 * row][:FLIPS]
    assert len(used) >= 20

    def load() -> None:
        tierckpt.load(str(root), {"big": ShardedTensor(torch.zeros(130, SHAPE[1]), SHAPE, (100, 0))})

    _assert_all_caught(root, load, used)
    target = ShardedTensor(torch.zeros(130, SHAPE[1]), SHAPE, (100, 0))
    tierckpt.load(str(root), {"big": target})
    assert torch.equal(target.local, full_tensor()[100:230])


def test_checkpoints_without_block_checksums_are_checked_per_piece(tmp_path) -> None:
    """A pieces table in the format before block checksums: the whole-piece CRC is checked on load."""
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), _state())
    table_path = generation_dir(root) / "meta/pieces.parquet"
    table = pq.read_table(table_path).drop_columns(["crc_block_bytes", "block_crc32c"])
    pq.write_table(table, table_path, row_group_size=2048, write_statistics=True)
    reseal(root)
    target = _zeros()
    tierckpt.load(str(root), target)
    assert torch.equal(target["model"]["big"], full_tensor())
    flips = random_flips(root, 12, seed=5)
    _assert_all_caught(root, lambda: tierckpt.load(str(root), _zeros(), chunk_bytes=300_000), flips)


def test_check_crc_false_skips_the_check(tmp_path) -> None:
    """The switch the cost benchmark uses: without it the same flip loads silently wrong bytes."""
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), {"big": full_tensor()})
    ((file, byte, bit, _),) = random_flips(root, 1, seed=9)
    flip(file, byte, bit)
    target = {"big": torch.zeros(SHAPE)}
    tierckpt.load(str(root), target, check_crc=False)
    assert not torch.equal(target["big"], full_tensor())
    with pytest.raises(CorruptCheckpointError):
        tierckpt.load(str(root), target)


@pytest.mark.parametrize("layout", ["rows", "cols"], ids=["reshard-rows", "strided-direct-cols"])
def test_every_flip_is_caught_by_a_resharded_load_2_to_3_ranks(dist_pool, tmp_path, layout) -> None:
    path = str(tmp_path / "ckpt")
    results = dist_pool.run(flips_on_reshard, path, 2, 3, layout, FLIPS, 11, timeout_s=600)
    summary = results[0]
    assert summary["tried"] == FLIPS
    assert summary["caught"] == FLIPS
    assert summary["bytes_read"] == SHAPE[0] * SHAPE[1] * 4  # read amplification 1.00


def test_every_flip_is_caught_by_a_strided_direct_load_1_to_2_ranks(dist_pool, tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    summary = dist_pool.run(flips_on_reshard, path, 1, 2, "cols", FLIPS, 12, timeout_s=600)[0]
    assert (summary["tried"], summary["caught"]) == (FLIPS, FLIPS)
    assert summary["bytes_read"] == SHAPE[0] * SHAPE[1] * 4


# -- the arithmetic ---------------------------------------------------------------------------------
def test_partial_crcs_combine_to_the_block_crc() -> None:
    rng = random.Random(0)
    for _ in range(50):
        data = os.urandom(rng.randrange(1, 5000))
        cuts = sorted({0, len(data), *(rng.randrange(len(data)) for _ in range(rng.randrange(4)))})
        parts = list(zip(cuts, cuts[1:]))
        raws = np.array([raw_crc(data[a:b]) for a, b in parts], dtype=np.uint64)
        tails = np.array([len(data) - b for _, b in parts], dtype=np.uint64)
        combined = np.bitwise_xor.reduce(shift(raws, tails)) ^ zeros_crc(np.array([len(data)]))[0]
        assert int(combined) == crc32c.crc32c(data)


def test_block_accumulator_and_piece_crc() -> None:
    rng = random.Random(1)
    datas = [os.urandom(n) for n in (0, 1, 1023, 1024, 1025, 4096, 5000)]
    accs = []
    for data in datas:
        acc = BlockAccumulator(1024)
        at = 0
        while at < len(data):
            step = rng.randrange(1, 700)
            acc.update(memoryview(data[at : at + step]))
            at += step
        accs.append(acc)
    for data, sums in zip(datas, finish_pieces(accs)):
        assert sums.crc32c == crc32c.crc32c(data)
        assert list(sums.block_crc32c) == block_crcs(data, 1024)
    assert combine_blocks([[]], [0]) == [0]


def test_powers_table_matches_the_vectorised_multiplication() -> None:
    """The import-time table ``x^(2^k) mod P`` (built with Python ints) equals the numpy multiplication
    the combining code uses, and shifting by it gives the CRC of real zero bytes."""
    import crc32c as _crc32c
    import numpy as np

    from tierckpt.io import crc

    table = [1 << 30]
    for _ in range(63):
        last = np.array([table[-1]], dtype=np.uint64)
        table.append(int(crc._mulmod(last, last)[0]))
    assert crc._X2N == table
    for n in (1, 7, 4096, 1 << 20, 3 * (1 << 20) + 5):
        assert int(crc.zeros_crc(np.array([n]))[0]) == _crc32c.crc32c(bytes(n))
