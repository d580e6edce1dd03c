"""tierckpt: PyTorch checkpointing with load-time resharding on a parallelism-agnostic format.

``save(uri, state)`` and ``load(uri, state)`` work the same for plain modules, DDP, FSDP2/DTensor,
FSDP1 flat shards and hand-described TP/PP shards, in one process or a torch.distributed group.
"""

import logging as _logging

from .errors import (
    CheckpointBusyError, CheckpointError, CheckpointNotFoundError, CollectiveError, CorruptCheckpointError,
    IncompleteCheckpointError, StateMismatchError, StorageError, StoragePermissionError, TransientStorageError,
    UnsupportedURIError,
)
from .cache import gc, open_tiered, prefetch, status, sync, wait
from .loader import load, read_checkpoint
from .manager import CheckpointManager
from .monitor import Monitor, prometheus_text, straggler_report
from .saver import SaveHandle, async_save, save
from .sharded import FlatShardedTensor, ShardedTensor
from .training_state import MultiSourceReader, ResumableSampler, RNGState

__version__ = "0.1.0"

__all__ = [
    "CheckpointBusyError", "CheckpointError", "CheckpointManager", "CheckpointNotFoundError", "CollectiveError", "CorruptCheckpointError", "FlatShardedTensor",
    "IncompleteCheckpointError", "Monitor", "MultiSourceReader", "RNGState", "ResumableSampler", "ShardedTensor", "SaveHandle", "async_save", "StateMismatchError", "StorageError", "StoragePermissionError",
    "TransientStorageError", "UnsupportedURIError", "gc", "load", "open_tiered", "prefetch", "status", "sync", "wait", "prometheus_text", "straggler_report", "read_checkpoint", "save",
]

_logging.getLogger("tierckpt").addHandler(_logging.NullHandler())
