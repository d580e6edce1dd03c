"""A read (or a write) that fails on one rank in the middle of a load (a save) fails it on every rank, at once.

The ranks exchange each round's parts: a rank whose reads fail must still take its part in every exchange
and the load's agreement, so the others raise its error (naming it) instead of waiting in the exchange until
the collective timeout (a :class:`~tierckpt.errors.CollectiveError` naming no cause).
"""

from __future__ import annotations

import pytest

import scenarios_one_rank_fails as S

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 60.0
"""The collective timeout of the load: a rank left waiting for the failing one raises a CollectiveError."""


@pytest.mark.parametrize("failing_rank", [0, 3])
def test_a_failed_read_on_one_rank_fails_every_rank_with_its_error(dist_pool, tmp_path, failing_rank):
    results = dist_pool.run(S.one_rank_fails_its_reads, str(tmp_path / "ckpt"), failing_rank, TIMEOUT_S, timeout_s=300)
    for rank, result in enumerate(results):
        assert result["type"] == "StorageError", (rank, result)
        assert S.INJECTED in result["message"] and f"on rank {failing_rank}" in result["message"], (rank, result)


def test_a_failed_write_on_one_rank_fails_every_rank_and_commits_nothing(dist_pool, tmp_path):
    results = dist_pool.run(S.one_rank_fails_its_writes, str(tmp_path / "ckpt"), 2, TIMEOUT_S, timeout_s=300)
    for rank, result in enumerate(results):
        assert S.INJECTED in result["message"] and "on rank 2" in result["message"], (rank, result)
        assert result["committed"] == "False", (rank, result)
