"""A peer's replica that cannot be streamed: read from where the URI points when it commits the same
generation, else the recovery fails on every rank, naming it, at once.

Node-1 is lost; node-0 holds its replica and streams the replacement node's large units from its tier's
pages (:mod:`tierckpt.loading.peer_stream`). When node-0 cannot open its tier file, the ranks waiting for those
chunks must not wait for the collective timeout: every rank's load raises the holder's error. When the
remote is reachable and holds the generation, a damaged replica costs a second read, not the load.
"""

from __future__ import annotations

import shutil
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


def test_a_replacement_rank_lost_before_its_stream_connects_fails_the_others_loudly(workdir: Path) -> None:
    """Rank 2 (a replacement rank) dies as its read step is about to receive its streamed units, so the lanes
    from its peer to it never connect: every other rank's load raises, none returns, within the group's
    timeout (30 s in these children), and every rank's process ends."""
    uri = uri_of(workdir, 1)
    _lose_node_1_of_big(workdir, uri)
    job = Job(workdir, ["node-0", "node-0", "node-2", "node-2"], "big", kill_rank=2,
              loads=[{"uri": uri, "seed": 1, "kill_receiver": True}])
    survivors = job.wait([0, 1, 3], timeout_s=120)
    job.kill([2])
    assert job.procs[2].exitcode == 9
    for rank, r in zip([0, 1, 3], survivors):
        load = r["loads"][uri]
        assert "error" in load, (rank, load)
        assert load["seconds"] < 60, (rank, load["seconds"], load["error"])


def test_a_damaged_replica_is_read_again_from_the_remote_when_it_commits_the_same_generation(workdir: Path) -> None:
    """Saved down to the remote; node-1 lost (the remote kept); one byte of node-0's replica of rank 2's data
    file flipped: the streamed chunk fails its check, and the group loads the generation again from the remote,
    bit-exact on every rank (before: every rank's load raised the checksum mismatch)."""
    uri = uri_of(workdir, 1)
    saved = Job(workdir, ["node-0", "node-0", "node-1", "node-1"], "big",
                saves=[{"uri": uri, "seed": 1, "level": ["replicated", "remote"]}]).wait()
    assert all(r["saves"][uri]["ok"] for r in saved), saved
    shutil.rmtree(workdir / "node-1")  # node-1 lost; the remote stays reachable
    [replica] = list((workdir / "node-0" / "shm").rglob("rank-00002.bin"))
    size = replica.stat().st_size
    with open(replica, "r+b") as f:  # the middle of the file: inside rank 2's streamed part
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    fresh = Job(workdir, ["node-0", "node-0", "node-2", "node-2"], "big", loads=[{"uri": uri, "seed": 1}]).wait()
    for r in fresh:
        load = r["loads"][uri]
        assert "error" not in load, load.get("trace")
        assert load["differs"] == [], f"{r['node']}: {load['differs']} differ from what was saved"
