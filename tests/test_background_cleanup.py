"""Superseded generations are removed in the background after a save's commit (tierckpt.saving.cleanup):
the save returns before the removal, the removal happens, it never touches the committed generation
or one that may still be committed, and an exit leaves only superseded generations that the next save
and gc remove."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tierckpt
from tierckpt.saving import cleanup
from tierckpt.native import layout
from tierckpt.backends import local
from tierckpt.formats.verify import verify

sys.path.insert(0, str(Path(__file__).parent))
from racing_child import empty_state, make_state, matches  # noqa: E402

HERE = Path(__file__).parent


def record(uri: str) -> layout.CommitRecord:
    return layout.CommitRecord.decode((Path(uri) / layout.COMMIT).read_bytes())


def generations(uri: str) -> list[str]:
    return sorted(p.name for p in Path(uri).iterdir() if p.is_dir() and layout.is_generation(p.name))


def files_of(uri: str, generation: str) -> list[Path]:
    return [p for p in (Path(uri) / generation).rglob("*") if p.is_file()]


def plant(uri: str, generation: str) -> None:
    """A generation directory with a data file, as a crashed or running save leaves it."""
    (Path(uri) / generation / "data").mkdir(parents=True)
    (Path(uri) / generation / "data" / "rank-00000.bin").write_bytes(b"partial")


def load(uri: str) -> dict[str, Any]:
    return tierckpt.load(uri, empty_state())


@pytest.fixture
def gated_removal(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Removals of generations wait until the returned event is set (the real removal follows). Sweeps an
    earlier test in this worker started are waited for first: the tests here look at ``cleanup.pending()``."""
    cleanup.wait_pending(60)
    gate = threading.Event()
    original = local.LocalBackend.delete_prefix

    async def gated(self: Any, prefix: str) -> None:
        await asyncio.to_thread(gate.wait, 60)
        await original(self, prefix)

    monkeypatch.setattr(local.LocalBackend, "delete_prefix", gated)
    yield gate
    gate.set()
    cleanup.wait_pending(60)


def test_the_save_returns_before_the_old_generation_is_removed(tmp_path: Path, gated_removal: threading.Event) -> None:
    uri = str(tmp_path / "ckpt")
    first = tierckpt.save(uri, make_state(1)).generation
    second = tierckpt.save(uri, make_state(2)).generation   # returns while the removal waits at the gate
    assert record(uri).generation == second
    assert files_of(uri, first), "the old generation is still whole when the save returns"
    assert cleanup.pending() == [uri]
    loaded = load(uri)
    assert loaded["step"] == 2 and matches(loaded), "a load meanwhile reads the committed generation"
    gated_removal.set()
    assert cleanup.wait_pending(60) == []
    assert generations(uri) == [second]
    assert matches(load(uri)) and verify(uri).ok


def test_the_sweep_removes_every_superseded_generation_and_nothing_else(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    first = tierckpt.save(uri, make_state(1)).generation    # commit sequence 1
    cleanup.wait_pending(60)
    lost = layout.new_generation(1)         # a losing save that started from no COMMIT
    same_base = layout.new_generation(2)    # started from sequence 1, like the next save: its CAS must fail
    legacy = "g-1700000000000-feedfacefeed"  # a name from before commit sequences
    running = layout.new_generation(3)      # started from sequence 2: may still be in flight
    for generation in (lost, same_base, legacy, running):
        plant(uri, generation)
    second = tierckpt.save(uri, make_state(2)).generation   # commit sequence 2
    assert cleanup.wait_pending(60) == []
    assert generations(uri) == sorted([second, running])
    assert files_of(uri, running) == [Path(uri) / running / "data" / "rank-00000.bin"], "the in-flight save's file is untouched"
    assert first not in generations(uri)
    loaded = load(uri)
    assert loaded["step"] == 2 and matches(loaded)


def test_a_generation_of_a_save_in_flight_in_another_process_is_kept(tmp_path: Path) -> None:
    """A real save paused before its commit (another process) keeps its generation through a sweep of the
    record it started from, and commits afterwards."""
    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, make_state(1))
    cleanup.wait_pending(60)
    control = tmp_path / "control"
    saver, in_flight = paused_save(uri, control)
    try:
        before = files_of(uri, in_flight)
        assert before
        committed = record(uri)
        assert cleanup.sweep_after_commit(local.LocalBackend(uri), uri, committed, None).result(60) == []
        assert sorted(files_of(uri, in_flight)) == sorted(before)
        (control / "go").touch()
        out, err = saver.communicate(timeout=120)
    finally:
        (control / "go").touch()
        saver.wait(timeout=120)
    assert json.loads(out.splitlines()[-1]) == {"outcome": "committed", "generation": in_flight}, err[-2000:]
    loaded = load(uri)
    assert loaded["step"] == 2 and matches(loaded) and verify(uri).ok


