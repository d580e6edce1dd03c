"""The wire benchmark (``benchmarks/bench_wire.py``) moves the bytes it times, over each count of lanes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _common as C  # noqa: E402
import bench_wire  # noqa: E402


@pytest.mark.multiproc
@pytest.mark.parametrize("lanes", [1, 2])
def test_every_chunk_arrives_whatever_the_lanes(monkeypatch: pytest.MonkeyPatch, lanes: int) -> None:
    """Three chunks and a partial one, on ``lanes`` devices of the group: rank 1 receives every byte (the
    ranks check it) and reports one time per repeat."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", ",".join(["lo"] * lanes))
    nbytes = 3 * bench_wire.CHUNK_BYTES + 4096
    seconds = C.run_ranks(bench_wire.wire_ranks, 2, nbytes, lanes, 2, timeout_s=120)[1]
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
