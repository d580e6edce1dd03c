"""Progress bars (tierckpt.progress): opt-in from Python, on a terminal or forced from the CLI, off on a
pipe and with --quiet; the bytes counted equal the bytes the call moved."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import sys
import termios
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt import progress
from tierckpt.cli import main as cli


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(1000)}


def _zeros() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(300_000), "b": torch.zeros(1000)}


def test_save_and_load_count_the_bytes_they_move(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    with progress.shown("save", enabled=False) as bar:
        monitor = tierckpt.Monitor()
        tierckpt.save(uri, _state(), monitor=monitor)
    assert bar.done == monitor.counters["bytes_written"] > 300_000 * 4
    target = _zeros()
    with progress.shown("load", enabled=False) as bar:
        monitor = tierckpt.Monitor()
        tierckpt.load(uri, target, monitor=monitor)
    assert bar.done == monitor.counters["bytes_read"] == 300_000 * 4 + 1000 * 4
    assert torch.equal(target["a"], _state()["a"])


def test_python_progress_is_opt_in(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = str(tmp_path / "ck")
    tierckpt.save(uri, _state())
    tierckpt.load(uri, _zeros())
    assert capsys.readouterr().err == ""  # default: no bar
    tierckpt.save(uri, _state(), progress=True)
    tierckpt.load(uri, _zeros(), progress=True)
    err = capsys.readouterr().err
    assert f"save {uri}: 100%" in err and f"load {uri}" in err


def test_throttled_bar_shows_the_exact_count_once_closed(capsys: pytest.CaptureFixture[str]) -> None:
    with progress.shown("moving", enabled=True, total=10_000) as bar:
        for _ in range(10_000):
            bar.add(1)
    err = capsys.readouterr().err
    assert "100%" in err and "9.77k/9.77k" in err and bar.done == 10_000  # 10_000 / 1024
    assert err.count("\r") < 50  # redrawn a few times, not once per call


def _terminal() -> tuple[int, int]:
    """A pseudo-terminal 120 columns wide (a fresh pty has none): its reading and writing ends."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    return master, slave


def _run_cli(argv: list[str], make_stderr: Callable[[], tuple[int, int]]) -> tuple[int, str]:
    """Run ``tierckpt argv`` in this process with stderr on a fresh pty or pipe; its exit code and stderr."""
    read_fd, write_fd = make_stderr()
    saved = sys.stderr
    sys.stderr = os.fdopen(write_fd, "w", buffering=1)
    try:
        code = cli.main(argv)
    finally:
        sys.stderr.close()
        sys.stderr = saved
    chunks = []
    while select.select([read_fd], [], [], 0)[0]:
        try:
            data = os.read(read_fd, 65536)
        except OSError:  # a pty whose other end is closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(read_fd)
    return code, b"".join(chunks).decode(errors="replace")


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    uri = str(tmp_path / "ck")
    tierckpt.save(uri, _state())
    return uri


def test_cli_convert_draws_a_bar_on_a_terminal(saved: str, tmp_path: Path) -> None:
    code, err = _run_cli(["convert", saved, str(tmp_path / "st"), "--to", "safetensors"], _terminal)
    assert code == 0 and f"convert {saved}" in err and "1.15M" in err  # 1_204_000 bytes in binary units


def test_cli_convert_is_silent_on_a_pipe_and_with_quiet(saved: str, tmp_path: Path) -> None:
    code, err = _run_cli(["convert", saved, str(tmp_path / "p"), "--to", "safetensors"], os.pipe)
    assert code == 0 and "convert " not in err and "B/s" not in err
    code, err = _run_cli(["convert", saved, str(tmp_path / "q"), "--to", "safetensors", "-q"], _terminal)
    assert code == 0 and "convert " not in err and "B/s" not in err


def test_cli_progress_is_forced_on_a_pipe(saved: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, err = _run_cli(["convert", saved, str(tmp_path / "f"), "--to", "safetensors", "--progress"], os.pipe)
    assert code == 0 and f"convert {saved}" in err
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    code, err = _run_cli(["verify", saved], os.pipe)
    assert code == 0 and "verify: 100%" in err


def test_remaining_counts_what_left_the_queue() -> None:
    bar = progress.ByteProgress("sync", enabled=False)
    bar.remaining("s3://b/x", 1000)
    bar.remaining("s3://b/y", 500)
    bar.remaining("s3://b/x", 400)
    assert (bar.done, bar.total) == (600, 1500)
    bar.remaining("s3://b/x", 0)
    bar.remaining("s3://b/y", 0)
    assert (bar.done, bar.total) == (1500, 1500)


def _save_and_load_with_bars(root: str) -> str | None:
    """On ranks 0 and 1: a save and a load with progress=True, stderr captured; what each rank drew."""
    import io

    import torch.distributed as dist
    from distributed import subgroup

    group = subgroup(2)
    if group is None:
        return None
    rank = dist.get_rank()
    shard = {"w": torch.full((1000,), float(rank))}
    saved, sys.stderr = sys.stderr, io.StringIO()
    try:
        tierckpt.save(root, {f"w{rank}": shard["w"]}, group=group, progress=True)
        tierckpt.load(root, {f"w{rank}": torch.zeros(1000)}, group=group, progress=True)
        return sys.stderr.getvalue()
    finally:
        sys.stderr = saved


@pytest.mark.multiproc
def test_in_a_group_only_rank_0_draws(dist_pool, tmp_path: Path) -> None:
    drawn = dist_pool.run(_save_and_load_with_bars, str(tmp_path / "ck"))
    assert f"save {tmp_path / 'ck'}: 100%" in drawn[0] and f"load {tmp_path / 'ck'}" in drawn[0]
    assert drawn[1] == "" and drawn[2:] == [None, None]
