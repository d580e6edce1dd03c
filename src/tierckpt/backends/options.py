"""The storage options each backend takes: a misspelt one is named, with the valid ones, before the
backend is built (rather than ``__init__() got an unexpected keyword argument`` from its constructor)."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from tierckpt.errors import CheckpointError
from tierckpt.backends.base import Backend

CHAIN_OPTIONS = ("cache", "memory")
"""Storage options of the storage chain itself (node cache, node memory tier), valid for every URI."""
FIXED_S3FS = {"self", "kwargs", "asynchronous", "loop", "skip_instance_cache", "use_listings_cache"}
"""s3fs arguments the S3 backend sets itself: not storage options."""


def valid_options(backend: type[Backend]) -> list[str] | None:
    """The storage options ``backend`` takes (its constructor's keywords, the chain's, and for S3 the
    s3fs file system's), or ``None`` when it passes any option on (a generic fsspec file system)."""
    params = inspect.signature(backend.__init__).parameters
    names = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    names -= {"self", "root_uri"}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        if backend.__name__ != "S3Backend":
            return None
        import s3fs

        names |= set(inspect.signature(s3fs.S3FileSystem.__init__).parameters) - FIXED_S3FS
    return sorted(names | set(CHAIN_OPTIONS))


def check_options(backend: type[Backend], uri: str, options: Mapping[str, Any]) -> Mapping[str, Any]:
    """``options`` unchanged if ``backend`` takes each of them; else an error naming the unknown ones,
    the closest valid name and every valid one."""
    valid = valid_options(backend)
    unknown = [key for key in options if valid is not None and key not in valid]
    if not unknown:
        return options
    hints = [f"{key!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(str(key), valid, 1))
             else repr(key) for key in unknown]
    raise CheckpointError(
        f"unknown storage option {', '.join(hints)} for {uri!r}; valid storage options there: "
        f"{', '.join(map(repr, valid))}"
    )
