"""Multi-rank scenarios for the read-path checksums (run on every rank of tests/distributed.py's pool).

Shared with the single-process tests: the helpers that pick bits to flip in a saved checkpoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.distributed as dist
from distributed import subgroup

import tierckpt
from tierckpt.native import layout
from tierckpt.errors import CorruptCheckpointError
from tierckpt.native.metadata import decode_pieces, decode_tensors
from tierckpt.sharded import ShardedTensor

SHAPE = (384, 3072)
"""fp32, 4.5 MiB: pieces of several 1 MiB checksum blocks, rows of 12 KiB."""


def generation_dir(root: Path) -> Path:
    return root / json.loads((root / layout.COMMIT).read_text())["generation"]


def piece_bits(root: Path, fqns: set[str] | None = None) -> list[tuple[Path, int, int, str]]:
    """``(data file, first byte, byte length, tensor)`` of every saved piece (of ``fqns``)."""
    gen = generation_dir(root)
    tensors = decode_tensors((gen / "meta/tensors.parquet").read_bytes())
    pieces = decode_pieces((gen / "meta/pieces.parquet").read_bytes(), tensors)
    out = []
    for fqn, plist in sorted(pieces.items()):
        if fqns is not None and fqn not in fqns:
            continue
        for p in plist:
            out.append((gen / p.file, p.byte_offset, p.byte_length, fqn))
    return out


def random_flips(root: Path, count: int, seed: int, fqns: set[str] | None = None) -> list[tuple[Path, int, int, str]]:
    """``count`` random single-bit flips ``(file, byte, bit, tensor)`` inside the saved pieces."""
    spans = piece_bits(root, fqns)
    total = sum(n for _, _, n, _ in spans)
    rng = random.Random(seed)
    flips = []
    for _ in range(count):
        at = rng.randrange(total)
        for file, offset, n, fqn in spans:
            if at < n:
                flips.append((file, offset + at, rng.randrange(8), fqn))
                break
            at -= n
    return flips


def flip(file: Path, byte: int, bit: int) -> None:
    with open(file, "r+b") as f:
        f.seek(byte)
        value = f.read(1)[0]
        f.seek(byte)
        f.write(bytes([value ^ (1 << bit)]))


def full_tensor() -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) * 0.5


def _rows(world: int, rank: int) -> tuple[int, int]:
    n = SHAPE[0] // world
    return rank * n, n


def _cols(world: int, rank: int) -> tuple[int, int]:
    n = SHAPE[1] // world
    return rank * n, n


def _target(layout_name: str, world: int, rank: int) -> tuple[ShardedTensor, torch.Tensor]:
    full = full_tensor()
    if layout_name == "rows":
        start, n = _rows(world, rank)
        return ShardedTensor(torch.zeros(n, SHAPE[1]), SHAPE, (start, 0)), full[start : start + n]
    start, n = _cols(world, rank)
    return ShardedTensor(torch.zeros(SHAPE[0], n), SHAPE, (0, start)), full[:, start : start + n]


def flips_on_reshard(path: str, save_world: int, load_world: int, load_layout: str, count: int, seed: int) -> dict:
    """Save row-sharded on ``save_world`` ranks; flip ``count`` random bits one at a time and load each
    time on ``load_world`` ranks laid out by ``load_layout`` (``rows`` or ``cols``: strided direct reads).

    Returns, on rank 0, how many flips were caught with an error naming the file and tensor, and the
    bytes read by the clean load (summed over ranks).
    """
    group = subgroup(save_world)
    if group is not None:
        rank = dist.get_rank(group)
        start, n = _rows(save_world, rank)
        local = full_tensor()[start : start + n].clone()
        tierckpt.save(path, {"w": ShardedTensor(local, SHAPE, (start, 0))}, group=group)
    dist.barrier()
    group = subgroup(load_world)
    result: dict = {}
    if group is not None:
        rank = dist.get_rank(group)
        flips = random_flips(Path(path), count, seed)
        caught = 0
        for file, byte, bit, fqn in flips:
            if rank == 0:
                flip(file, byte, bit)
            dist.barrier(group)
            target, _ = _target(load_layout, load_world, rank)
            try:
                tierckpt.load(path, {"w": target}, group=group)
            except CorruptCheckpointError as exc:
                caught += str(file.name) in str(exc) and repr(fqn) in str(exc)
            dist.barrier(group)
            if rank == 0:
                flip(file, byte, bit)
            dist.barrier(group)
        target, expected = _target(load_layout, load_world, rank)
        monitor = tierckpt.Monitor()
        tierckpt.load(path, {"w": target}, group=group, monitor=monitor)
        assert torch.equal(target.local, expected)
        read = torch.tensor([monitor.counters.get("bytes_read", 0)], dtype=torch.int64)
        dist.all_reduce(read, group=group)
        result = {"tried": len(flips), "caught": caught, "bytes_read": int(read.item())}
    dist.barrier()
    return result
