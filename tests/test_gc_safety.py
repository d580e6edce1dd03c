"""gc never deletes a generation that may still be in flight (decided by commit sequence, not by
clocks), and deletes nothing without an explicit keep policy."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import tierckpt
from tierckpt.saving import cleanup
from tierckpt.native import layout
from tierckpt.backends import open_backend
from tierckpt.loading.api import read_checkpoint
from tierckpt.formats.verify import verify

sys.path.insert(0, str(Path(__file__).parent))
from racing_child import empty_state, make_state, matches  # noqa: E402

CHILD = str(Path(__file__).parent / "racing_child.py")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierckpt", *args], capture_output=True, text=True, timeout=120)


def load(uri: str) -> dict:
    """The checkpoint at ``uri`` loaded into a fresh state."""
    return tierckpt.load(uri, empty_state())


def wait_for(path: Path, job: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def test_gc_during_a_save_from_a_host_whose_clock_is_60s_behind(tmp_path: Path) -> None:
    root = tmp_path / "run"
    uri = str(root / "step-00000100")
    tierckpt.save(uri, make_state(1))
    previous = read_checkpoint(open_backend(uri)).meta.generation
    control = tmp_path / "control"
    control.mkdir()
    saver = subprocess.Popen([sys.executable, CHILD, "pause", uri, "2", str(control), "--skew-s", "-60"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(control / "paused", saver)                      # data written, COMMIT not yet
        in_flight = (control / "paused").read_text()
        files_before = sorted(p.relative_to(root) for p in (Path(uri) / in_flight).rglob("*"))
        assert files_before, "the paused save has written its data files"

        gc = cli("gc", str(root), "--keep-last", "1", "--json")   # a real second process, mid-save
        assert gc.returncode == 0, gc.stderr
        assert json.loads(gc.stdout)["leftovers"] == [], gc.stdout
        assert sorted(p.relative_to(root) for p in (Path(uri) / in_flight).rglob("*")) == files_before
        before = load(uri)
        assert before["step"] == 1 and matches(before), "the previous checkpoint survives gc"
        (control / "go").touch()
        out, err = saver.communicate(timeout=120)
    finally:
        (control / "go").touch()
        saver.wait(timeout=120)
    result = json.loads(out.splitlines()[-1])
    assert result == {"outcome": "committed", "generation": in_flight}, err[-2000:]
    after = load(uri)
    assert after["step"] == 2 and matches(after), "the new checkpoint loads"
    assert verify(uri).ok
    assert not (Path(uri) / previous).exists(), "the save removed the generation it replaced"


def test_gc_removes_generations_that_can_never_commit_and_keeps_those_in_flight(tmp_path: Path, no_sweep_grace: None) -> None:
    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, make_state(1))                          # commit sequence 1
    cleanup.wait_pending()                                     # its own sweep is over before the leftovers appear
    record = layout.CommitRecord.decode((Path(uri) / layout.COMMIT).read_bytes())
    assert record.seq == 1 and layout.seq_of(record.generation) == 1
    lost = layout.new_generation(1)     # started from no COMMIT, like the committed save: its CAS must fail
    running = layout.new_generation(2)  # started from the current COMMIT: may still be in flight
    legacy_clock_ahead = "g-9999999999999-feedfacefeed"  # a name from before sequences
    for gen in (lost, running, legacy_clock_ahead):
        (Path(uri) / gen / "data").mkdir(parents=True)
        (Path(uri) / gen / "data" / "rank-00000.bin").write_bytes(b"partial")
    dry = tierckpt.gc(str(tmp_path), keep_last=1, dry_run=True)
    assert sorted(dry.leftovers) == sorted([f"ckpt/{lost}", f"ckpt/{legacy_clock_ahead}"]) and dry.dry_run
    assert (Path(uri) / lost).exists()
    result = tierckpt.gc(str(tmp_path), keep_last=1)
    assert sorted(result.leftovers) == sorted([f"ckpt/{lost}", f"ckpt/{legacy_clock_ahead}"])
    assert not [p for gen in (lost, legacy_clock_ahead) for p in (Path(uri) / gen).rglob("*") if p.is_file()]
    assert (Path(uri) / running).exists() and (Path(uri) / record.generation).exists()
    assert matches(load(uri))


def test_gc_without_a_keep_policy_deletes_nothing(tmp_path: Path) -> None:
    for step in (100, 200, 300):
        tierckpt.save(str(tmp_path / f"step-{step:08d}"), make_state(step))
    bare = cli("gc", str(tmp_path))
    assert bare.returncode != 0 and "--keep-last" in bare.stderr, bare
    dry = cli("gc", str(tmp_path), "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0 and "would delete 2" in dry.stdout, dry
    for step in (100, 200, 300):
        assert load(str(tmp_path / f"step-{step:08d}"))["step"] == step
    helptext = cli("gc", "--help").stdout
    assert "--dry-run" in helptext and "--keep-last N" in helptext
    real = cli("gc", str(tmp_path), "--keep-every", "200", "--json")
    assert real.returncode == 0, real.stderr
    assert json.loads(real.stdout)["deleted"] == ["step-00000100"]
    assert load(str(tmp_path / "step-00000300"))["step"] == 300 and load(str(tmp_path / "step-00000200"))["step"] == 200
    assert not (tmp_path / "step-00000100" / layout.COMMIT).exists()
    assert torch.equal(load(str(tmp_path / "step-00000200"))["w"], make_state(200)["w"])
