"""Real loads through per-rank plans (planner/rank_plan.py) on 4 gloo ranks: each rank plans its own
units, the group agrees on rounds cut at different places per rank, exchanges go point to point or
all-to-all as agreed, and every byte is read and checked once by the group."""

from __future__ import annotations

import pytest

import scenarios_rank_plan


@pytest.mark.multiproc
@pytest.mark.parametrize("round_bytes", [1 << 20, 256 << 20])
def test_rows_to_columns_through_rank_plans_read_once_exact(dist_pool, tmp_path, round_bytes):
    stats = dist_pool.run(scenarios_rank_plan.rows_to_columns, str(tmp_path / "ckpt"), round_bytes)
    assert len(stats) == 4
    tensor_bytes = stats[0]["tensor_bytes"]
    assert sum(s["bytes_read"] for s in stats) == tensor_bytes  # each byte read once by the group
    assert sum(s["bytes_checked"] for s in stats) == tensor_bytes  # and checked once
    assert all(s.get("units_direct", 0) == 0 for s in stats)
    # Each rank receives 3/4 of its columns from the others. With 1 MiB rounds every rank cuts around each
    # piece of the big matrix, so those rounds hold 1 MiB deliveries only and go point to point, straight
    # into the targets; one round holding everything has small deliveries too: one all-to-all.
    assert sum(s["bytes_exchanged"] for s in stats) >= 3 * tensor_bytes // 4
    in_place = 3 * (2048 // 4) * (2048 // 4) * 4 if round_bytes == 1 << 20 else 0
    assert all(s.get("bytes_received_in_place", 0) == in_place for s in stats)


@pytest.mark.multiproc
def test_a_planning_failure_on_one_rank_raises_on_every_rank(dist_pool, tmp_path):
    """Each rank plans alone, so a plan that fails on one rank is carried by the next agreement."""
    errors = dist_pool.run(scenarios_rank_plan.planning_fails_on_one_rank, str(tmp_path / "ckpt"))
    assert len(errors[:2]) == 2
    for message in errors[:2]:
        assert "failed on 1 of 2 ranks" in message and "cover 16 of the 32 elements rank 1 needs" in message, message
