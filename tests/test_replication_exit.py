"""Processes that exit normally right after their last ``async_save`` committed, in real gloo groups of
separate processes (``tests/exit_child.py``): the exit waits for peer replication in flight and stops the
replicator cleanly (also when the script destroys the default group first), and a committed save is
reported committed on every rank even when rank 0, which serves the group's store, leaves first.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import free_port  # noqa: E402
from exit_child import AWAY_S  # noqa: E402
from processes import communicate_all  # noqa: E402

CHILD = str(Path(__file__).parent / "exit_child.py")
LIMIT_S = 150


def _run(mode: str, workdir: Path, world: int = 2, env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Launch ``world`` ranks, each its own simulated node; their completed processes."""
    return communicate_all(_launch(mode, workdir, world, env), LIMIT_S, mode)


def _launch(mode: str, workdir: Path, world: int = 2, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start ``world`` ranks of ``exit_child.py MODE``, each its own simulated node."""
    port = free_port()
    procs = []
    for rank in range(world):
        child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1",
                     "TIERCKPT_NODE_ID": f"node-{rank}", "TIERCKPT_MEMORY_DIR": str(workdir / f"node-{rank}" / "shm"),
                     "TIERCKPT_MEMORY_BYTES": "512M", **(env or {})}
        procs.append(subprocess.Popen([sys.executable, CHILD, mode, str(workdir), str(rank), str(world), str(port)],
                                      env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _levels(workdir: Path, node: str) -> dict[str, dict]:
    """The levels recorded in ``node``'s memory tier, by generation."""
    return {p.stem: json.loads(p.read_text()) for p in (workdir / node / "shm").glob("*/levels/*.json")}


@pytest.mark.parametrize("mode", ["return", "destroy"])
def test_exit_right_after_a_save_finishes_its_replication(tmp_path: Path, mode: str) -> None:
    # Both nodes exit as soon as their own transfers are done: each waits for its peer's closing word, so
    # no acknowledgement is still on the wire when a process tears its sockets down (no retry needed).
    runs = _run(mode, tmp_path, env={"TIERCKPT_MEMORY": "on"})
    for rank, run in enumerate(runs):
        assert "terminate called" not in run.stderr, run.stderr
        assert run.returncode == 0, f"rank {rank} exited {run.returncode}: {run.stderr}"
    generation = runs[0].stdout.split("generation ", 1)[1].split()[0]
    assert all(f"generation {generation}" in r.stdout for r in runs)
    for rank in range(2):
        node, peer = f"node-{rank}", f"node-{1 - rank}"
        level = _levels(tmp_path, node).get(generation)
        assert level is not None, f"{node} recorded no level for {generation}: {runs[rank].stderr}"
        assert level["level"] == "replicated" and level["acknowledged"] == [peer], (json.dumps(level), runs[rank].stderr)
        # The peer holds this node's data file of the last generation, whole.
        own = list((tmp_path / node / "shm").glob(f"*/objects/{generation}/data/rank-0000{rank}.bin"))
        replica = list((tmp_path / peer / "shm").glob(f"*/objects/{generation}/data/rank-0000{rank}.bin"))
        assert len(own) == len(replica) == 1 and own[0].read_bytes() == replica[0].read_bytes()


def test_a_committed_save_is_committed_on_every_rank_when_rank_0_exits_first(tmp_path: Path) -> None:
    runs = _run("slow-reader", tmp_path, env={"TIERCKPT_MEMORY": "off"})
    for rank, run in enumerate(runs):
        assert run.returncode == 0, f"rank {rank} exited {run.returncode}: {run.stderr}"
    generations = [r.stdout.split("committed ", 1)[1].split()[0] if "committed " in r.stdout else r.stdout for r in runs]
    assert generations[0] == generations[1], f"rank 0: {runs[0].stdout!r}; rank 1: {runs[1].stdout!r}"
    commit = json.loads((tmp_path / "remote" / "ckpt" / "COMMIT").read_text())
    assert commit["generation"] == generations[0]


def test_a_replication_the_exit_drain_gives_up_on_stays_memory(tmp_path: Path) -> None:
    runs = _run("stuck-peer", tmp_path, env={"TIERCKPT_MEMORY": "on"})
    for rank, run in enumerate(runs):
        assert "terminate called" not in run.stderr, run.stderr
        assert run.returncode == 0, f"rank {rank} exited {run.returncode}: {run.stderr}"
    generation = runs[0].stdout.split("generation ", 1)[1].split()[0]
    # Node 0's files never reached node 1: the exit drain gave up after the exit wait and said so.
    said = re.escape(f"peer replication of {tmp_path / 'remote' / 'ckpt'} generation {generation}")
    assert re.search(f"{said} did not finish within [0-9.]+s \\(the process exited\\): its level stays 'memory'",
                     runs[0].stderr), runs[0].stderr
    level = _levels(tmp_path, "node-0")[generation]
    assert level["level"] == "memory" and level["acknowledged"] == [], level
    assert "replication cut short: the process exited" in level["reason"]
    # Node 1's own files reached node 0; what it failed to take is named on its stderr.
    assert _levels(tmp_path, "node-1")[generation]["level"] == "replicated", runs[1].stderr
    assert "this node did not take every peer's replica" in runs[1].stderr, runs[1].stderr


def test_an_interrupted_save_does_not_hold_the_exit_for_its_agreement(tmp_path: Path) -> None:
    # Rank 0 is interrupted while its agreement thread waits in the check-in for rank 1, which stays away
    # AWAY_S seconds: the process exits with the KeyboardInterrupt at once, not once rank 1 leaves.
    procs = _launch("interrupted", tmp_path, env={"TIERCKPT_MEMORY": "off"})
    start = time.monotonic()
    try:
        stdout, stderr = procs[0].communicate(timeout=AWAY_S - 10)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"rank 0 did not exit within {AWAY_S - 10} s of its interrupted save: its agreement held the exit")
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert "saving" in stdout, stderr
    assert "KeyboardInterrupt" in stderr and procs[0].returncode != 0, stderr
    assert time.monotonic() - start < AWAY_S - 10
