"""``tierckpt stats`` and ``tierckpt ls`` on real saves, and the command table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt.cli import main as cli
from tierckpt.native import layout
from tierckpt.loading.api import Checkpoint
from tierckpt.native.metadata import CheckpointMeta


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), {"w": torch.randn(256, 64), "b": torch.zeros(64, dtype=torch.bfloat16), "step": 3})
    return root


def _json(argv: list[str], capsys) -> tuple[int, dict]:
    code = cli.main(argv)
    return code, json.loads(capsys.readouterr().out)


# -- stats -----------------------------------------------------------------------------------------------
def test_stats_json_of_a_real_save(saved: Path, capsys) -> None:
    code, doc = _json(["stats", str(saved), "--json"], capsys)
    assert code == cli.EXIT_OK
    assert doc["world_size"] == 1
    (rank,) = doc["ranks"]
    assert rank["rank"] == 0 and {"plan", "stage"} <= set(rank["phases_s"])
    data_file = next((saved).glob("g-*/data/rank-00000.bin"))
    assert rank["counters"]["bytes_written"] == data_file.stat().st_size
    assert rank["write_s"] > 0 and rank["write_bytes_per_s"] == pytest.approx(rank["counters"]["bytes_written"] / rank["write_s"])
    assert set(doc["stragglers"]) == set(rank["phases_s"])
    assert all(s["slowest_rank"] == 0 and s["skew"] == pytest.approx(1.0) for s in doc["stragglers"].values())
    totals = doc["totals"]
    assert totals["tensor_bytes"] == 256 * 64 * 4 + 64 * 2
    assert totals["counters"]["bytes_written"] == rank["counters"]["bytes_written"]
    assert totals["write_bytes_per_s"] > 0


def test_stats_text(saved: Path, capsys) -> None:
    assert cli.main(["stats", str(saved)]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "stragglers" in out and "bytes_written" in out and "MiB/s" in out


def test_stats_stragglers_over_several_ranks() -> None:
    """Rank 1 is slow in ``stage``: it is named, and the group's rate divides by its seconds."""
    timings = {
        "rank0.plan_s": 0.1, "rank0.stage_s": 1.0, "rank0.bytes_written": 1000.0,
        "rank1.plan_s": 0.1, "rank1.stage_s": 3.0, "rank1.bytes_written": 3000.0,
    }
    meta = CheckpointMeta(generation="g-1-a", world_size=2, created_unix=0.0, timings=timings, tensor_bytes=4000)
    doc = cli.save_stats("mem", Checkpoint(meta=meta, tensors={}))
    assert doc["stragglers"]["stage"]["slowest_rank"] == 1
    assert doc["stragglers"]["stage"]["skew"] == pytest.approx(1.5)
    assert doc["totals"]["counters"] == {"bytes_written": 4000}
    assert doc["totals"]["write_s"] == 3.0 and doc["totals"]["write_bytes_per_s"] == pytest.approx(4000 / 3.0)
    assert [r["write_bytes_per_s"] for r in doc["ranks"]] == [1000.0, 1000.0]
    assert "slowest" in cli.render_stats(doc)


def test_stats_errors(saved: Path, tmp_path: Path) -> None:
    assert cli.main(["stats", str(tmp_path / "none")]) == cli.EXIT_NOT_FOUND
    (saved / layout.COMMIT).unlink()
    assert cli.main(["stats", str(saved)]) == cli.EXIT_INCOMPLETE


# -- ls --------------------------------------------------------------------------------------------------
def test_ls_single_checkpoint(saved: Path, capsys) -> None:
    code, doc = _json(["ls", str(saved), "--json"], capsys)
    assert code == cli.EXIT_OK
    (entry,) = doc["checkpoints"]
    assert entry["path"] == "." and entry["step"] is None and entry["status"] == "committed" and not entry["latest"]
    assert entry["world_size"] == 1 and entry["tensor_bytes"] == 256 * 64 * 4 + 64 * 2
    assert entry["generation"] == json.loads((saved / layout.COMMIT).read_text())["generation"]
    assert entry["uncommitted_generations"] == 0


@pytest.fixture
def manager_root(tmp_path: Path) -> Path:
    """A CheckpointManager root with steps 10, 20, 30 and an interrupted save of step 40."""
    root = tmp_path / "run"
    manager = tierckpt.CheckpointManager(str(root), save_every=10)
    for step in (10, 20, 30, 40):
        manager.save(step, {"w": torch.full((4, step), float(step)), "step": step})
    (root / "step-00000040" / layout.COMMIT).unlink()
    (root / "LATEST").write_text(json.dumps({"step": 30}))
    return root


def test_ls_manager_root(manager_root: Path, capsys) -> None:
    code, doc = _json(["ls", str(manager_root), "--json"], capsys)
    assert code == cli.EXIT_OK
    rows = [(e["step"], e["status"], e["latest"], e["path"]) for e in doc["checkpoints"]]
    assert rows == [
        (10, "committed", False, "step-00000010"),
        (20, "committed", False, "step-00000020"),
        (30, "committed", True, "step-00000030"),
        (40, "incomplete", False, "step-00000040"),
    ]
    by_step = {e["step"]: e for e in doc["checkpoints"]}
    assert by_step[20]["tensor_bytes"] == 4 * 20 * 4 and by_step[20]["world_size"] == 1
    assert by_step[40]["generation"].startswith("g-") and by_step[40]["created"] is not None
    assert by_step[40]["tensor_bytes"] is None


def test_ls_text_marks_latest(manager_root: Path, capsys) -> None:
    assert cli.main(["ls", str(manager_root)]) == cli.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    latest = [line for line in lines if " * " in line]
    assert len(latest) == 1 and "step-00000030" in latest[0]
    assert any("incomplete" in line and "step-00000040" in line for line in lines)


