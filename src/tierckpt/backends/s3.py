"""S3 through s3fs: :class:`S3Backend`, an :class:`~tierckpt.backends.fsspec_backend.FsspecBackend`
with S3's own whole-object, streamed and conditional writes.

It handles ``s3://bucket/prefix`` (and ``s3a://``) with s3fs:

* ``get_range`` is one ranged GET; a range past the end of an object raises
  :class:`~tierckpt.errors.CorruptCheckpointError` instead of returning a short read.
* ``open_writer`` streams a multipart upload (parts of ``part_size`` bytes, a few in flight);
  nothing is visible until ``close`` completes the upload, and ``abort`` aborts it so no parts
  or partial object remain. Objects of up to two parts are sent as a single PUT: a multipart upload
  costs two requests more (start, complete), which a rank's file of a few parts would feel.
* ``commit`` is a single conditional PUT, which S3 makes visible atomically: ``If-None-Match: *``
  when no object may exist yet, else ``If-Match`` with the ETag of the object it read and compared
  with ``expected``. A refused precondition (412, or 409 for a concurrent conditional write) raises
  :class:`~tierckpt.errors.CheckpointBusyError`. Ceph's radosgw 16.2 refuses ``If-Match`` with the
  quoted ETag (the form S3 returns, which AWS and moto accept) and takes it bare: a 412 is retried once
  with the bare ETag, only after a second read finds the object still the one compared. Stores without
  conditional writes answer 501 and the commit fails with a :class:`~tierckpt.errors.StorageError`
  naming the response.

Configuration. Endpoint, region and credentials come from the usual AWS environment variables and
config files (botocore's defaults) unless passed as options: ``endpoint_url``, ``key``, ``secret``,
``token``, ``region``, plus any other :class:`s3fs.S3FileSystem` keyword. The environment variable
``TIERCKPT_S3_ENDPOINT_URL``, when set, is the default endpoint (handy for MinIO or a local moto
server in tests); an explicit ``endpoint_url`` option wins over it. ``timeout_s`` (default 30)
bounds botocore's connect and read timeouts, and botocore makes a single attempt per request:
retrying is the I/O scheduler's job, so an unreachable endpoint fails fast.

Fork: an fsspec async file system is bound to its parent's I/O loop; open a new backend in a
forked child instead of reusing the parent's.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import threading
from collections.abc import Mapping
from typing import Any

from tierckpt.errors import (
    CheckpointBusyError,
    CheckpointNotFoundError,
    StorageError,
    TransientStorageError,
    UnsupportedURIError,
)
from tierckpt.backends.retry import retry_transient
from tierckpt.backends.base import UNCONDITIONAL, Backend, ObjectWriter, Unconditional
from tierckpt.backends.bounded import oversized
from tierckpt.backends.commit_check import commit_refused
from tierckpt.backends.fsspec_backend import FsspecBackend, response_error

ENDPOINT_ENV = "TIERCKPT_S3_ENDPOINT_URL"
"""Environment variable naming the default S3 endpoint URL."""


def s3_endpoint(endpoint_url: str | None) -> str | None:
    """The S3 endpoint to use: ``endpoint_url``, else ``$TIERCKPT_S3_ENDPOINT_URL``, else ``None`` (AWS).

    Checked here, because botocore's own error (``ValueError: Invalid endpoint``) names neither the
    setting it came from nor the fix.
    """
    source = "storage option endpoint_url"
    if not endpoint_url:
        endpoint_url, source = os.environ.get(ENDPOINT_ENV) or None, ENDPOINT_ENV
    if endpoint_url is not None and not endpoint_url.lower().startswith(("http://", "https://")):
        raise UnsupportedURIError(
            f"{source}={endpoint_url!r} is not an endpoint URL: it must start with http:// or https:// "
            f"(e.g. http://{endpoint_url.split('://')[-1]})"
        )
    return endpoint_url


class _MultipartWriter(ObjectWriter):
    """A streamed S3 upload: one PUT up to ``2 * part_size`` bytes, else a multipart upload with parts in flight.

    Part sizes start at ``part_size`` and double every 2,000 parts so an object of any size fits in
    S3's 10,000-part limit. A failure inside ``write`` or ``close`` leaves the writer to be aborted
    by its owner (``close`` aborts the upload itself when completing fails).

    Each byte is copied once, into the ``bytearray`` of its part (the caller may reuse its memory as soon
    as ``write`` returns, while the part is still in flight), and that ``bytearray`` is the request's body:
    botocore signs, checksums and sends a ``bytearray`` as it is, where a ``bytes`` body is wrapped in a
    file object that its checksums read back in copied blocks and aiohttp copies whole once more.
    """

    def __init__(self, backend: S3Backend, key: str) -> None:
        self._backend = backend
        self._uri = backend.uri_of(key)
        self._bucket, _, self._key = backend._path(key).partition("/")
        self._part = bytearray()
        self._held: list[bytearray] = []
        """Full parts kept back while the object may still go up as one PUT (at most two)."""
        self._upload_id: str | None = None
        self._next_part = 1
        self._parts: list[dict[str, Any]] = []
        self._in_flight: set[asyncio.Task[None]] = set()

    async def _s3(self, what: str, method: str, **kwargs: Any) -> Any:
        """One S3 request of the upload, retried on transient errors (parts and PUTs are idempotent)."""

        return await retry_transient(
            lambda: self._backend._call(
                f"{what} {self._uri}", "call_s3", method, Bucket=self._bucket, Key=self._key, **kwargs
            )
        )

    def _part_size(self) -> int:
        """The size of the part being filled: its number is the next to send plus the parts held back."""
        number = self._next_part + len(self._held)
        return self._backend.part_size * 2 ** ((number - 1) // 2000)

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open()
        view = memoryview(data).cast("B")
        while view:
            size = self._part_size()
            taken = size - len(self._part)
            self._part += view[:taken]  # grown in place: no zero fill of a preallocated part
            view = view[taken:]
            if len(self._part) == size:
                self._held.append(self._part)
                self._part = bytearray()
            if self._held and (self._upload_id is not None or not self._one_put()):
                await self._send_held()

    def _one_put(self) -> bool:
        """Whether everything written so far still goes up as one PUT (at most ``2 * part_size`` bytes)."""
        return sum(map(len, self._held)) + len(self._part) <= 2 * self._backend.part_size

    async def _send_held(self) -> None:
        held, self._held = self._held, []
        for part in held:
            await self._send_part(part)

    async def _send_part(self, chunk: bytearray) -> None:
        if self._upload_id is None:
            response = await self._s3("start multipart upload of", "create_multipart_upload")
            self._upload_id = response["UploadId"]
        while len(self._in_flight) >= self._backend.parts_in_flight:
            await self._wait_for_one()
        number = self._next_part
        self._next_part += 1
        self._in_flight.add(asyncio.ensure_future(self._upload_part(number, chunk)))

    async def _upload_part(self, number: int, chunk: bytearray) -> None:
        response = await self._s3(
            f"upload part {number} of",
            "upload_part",
            PartNumber=number,
            UploadId=self._upload_id,
            Body=chunk,
        )
        self._parts.append({"PartNumber": number, "ETag": response["ETag"]})

    async def _wait_for_one(self) -> None:
        done, _ = await asyncio.wait(self._in_flight, return_when=asyncio.FIRST_COMPLETED)
        self._in_flight -= done
        for task in done:
            task.result()

    async def close(self) -> None:
        self._check_open()
        try:
            if self._upload_id is None and self._one_put():
                # One PUT saves the two requests that start and complete an upload.
                body = bytearray().join([*self._held, self._part]) if self._held else self._part
                await self._s3("write", "put_object", Body=body)
            else:
                await self._send_held()
                if self._part:
                    await self._send_part(self._part)
                while self._in_flight:
                    await self._wait_for_one()
                parts = sorted(self._parts, key=lambda p: p["PartNumber"])
                await self._s3(
                    "complete multipart upload of",
                    "complete_multipart_upload",
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
                self._upload_id = None
        except BaseException:
            await self.abort()
            raise
        self._done = True
        self._release_buffers()

    def _release_buffers(self) -> None:
        self._part, self._held = bytearray(), []

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._release_buffers()
        for task in self._in_flight:
            task.cancel()
        await asyncio.gather(*self._in_flight, return_exceptions=True)
        self._in_flight.clear()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            await self._s3("abort multipart upload of", "abort_multipart_upload", UploadId=upload_id)


_S3_FILESYSTEMS: dict[tuple[int, str], Any] = {}
_S3_FILESYSTEMS_LOCK = threading.Lock()


def _s3_filesystem(**options: Any) -> Any:
    """The process's :class:`s3fs.S3FileSystem` for these options, created on first use.

    Its client costs 70-250 ms of CPU to set up (botocore models, endpoint resolution); every save to
    a new URI would pay that on the critical path, and under the GIL it also slows the snapshot copy.
    Keyed by process id too, since a forked child cannot use its parent's event loop.
    """
    import s3fs

    cache_key = (os.getpid(), repr(sorted(options.items())))
    with _S3_FILESYSTEMS_LOCK:
        fs = _S3_FILESYSTEMS.get(cache_key)
        if fs is None:
            fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, asynchronous=False, **options)
            fs.retries = 1  # s3fs's own retry loop; the I/O scheduler retries instead
            _S3_FILESYSTEMS[cache_key] = fs
    return fs


class S3Backend(FsspecBackend):
    """``s3://bucket/prefix`` through s3fs; see the module docstring for options and semantics."""

    def __init__(
        self,
        root_uri: str,
        *,
        endpoint_url: str | None = None,
        key: str | None = None,
        secret: str | None = None,
        token: str | None = None,
        region: str | None = None,
        timeout_s: float = 30.0,
        part_size: int = 16 * 2**20,
        parts_in_flight: int = 4,
        **storage_options: Any,
    ) -> None:
        Backend.__init__(self, root_uri)
        scheme, sep, rest = root_uri.partition("://")
        self._bucket = rest.split("/", 1)[0]
        if scheme not in ("s3", "s3a") or not sep or not self._bucket:
            raise UnsupportedURIError(
                f"S3 URI {root_uri!r} is not of the form s3://bucket[/prefix]"
            )
        if part_size < 5 * 2**20:
            raise UnsupportedURIError(
                f"part_size={part_size} for {root_uri}: S3 multipart parts must be at least 5 MiB"
            )
        self.part_size = part_size
        self._timeout_s = timeout_s
        self.parts_in_flight = max(1, parts_in_flight)
        config_kwargs = {
            "connect_timeout": timeout_s,
            "read_timeout": timeout_s,
            "retries": {"total_max_attempts": 1, "mode": "standard"},
            **storage_options.pop("config_kwargs", {}),
        }
        client_kwargs = dict(storage_options.pop("client_kwargs", {}))
        if region:
            client_kwargs.setdefault("region_name", region)
        endpoint = s3_endpoint(endpoint_url)
        self._service = f"s3://{self._bucket} at {endpoint or 'AWS'}"
        fs = _s3_filesystem(
            endpoint_url=endpoint,
            key=key,
            secret=secret,
            token=token,
            client_kwargs=client_kwargs,
            config_kwargs=config_kwargs,
            **storage_options,
        )
        self._bind(fs, rest.rstrip("/"))

    @property
    def request_timeout_s(self) -> float:
        """The ``timeout_s`` option: botocore's connect and read timeouts."""
        return self._timeout_s

    @property
    def service(self) -> str:
        """The bucket at its endpoint: one bucket name may live on several endpoints (MinIO, AWS)."""
        return self._service

    async def put(self, key: str, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if len(view) <= self.part_size:
            await self.commit(key, view)
            return
        writer = await self.open_writer(key)
        try:
            for offset in range(0, len(view), self.part_size):
                await writer.write(view[offset : offset + self.part_size])
            await writer.close()
        except BaseException:
            await writer.abort()
            raise

    async def open_writer(self, key: str) -> ObjectWriter:
        return _MultipartWriter(self, key)

    async def get(self, key: str) -> bytes:
        what = f"read {self.uri_of(key)}"
        return await self._call(what, "cat_file", self._path(key), **_one_get(type(self.fs)))

    async def get_capped(self, key: str, cap: int) -> bytes:
        """:meth:`get` in one request (not a HEAD for the size, then the GET): the response's length is known
        before its body is read, and a body over ``cap`` is left unread."""
        bucket, _, obj = self._path(key).partition("/")
        uri = self.uri_of(key)

        async def fetch() -> tuple[int, bytes | None]:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=obj)
            async with response["Body"] as stream:
                size = int(response["ContentLength"])
                return size, (await stream.read() if size <= cap else None)

        size, data = await self._on_fs_loop(f"read {uri}", fetch)
        if data is None:
            raise oversized(uri, size, cap)
        if len(data) != size:
            raise TransientStorageError(f"read {uri}: the response ended after {len(data)} of its {size} bytes")
        return data

    async def commit(
        self, key: str, data: bytes | memoryview, *, expected: bytes | None | Unconditional = UNCONDITIONAL,
        after: Mapping[str, int | None] | None = None,
    ) -> None:
        bucket, _, obj = self._path(key).partition("/")
        uri = self.uri_of(key)
        body = data if isinstance(data, bytes) else bytes(data)
        if expected is UNCONDITIONAL:
            await self._put_object(uri, bucket, obj, body)
            return
        if expected is None:
            await self._put_if(uri, expected, bucket, obj, body, IfNoneMatch="*")
            return
        current, etag = await self._get_with_etag(bucket, obj, uri)
        if current != expected or etag is None:
            raise commit_refused(uri, expected, current)
        try:
            await self._put_if(uri, expected, bucket, obj, body, IfMatch=etag)
        except CheckpointBusyError:
            if not etag.startswith('"'):
                raise
            # Ceph radosgw (16.2) compares If-Match with the bare ETag and refuses the quoted form its own
            # responses carry, which AWS and moto accept. Only while the object is still the one compared is
            # the refusal that: then the bare ETag, still a precondition the server checks, decides.
            again, etag_now = await self._get_with_etag(bucket, obj, uri)
            if again != expected or etag_now != etag:
                raise
            await self._put_if(uri, expected, bucket, obj, body, IfMatch=etag.strip('"'))

    async def _put_object(self, uri: str, bucket: str, obj: str, body: bytes, **conditions: str) -> None:
        await self._call(f"write {uri}", "call_s3", "put_object", Bucket=bucket, Key=obj, Body=body, **conditions)

    async def _put_if(self, uri: str, expected: bytes | None, bucket: str, obj: str, body: bytes,
                      **conditions: str) -> None:
        """One conditional PUT; a refused precondition (412, or 409 for a concurrent conditional write) raises
        :func:`~tierckpt.backends.commit_check.commit_refused`."""
        try:
            await self._put_object(uri, bucket, obj, body, **conditions)
        except StorageError as exc:
            code, status = response_error(exc)
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise commit_refused(uri, expected, f"a different object ({code or status})") from exc
            raise

    async def _get_with_etag(self, bucket: str, obj: str, uri: str) -> tuple[bytes | None, str | None]:
        """The object's bytes and ETag from one GET (``(None, None)``: no object)."""

        async def fetch() -> tuple[bytes, str]:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=obj)
            async with response["Body"] as stream:
                return await stream.read(), response["ETag"]

        try:
            return await self._on_fs_loop(f"read {uri}", fetch)
        except CheckpointNotFoundError:
            return None, None


@functools.cache
def _one_get(fs_type: type) -> dict[str, Any]:
    """``cat_file`` arguments for a whole object in one GET. s3fs from 2026.9 reads large objects in
    parallel parts, statting the object first, unless ``max_concurrency=1``; earlier versions (which
    do one GET already) do not take the argument."""
    accepts = "max_concurrency" in inspect.signature(fs_type._cat_file).parameters
    return {"max_concurrency": 1} if accepts else {}
