"""Comm's object collectives on a real gloo group: every rank gets the same object, in as few collectives
as the docstrings say (one broadcast of a slot when the pickle fits, a second for the rest)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from collective_count import counting_collectives
from distributed import subgroup
from tierckpt.comm import OBJECT_SLOT_BYTES, Comm


def broadcast_from(src: int, payload_bytes: int) -> tuple[bool, int] | None:
    """Broadcast from rank ``src`` of a 3-rank group an object pickling to about ``payload_bytes``;
    ``(received equal to what src sent, broadcasts made)`` on the group's ranks."""
    group = subgroup(3)
    if group is None:
        return None
    comm = Comm(group)
    sent = {"src": src, "blob": bytes(range(256)) * (payload_bytes // 256), "tail": [src, "x" * 7]}
    calls = []
    original = dist.broadcast

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.broadcast = counted
    try:
        got = comm.broadcast_object(sent if comm.rank == src else None, src)
    finally:
        dist.broadcast = original
    return got == sent, len(calls)


@pytest.mark.parametrize("src", [0, 2])
@pytest.mark.parametrize("payload, broadcasts", [(1 << 10, 1), (OBJECT_SLOT_BYTES + (300 << 10), 2)])
def test_every_rank_gets_the_object_in_one_broadcast_when_it_fits(dist_pool, src: int, payload: int, broadcasts: int) -> None:
    results = [r for r in dist_pool.run(broadcast_from, src, payload) if r is not None]
    assert results == [(True, broadcasts)] * 3


_TAIL_GROUPS: dict[int, object] = {}


def gather_on_ranks_1_to_3(payload_bytes: int) -> tuple[bool, int, int] | None:
    """All-gather over the group of global ranks 1, 2, 3 (its first rank is not the world's) of an object per
    rank pickling to about ``payload_bytes``; ``(every rank's object, in order, received; gathers made,
    broadcasts made)`` on the group's ranks."""
    if 4 not in _TAIL_GROUPS:
        _TAIL_GROUPS[4] = dist.new_group([1, 2, 3])  # every rank of the world creates it
    if dist.get_rank() == 0:
        return None
    comm = Comm(_TAIL_GROUPS[4])
    sent = [{"rank": r, "blob": bytes([r]) * (payload_bytes + 97 * r)} for r in range(3)]
    with counting_collectives() as calls:
        got = comm.all_gather_object(sent[comm.rank])
    return got == sent, calls["gather"], calls["broadcast"]


@pytest.mark.parametrize("payload, rounds", [(1 << 10, 1), (OBJECT_SLOT_BYTES + (100 << 10), 2)])
def test_every_rank_gets_every_object_by_a_gather_and_a_broadcast_per_round(dist_pool, payload: int, rounds: int) -> None:
    """Over gloo a small group all-gathers as a gather to its first rank and a broadcast from it
    (:data:`~tierckpt.comm.STAR_GATHER_MAX_RANKS`), one of each per round: the objects arrive whole, in
    rank order, also when the group's first rank is not the world's."""
    results = [r for r in dist_pool.run(gather_on_ranks_1_to_3, payload) if r is not None]
    assert results == [(True, rounds, rounds)] * 3
