"""Failures are reported for what they are, and failed saves clean up after themselves.

* An outage in the middle of a load (the pieces table, the data) is a storage error — transient,
  retried first — never ``CorruptCheckpointError`` (CLI exit 5, "corrupt").
* ENOSPC while writing the metadata or ``COMMIT`` (a real, full tmpfs) leaves no trace of the failed
  generation, and the previous checkpoint is still the committed one.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fault_proxy import FaultProxy, Rule
from test_faults import empty, make_state, opts

import tierckpt
from tierckpt.cli.main import main as cli_main
from tierckpt.errors import CorruptCheckpointError, StorageError, TransientStorageError
from tierckpt.saving import cleanup


# -- outages are not corruption ------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/meta/pieces.parquet", "/data/rank-"], ids=["pieces-table", "data"])
def test_an_outage_mid_load_is_a_transient_storage_error(proxy: FaultProxy, uri: str, path: str) -> None:  # noqa: F811
    o = opts(proxy.endpoint, timeout_s=1.0)
    tierckpt.save(uri, make_state(21), storage_options=o)
    proxy.add_rule(Rule("503", method="GET", path=path, count=None))
    target = empty()
    started = time.monotonic()
    with pytest.raises(TransientStorageError) as info:
        tierckpt.load(uri, target, storage_options=o)
    assert not isinstance(info.value, CorruptCheckpointError)
    assert time.monotonic() - started < 60
    proxy.clear()
    tierckpt.load(uri, target, storage_options=o)  # the checkpoint was never damaged
    assert torch.equal(target["w"], make_state(21)["w"])


# -- ENOSPC while committing -----------------------------------------------------------------------------
PAGE = 4096


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs (unmounted afterwards)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True, timeout=20)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=20)


def _fill_leaving(mount: Path, pages: int) -> None:
    """Write a filler file so that exactly ``pages`` pages stay free."""
    st = os.statvfs(mount)
    free = st.f_bavail * st.f_frsize
    with open(mount / "filler", "wb") as f:
        f.write(b"\0" * (free - pages * PAGE))
    st = os.statvfs(mount)
    assert st.f_bavail * st.f_frsize == pages * PAGE


def _leftovers(root: Path, keep: str) -> list[str]:
    """What is under ``root`` besides COMMIT, its lock file (kept by design) and the generation ``keep``."""
    from tierckpt.backends.files import lock_name

    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*")
        if p.name not in ("COMMIT", lock_name("COMMIT")) and not str(p.relative_to(root)).startswith(keep)
    )


@pytest.mark.parametrize("extra_pages, failing", [
    (1, ("tensors.parquet", "pieces.parquet")), (2, ("header.json",)), (3, ("COMMIT",)),
])
def test_enospc_while_committing_leaves_nothing_behind(small_tmpfs: Path, extra_pages: int, failing: tuple[str, ...]) -> None:
    """The data file fits; the ``extra_pages`` pages after it hold only some of the metadata documents
    (the two tables are written at once, so either may be the one that finds the disk full)."""
    root = small_tmpfs / "ckpt"
    previous = {"w": torch.arange(1000, dtype=torch.float32)}
    tierckpt.save(str(root), previous)
    committed = (root / "COMMIT").read_text()
    generation = next(p.name for p in root.iterdir() if p.is_dir())
    state = {"w": torch.ones(PAGE * 64 // 4)}  # 64 pages of data, no objects
    _fill_leaving(small_tmpfs, 64 + extra_pages)
    with pytest.raises(StorageError) as info:
        tierckpt.save(str(root), state)
    message = str(info.value)
    assert "No space left" in message and any(name in message for name in failing), message
    assert (root / "COMMIT").read_text() == committed
    assert _leftovers(root, generation) == [], "the failed generation was left on the full disk"
    target = {"w": torch.zeros(1000)}
    tierckpt.load(str(root), target)
    assert torch.equal(target["w"], previous["w"])
    assert cli_main(["verify", str(root)]) == 0


def test_a_failed_cleanup_leaves_the_save_its_own_error_and_says_what_stays(
        small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A save fails for its own cause (ENOSPC writing its header); removing its generation then fails too (the
    file system went read-only). The save raises its own error, naming its cause; the generation it leaves is
    logged with its cause and what removes it: the next save, once the file system is writable."""
    from tierckpt.backends.local import LocalBackend

    root = small_tmpfs / "ckpt"
    previous = {"w": torch.arange(1000, dtype=torch.float32)}
    tierckpt.save(str(root), previous)
    committed = (root / "COMMIT").read_text()
    generation = next(p.name for p in root.iterdir() if p.is_dir())
    delete_prefix = LocalBackend.delete_prefix

    async def read_only_first(self: LocalBackend, prefix: str) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True, capture_output=True, timeout=20)
        await delete_prefix(self, prefix)

    monkeypatch.setattr(LocalBackend, "delete_prefix", read_only_first)
    _fill_leaving(small_tmpfs, 64 + 2)  # the data file and the two tables fit, the header does not
    with caplog.at_level("WARNING", logger="tierckpt"), pytest.raises(StorageError) as info:
        tierckpt.save(str(root), {"w": torch.ones(PAGE * 64 // 4)})
    monkeypatch.setattr(LocalBackend, "delete_prefix", delete_prefix)
    subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=True, capture_output=True, timeout=20)
    assert "No space left" in str(info.value) and "header.json" in str(info.value), info.value
    left = _leftovers(root, generation)
    assert left, "the read-only file system removed the generation after all: nothing was tested"
    failed = left[0].split("/")[0]
    warnings = [r.getMessage() for r in caplog.records if failed in r.getMessage()]
    assert len(warnings) == 1 and "Read-only file system" in warnings[0] and "next save" in warnings[0], warnings
    assert (root / "COMMIT").read_text() == committed
    target = {"w": torch.zeros(1000)}
    tierckpt.load(str(root), target)
    assert torch.equal(target["w"], previous["w"])
    (small_tmpfs / "filler").unlink()
    tierckpt.save(str(root), previous)
    assert cleanup.wait_pending(60) == []
    assert not (root / failed).exists()  # the next save's sweep removed it
