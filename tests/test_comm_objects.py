"""Comm's object collectives on a real gloo group: every rank gets the same object, in as few collectives
as the docstrings say (one broadcast of a slot when the pickle fits, a second for the rest)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

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
