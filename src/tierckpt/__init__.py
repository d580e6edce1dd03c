"""tierckpt: PyTorch checkpointing with load-time resharding on a parallelism-agnostic format.

``save(uri, state)`` and ``load(uri, state)`` work the same for plain modules, DDP, FSDP2/DTensor,
FSDP1 flat shards and hand-described TP/PP shards, in one process or a torch.distributed group.

``import tierckpt`` is cheap: the modules behind the public names (which import torch) load on first
use (PEP 562), so ``tierckpt --version`` answers at once. Every name imports as it always did. That first
use imports with Python's cyclic garbage collector paused (:mod:`tierckpt.gc_pause`): the import makes
thousands of long-lived objects, and each collection it set off walked the whole heap of a process that has
torch imported (about a quarter of the loader's 0.3-0.4 s import on the 2-core test VM).
"""

from __future__ import annotations

import importlib
import logging as _logging
from typing import TYPE_CHECKING, Any

from tierckpt.errors import (
    CheckpointBusyError, CheckpointError, CheckpointNotFoundError, ChecksumMismatchError, CollectiveError,
    CorruptCheckpointError, IncompleteCheckpointError, MissingFileError, StateMismatchError, StorageError,
    StoragePermissionError, TransientStorageError, UnsupportedURIError,
)
from tierckpt.gc_pause import gc_paused as _gc_paused

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    **dict.fromkeys(("drop", "gc", "open_tiered", "prefetch", "status", "sync", "wait"), ".cache_api"),
    **dict.fromkeys(("load", "read_checkpoint", "read_state"), ".loading.api"),
    "CheckpointManager": ".manager.api",
    "inspect": ".reports",
    **dict.fromkeys(("Monitor", "prometheus_text", "straggler_report"), ".monitor"),
    **dict.fromkeys(("SaveHandle", "async_save", "save"), ".saving.api"),
    **dict.fromkeys(("FlatShardedTensor", "ShardedTensor"), ".sharded"),
    **dict.fromkeys(("MultiSourceReader", "ResumableSampler", "RNGState"), ".state.training"),
}
"""Public name -> the module that defines it, imported when the name is first used."""

_import = _gc_paused(importlib.import_module)

__all__ = [
    "CheckpointBusyError", "CheckpointError", "CheckpointManager", "CheckpointNotFoundError", "ChecksumMismatchError", "CollectiveError", "CorruptCheckpointError", "FlatShardedTensor",
    "IncompleteCheckpointError", "MissingFileError", "Monitor", "MultiSourceReader", "RNGState", "ResumableSampler", "ShardedTensor", "SaveHandle", "async_save", "StateMismatchError", "StorageError", "StoragePermissionError",
    "TransientStorageError", "UnsupportedURIError", "drop", "gc", "inspect", "load", "open_tiered", "prefetch", "status", "sync", "wait", "prometheus_text", "straggler_report", "read_checkpoint", "read_state", "save",
]


def __getattr__(name: str) -> Any:
    """A public name's value, importing its module on first use; a submodule (``tierckpt.native.layout``) likewise."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(_import(module, __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return _import(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from tierckpt.cache_api import drop, gc, open_tiered, prefetch, status, sync, wait
    from tierckpt.reports import inspect
    from tierckpt.loading.api import load, read_checkpoint, read_state
    from tierckpt.manager.api import CheckpointManager
    from tierckpt.monitor import Monitor, prometheus_text, straggler_report
    from tierckpt.saving.api import SaveHandle, async_save, save
    from tierckpt.sharded import FlatShardedTensor, ShardedTensor
    from tierckpt.state.training import MultiSourceReader, ResumableSampler, RNGState

_logging.getLogger("tierckpt").addHandler(_logging.NullHandler())

from tierckpt._moved import install as _install_moved_paths

_install_moved_paths()  # old import paths (tierckpt.cache, tierckpt.loader, ...) load the moved modules
