"""The node-local tiered storage cache: write-back saves, read-through loads, durability tracking.

See :mod:`tierckpt.cache.tiered` for the design and :mod:`tierckpt.cache.api` for the functions.
"""

from .api import (
    CheckpointStatus, GcResult, PrefetchHandle, drop, gc, open_tiered, prefetch, status, sync, wait,
)
from .catalog import Catalog
from .config import CacheConfig, parse_bytes
from .status import Durability, StoreStatus
from .tiered import TieredBackend

__all__ = [
    "CacheConfig", "Catalog", "Durability", "CheckpointStatus", "GcResult", "PrefetchHandle", "StoreStatus", "TieredBackend",
    "drop", "gc", "open_tiered", "parse_bytes", "prefetch", "status", "sync", "wait",
]
