"""Peer recovery's lanes on a real gloo group: several connections per pair of ranks, made once per process
and group, connecting only the pairs that talk, every chunk arriving whole and in its place."""

from __future__ import annotations

import torch
import torch.distributed as dist

from distributed import subgroup
from tierckpt.loading import peer_lanes
from tierckpt.comm import Comm

CHUNK_SIZES = [3 << 20, 1, 5 << 20, 4096, 2 << 20, 7, 1 << 20]
"""Chunks of uneven sizes, more of them than lanes: the j-th chunk of a pair takes lane j mod LANES."""


def _chunk(sender: int, j: int) -> torch.Tensor:
    """The bytes ``sender`` sends as its ``j``-th chunk: each chunk its own pattern, so a swap would show."""
    return (torch.arange(CHUNK_SIZES[j], dtype=torch.int64) * (j + 3) + 31 * sender).to(torch.uint8)


def stream_between_halves(group_size: int) -> tuple[int, bool, bool] | None:
    """Over a group of ``group_size`` ranks, rank r < size/2 streams every chunk to rank r + size/2 (the other
    pairs never talk). ``(lanes used, every received chunk exact, the lanes group made once)``."""
    group = subgroup(group_size)
    if group is None:
        return None
    comm = Comm(group)
    lanes = peer_lanes.lanes_of(comm, tag=77)
    half = group_size // 2
    peer = comm.rank + half if comm.rank < half else comm.rank - half
    if comm.rank < half:
        works = [lanes.send(_chunk(comm.rank, j), peer) for j in range(len(CHUNK_SIZES))]
        exact = True
    else:
        got = [torch.zeros(n, dtype=torch.uint8) for n in CHUNK_SIZES]
        works = [lanes.recv(into, peer) for into in got]
    for work in works:
        work.wait()
    lanes.close()
    if comm.rank >= half:
        exact = all(torch.equal(into, _chunk(peer, j)) for j, into in enumerate(got))
    made_once = peer_lanes.lanes_of(comm, tag=77).side is lanes.side
    dist.barrier(group)
    return lanes.count, exact, made_once


def test_chunks_go_whole_over_several_lanes_per_pair(dist_pool) -> None:
    results = dist_pool.run(stream_between_halves, 4)
    assert results == [(peer_lanes.LANES, True, True)] * 4


def test_a_subgroup_has_lanes_of_its_own(dist_pool) -> None:
    results = [r for r in dist_pool.run(stream_between_halves, 2) if r is not None]
    assert results == [(peer_lanes.LANES, True, True)] * 2


def test_a_group_that_is_not_gloo_streams_over_itself() -> None:
    lanes = peer_lanes.lanes_of(Comm("self"), tag=5)
    assert (lanes.count, lanes.side, lanes.tag) == (1, None, 5)
