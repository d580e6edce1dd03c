"""Backends over fsspec file systems: a generic adapter, and S3 through s3fs.

:class:`FsspecBackend` wraps any fsspec file system (HDFS through pyarrow, GCS, Azure, ...).
Async implementations (``fs.async_impl``) run their coroutines on fsspec's own I/O loop thread and
are awaited from the caller's loop without tying up a thread; sync implementations run in worker
threads (``asyncio.to_thread``). Either way the backend can be used from any event loop, including
one running on a background thread. Whole-object writes go through a hidden
``.<name>.<uuid>.partial`` object that is renamed into place, which is atomic on HDFS and POSIX.

:class:`S3Backend` handles ``s3://bucket/prefix`` (and ``s3a://``) with s3fs:

* ``get_range`` is one ranged GET; a range past the end of an object raises
  :class:`~tierckpt.errors.CorruptCheckpointError` instead of returning a short read.
* ``open_writer`` streams a multipart upload (parts of ``part_size`` bytes, a few in flight);
  nothing is visible until ``close`` completes the upload, and ``abort`` aborts it so no parts
  or partial object remain. Objects of up to two parts are sent as a single PUT: a multipart upload
  costs two requests more (start, complete), which a rank's file of a few parts would feel.
* ``commit`` is a single conditional PUT, which S3 makes visible atomically: ``If-None-Match: *``
  when no object may exist yet, else ``If-Match`` with the ETag of the object it read and compared
  with ``expected``. A refused precondition (412, or 409 for a concurrent conditional write) raises
  :class:`~tierckpt.errors.CheckpointBusyError`. Stores without conditional writes answer 501 and
  the commit fails with a :class:`~tierckpt.errors.StorageError` naming the response.

The generic adapter has no conditional write: its ``commit`` checks, then writes, so two writers
racing on such a file system may both succeed (a documented limitation).

Configuration. Endpoint, region and credentials come from the usual AWS environment variables and
config files (botocore's defaults) unless passed as options: ``endpoint_url``, ``key``, ``secret``,
``token``, ``region``, plus any other :class:`s3fs.S3FileSystem` keyword. The environment variable
``TIERCKPT_S3_ENDPOINT_URL``, when set, is the default endpoint (handy for MinIO or a local moto
server in tests); an explicit ``endpoint_url`` option wins over it. ``timeout_s`` (default 30)
bounds botocore's connect and read timeouts, and botocore makes a single attempt per request:
retrying is the I/O scheduler's job, so an unreachable endpoint fails fast.

Errors. Provider exceptions are translated here, chained with ``from``, into
:class:`~tierckpt.errors.CheckpointNotFoundError` (missing key or bucket),
:class:`~tierckpt.errors.StoragePermissionError` (denied, bad or missing credentials),
:class:`~tierckpt.errors.TransientStorageError` (throttling, 5xx, timeouts, connection failures)
or :class:`~tierckpt.errors.StorageError`; each message is one line naming the URI and the cause.

Fork: an fsspec async file system is bound to its parent's I/O loop; open a new backend in a
forked child instead of reusing the parent's.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import fsspec
from fsspec.exceptions import FSTimeoutError

from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
    UnsupportedURIError,
)
from .base import (
    UNCONDITIONAL, Backend, Capabilities, ObjectWriter, Unconditional, check_expected, commit_refused, validate_key,
)
from .local import check_prefix, check_range, is_temp_name, range_past_end, temp_name
from ..retry import retry_transient

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

_T = TypeVar("_T")

# -- error translation ----------------------------------------------------------------------------
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "NoSuchUpload", "404"})
_PERMISSION_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
        "403",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "500",
        "502",
        "503",
        "504",
    }
)
_TRANSIENT_STATUS = frozenset({500, 502, 503, 504})


def _provider_types() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(transient, missing-credentials, other provider) exception types of the installed clients."""
    transient: list[type] = [ConnectionError, TimeoutError, FSTimeoutError]
    credentials: list[type] = []
    other: list[type] = []
    try:
        import botocore.exceptions as bx

        transient += [bx.ConnectionError, bx.HTTPClientError]
        credentials += [bx.NoCredentialsError, bx.PartialCredentialsError]
        other.append(bx.BotoCoreError)
    except ImportError:
        pass
    try:
        import aiohttp

        transient += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
        other.append(aiohttp.ClientError)
    except ImportError:
        pass
    return tuple(transient), tuple(credentials), tuple(other)


