"""S3Backend against local S3 servers (moto, and radosgw where Ceph is installed): the shared contract plus
S3-only behaviour and errors."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest
from backend_contract import LARGE_CHUNK, BackendContract

from tierckpt.backends import S3Backend, open_plain_backend
from tierckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    OversizedFileError,
    StoragePermissionError,
    TransientStorageError,
)
from tierckpt.io import get_scheduler


@pytest.mark.s3_servers
class TestS3Backend(BackendContract):
    @pytest.fixture
    def backend(self, s3_bucket_uri: str) -> S3Backend:
        backend = open_plain_backend(s3_bucket_uri)
        assert isinstance(backend, S3Backend)
        return backend

    def _uploads(self, backend: S3Backend) -> list[dict]:
        bucket = backend.root.split("/")[0]
        return backend.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])

    async def test_large_writer_uses_multipart_and_abort_removes_it(self, backend: S3Backend) -> None:
        writer = await backend.open_writer("big/aborted")
        for _ in range(7):  # 35 MiB: past two 16 MiB parts, so a multipart upload is under way
            await writer.write(b"\0" * LARGE_CHUNK)
        assert len(self._uploads(backend)) == 1
        await writer.abort()
        assert self._uploads(backend) == []
        assert not await backend.exists("big/aborted")
        assert await backend.list() == []

    @pytest.mark.parametrize(("parts", "tail", "suffix"), [(1, b"tail", None), (2, b"", None), (3, b"tail", "-4")])
    async def test_put_is_one_request_up_to_two_parts_then_multipart(
        self, backend: S3Backend, parts: int, tail: bytes, suffix: str | None,
    ) -> None:
        data = bytes(range(256)) * (parts * backend.part_size // 256) + tail
        await backend.put("big/put", data)
        assert await backend.get("big/put") == data
        bucket, _, key = backend._path("big/put").partition("/")
        etag = backend.fs.call_s3("head_object", Bucket=bucket, Key=key)["ETag"].strip('"')
        if suffix is None:
            assert "-" not in etag  # a single PUT: no part count in the ETag
        else:
            assert etag.endswith(suffix)  # a multipart ETag: three full parts and the tail
        assert self._uploads(backend) == []

    @pytest.mark.parametrize("parts", [1, 3])
    async def test_writer_keeps_its_own_copy_of_every_write(self, backend: S3Backend, parts: int) -> None:
        """The caller may refill its buffer as soon as ``write`` returns, while the part holding the bytes is
        still in flight or held back for the single PUT: the object is what was written, not what the
        buffer held later."""
        buffer = bytearray(LARGE_CHUNK)
        expected = bytearray()
        writer = await backend.open_writer("big/reused")
        for i in range(parts * backend.part_size // LARGE_CHUNK + 1):
            buffer[:] = bytes([i % 251]) * LARGE_CHUNK
            await writer.write(memoryview(buffer)[: LARGE_CHUNK - i])  # sizes that do not divide a part
            expected += buffer[: LARGE_CHUNK - i]
        buffer[:] = b"\xff" * LARGE_CHUNK
        await writer.close()
        assert await backend.get("big/reused") == expected
        assert self._uploads(backend) == []

    async def test_get_capped_is_one_request_and_leaves_an_oversized_body_unread(self, backend: S3Backend) -> None:
        await backend.put("small", b"0123456789")
        await backend.put("large", b"x" * (1 << 20))
        sent: list[str] = []
        backend.fs.s3.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.method))
        assert await backend.get_capped("small", 10) == b"0123456789"
        assert sent == ["GET"]  # no HEAD for the size first
        with pytest.raises(OversizedFileError, match="large holds 1048576 bytes, more than such a file can [(]4096[)]"):
            await backend.get_capped("large", 4096)
        with pytest.raises(CheckpointNotFoundError):
            await backend.get_capped("missing", 4096)
        assert sent == ["GET", "GET", "GET"]

    def test_works_from_the_scheduler_thread(self, backend: S3Backend) -> None:
        scheduler = get_scheduler()
        scheduler.run(backend.put("k", b"from another loop"))
        assert scheduler.run(backend.get("k")) == b"from another loop"

    async def test_missing_bucket_names_the_bucket(self, s3_server: str) -> None:
        backend = open_plain_backend("s3://no-such-bucket-tierckpt/prefix")
        for op in (backend.get("k"), backend.put("k", b"x"), backend.list()):
            with pytest.raises(CheckpointNotFoundError, match="bucket 'no-such-bucket-tierckpt' does not exist"):
                await op


def test_unreachable_endpoint_fails_fast_with_one_line(refused_endpoint: str) -> None:
    endpoint = refused_endpoint  # nothing listens there
    backend = open_plain_backend(
        "s3://bucket/prefix", endpoint_url=endpoint, key="k", secret="s", region="us-east-1", timeout_s=2
    )
    scheduler = get_scheduler()
    before = scheduler.metrics.snapshot().get("get")
    started = time.monotonic()
    with pytest.raises(TransientStorageError) as info:
        scheduler.run(scheduler.slotted(backend, backend.root_uri, "get", backend.get, "some/key", retries=2), timeout_s=10)
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert "\n" not in message and "s3://bucket/prefix/some/key" in message and "127.0.0.1" in message
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, OSError)
    after = scheduler.metrics.snapshot()["get"]
    assert after.retries - (before.retries if before else 0) == 1
    assert after.errors - (before.errors if before else 0) == 1


@pytest.fixture
def moto_auth_enforced(s3_server: str) -> Iterator[str]:
    """Make the moto server check credentials (it accepts any by default), then restore it."""

    def set_no_auth_count(value: str) -> None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        request = urllib.request.Request(
            f"{s3_server}/moto-api/reset-auth", data=value.encode(), headers={"Content-Type": "text/plain"}
        )
        opener.open(request, timeout=10)

    set_no_auth_count("0")
    try:
        yield s3_server
    finally:
        set_no_auth_count("inf")


async def test_bad_credentials_are_a_permission_error(moto_auth_enforced: str) -> None:
    backend = open_plain_backend("s3://any-bucket/prefix", key="AKIAINVALIDINVALID00", secret="wrong")
    with pytest.raises(StoragePermissionError) as info:
        await backend.get("k")
    assert isinstance(info.value, PermissionError)
    assert "s3://any-bucket/prefix/k" in str(info.value) and "\n" not in str(info.value)
