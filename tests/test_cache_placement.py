"""The node cache's default directory and budget, chosen for cluster nodes (tierckpt.node.disk.placement),
and what ``tierckpt status`` says of them. Every location is a tmp dir; the mount table is a file here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt.cli import main as cli
from tierckpt.node.disk import CacheConfig, placement

LEAF = f"tierckpt-cache-{os.getuid()}"


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node whose home is on NFS, with $TMPDIR on tmpfs, local disk at local/, shared Lustre at scratch/."""
    for name in ("home", "tmpdir", "local", "scratch"):
        (tmp_path / name).mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text(
        f"/dev/sda1 {tmp_path} ext4 rw 0 0\n"
        f"server:/export/home {tmp_path / 'home'} nfs4 rw 0 0\n"
        f"tmpfs {tmp_path / 'tmpdir'} tmpfs rw 0 0\n"
        f"/dev/nvme0n1 {tmp_path / 'local'} xfs rw 0 0\n"
        f"mds@tcp:/fs {tmp_path / 'scratch'} lustre rw 0 0\n"
    )
    monkeypatch.setattr(placement, "MOUNTS", str(mounts))
    monkeypatch.setattr(placement, "SCRATCH_DIRS", (str(tmp_path / "scratch"), str(tmp_path / "local")))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))
    for name in ("XDG_CACHE_HOME", "TIERCKPT_CACHE_DIR", "TIERCKPT_CACHE_BYTES"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_an_nfs_home_sends_the_cache_to_node_local_disk(node: Path) -> None:
    config = CacheConfig.from_env()
    # $TMPDIR is tmpfs (memory), scratch/ is Lustre (network): local/ is the first node-local disk
    assert config.directory == str(node / "local" / LEAF)
    assert config.directory_reason == f"node-local scratch {node / 'local'}, xfs; {node / 'home' / '.cache'} is on a network file system"


def test_tmpdir_on_a_local_disk_comes_first(node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (node / "job").mkdir()
    monkeypatch.setenv("TMPDIR", str(node / "job"))  # on / (ext4)
    config = CacheConfig.from_env()
    assert config.directory == str(node / "job" / LEAF) and config.directory_reason.startswith("node-local scratch $TMPDIR, ext4")


def test_a_home_on_a_local_disk_keeps_the_user_cache_directory(node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (node / "ws").mkdir()
    monkeypatch.setenv("HOME", str(node / "ws"))  # on / (ext4): a workstation
    config = CacheConfig.from_env()
    assert config.directory == str(node / "ws" / ".cache" / "tierckpt")
    assert config.directory_reason == "the user cache directory, on a disk of this node: ext4"


def test_without_node_local_scratch_the_home_is_used_all_the_same(node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "SCRATCH_DIRS", (str(node / "scratch"), str(node / "absent")))
    config = CacheConfig.from_env()
    assert config.directory == str(node / "home" / ".cache" / "tierckpt")
    assert config.directory_reason == "the user cache directory, nfs4; no node-local scratch found"


def test_the_environment_wins_and_says_so(node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(node / "scratch" / "mine"))
    monkeypatch.setenv("TIERCKPT_CACHE_BYTES", "3G")
    config = CacheConfig.from_env()
    assert (config.directory, config.directory_reason) == (str(node / "scratch" / "mine"), "TIERCKPT_CACHE_DIR")
    assert (config.disk_bytes, config.disk_bytes_reason) == (3 * 2**30, "TIERCKPT_CACHE_BYTES")
    given = CacheConfig.from_env(directory=str(node / "x"), disk_bytes="1G")
    assert (given.directory_reason, given.disk_bytes_reason) == ("CacheConfig.directory", "CacheConfig.disk_bytes")


def test_the_default_budget_is_capped_by_the_disk_size(node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = CacheConfig(directory=str(node / "c"))
    size = placement.size_bytes(str(node))
    assert size is not None and 0 < real.disk_bytes <= min(placement.DEFAULT_DISK_BYTES, size // 2)
    monkeypatch.setattr(placement, "size_bytes", lambda directory: 10 * 2**30)  # a small scratch disk
    small = CacheConfig(directory=str(node / "c"))
    assert (small.disk_bytes, small.disk_bytes_reason) == (5 * 2**30, "half of its 10.0 GiB file system")
    monkeypatch.setattr(placement, "size_bytes", lambda directory: 2**40)
    big = CacheConfig(directory=str(node / "c"))
    assert (big.disk_bytes, big.disk_bytes_reason) == (100 * 2**30, "the default cap (100 GiB)")


def test_status_says_where_the_cache_is_and_why(node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = str(node / "ckpt")
    tierckpt.save(uri, {"w": torch.arange(4.0)})
    assert cli.main(["status", uri]) == 0
    out = capsys.readouterr().out
    assert f"node cache {node / 'local' / LEAF} (node-local scratch {node / 'local'}, xfs;" in out and "; budget " in out
    assert cli.main(["status", uri, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["node_cache"]
    assert doc["directory"] == str(node / "local" / LEAF) and doc["disk_bytes"] > 0
    assert doc["directory_reason"].startswith("node-local scratch") and doc["disk_bytes_reason"]
