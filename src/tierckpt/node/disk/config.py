"""Configuration of the node-local storage cache (:class:`CacheConfig`).

Environment variables (read by :meth:`CacheConfig.from_env`):

* ``TIERCKPT_CACHE_DIR``: the node cache directory (default: chosen for cluster nodes by
  :func:`tierckpt.node.disk.placement.default_directory`: ``~/.cache/tierckpt`` on a node-local disk, else
  node-local scratch such as ``$TMPDIR``).
* ``TIERCKPT_CACHE_BYTES``: the local (disk) tier budget, e.g. ``"200G"``, ``"512M"``, ``"1000000"``
  (:func:`tierckpt.units.parse_bytes`: ``G`` and ``GiB`` are binary, ``GB`` decimal); default: the smaller
  of 100 GiB and half the file system's size (:func:`tierckpt.node.disk.placement.default_disk_bytes`).
* ``TIERCKPT_CACHE``: ``"0"``/``"off"`` disables caching, ``"1"``/``"on"`` enables it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from tierckpt.errors import CheckpointError, NodeCacheError
from tierckpt.units import parse_bytes
from tierckpt.node.disk.placement import default_directory, default_disk_bytes


def cache_error(directory: str, what: str, exc: BaseException) -> NodeCacheError:
    """The error for the node cache ``directory`` failing ``what`` with ``exc`` (read-only, not writable,
    full): the directory, the setting that chooses it, and how to go without the cache."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return NodeCacheError(
        f"the node cache {directory} cannot be used ({what}: {reason}): point TIERCKPT_CACHE_DIR at a writable "
        "directory with room (or free space there), or go without the node cache: storage_options={'cache': False} "
        "for one call, TIERCKPT_CACHE=off for all"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """How the tiered store caches one node's checkpoints. Values, never mutated."""

    directory: str = ""
    """Node cache directory (shared by every process on the node); ``""`` means the default."""
    memory_bytes: int = 64 * 2**20
    """Budget of the in-process memory tier (whole small objects such as metadata)."""
    memory_object_bytes: int = 4 * 2**20
    """Largest object the memory tier holds."""
    disk_bytes: int | None = None
    """Budget of the local disk tier (``None``: the default, see :mod:`~tierckpt.node.disk.placement`). Data not
    yet on the remote is never evicted, even over budget."""
    block_bytes: int = 8 * 2**20
    """Remote objects larger than this are cached as aligned blocks of this size; smaller ones whole."""
    upload_concurrency: int = 8
    """Uploads of one store in flight at once (each also holds a scheduler slot of the remote)."""
    upload_while_writing: bool = True
    """Start uploading a streamed data file while it is still being written to the node cache (it is
    published on the remote only after the local copy is committed and checked; see ``tail_upload``)."""
    enabled: bool = True
    """Whether :func:`~tierckpt.store.open_store` puts remote URIs behind the node cache at all (``cache=True`` overrides it)."""
    exit_wait_s: float = 600.0
    """At interpreter exit, how long to let this process's pending uploads finish (the rest stay
    pending in the catalogue for ``tierckpt.node.disk.sync``)."""
    poll_s: float = 0.05
    """How often waiters re-read the catalogue (uploads of other processes show up there)."""

    directory_reason: str = dataclasses.field(default="", compare=False)
    """Why :attr:`directory` is where it is (``tierckpt status`` prints it); filled in when empty."""
    disk_bytes_reason: str = dataclasses.field(default="", compare=False)
    """Why :attr:`disk_bytes` is what it is; filled in when empty."""

    def __post_init__(self) -> None:
        if not self.directory:
            directory, why = default_directory()
            object.__setattr__(self, "directory", directory)
            object.__setattr__(self, "directory_reason", self.directory_reason or why)
        object.__setattr__(self, "directory_reason", self.directory_reason or "CacheConfig.directory")
        object.__setattr__(self, "directory", os.path.abspath(os.path.expanduser(self.directory)))
        if self.disk_bytes is None:
            budget, why = default_disk_bytes(self.directory)
            object.__setattr__(self, "disk_bytes", budget)
            object.__setattr__(self, "disk_bytes_reason", self.disk_bytes_reason or why)
        object.__setattr__(self, "disk_bytes_reason", self.disk_bytes_reason or "CacheConfig.disk_bytes")
        for name in ("memory_bytes", "memory_object_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise CheckpointError(f"CacheConfig.{name} must not be negative, got {getattr(self, name)}")
        if self.block_bytes < 1 or self.upload_concurrency < 1:
            raise CheckpointError(
                f"CacheConfig.block_bytes and upload_concurrency must be at least 1, got "
                f"{self.block_bytes} and {self.upload_concurrency}"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> CacheConfig:
        """A config from the environment (see the module docstring); ``overrides`` win."""
        values: dict[str, Any] = {}
        if os.environ.get("TIERCKPT_CACHE_DIR"):
            values["directory"] = os.environ["TIERCKPT_CACHE_DIR"]
            values["directory_reason"] = "TIERCKPT_CACHE_DIR"
        if os.environ.get("TIERCKPT_CACHE_BYTES"):
            values["disk_bytes"] = parse_bytes(os.environ["TIERCKPT_CACHE_BYTES"], "TIERCKPT_CACHE_BYTES")
            values["disk_bytes_reason"] = "TIERCKPT_CACHE_BYTES"
        flag = os.environ.get("TIERCKPT_CACHE", "").strip().lower()
        if flag:
            if flag not in ("0", "1", "on", "off", "true", "false", "yes", "no"):
                raise CheckpointError(f"TIERCKPT_CACHE={flag!r}: use 1/on to enable the cache or 0/off to disable it")
            values["enabled"] = flag in ("1", "on", "true", "yes")
        for name in ("memory_bytes", "disk_bytes", "block_bytes"):
            if isinstance(overrides.get(name), str):
                overrides[name] = parse_bytes(overrides[name], name)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise CheckpointError(f"unknown CacheConfig fields {sorted(unknown)}")
        for name in ("directory", "disk_bytes"):  # a value given here is not the environment's
            if name in overrides:
                values.pop(f"{name}_reason", None)
        values.update(overrides)
        return cls(**values)
