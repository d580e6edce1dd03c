"""Collective failures name the ranks involved instead of hanging or timing out silently."""

import pytest

import scenarios

pytestmark = pytest.mark.multiproc


def test_a_rank_that_never_arrives_is_named(dist_pool, tmp_path):
    try:
        messages = dist_pool.run(scenarios.missing_rank, str(tmp_path / "c"))
    finally:
        dist_pool.close()  # the abandoned barrier leaves the group out of step: start fresh workers
    assert "ranks 2 of the group did not arrive" in messages[0], messages[0]
    assert messages[1] and messages[1] != "no error", messages[1]
