"""The node-local tiered storage cache: write-back saves, read-through loads, durability tracking.

Below :mod:`tierckpt.store` (which assembles it into a chain): :mod:`~tierckpt.node.disk.tiered` is the
store, :mod:`~tierckpt.node.disk.uploads` its upload engine, :mod:`~tierckpt.node.disk.durable` its durability
API, :mod:`~tierckpt.node.disk.uploader` this process's uploads per cache directory,
:mod:`~tierckpt.node.disk.catalog` the LMDB catalogue. The public functions (``status``, ``wait``,
``sync``, ``drop``, ``prefetch``, ``gc``) are in :mod:`tierckpt.cache_api`, above the store.
"""

from tierckpt.node.disk.catalog import Catalog
from tierckpt.node.disk.config import CacheConfig, parse_bytes
from tierckpt.node.disk.tiered import TieredBackend
from tierckpt.node.disk.uploader import Uploader

__all__ = ["CacheConfig", "Catalog", "TieredBackend", "Uploader", "parse_bytes"]
