"""The side group (``tierckpt.node.memory.sidegroup``) on real gloo groups: one per process and group, made without
a collective, the replicators' device at the tier's background priority and the lanes at training's."""

from __future__ import annotations

import os

import pytest


def _make_side_group_of_a_new_group() -> dict:
    """A new group over every rank; only rank 0 asks for its side group, twice. The gloo I/O threads that
    making it started, by their niceness."""
    import torch.distributed as dist

    from tierckpt.node.memory.background import started_threads
    from tierckpt.node.memory.sidegroup import side_group_of, side_groups

    group = dist.new_group(list(range(dist.get_world_size())))
    out: dict = {}
    if dist.get_rank() == 0:  # alone: making a side group exchanges nothing
        before, own_nice = started_threads(), os.getpriority(os.PRIO_PROCESS, 0)
        side = side_group_of(group, "first")
        loops = []
        for tid in sorted(started_threads() - before):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    loops.append(os.getpriority(os.PRIO_PROCESS, tid))
        again = side_group_of(group, "second")
        out = {"once": again is side, "users": sorted(side.users), "mine": sum(s is side for s in side_groups()),
               "background": sorted(nice for nice in loops if nice > own_nice), "at_own": loops.count(own_nice)}
    dist.barrier()
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread priorities are read per thread on Linux")
def test_one_side_group_per_group_its_replica_device_at_background_priority(dist_pool) -> None:
    from tierckpt.node.memory.background import DEFAULT_NICE
    from tierckpt.node.memory.sidegroup import LANES

    result = dist_pool.run(_make_side_group_of_a_new_group)[0]
    assert result["once"] and result["mine"] == 1 and result["users"] == ["first", "second"]
    assert result["background"] == [DEFAULT_NICE] and result["at_own"] == LANES  # the replicators' device alone
