"""The backend over any fsspec file system, and the translation of provider errors that S3 shares.

:class:`FsspecBackend` wraps any fsspec file system (HDFS through pyarrow, GCS, Azure, ...).
Async implementations (``fs.async_impl``) run their coroutines on fsspec's own I/O loop thread and
are awaited from the caller's loop without tying up a thread; sync implementations run in worker
threads (``asyncio.to_thread``). Either way the backend can be used from any event loop, including
one running on a background thread. Whole-object writes go through a hidden
``.<name>.<uuid>.partial`` object that is renamed into place, which is atomic on HDFS and POSIX.

:class:`~tierckpt.backends.s3.S3Backend` (``s3://``) builds on it, in :mod:`tierckpt.backends.s3`.

The generic adapter has no conditional write: its ``commit`` checks, then writes, so two writers
racing on such a file system may both succeed (a documented limitation).

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
import functools
import posixpath
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import fsspec
from fsspec.exceptions import FSTimeoutError

from tierckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    StorageError,
    StoragePermissionError,
    StorageUnreachableError,
    TransientStorageError,
    UnsupportedURIError,
)
from tierckpt.native.keys import validate_key
from tierckpt.backends.base import UNCONDITIONAL, Backend, Capabilities, ObjectWriter, Unconditional
from tierckpt.backends.commit_check import check_expected
from tierckpt.backends.files import check_prefix, check_range, is_temp_name, range_past_end, temp_name

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


@functools.cache
def _provider_types() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(transient, missing-credentials, other provider) exception types of the installed clients.

    Imported on the first failure to classify, not with this module: importing aiohttp and botocore
    takes 0.2-0.5 s, which every process that loads from a local path or memory would pay before its
    first load."""
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


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it was raised from or while handling."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def response_error(exc: BaseException) -> tuple[str | None, int | None]:
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
    exc: Exception, what: str, bucket: str | None = None, service: str | None = None
) -> CheckpointError | None:
    """Map a provider exception raised while doing ``what`` to a tierckpt error (None: not ours).

    A connection that fails or times out is a :class:`~tierckpt.errors.StorageUnreachableError` naming
    ``service`` (what answers the store: ``s3://bucket at http://host:port``) and what to check."""
    if isinstance(exc, CheckpointError):
        return None
    cause = _one_line(exc)
    code, status = response_error(exc)
    if code == "NoSuchBucket":
        return CheckpointNotFoundError(f"{what}: bucket {bucket!r} does not exist ({cause})")
    if code in _NOT_FOUND_CODES or status == 404:
        return CheckpointNotFoundError(f"{what}: no such object ({cause})")
    if code in _PERMISSION_CODES or status == 403:
        return StoragePermissionError(f"{what}: access denied, check the credentials ({cause})")
    if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS:
        return TransientStorageError(f"{what}: transient failure ({cause})")
    transient_types, credential_types, provider_types = _provider_types()
    if any(isinstance(e, transient_types) for e in _chain(exc)):
        where = f"cannot reach {service}: " if service else ""
        return StorageUnreachableError(
            f"{what}: {where}connection failed or timed out ({cause}); check the endpoint (the storage option "
            "endpoint_url or TIERCKPT_S3_ENDPOINT_URL for S3), the network, and that the store is up"
        )
    if isinstance(exc, credential_types):
        return StoragePermissionError(
            f"{what}: no usable credentials ({cause}); set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY or pass key=/secret= options"
        )
    if isinstance(exc, FileNotFoundError):
        return CheckpointNotFoundError(f"{what}: no such object ({cause})")
    if isinstance(exc, PermissionError):
        return StoragePermissionError(f"{what}: permission denied ({cause})")
    if isinstance(exc, (OSError, *provider_types)):
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
        return translate_error(exc, what, self._bucket, self.service)

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
            if response_error(exc)[0] != "InvalidRange":
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
