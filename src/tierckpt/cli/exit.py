"""The CLI's exit codes, and which :class:`~tierckpt.errors.CheckpointError` maps to which (the table is in :mod:`tierckpt.cli.main`)."""

from __future__ import annotations

from tierckpt.errors import (
    CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError, StorageUnreachableError,
    UnsupportedURIError,
)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INCOMPLETE = 4
EXIT_CORRUPT = 5
EXIT_DIVERGED = 6
EXIT_UNREACHABLE = 7

#: Most specific first: the first matching class decides the exit code.
ERROR_EXIT_CODES: tuple[tuple[type[CheckpointError], int], ...] = (
    (UnsupportedURIError, EXIT_USAGE),
    (StorageUnreachableError, EXIT_UNREACHABLE),
    (CheckpointNotFoundError, EXIT_NOT_FOUND),
    (IncompleteCheckpointError, EXIT_INCOMPLETE),
    (CorruptCheckpointError, EXIT_CORRUPT),
    (CheckpointError, EXIT_ERROR),
)


def exit_code(error: CheckpointError) -> int:
    """The documented exit code for a tierckpt error."""
    return next(code for cls, code in ERROR_EXIT_CODES if isinstance(error, cls))
