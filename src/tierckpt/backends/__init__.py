"""Storage backends and :func:`open_backend`, which picks one from a URI's scheme.

=====================  ==========================================================
URI                    Backend
=====================  ==========================================================
``/path``, ``file://``  :class:`~tierckpt.backends.local.LocalBackend`
``memory://NAME/...``  :class:`~tierckpt.backends.memory.MemoryBackend`
``s3://``, ``s3a://``  :class:`~tierckpt.backends.s3.S3Backend`
``hdfs://``            :class:`~tierckpt.backends.fsspec_backend.FsspecBackend`
any fsspec protocol    :class:`~tierckpt.backends.fsspec_backend.FsspecBackend`
=====================  ==========================================================

This package is the floor of the storage chain: nothing here imports from above it. The node cache
and every other link are assembled in front of a backend by :func:`tierckpt.store.open_store`.

Adding a backend: a ``Backend`` subclass in its own module here (it passes ``tests/backend_contract.py``),
and one branch in :func:`open_backend` for its scheme.

May import: ``errors``, ``deadline``, ``native`` (keys, layout), the ``_copycrc`` extension. Nothing of the
node tiers: a backend knows no node.
"""

from __future__ import annotations

import re
from typing import Any

import fsspec

from tierckpt.errors import CheckpointError, UnsupportedURIError
from tierckpt.native.keys import validate_key
from tierckpt.backends.base import Backend, Capabilities, ObjectWriter
from tierckpt.backends.fsspec_backend import FsspecBackend
from tierckpt.backends.s3 import S3Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.memory import MemoryBackend
from tierckpt.backends.options import check_options

__all__ = [
    "Backend",
    "Capabilities",
    "FsspecBackend",
    "LocalBackend",
    "MemoryBackend",
    "ObjectWriter",
    "S3Backend",
    "check_options",
    "open_backend",
    "open_plain_backend",
    "split_uri",
    "backend_of_scheme",
    "validate_key",
    "validate_uri",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.DOTALL)
_NATIVE_SCHEMES = ("file", "memory", "s3", "s3a", "hdfs")
_SCHEME_WITHOUT_SLASHES = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):(?!//)(.*)$", re.DOTALL)


def validate_uri(uri: str) -> str:
    """``uri`` unchanged, unless it is empty or a scheme without ``//`` (``s3:/bucket/x``, ``s3:bucket/x``).

    Such a string is a mistyped URI far more often than a local directory whose name holds a colon,
    and taking it for a path would silently write ``./s3:/bucket/x`` on local disk. ``file:/path``
    (one slash, RFC 8089) stays a valid local path; a local name with a colon is written ``./name``.
    """
    if not uri.strip():
        raise UnsupportedURIError(
            f"an empty URI ({uri!r}) names no checkpoint (it would be written into the working directory): pass a "
            "directory path, e.g. './ckpt/step-100', or a URI such as 's3://bucket/run/step-100'"
        )
    match = _SCHEME_WITHOUT_SLASHES.match(uri)
    if match is None or (match.group(1).lower() == "file" and match.group(2).startswith("/")):
        return uri
    scheme, rest = match.group(1), match.group(2).lstrip("/")
    raise UnsupportedURIError(
        f"{uri!r} is not a storage URI: a scheme is followed by '//' (write {scheme}://{rest}, e.g. "
        f"s3://bucket/key); for a local path whose name holds a colon write ./{uri}"
    )


def split_uri(uri: str) -> tuple[str, str]:
    """``"s3://b/p"`` -> ``("s3", "b/p")``; a plain path has the scheme ``""``.

    Raises :class:`~tierckpt.errors.UnsupportedURIError` for a scheme without ``//`` (:func:`validate_uri`).
    """
    match = _SCHEME.match(validate_uri(uri))
    if match is None:
        return "", uri
    return match.group(1).lower(), match.group(2)


def open_backend(uri: str, **options: Any) -> Backend:
    """The backend of ``uri`` itself (never the node cache: :func:`tierckpt.store.open_store` assembles the
    chain of a URI); ``options`` go to its constructor (e.g. S3 credentials). ``cache=False`` is accepted
    (it asks for exactly this); any other ``cache`` is an error."""
    if options.pop("cache", False) is not False:
        raise CheckpointError(
            f"open_backend({uri!r}) opens the URI's own backend and takes no cache option; open the store with "
            "tierckpt.store.open_store(uri, {'cache': ...}) to choose the node cache"
        )
    return backend_of_scheme(split_uri(uri)[0], uri, options)


def backend_of_scheme(scheme: str, uri: str, options: dict[str, Any]) -> Backend:
    """The backend of ``uri``, whose scheme the caller already split off (:func:`split_uri`): the chain's
    assembler splits a URI once and hands the scheme here. ``options`` go to the backend's constructor."""
    if scheme in ("", "file"):
        return LocalBackend(uri, **check_options(LocalBackend, uri, options))
    if scheme == "memory":
        return MemoryBackend(uri, **check_options(MemoryBackend, uri, options))
    if scheme in ("s3", "s3a"):
        return S3Backend(uri, **check_options(S3Backend, uri, options))
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


open_plain_backend = open_backend
"""The same as :func:`open_backend` (the name says it: no node cache)."""
