"""A peer's replica that cannot be streamed fails the recovery on every rank, naming it, at once.

Node-1 is lost; node-0 holds its replica and streams the replacement node's large units from its tier's
pages (:mod:`tierckpt.peer_stream`). When node-0 cannot open its tier file, the ranks waiting for those
chunks must not wait for the collective timeout: every rank's load raises the holder's error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_memory_recovery import Job, _lose_node_1_of_big, uri_of, workdir  # noqa: F401 - workdir is a fixture

pytestmark = pytest.mark.multiproc


def test_a_replica_the_holder_cannot_open_fails_every_rank_with_the_holders_error(workdir: Path) -> None:
    uri = uri_of(workdir, 1)
    _lose_node_1_of_big(workdir, uri)
    fresh = Job(workdir, ["node-0", "node-0", "node-2", "node-2"], "big",
                loads=[{"uri": uri, "seed": 1, "unopenable_tier_files": True}]).wait(timeout_s=120)
    errors = [r["loads"][uri].get("error", "") for r in fresh]
    for rank, error in enumerate(errors):
        assert "injected by the test: cannot open" in error, (rank, error)
        assert "CollectiveError" not in error.split(":", 1)[0], (rank, error)
