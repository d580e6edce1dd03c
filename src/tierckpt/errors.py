"""The errors tierckpt raises.

Every error derives from :class:`CheckpointError` (an ``Exception``), and where a built-in exception
has the same meaning the subclass inherits it too, so ``except FileNotFoundError`` keeps working.
Messages name the thing (key, URI, file) and, where there is one, the fix.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of every error tierckpt raises."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint, or an object inside a store, does not exist."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint has data but no commit: a save was interrupted or is still running."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes or metadata fail validation (checksum, size, decoding, out-of-bounds ranges)."""


class ChecksumMismatchError(CorruptCheckpointError):
    """Bytes read fail the CRC-32C recorded for them at save time. ``key`` (relative to the checkpoint
    root), ``start`` and ``end`` name the bytes, so a load or ``verify`` whose node cache served them can
    drop that copy and read them again from the remote: only a mismatch there is corruption."""

    def __init__(self, message: str, key: str | None = None, start: int = 0, end: int = 0) -> None:
        super().__init__(message)
        self.key, self.start, self.end = key, start, end


class MissingFileError(CorruptCheckpointError):
    """A file that a committed checkpoint's metadata lists is in no store or tier the loading group reaches
    (deleted, or held only by a node that was lost before its copies reached a peer or the remote)."""


class StateMismatchError(CheckpointError, ValueError):
    """The state passed to ``load`` does not match the checkpoint (keys, shapes, dtypes)."""


class UnsupportedURIError(CheckpointError, ValueError):
    """A storage URI has a scheme or form that no backend handles."""


class StorageError(CheckpointError, OSError):
    """A storage backend failed; the provider's exception is chained as ``__cause__``."""


class TransientStorageError(StorageError):
    """A storage failure that may succeed when retried (throttling, 5xx, resets, timeouts)."""


class StoragePermissionError(StorageError, PermissionError):
    """The store refused access (bad credentials, access denied)."""


class CheckpointBusyError(CheckpointError):
    """Another save to the same checkpoint root is still in flight."""


class CollectiveError(CheckpointError):
    """A torch.distributed collective failed or timed out; the message names the ranks involved."""


class StorageUnreachableError(TransientStorageError):
    """A store's endpoint could not be reached or gave no complete answer in time (connection refused or
    reset, a request timed out); the message names the endpoint and what to check. ``tierckpt`` exits 7."""


class DeadlineExceededError(StorageUnreachableError, TimeoutError):
    """An operation did not finish within its overall deadline (:mod:`tierckpt.deadline`); the message
    names the operation, its URI, what it was waiting for and the setting that sets the deadline."""


class OversizedFileError(CorruptCheckpointError):
    """A file of a checkpoint or of a node tier is larger than such a file can legitimately be; it is
    refused unread (its size is checked before reading), naming the file, its size and the cap."""


class NotACheckpointError(CheckpointNotFoundError):
    """A URI has no ``COMMIT`` record and no tierckpt data: it is something else (a CheckpointManager
    root, a safetensors or DeepSpeed folder...); the message says what it looks like and what to do."""


class NodeCacheError(StorageError):
    """The node cache directory cannot be used (not writable, read-only, full); the message names the
    directory, ``TIERCKPT_CACHE_DIR`` and how to go without the cache (``storage_options={"cache": False}``)."""


class NotDurableError(StorageError):
    """Steps a :class:`~tierckpt.CheckpointManager` waited for are not durable as its own saves: the remote's
    ``COMMIT`` names another job's generation (a job still running on the same root), or their uploads
    failed for good; the message names each step and why."""


class NodeTierNotPrivateError(StorageError, PermissionError):
    """A node tier's directory (the node cache, the memory tier) is not this user's own: another user owns
    it, others may write it, or another user's symlink leads to it. Nothing in it was read or written; the
    message names the directory, its owner and mode, and the setting that moves it (``TIERCKPT_CACHE_DIR``,
    ``TIERCKPT_MEMORY_DIR``)."""


class RouteCostsError(CheckpointError, ValueError):
    """The load routes' costs cannot be taken as given (a malformed ``$TIERCKPT_ROUTE_COSTS``, a probe of the
    store that read short); the message names the setting or the file and what to write."""