_TRANSIENT_TYPES, _CREDENTIAL_TYPES, _PROVIDER_TYPES = _provider_types()


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it was raised from or while handling."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _response_error(exc: BaseException) -> tuple[str | None, int | None]:
    """The (error code, HTTP status) of the first botocore ``ClientError`` in the chain."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and "Error" in response:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return response["Error"].get("Code"), status
    return None, None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "no details"
    return f"{type(exc).__name__}: {text[:300]}"


def translate_error(
    exc: Exception, what: str, bucket: str | None = None
) -> CheckpointError | None:
    """Map a provider exception raised while doing ``what`` to a tierckpt error (None: not ours)."""
    if isinstance(exc, CheckpointError):
        return None
    cause = _one_line(exc)
    code, status = _response_error(exc)
    if code == "NoSuchBucket":
        return CheckpointNotFoundError(f"{what}: bucket {bucket!r} does not exist ({cause})")
    if code in _NOT_FOUND_CODES or status == 404:
        return CheckpointNotFoundError(f"{what}: no such object ({cause})")
    if code in _PERMISSION_CODES or status == 403:
        return StoragePermissionError(f"{what}: access denied, check the credentials ({cause})")
    if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS:
        return TransientStorageError(f"{what}: transient failure ({cause})")
    if any(isinstance(e, _TRANSIENT_TYPES) for e in _chain(exc)):
        return TransientStorageError(f"{what}: connection failed or timed out ({cause})")
    if isinstance(exc, _CREDENTIAL_TYPES):
        return StoragePermissionError(
            f"{what}: no usable credentials ({cause}); set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY or pass key=/secret= options"
        )
    if isinstance(exc, FileNotFoundError):
        return CheckpointNotFoundError(f"{what}: no such object ({cause})")
    if isinstance(exc, PermissionError):
        return StoragePermissionError(f"{what}: permission denied ({cause})")
    if isinstance(exc, (OSError, *_PROVIDER_TYPES)):
        return StorageError(f"{what}: {cause}")
    return None


# -- the generic adapter ---------------------------------------------------------------------------
class _RenameWriter(ObjectWriter):
    """Streams into a hidden temp object through a sync fsspec file; ``close`` renames it."""

    def __init__(self, backend: FsspecBackend, key: str, tmp: str, file: Any) -> None:
        self._backend = backend
        self._key = key
        self._uri = backend.uri_of(key)
        self._tmp = tmp
        self._file = file

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open()
        what = f"write {self._uri}"
        await self._backend._in_thread(what, self._file.write, data)

    async def close(self) -> None:
        self._check_open()
        self._done = True
        what = f"write {self._uri}"
        try:
            await self._backend._in_thread(what, self._file.close)
            await self._backend._call(what, "mv", self._tmp, self._backend._path(self._key))
        except BaseException:
            await self._backend._remove_quietly(self._tmp)
            raise

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            await self._backend._in_thread(f"abort {self._tmp}", self._file.close)
        finally:
            await self._backend._remove_quietly(self._tmp)


class FsspecBackend(Backend):
    """Any fsspec file system, e.g. ``hdfs://namenode:8020/ckpt`` (options go to fsspec)."""

    capabilities = Capabilities()
    _bucket: str | None = None

    def __init__(self, root_uri: str, **storage_options: Any) -> None:
        super().__init__(root_uri)
        storage_options.setdefault("skip_instance_cache", True)
        try:
            fs, path = fsspec.core.url_to_fs(root_uri, **storage_options)
        except (ImportError, ValueError) as exc:
            raise UnsupportedURIError(
                f"cannot open {root_uri!r} with fsspec ({_one_line(exc)}); install the "
                "file system's fsspec implementation or fix the URI"
            ) from exc
        except OSError as exc:  # e.g. HDFS: no libhdfs/JVM, or the namenode refused
            raise translate_error(exc, f"connect to {root_uri}") or exc from exc
        self._bind(fs, path)

    def _bind(self, fs: fsspec.AbstractFileSystem, root_path: str) -> None:
        self.fs = fs
        self.root = root_path.rstrip("/")
        self._async = bool(getattr(fs, "async_impl", False))

    def _path(self, key: str) -> str:
        return f"{self.root}/{validate_key(key)}"

    def uri_of(self, key: str) -> str:
        """The full URI of ``key``, for messages."""
        return f"{self.root_uri.rstrip('/')}/{key}"

    # -- running file system calls ----------------------------------------------------------------
    def _translated(self, exc: Exception, what: str) -> CheckpointError | None:
        return translate_error(exc, what, self._bucket)

    async def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``fs.<method>`` (its coroutine ``_<method>`` when async) and translate errors."""
        if self._async and hasattr(type(self.fs), f"_{method}"):
            return await self._on_fs_loop(what, lambda: getattr(self.fs, f"_{method}")(*args, **kwargs))
        return await self._in_thread(what, getattr(self.fs, method), *args, **kwargs)

    async def _on_fs_loop(self, what: str, make: Callable[[], Any]) -> Any:
        """Run the coroutine ``make()`` on the async file system's own loop, translating errors."""
        try:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make(), self.fs.loop))
        except Exception as exc:
            err = self._translated(exc, what)
            if err is None:
                raise
            raise err from exc

    async def _in_thread(self, what: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run a blocking call in a worker thread, translating errors."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except Exception as exc:
            err = self._translated(exc, what)
            if err is None:
                raise
            raise err from exc

    async def _remove_quietly(self, path: str) -> None:
        try:
            await self._call(f"remove {path}", "rm_file", path)
        except CheckpointNotFoundError:
            pass

    # -- Backend ----------------------------------------------------------------------------------
    async def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        parent, name = posixpath.split(path)
        tmp = f"{parent}/{temp_name(name)}"
        what = f"write {self.uri_of(key)}"
        await self._call(what, "makedirs", parent, exist_ok=True)
        try:
            await self._call(what, "pipe_file", tmp, data)
            await self._call(what, "mv", tmp, path)
        except BaseException:
            await self._remove_quietly(tmp)
            raise

    async def open_writer(self, key: str) -> ObjectWriter:
        path = self._path(key)
        parent, name = posixpath.split(path)
        tmp = f"{parent}/{temp_name(name)}"
        what = f"open {self.uri_of(key)} for writing"
        await self._call(what, "makedirs", parent, exist_ok=True)
        file = await self._in_thread(what, self.fs.open, tmp, "wb")
        return _RenameWriter(self, key, tmp, file)

    async def get(self, key: str) -> bytes:
        return await self._call(f"read {self.uri_of(key)}", "cat_file", self._path(key))

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        uri = self.uri_of(key)
        check_range(uri, start, end)
        if start == end:
            size = await self.size(key)
            if start > size:
                raise range_past_end(uri, start, end, size)
            return b""
        try:
            what = f"read [{start}, {end}) of {uri}"
            data = await self._call(what, "cat_file", path, start=start, end=end)
        except StorageError as exc:
            if _response_error(exc)[0] != "InvalidRange":
                raise
            raise range_past_end(uri, start, end, await self.size(key)) from exc
        if len(data) != end - start:
            raise range_past_end(uri, start, end, await self.size(key))
        return data

    async def read_into(self, key: str, start: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        view[:] = await self.get_range(key, start, start + len(view))

    async def _file_info(self, key: str) -> dict[str, Any]:
        uri = self.uri_of(key)
        info = await self._call(f"stat {uri}", "info", self._path(key))
        if info.get("type") != "file":
            kind = info.get("type")
            raise CheckpointNotFoundError(f"stat {uri}: no such object (it is a {kind})")
        return info

    async def exists(self, key: str) -> bool:
        try:
            await self._file_info(key)
        except CheckpointNotFoundError:
            return False
        return True

    async def size(self, key: str) -> int:
        return int((await self._file_info(key))["size"])

    async def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        base = "/".join([self.root, *prefix.split("/")[:-1]])
        what = f"list {self.root_uri} prefix {prefix!r}"
        paths = await self._call(what, "find", base, withdirs=False)
        root = self.root + "/"
        keys = (p[len(root) :] for p in paths if p.startswith(root))
        return sorted(
            k for k in keys if k.startswith(prefix) and not is_temp_name(posixpath.basename(k))
        )

    async def delete(self, key: str) -> None:
        try:
            await self._call(f"delete {self.uri_of(key)}", "rm_file", self._path(key))
        except CheckpointNotFoundError:
            pass

    async def delete_prefix(self, prefix: str) -> None:
        keys = await self.list(prefix)
        if keys:
            what = f"delete {self.root_uri} prefix {prefix!r}"
            await self._call(what, "rm", [self._path(k) for k in keys])

    async def commit(
        self, key: str, data: bytes, *, expected: bytes | None | Unconditional = UNCONDITIONAL,
        after: Mapping[str, int | None] | None = None,
    ) -> None:
        """Check, then write: fsspec offers no conditional write (see the module docstring)."""
        await check_expected(self, key, expected, self.uri_of(key))
        await self.put(key, data)


# -- S3 ---------------------------------------------------------------------------------------------
class _MultipartWriter(ObjectWriter):
    """A streamed S3 upload: one PUT up to ``2 * part_size`` bytes, else a multipart upload with parts in flight.

    Part sizes start at ``part_size`` and double every 2,000 parts so an object of any size fits in
    S3's 10,000-part limit. A failure inside ``write`` or ``close`` leaves the writer to be aborted
    by its owner (``close`` aborts the upload itself when completing fails).
    """

    def __init__(self, backend: S3Backend, key: str) -> None:
        self._backend = backend
        self._uri = backend.uri_of(key)
        self._bucket, _, self._key = backend._path(key).partition("/")
        self._buf = bytearray()
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
        return self._backend.part_size * 2 ** ((self._next_part - 1) // 2000)

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open()
        self._buf += memoryview(data).cast("B")
        if self._upload_id is None and len(self._buf) <= 2 * self._backend.part_size:
            return  # may still go up as one PUT at close
        while len(self._buf) >= self._part_size():
            size = self._part_size()
            chunk = bytes(self._buf[:size])
            del self._buf[:size]
            await self._send_part(chunk)

    async def _send_part(self, chunk: bytes) -> None:
        if self._upload_id is None:
            response = await self._s3("start multipart upload of", "create_multipart_upload")
            self._upload_id = response["UploadId"]
        while len(self._in_flight) >= self._backend.parts_in_flight:
            await self._wait_for_one()
        number = self._next_part
        self._next_part += 1
        self._in_flight.add(asyncio.ensure_future(self._upload_part(number, chunk)))

    async def _upload_part(self, number: int, chunk: bytes) -> None:
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
            if self._upload_id is None:
                await self._s3("write", "put_object", Body=bytes(self._buf))
            else:
                if self._buf:
                    await self._send_part(bytes(self._buf))
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
        self._buf = bytearray()

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._buf = bytearray()
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
        fs = _s3_filesystem(
            endpoint_url=s3_endpoint(endpoint_url),
            key=key,
            secret=secret,
            token=token,
            client_kwargs=client_kwargs,
            config_kwargs=config_kwargs,
            **storage_options,
        )
        self._bind(fs, rest.rstrip("/"))

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
        # One GET: without max_concurrency=1 s3fs first stats the object to plan parallel parts.
        what = f"read {self.uri_of(key)}"
        return await self._call(what, "cat_file", self._path(key), max_concurrency=1)

    async def commit(
        self, key: str, data: bytes | memoryview, *, expected: bytes | None | Unconditional = UNCONDITIONAL,
        after: Mapping[str, int | None] | None = None,
    ) -> None:
        bucket, _, obj = self._path(key).partition("/")
        uri = self.uri_of(key)
        body = data if isinstance(data, bytes) else bytes(data)
        conditions: dict[str, str] = {}
        if expected is None:
            conditions["IfNoneMatch"] = "*"
        elif expected is not UNCONDITIONAL:
            current, etag = await self._get_with_etag(bucket, obj, uri)
            if current != expected:
                raise commit_refused(uri, expected, current)
            conditions["IfMatch"] = str(etag)
        try:
            await self._call(f"write {uri}", "call_s3", "put_object", Bucket=bucket, Key=obj, Body=body, **conditions)
        except StorageError as exc:
            code, status = _response_error(exc)
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise commit_refused(uri, expected, f"a different object ({code or status})") from exc  # type: ignore[arg-type]
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
