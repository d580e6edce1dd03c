"""The node-local tiered storage cache: write-back saves, read-through loads, durability tracking.

Below :mod:`tierckpt.store` (which assembles it into a chain): :mod:`~tierckpt.cache.tiered` is the
store, :mod:`~tierckpt.cache.uploads` its upload engine, :mod:`~tierckpt.cache.durable` its durability
API, :mod:`~tierckpt.cache.uploader` this process's uploads per cache directory,
:mod:`~tierckpt.cache.catalog` the LMDB catalogue. The public functions (``status``, ``wait``,
``sync``, ``drop``, ``prefetch``, ``gc``) are in :mod:`tierckpt.cache_api`, above the store.
"""

from .catalog import Catalog
from .config import CacheConfig, parse_bytes
from .tiered import TieredBackend
from .uploader import Uploader

__all__ = ["CacheConfig", "Catalog", "TieredBackend", "Uploader", "parse_bytes"]
