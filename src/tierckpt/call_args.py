"""Checks of the arguments of the public calls that a first user gets wrong, each a clear error that
names the mistake and the fix (rather than a ``TypeError`` from deep inside)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tierckpt.errors import CheckpointError


def uri_text(call: str, uri: str | os.PathLike[str]) -> str:
    """``uri`` as the string every store takes: a ``str`` as it is, a path object (``pathlib.Path``, any
    ``os.PathLike``) as its path. Every public call that takes a URI (``load``, ``read_state``, ``inspect``,
    ``verify``, ``status``, ``prefetch``, ``convert``...) passes it through here first, so a ``Path`` works
    wherever a string does; anything else is a :class:`~tierckpt.errors.CheckpointError` naming ``call``."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if isinstance(uri, bytes):
        raise CheckpointError(f"tierckpt.{call}: the URI must be a str or a path object, got bytes {uri!r}; "
                              "decode it first (os.fsdecode)")
    if not isinstance(uri, str):
        raise CheckpointError(f"tierckpt.{call}: the URI must be a str or a path object (a path or e.g. "
                              f"'s3://bucket/run'), got {type(uri).__name__}")
    return uri


def checked_uri(call: str, uri: Any, state: Any) -> str:
    """``uri`` as a string (:func:`uri_text`); :func:`tierckpt.save` and :func:`tierckpt.load` take the URI
    first, where ``torch.save(obj, f)`` takes the object first, so that order is named."""
    if isinstance(uri, (str, os.PathLike)):
        return uri_text(call, uri)
    if isinstance(state, (str, os.PathLike)):
        raise CheckpointError(
            f"tierckpt.{call} got the state where the URI goes: the URI comes first: tierckpt.{call}(uri, state) "
            f"(torch.save takes the object first; tierckpt.{call}({os.fspath(state)!r}, state) here)"
        )
    raise CheckpointError(f"tierckpt.{call}: the URI must be a string (a path or e.g. 's3://bucket/run'), got "
                          f"{type(uri).__name__}; call tierckpt.{call}(uri, state)")


def merged_options(call: str, storage_options: Mapping[str, Any] | None, keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The storage options of a call that takes them as ``storage_options=`` (as ``save``/``load`` do) or,
    as before, as keyword arguments; one option given both ways is an error."""
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise CheckpointError(f"tierckpt.{call}: storage_options must be a dict, got {type(storage_options).__name__}")
    options = dict(storage_options or {})
    both = sorted(set(options) & set(keywords))
    if both:
        raise CheckpointError(f"tierckpt.{call}: {both} given both in storage_options= and as keyword arguments; "
                              "pass each storage option once, preferably in storage_options=")
    options.update(keywords)
    return options