def test_ls_any_directory_of_checkpoints(saved: Path, tmp_path: Path, capsys) -> None:
    shutil.copytree(saved, tmp_path / "more" / "b")
    tierckpt.save(str(tmp_path / "more" / "a"), {"x": torch.ones(3)})
    (tmp_path / "more" / "notes.txt").write_text("not a checkpoint")
    code, doc = _json(["ls", str(tmp_path / "more"), "--json"], capsys)
    assert code == cli.EXIT_OK
    assert [(e["path"], e["status"]) for e in doc["checkpoints"]] == [("a", "committed"), ("b", "committed")]


def test_ls_reports_a_corrupt_checkpoint_and_goes_on(manager_root: Path, capsys) -> None:
    header = next((manager_root / "step-00000020").glob("g-*/meta/header.json"))
    header.write_text("{")
    code, doc = _json(["ls", str(manager_root), "--json"], capsys)
    assert code == cli.EXIT_OK
    bad = next(e for e in doc["checkpoints"] if e["step"] == 20)
    assert bad["status"] == "corrupt" and "header.json" in bad["error"]


def test_ls_nothing(tmp_path: Path, capsys) -> None:
    assert cli.main(["ls", str(tmp_path)]) == cli.EXIT_NOT_FOUND
    assert "no checkpoints under" in capsys.readouterr().err


# -- the command table ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["inspect", "verify", "stats", "ls", "convert"])
def test_read_commands_documented(command: str, capsys) -> None:
    assert cli.main([command, "--help"]) == cli.EXIT_OK
    assert "--json" in capsys.readouterr().out


def test_convert_help_says_what_streams(capsys) -> None:
    cli.main(["convert", "--help"])
    out = capsys.readouterr().out
    assert "streams" in out and "whole model in memory" in out and "trust" in out


# -- sync with the node cache off ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["sync"], ["sync", "s3://bucket/run"], ["sync", "--drop", "s3://bucket/run"]])
def test_sync_with_the_cache_off_says_so_and_opens_no_cache(argv: list[str], tmp_path: Path, monkeypatch, capsys) -> None:
    """``TIERCKPT_CACHE=off``: ``sync`` neither opens nor creates the node cache (it used to write its
    catalogue there and report "synced 0 store(s)"); it exits 1 naming the setting and how to sync."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TIERCKPT_CACHE", "off")
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(cache))
    monkeypatch.setenv("TIERCKPT_MEMORY", "off")
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(tmp_path / "memory"))
    assert cli.main(argv) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "the node cache is off (TIERCKPT_CACHE=off)" in err and "TIERCKPT_CACHE=on tierckpt sync" in err, err
    assert not cache.exists()


def test_sync_with_the_cache_off_writes_the_memory_tier_down_without_it(tmp_path: Path, monkeypatch, capsys) -> None:
    """``TIERCKPT_CACHE=off`` and a memory-only checkpoint in this node's memory tier: ``sync`` writes it down
    where its URI points without opening (or creating) the node cache, and it then loads from there alone."""
    from tierckpt.node.memory import MemoryConfig

    cache, memdir, uri = tmp_path / "cache", tmp_path / "memory", str(tmp_path / "ckpt")
    memory = MemoryConfig(directory=str(memdir), budget_bytes=1 << 26, exit_wait_s=0)
    want = {"w": torch.arange(4096, dtype=torch.float32), "step": 9}
    tierckpt.save(uri, want, storage_options={"memory": memory}, persist=False)
    assert not (tmp_path / "ckpt" / layout.COMMIT).exists()  # memory only: nothing where the URI points yet
    for name, value in (("TIERCKPT_CACHE", "off"), ("TIERCKPT_CACHE_DIR", str(cache)), ("TIERCKPT_MEMORY", "off"),
                        ("TIERCKPT_MEMORY_DIR", str(memdir))):
        monkeypatch.setenv(name, value)
    assert cli.main(["sync", uri, "--timeout", "60"]) == cli.EXIT_OK, capsys.readouterr().err
    assert f"synced 1 store(s)\n  {uri}" in capsys.readouterr().out
    assert not cache.exists()
    got = tierckpt.load(uri, {"w": torch.zeros(4096), "step": 0}, storage_options={"memory": False, "cache": False})
    assert torch.equal(got["w"], want["w"]) and got["step"] == 9


# -- status and wait with the node cache off ---------------------------------------------------------------
def test_status_and_wait_with_the_node_cache_off_open_no_cache(saved: Path, tmp_path: Path, capsys,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``TIERCKPT_CACHE=off``: ``status`` and ``wait`` never open (nor create) the node cache. ``status``
    of a local path reports its COMMIT, committed where it is (no node cache is ever consulted for a local
    path); ``wait`` refuses to report "durable" for what it cannot see, as ``sync`` does."""
    cache_dir = tmp_path / "node-cache"
    monkeypatch.setenv("TIERCKPT_CACHE", "off")
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(tmp_path / "shm"))
    monkeypatch.delenv("TIERCKPT_MEMORY", raising=False)
    generation = json.loads((saved / "COMMIT").read_text())["generation"]
    code, doc = _json(["status", str(saved), "--json"], capsys)
    assert code == cli.EXIT_OK
    assert (doc["generation"], doc["remote_generation"], doc["pending_keys"]) == (generation, generation, [])
    assert doc["node_cache"]["enabled"] is False and doc["node_cache"]["used"] is False and doc["local_path"]
    assert cli.main(["status", str(saved)]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert f"local path; committed: {generation}" in out and "never through the node cache" in out
    assert cli.main(["wait", str(saved)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "the node cache is off (TIERCKPT_CACHE=off)" in err and "nothing here to wait for" in err, err
    assert not cache_dir.exists()
