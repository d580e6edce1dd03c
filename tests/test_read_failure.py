"""A read that fails on one rank in the middle of an exchanged load fails the load on every rank, at once.

The ranks exchange each round's parts: a rank whose reads fail must still take its part in every exchange
and the load's agreement, so the others raise its error (naming it) instead of waiting in the exchange until
the collective timeout (a :class:`~tierckpt.errors.CollectiveError` naming no cause).
"""

from __future__ import annotations

import pytest

import scenarios_read_failure as S

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 60.0
"""The collective timeout of the load: a rank left waiting for the failing one raises a CollectiveError."""


@pytest.mark.parametrize("failing_rank", [0, 3])
def test_a_failed_read_on_one_rank_fails_every_rank_with_its_error(dist_pool, tmp_path, failing_rank):
    results = dist_pool.run(S.one_rank_fails_its_reads, str(tmp_path / "ckpt"), failing_rank, TIMEOUT_S, timeout_s=300)
    for rank, result in enumerate(results):
        assert result["type"] == "StorageError", (rank, result)
        assert S.INJECTED in result["message"] and f"on rank {failing_rank}" in result["message"], (rank, result)
