"""Storage keys: the one rule for what a key under a root may be.

Below both :mod:`tierckpt.backends` (which refuse keys that could leave their root) and
:mod:`tierckpt.native.metadata` (which rejects such keys in stored metadata), so neither imports the other.
"""

from __future__ import annotations

import re

from tierckpt.errors import CorruptCheckpointError

_CONTROL = re.compile(r"[\x00-\x1f]")
"""Any control character (below the space): a regular expression scans a key in C, where a per-character
generator cost microseconds per call, and every read and write of a file validates its key."""


def validate_key(key: str) -> str:
    """``key`` if it stays inside its root, else :class:`CorruptCheckpointError` naming it and the rule.

    A key is a non-empty, relative, ``/``-separated path without control characters, backslashes or
    ``""``, ``.`` or ``..`` parts.
    """
    if not isinstance(key, str) or not key:
        raise CorruptCheckpointError(f"invalid storage key {key!r}: keys are non-empty strings")
    if _CONTROL.search(key):
        raise CorruptCheckpointError(f"invalid storage key {key!r}: keys hold no control characters (NUL, newline...)")
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise CorruptCheckpointError(
            f"invalid storage key {key!r}: keys are relative '/'-separated paths without "
            "'.', '..' or empty parts, so they cannot leave the checkpoint root"
        )
    return key
