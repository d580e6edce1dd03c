"""tierckpt.units.parse_bytes: the one byte-size rule of the environment, CacheConfig and the CLI."""

from __future__ import annotations

import pytest

from tierckpt.cli import main as cli
from tierckpt.node.disk.config import CacheConfig
from tierckpt.errors import CheckpointError
from tierckpt.units import parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0), ("123", 123), ("123B", 123), (" 7 b ", 7),
        ("1K", 2**10), ("512M", 512 * 2**20), ("10G", 10 * 2**30), ("2T", 2 * 2**40), ("1P", 2**50),
        ("1KiB", 2**10), ("500MiB", 500 * 2**20), ("10GiB", 10 * 2**30), ("10gib", 10 * 2**30), ("1PiB", 2**50),
        ("1KB", 10**3), ("500MB", 500 * 10**6), ("5GB", 5 * 10**9), ("5gb", 5 * 10**9), ("1TB", 10**12), ("1PB", 10**15),
        ("1.5KiB", 1536), ("1.5K", 1536), ("0.1G", 107374182), ("1.1TB", 1_100_000_000_000),  # exact, rounded down
        (4096, 4096),
    ],
)
def test_parse_bytes_accepts(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1", "10X", "1e9", "1.5.2", "10 G B", "G", "1,000", "0x10", "10Gb/s"])
def test_parse_bytes_rejects_garbage_naming_the_value(text: str) -> None:
    with pytest.raises(CheckpointError) as info:
        parse_bytes(text, "TIERCKPT_CACHE_BYTES")
    message = str(info.value)
    assert "TIERCKPT_CACHE_BYTES" in message and repr(text) in message and "512M" in message


def test_parse_bytes_limits_and_types() -> None:
    with pytest.raises(CheckpointError, match="disk_bytes must not be negative, got -1"):
        parse_bytes(-1, "disk_bytes")
    with pytest.raises(CheckpointError, match="at least 1 byte"):
        parse_bytes("0.1B", "shard size", minimum=1)
    for bad in (True, 1.5, None):
        with pytest.raises(CheckpointError, match="byte count"):
            parse_bytes(bad)  # type: ignore[arg-type]


def test_the_environment_and_cache_config_use_it(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TIERCKPT_CACHE_BYTES", "200GB")
    config = CacheConfig.from_env(memory_bytes="64MiB", block_bytes="8M")
    assert config.disk_bytes == 200 * 10**9 and config.memory_bytes == 64 * 2**20 and config.block_bytes == 8 * 2**20
    monkeypatch.setenv("TIERCKPT_CACHE_BYTES", "plenty")
    with pytest.raises(CheckpointError, match="TIERCKPT_CACHE_BYTES 'plenty'"):
        CacheConfig.from_env()


def test_the_cli_uses_it(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.build_parser().parse_args(["convert", "a", "b", "--to", "safetensors", "--max-shard-bytes", "2G"])
    assert args.max_shard_bytes == 2 * 2**30
    args = cli.build_parser().parse_args(["convert", "a", "b", "--to", "safetensors", "--max-shard-bytes", "2GB"])
    assert args.max_shard_bytes == 2 * 10**9
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["convert", "a", "b", "--to", "safetensors", "--max-shard-bytes", "0"])
    assert "at least 1 byte" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["convert", "a", "b", "--to", "safetensors", "--max-shard-bytes", "huge"])
    assert "'huge'" in capsys.readouterr().err
