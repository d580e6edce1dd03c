"""The wire benchmark (``benchmarks/bench_wire.py``) moves the bytes it times, over each count of lanes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _common as C  # noqa: E402
import bench_wire  # noqa: E402


@pytest.mark.multiproc
def test_every_chunk_arrives_whatever_the_lanes() -> None:
    """Three chunks and a partial one, over the group itself and over two lanes: rank 1 receives every byte
    (the ranks check it) and reports one time per repeat, per count of lanes and chunk size."""
    chunk = 1 << 20
    seconds = C.run_ranks(bench_wire.wire_ranks, 2, 3 * chunk + 4096, [1, 2], [chunk], 2, timeout_s=120)[1]
    assert sorted(seconds) == [(1, chunk), (2, chunk)]
    assert all(len(runs) == 2 and all(s > 0 for s in runs) for runs in seconds.values())
