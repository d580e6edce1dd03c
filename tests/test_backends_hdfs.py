"""The generic fsspec adapter, which HDFS goes through.

It runs the shared contract over fsspec's local file system (a sync implementation, so the
worker-thread path and the temp-object-plus-rename writes are exercised here). A real HDFS cluster
is used only when ``TIERCKPT_TEST_HDFS_URI`` names a writable scratch directory, e.g.
``hdfs://namenode:8020/tmp/tierckpt-tests``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from backend_contract import BackendContract

from tierckpt.backends import FsspecBackend, open_plain_backend
from tierckpt.errors import StorageError, UnsupportedURIError

HDFS_URI = os.environ.get("TIERCKPT_TEST_HDFS_URI")


class TestFsspecAdapter(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> FsspecBackend:
        return FsspecBackend(f"file://{tmp_path}/root")

    async def test_temp_objects_are_hidden_and_removed(self, backend: FsspecBackend, tmp_path: Path) -> None:
        writer = await backend.open_writer("w/obj")
        await writer.write(b"partial")
        assert [p.name.endswith(".partial") for p in (tmp_path / "root" / "w").iterdir()] == [True]
        assert await backend.list() == []
        await writer.close()
        assert [p.name for p in (tmp_path / "root" / "w").iterdir()] == ["obj"]


def test_fsspec_uri_without_its_implementation_is_unsupported() -> None:
    with pytest.raises(UnsupportedURIError, match="nosuchproto"):
        FsspecBackend("nosuchproto://x/y")


@pytest.mark.skipif(
    bool(os.environ.get("HADOOP_HOME")),
    reason="with a real Hadoop client the refused connection is retried for a long time",
)
def test_unreachable_hdfs_is_a_storage_error() -> None:
    with pytest.raises(StorageError, match="hdfs://127.0.0.1:1/x"):
        open_plain_backend("hdfs://127.0.0.1:1/x")


@pytest.mark.skipif(HDFS_URI is None, reason="set TIERCKPT_TEST_HDFS_URI to an hdfs:// scratch directory")
class TestHDFSBackend(BackendContract):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[FsspecBackend]:
        assert HDFS_URI is not None
        backend = open_plain_backend(f"{HDFS_URI.rstrip('/')}/{uuid.uuid4().hex}")
        assert isinstance(backend, FsspecBackend)
        yield backend
        await backend.delete_prefix("")
