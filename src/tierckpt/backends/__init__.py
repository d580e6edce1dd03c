"""Storage backends and :func:`open_backend`, which picks one from a URI's scheme.

=====================  ==========================================================
URI                    Backend
=====================  ==========================================================
``/path``, ``file://``  :class:`~tierckpt.backends.local.LocalBackend`
``memory://NAME/...``  :class:`~tierckpt.backends.memory.MemoryBackend`
``s3://``, ``s3a://``  :class:`~tierckpt.backends.fsspec_backend.S3Backend`
``hdfs://``            :class:`~tierckpt.backends.fsspec_backend.FsspecBackend`
any fsspec protocol    :class:`~tierckpt.backends.fsspec_backend.FsspecBackend`
=====================  ==========================================================
"""

from __future__ import annotations

import re
from typing import Any

import fsspec

from ..errors import UnsupportedURIError
from .base import Backend, ByteRange, Capabilities, ObjectWriter, validate_key
from .fsspec_backend import FsspecBackend, S3Backend
from .local import LocalBackend
from .memory import MemoryBackend

__all__ = [
    "Backend",
    "ByteRange",
    "Capabilities",
    "FsspecBackend",
    "LocalBackend",
    "MemoryBackend",
    "ObjectWriter",
    "S3Backend",
    "open_backend",
    "open_plain_backend",
    "split_uri",
    "validate_key",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.DOTALL)
_NATIVE_SCHEMES = ("file", "memory", "s3", "s3a", "hdfs")


def split_uri(uri: str) -> tuple[str, str]:
    """``"s3://b/p"`` -> ``("s3", "b/p")``; a plain path has the scheme ``""``."""
    match = _SCHEME.match(uri)
    if match is None:
        return "", uri
    return match.group(1).lower(), match.group(2)


def open_backend(uri: str, *, cache: Any = None, **options: Any) -> Backend:
    """The backend for ``uri``; ``options`` go to its constructor (e.g. S3 credentials).

    Remote schemes (s3, hdfs, other fsspec protocols) go through the node cache
    (:mod:`tierckpt.cache`: write-back, read-through) unless ``cache=False`` or ``TIERCKPT_CACHE=off``;
    pass a :class:`~tierckpt.cache.CacheConfig` as ``cache`` to configure it per call.
    """
    if cache is False:
        return open_plain_backend(uri, **options)
    from ..cache import open_tiered

    return open_tiered(uri, cache, **options)


def open_plain_backend(uri: str, **options: Any) -> Backend:
    """The backend for ``uri`` itself, without the node cache."""
    scheme, _ = split_uri(uri)
    if scheme in ("", "file"):
        return LocalBackend(uri, **options)
    if scheme == "memory":
        return MemoryBackend(uri, **options)
    if scheme in ("s3", "s3a"):
        return S3Backend(uri, **options)
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        reason = " ".join(str(exc).split())
        raise UnsupportedURIError(
            f"no storage backend for {uri!r}: scheme {scheme!r} is not supported ({reason}); "
            f"supported schemes: {', '.join(_NATIVE_SCHEMES)}, a plain path, or any installed "
            "fsspec protocol"
        ) from exc
    return FsspecBackend(uri, **options)
