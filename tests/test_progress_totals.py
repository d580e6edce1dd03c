"""Every progress bar has a total, and ends with done == total: a load announces the bytes this rank reads once
planned, a save its data file (through the node cache: then also the upload it waits for), ``convert`` the
sum of the calls it makes; prefetch knows its total before it starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt import progress
from tierckpt.convert import api as convert
from tierckpt.node.disk import CacheConfig

STATE_BYTES = 300_000 * 4 + 1000 * 4


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(1000)}


def _zeros() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(300_000), "b": torch.zeros(1000)}


def test_load_and_save_bars_have_totals(tmp_path: Path) -> None:
    uri = tmp_path / "ck"
    with progress.shown("save", enabled=False) as bar:
        monitor = tierckpt.Monitor()
        tierckpt.save(uri, _state(), monitor=monitor, progress=True)
    assert bar.total == bar.done == monitor.counters["bytes_written"] >= STATE_BYTES
    with progress.shown("load", enabled=False) as bar:
        tierckpt.load(uri, _zeros(), progress=True)
    assert bar.total == bar.done == STATE_BYTES  # the load bar had no total


def test_the_drawn_load_bar_shows_its_total(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = str(tmp_path / "ck")
    tierckpt.save(uri, _state())
    tierckpt.load(uri, _zeros(), progress=True)
    err = capsys.readouterr().err
    assert f"load {uri}: 100%" in err and "1.15M/1.15M" in err, err  # STATE_BYTES / 2**20


def test_a_save_through_the_node_cache_counts_its_upload(s3_bucket_uri: str, tmp_path: Path) -> None:
    """A synchronous save to S3 writes its data file into the node cache, then waits for the upload: the bar
    counts both, the upload by what is still pending when the wait starts (at least the COMMIT, uploaded after
    every file), so it ends at 100% when the checkpoint is durable."""
    config = CacheConfig(directory=str(tmp_path / "cache"), enabled=True)
    uri = f"{s3_bucket_uri}/ck"
    with progress.shown("outer", enabled=False) as bar:
        monitor = tierckpt.Monitor()
        tierckpt.save(uri, _state(), storage_options={"cache": config}, monitor=monitor)
    written = monitor.counters["bytes_written"]
    assert bar.total == bar.done and bar.total > written >= STATE_BYTES  # the data file, then its upload
    assert tierckpt.status(uri, config=config).durable


def test_a_drawn_save_names_the_node_tiers(s3_bucket_uri: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    config = CacheConfig(directory=str(tmp_path / "cache"), enabled=True)
    uri = f"{s3_bucket_uri}/ck2"
    tierckpt.save(uri, _state(), storage_options={"cache": config}, progress=True)
    assert f"save {uri} (node tiers, then upload): 100%" in capsys.readouterr().err


def test_convert_bars_add_up_the_calls_they_make(tmp_path: Path) -> None:
    src = tmp_path / "ck"
    tierckpt.save(src, _state())
    with progress.shown("convert", enabled=False) as bar:
        convert.to_safetensors(src, tmp_path / "hf")
    assert bar.total == bar.done == STATE_BYTES
    with progress.shown("convert", enabled=False) as bar:
        convert.from_safetensors(tmp_path / "hf", tmp_path / "back")
    assert bar.total == bar.done >= STATE_BYTES
    with progress.shown("convert", enabled=False) as bar:
        convert.to_dcp(tmp_path / "back", tmp_path / "dcp")
    assert bar.total == bar.done == STATE_BYTES


def test_prefetch_knows_its_total(s3_bucket_uri: str, tmp_path: Path) -> None:
    uri = f"{s3_bucket_uri}/pf"
    tierckpt.save(uri, _state(), storage_options={"cache": False})
    handle = tierckpt.prefetch(uri, progress=False, config=CacheConfig(directory=str(tmp_path / "cache"), enabled=True))
    assert handle.bytes_total >= STATE_BYTES and handle.result(60) == handle.bytes_total == handle.bytes_done
