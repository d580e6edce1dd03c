"""A load of many small tensors from a local file reads neighbouring units in one call
(``Backend.read_segments``): few thread hops, each byte read once, every block still checked."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from scenarios_integrity import flip, piece_bits

import tierckpt
from tierckpt.backends import run_reads
from tierckpt.errors import CorruptCheckpointError
from tierckpt.monitor import Monitor
from tierckpt.loading.read_step import _strided_groups
from tierckpt.sharded import ShardedTensor
from tierckpt.node.memory import MemoryConfig


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # 48 tensors of 20 KiB to 276 KiB: units that do not line up with the 1 MiB checksum blocks
    return {f"layer{i}.w": torch.randn(5_000 + 1_000 * i, generator=g) for i in range(48)}


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Segments per call of the local reads' one-call path."""
    calls: list[int] = []
    real = run_reads.pread_segments

    def spy(path: str, segments, *args, **kwargs):
        calls.append(len(segments))
        return real(path, segments, *args, **kwargs)

    monkeypatch.setattr("tierckpt.backends.local.pread_segments", spy)
    return calls


@pytest.mark.parametrize("check_crc", [True, False])
def test_small_units_of_a_local_file_are_read_in_one_call(tmp_path: Path, counted: list[int], check_crc: bool) -> None:
    state = _state()
    root = str(tmp_path / "ckpt")
    tierckpt.save(root, state)
    target, monitor = _zeros(state), Monitor()
    tierckpt.load(root, target, check_crc=check_crc, monitor=monitor)
    assert all(torch.equal(target[k], state[k]) for k in state)
    nbytes = sum(v.numel() * 4 for v in state.values())
    stats = monitor.ranks[0]
    assert stats["bytes_read"] == nbytes and stats["bytes_checked"] == (nbytes if check_crc else 0)
    assert len(counted) == 1 and counted[0] >= len(state)  # every unit in one call (blocks cut where checked)


def test_a_flipped_bit_in_any_unit_of_a_grouped_read_is_caught(tmp_path: Path, counted: list[int]) -> None:
    state = _state()
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), state)
    for file, first, length, fqn in piece_bits(root)[::7]:  # a piece at the start, middle and end of blocks
        for byte in (first, first + length // 2, first + length - 1):
            flip(file, byte, 5)
            with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
                tierckpt.load(str(root), _zeros(state))
            flip(file, byte, 5)
    counted.clear()
    target = _zeros(state)
    tierckpt.load(str(root), target)
    assert all(torch.equal(target[k], state[k]) for k in state) and len(counted) == 1


def test_the_memory_tier_reads_small_units_in_one_call(
    tmp_path: Path, counted: list[int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load served by the node memory tier (the remote moved away) groups the same way."""
    state = _state()
    root = str(tmp_path / "remote" / "ckpt")
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(tmp_path / "shm"))
    options = {"memory": MemoryConfig(directory=str(tmp_path / "shm"), budget_bytes=1 << 30, exit_wait_s=0)}
    tierckpt.save(root, state, storage_options=options)
    os.rename(tmp_path / "remote", tmp_path / "away")
    counted.clear()
    target = _zeros(state)
    tierckpt.load(root, target, storage_options=options)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert len(counted) == 1 and counted[0] >= len(state)


def _columns(state: dict[str, torch.Tensor], first: int, width: int) -> dict[str, ShardedTensor]:
    """A column window of each saved matrix: every row of it a run of its own in the file (a strided unit)."""
    return {k: ShardedTensor(torch.zeros(v.shape[0], width), tuple(v.shape), (0, first)) for k, v in state.items()}


@pytest.mark.parametrize("mapped", ["on", "off"])
def test_strided_units_of_a_local_file_are_read_in_one_call(
    tmp_path: Path, counted: list[int], monkeypatch: pytest.MonkeyPatch, mapped: str,
) -> None:
    """A column window of each of six matrices saved in one file: six strided units, read in one call
    (through one thread hop), each run's bytes exact and every block still checked."""
    monkeypatch.setenv("TIERCKPT_MAPPED_READS", mapped)
    g = torch.Generator().manual_seed(3)
    state = {f"layer{i}.w": torch.randn(256, 1024, generator=g) for i in range(6)}
    root = str(tmp_path / "ckpt")
    tierckpt.save(root, state)
    target, monitor = _columns(state, 384, 128), Monitor()
    tierckpt.load(root, target, monitor=monitor)
    assert all(torch.equal(target[k].local, state[k][:, 384:512]) for k in state)
    assert counted == [len(state)]
    assert monitor.ranks[0]["bytes_read"] == sum(t.local.numel() * 4 for t in target.values())
    file, first, _, fqn = piece_bits(tmp_path / "ckpt")[2]
    flip(file, first + 5 * 4096 + 400 * 4, 3)  # row 5, column 400 of the third matrix: inside the window
    with pytest.raises(CorruptCheckpointError, match=rf"checksum mismatch.*{re.escape(fqn)}"):
        tierckpt.load(root, _columns(state, 384, 128))


def test_strided_groups_split_by_file_by_digest_and_by_size() -> None:
    """Strided units join their file's open group while it stays within the bytes a call reads; units
    whose runs' CRCs are taken and units read plain never share a call; other units are left out."""
    units = [
        SimpleNamespace(file="a", nbytes=10), SimpleNamespace(file="b", nbytes=10), SimpleNamespace(file="a", nbytes=15),
        SimpleNamespace(file="a", nbytes=10), SimpleNamespace(file="a", nbytes=40), SimpleNamespace(file="a", nbytes=5),
        SimpleNamespace(file="a", nbytes=5),
    ]
    strided = [True, True, True, True, True, True, False]
    digested = [True, True, True, False, True, True, True]
    assert _strided_groups(units, strided, digested, 30) == [[0, 2], [1], [3], [4], [5]]