def test_keep_previous_starts_no_sweep_and_the_next_save_removes_what_it_kept(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    first = tierckpt.save(uri, make_state(1)).generation
    second = tierckpt.save(uri, make_state(2), keep_previous=True).generation
    cleanup.wait_pending(60)
    assert generations(uri) == sorted([first, second])
    third = tierckpt.save(uri, make_state(3)).generation
    cleanup.wait_pending(60)
    assert generations(uri) == [third]


def run_child(uri: str, mode: str, seconds: float) -> tuple[dict[str, str], str]:
    done = subprocess.run([sys.executable, str(HERE / "cleanup_child.py"), uri, mode, str(seconds)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_an_exit_waits_for_pending_removals(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    gens, err = run_child(uri, "slow", 1.0)   # each removal starts 1 s after the save returned
    assert generations(uri) == [gens["second"]], err[-2000:]
    assert "cut short" not in err
    loaded = load(uri)
    assert loaded["step"] == 2 and matches(loaded)


def test_an_exit_cut_short_leaves_only_superseded_generations_for_the_next_save_and_gc(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    gens, err = run_child(uri, "stuck", 0.2)  # the exit drain gives up after 0.2 s
    assert f"removing superseded generations of {uri} was cut short" in err and "tierckpt gc" in err
    committed = record(uri)
    assert committed.generation == gens["second"]
    left = [g for g in generations(uri) if g != committed.generation]
    assert left == [gens["first"]]
    assert layout.superseded_generations([f"{g}/x" for g in generations(uri)], committed) == left
    loaded = load(uri)
    assert loaded["step"] == 2 and matches(loaded), "the committed checkpoint is whole"
    assert tierckpt.gc(uri, keep_last=1, dry_run=True).leftovers == tuple(left), "gc would remove it"
    third = tierckpt.save(uri, make_state(3)).generation
    assert cleanup.wait_pending(60) == []
    assert generations(uri) == [third], "the next save removed the leftover with its predecessor"
    loaded = load(uri)
    assert loaded["step"] == 3 and matches(loaded)


def test_a_forked_child_does_not_wait_for_its_parents_removals(tmp_path: Path, gated_removal: threading.Event) -> None:
    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, make_state(1))
    tierckpt.save(uri, make_state(2))
    assert cleanup.pending() == [uri]
    pid = os.fork()
    if pid == 0:  # the child: no I/O loop of the parent's runs here
        os._exit(0 if cleanup.pending() == [] and cleanup.wait_pending(1) == [] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    gated_removal.set()
    assert cleanup.wait_pending(60) == [] and len(generations(uri)) == 1


def test_a_checkpoint_deleted_and_saved_afresh_keeps_its_new_generation(tmp_path: Path) -> None:
    """A sweep decides what is superseded by the COMMIT found when it runs: a URI deleted and saved again
    from scratch (its commit sequences start over) while the first history's sweep was still pending keeps
    the new checkpoint's generation."""
    import shutil

    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, make_state(1))
    tierckpt.save(uri, make_state(2))  # its sweep (of step 1's generation) waits out its grace
    shutil.rmtree(uri)
    tierckpt.save(uri, make_state(3))  # a new history: sequence 1 again, below the pending sweep's record
    fresh = record(uri)
    assert cleanup.wait_pending(30) == []
    assert generations(uri) == [fresh.generation]
    loaded = tierckpt.load(uri, empty_state())
    assert matches(loaded) and loaded["step"] == 3


def paused_save(uri: str, control: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """A save of make_state(2) in another process, paused (racing_child.py ``pause``); its generation."""
    control.mkdir()
    saver = subprocess.Popen([sys.executable, str(HERE / "racing_child.py"), "pause", uri, "2", str(control), *flags],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (control / "paused").exists():
        assert saver.poll() is None, saver.communicate()
        time.sleep(0.01)
    return saver, (control / "paused").read_text()


@pytest.mark.parametrize("flags", [(), ("--while-writing",)], ids=["before-its-commit", "while-writing-its-data"])
def test_a_save_whose_generation_a_winners_sweep_removed_says_another_job_committed(tmp_path: Path, flags) -> None:
    """Two jobs save from the same COMMIT; the one that commits first sweeps the other's generation (it can
    never commit over the new record) while that one is paused before its commit, or still writing its data
    file. The loser raises CheckpointBusyError naming the winner, never an error about its own files (while
    writing it said to choose a writable file system), and the winner's checkpoint stays committed."""
    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, make_state(1))
    cleanup.wait_pending(60)
    control = tmp_path / "control"
    loser, in_flight = paused_save(uri, control, *flags)
    try:
        winner = tierckpt.save(uri, make_state(3)).generation  # from the same COMMIT: it wins
        assert cleanup.wait_pending(60) == []
        assert in_flight not in generations(uri)  # swept while the loser still runs
        (control / "go").touch()
        out, err = loser.communicate(timeout=120)
    finally:
        (control / "go").touch()
        loser.wait(timeout=120)
    outcome = json.loads(out.splitlines()[-1])["outcome"]
    assert outcome.startswith("error: CheckpointBusyError: ") and "another job committed" in outcome, (outcome, err[-2000:])
    assert winner in outcome
    loaded = load(uri)
    assert loaded["step"] == 3 and matches(loaded) and verify(uri).ok
