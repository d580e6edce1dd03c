"""LocalBackend: the shared contract plus local-only behaviour, and URI dispatch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from backend_contract import BackendContract

from tierckpt.node.disk.tiered import TieredBackend
from tierckpt.io.scheduled import ScheduledBackend
from tierckpt.store import open_store
from tierckpt.backends import open_plain_backend
from tierckpt.backends import (
    FsspecBackend,
    LocalBackend,
    MemoryBackend,
    S3Backend,
    open_backend,
    split_uri,
)
from tierckpt.errors import CheckpointError, UnsupportedURIError


class TestLocalBackend(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> LocalBackend:
        return LocalBackend(str(tmp_path / "root"))

    async def test_capabilities_and_paths(self, backend: LocalBackend, tmp_path: Path) -> None:
        assert backend.capabilities.local_path
        await backend.put("a/b.bin", b"data")
        path = backend.path_of("a/b.bin")
        assert path == str(tmp_path / "root" / "a" / "b.bin")
        assert Path(path).read_bytes() == b"data"

    async def test_temp_files_are_hidden_and_cleaned_up(self, backend: LocalBackend, tmp_path: Path) -> None:
        writer = await backend.open_writer("w/obj")
        await writer.write(b"partial")
        on_disk = os.listdir(tmp_path / "root" / "w")
        assert len(on_disk) == 1 and on_disk[0].startswith(".obj.") and on_disk[0].endswith(".partial")
        assert await backend.list() == []
        await writer.abort()
        assert os.listdir(tmp_path / "root" / "w") == []
        # A stray temp file left by a crash is never listed.
        (tmp_path / "root" / "w" / ".crashed.1234.partial").write_bytes(b"junk")
        await backend.put("w/real", b"ok")
        assert await backend.list() == ["w/real"]
        assert sorted(os.listdir(tmp_path / "root" / "w")) == [".crashed.1234.partial", "real"]

    async def test_file_uri(self, tmp_path: Path) -> None:
        backend = open_backend(f"file://{tmp_path}/via-uri")
        assert isinstance(backend, LocalBackend)
        await backend.put("k", b"v")
        assert (tmp_path / "via-uri" / "k").read_bytes() == b"v"

    async def test_missing_file_error_names_the_path(self, backend: LocalBackend) -> None:
        with pytest.raises(FileNotFoundError, match=str(backend.path_of("nope.bin"))):
            await backend.get("nope.bin")


    async def test_links_out_of_the_root_are_refused_and_a_linked_root_is_not(self, tmp_path: Path) -> None:
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "secret").write_bytes(b"not a checkpoint's")
        real_root = tmp_path / "real-root"
        (real_root / "gen").mkdir(parents=True)
        (real_root / "gen" / "inside").write_bytes(b"ok")
        (tmp_path / "linked-root").symlink_to(real_root)  # a root reached through a link is the user's choice
        backend = LocalBackend(str(tmp_path / "linked-root"))
        assert await backend.get("gen/inside") == b"ok"
        (real_root / "gen" / "file-link").symlink_to(outside / "secret")  # the last component a link
        (real_root / "dir-link").symlink_to(outside)  # a directory below the root a link
        (real_root / "gen" / "kept-inside").symlink_to(real_root / "gen" / "inside")
        for key in ("gen/file-link", "dir-link/secret"):
            with pytest.raises(CheckpointError, match="leads outside the checkpoint root"):
                await backend.get(key)
        assert await backend.get("gen/kept-inside") == b"ok"

# -- open_backend ----------------------------------------------------------------------------------
def test_split_uri() -> None:
    assert split_uri("s3://bucket/prefix") == ("s3", "bucket/prefix")
    assert split_uri("/plain/path") == ("", "/plain/path")
    assert split_uri("relative/path") == ("", "relative/path")
    assert split_uri("HDFS://nn:8020/x") == ("hdfs", "nn:8020/x")


def test_open_backend_picks_by_scheme(tmp_path: Path) -> None:
    assert isinstance(open_backend(str(tmp_path)), LocalBackend)
    assert isinstance(open_backend(f"file://{tmp_path}"), LocalBackend)
    assert isinstance(open_backend("memory://store/prefix"), MemoryBackend)
    s3 = open_plain_backend("s3://bucket/prefix", endpoint_url="http://127.0.0.1:1", key="k", secret="s")
    assert isinstance(s3, S3Backend) and not s3.capabilities.local_path
    options = {"endpoint_url": "http://127.0.0.1:1", "key": "k", "secret": "s"}
    cached = open_store("s3://bucket/prefix", options)
    assert isinstance(cached, TieredBackend) and isinstance(cached.remote, S3Backend)
    plain = open_store("s3://bucket/p", {**options, "cache": False})
    assert isinstance(plain, ScheduledBackend) and isinstance(plain.inner, S3Backend)
    assert isinstance(open_backend("s3://bucket/p", **options), S3Backend)  # the URI's own backend, never cached
    with pytest.raises(CheckpointError, match="open_store"):
        open_backend("s3://bucket/p", cache=True)
    assert isinstance(open_plain_backend("s3a://bucket/prefix", endpoint_url="http://127.0.0.1:1"), S3Backend)


def test_open_backend_uses_fsspec_for_other_protocols(tmp_path: Path) -> None:
    backend = open_plain_backend(f"local://{tmp_path}")  # fsspec's alias for its local file system
    assert isinstance(backend, FsspecBackend) and not isinstance(backend, S3Backend)


def test_unknown_scheme_is_rejected() -> None:
    with pytest.raises(UnsupportedURIError) as info:
        open_backend("nosuchscheme://bucket/prefix")
    message = str(info.value)
    assert "nosuchscheme://bucket/prefix" in message and "'nosuchscheme'" in message
    assert "s3" in message and "memory" in message and "\n" not in message
    assert isinstance(info.value, ValueError)


def test_read_ahead_spans_cover_strided_runs_but_not_far_gaps():
    """A column window of a row-major shard (runs 16 KiB apart) is announced as one span; runs more
    than the read-through gap apart, lone runs and out-of-order runs are not merged."""
    from tierckpt.backends.run_reads import READ_THROUGH_GAP_BYTES, read_ahead_spans

    rows = [r * 16384 + 4096 for r in range(1000)]
    assert read_ahead_spans(rows, 5461) == [(4096, 999 * 16384 + 5461)]
    far = READ_THROUGH_GAP_BYTES + 1
    assert read_ahead_spans([0, 100 + far, 200 + 2 * far], 100) == []
    assert read_ahead_spans([0, 100, 100 + 100 + far, 300 + far], 100) == [(0, 200), (200 + far, 200)]
    assert read_ahead_spans([500, 0, 100], 100) == [(0, 200)]
    assert read_ahead_spans([7], 100) == [] and read_ahead_spans([], 100) == []


@pytest.mark.fast
async def test_a_directory_prefix_goes_in_one_worker_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep deletes a whole generation per save: one thread hop removes its directory, whatever it holds;
    a prefix that names nothing, or a file, is fine."""
    import asyncio

    backend = LocalBackend(str(tmp_path))
    for key in ("g-1/data/rank-00000.bin", "g-1/data/rank-00001.bin", "g-1/meta/header.json", "g-2/x"):
        await backend.put(key, b"x")
    hops: list[object] = []
    original = asyncio.to_thread

    def to_thread(fn, *a, **k):  # this backend's hops only: a sweep an earlier test left running hops too
        if any(str(tmp_path) in str(arg) for arg in a):
            hops.append(fn)
        return original(fn, *a, **k)

    monkeypatch.setattr(asyncio, "to_thread", to_thread)
    await backend.delete_prefix("g-1/")
    assert len(hops) == 1 and not (tmp_path / "g-1").exists()
    assert await backend.list() == ["g-2/x"]
    await backend.delete_prefix("g-9/")
    await backend.delete_prefix("g-2/x/")
    assert await backend.list() == ["g-2/x"]
