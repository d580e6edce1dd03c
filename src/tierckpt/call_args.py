"""Checks of the arguments of the public calls that a first user gets wrong, each a clear error that
names the mistake and the fix (rather than a ``TypeError`` from deep inside)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .errors import CheckpointError


def checked_uri(call: str, uri: Any, state: Any) -> str:
    """``uri`` as a string (a path object is accepted); :func:`tierckpt.save` and :func:`tierckpt.load`
    take the URI first, where ``torch.save(obj, f)`` takes the object first, so that order is named."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if isinstance(uri, str):
        return uri
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
