"""Configuration of the node memory tier (:class:`MemoryConfig`).

Environment variables (read by :meth:`MemoryConfig.from_env`, and :func:`memory_enabled_from_env`):

* ``TIERCKPT_MEMORY``: ``on`` puts the memory tier at the top of every non-``memory://`` URI's storage
  chain (:func:`tierckpt.store.memory_config_for`); ``off`` (default) leaves it out. The storage option
  ``memory`` of a call overrides it.
* ``TIERCKPT_MEMORY_DIR``: the tier's directory, shared by every process of the node; it should be on a
  memory file system (tmpfs) so it outlives the training processes but costs no disk I/O
  (default ``/dev/shm/tierckpt-<uid>``: private to its user, created 0700 and checked on every open by
  :func:`tierckpt.node.private.private_directory`).
* ``TIERCKPT_MEMORY_BYTES``: the tier's budget, e.g. ``"48G"``, ``"512M"``, ``"1000000"`` (the byte sizes of
  :func:`tierckpt.units.parse_bytes`: G = 2**30, GB = 10**9). Default: half the size of the file system that holds the directory.
* ``TIERCKPT_MEMORY_FULL``: what a save does when its checkpoint cannot fit even after evicting
  everything a lower tier already holds: ``error`` (default; raise :class:`MemoryTierFullError`) or
  ``fallback`` (write to the next tier instead).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import warnings
from dataclasses import dataclass
from typing import Any

from tierckpt.errors import CheckpointError, StorageError
from tierckpt.units import parse_bytes

MEMORY_ENV = "TIERCKPT_MEMORY"
DIR_ENV = "TIERCKPT_MEMORY_DIR"
BYTES_ENV = "TIERCKPT_MEMORY_BYTES"
FULL_ENV = "TIERCKPT_MEMORY_FULL"
def default_directory() -> str:
    """The tier's default directory: ``/dev/shm/tierckpt-<uid>``, one per user of the node (node tiers
    are private: another user's tier is never shared, read or written)."""
    return f"/dev/shm/tierckpt-{os.geteuid()}"


class OnFull(enum.Enum):
    """What happens to a checkpoint that cannot fit in the memory tier."""

    ERROR = "error"
    """Raise :class:`MemoryTierFullError` naming the budget, the sizes and the setting to change."""
    FALLBACK = "fallback"
    """Leave the memory tier out for this checkpoint: the caller writes it to the next tier."""


class MemoryTierFullError(StorageError):
    """A checkpoint does not fit in the node memory tier, even after evicting every evictable copy."""


def memory_enabled_from_env() -> bool:
    """Whether ``TIERCKPT_MEMORY`` turns the memory tier on (``on``/``off``; unset or empty: off)."""
    flag = os.environ.get(MEMORY_ENV, "").strip().lower()
    if flag in ("", "off"):
        return False
    if flag == "on":
        return True
    raise CheckpointError(
        f"{MEMORY_ENV}={flag!r}: use 'on' (checkpoints commit into the node memory tier first) or 'off' (the default)"
    )


def filesystem_bytes(directory: str) -> int:
    """The size of the file system that holds ``directory`` (or would, once created)."""
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def default_budget(directory: str) -> int:
    """Half the size of the file system that holds ``directory`` (or would, once created)."""
    return max(filesystem_bytes(directory) // 2, 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryConfig:
    """Where the node memory tier lives and how much it may hold. Values, never mutated."""

    directory: str = dataclasses.field(default_factory=default_directory)
    """The tier's directory (tmpfs), shared by this user's processes of the node."""
    budget_bytes: int = 0
    """Bytes the tier may hold; ``0`` means the default, half the directory's file system."""
    on_full: OnFull = OnFull.ERROR
    """What a checkpoint that cannot fit does (see :class:`OnFull`)."""
    exit_wait_s: float = 600.0
    """At interpreter exit, how long to let this process's write-downs to the next tier finish (what is
    left stays in the tier for ``tierckpt sync``), and its peer replication in flight (a replication cut
    short leaves the level ``memory``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", os.path.abspath(os.path.expanduser(self.directory)))
        if self.budget_bytes < 0:
            raise CheckpointError(f"MemoryConfig.budget_bytes must not be negative, got {self.budget_bytes}")
        if self.budget_bytes == 0:
            object.__setattr__(self, "budget_bytes", default_budget(self.directory))
        room = filesystem_bytes(self.directory)
        if self.budget_bytes > room:  # it could never be reached: the file system would refuse writes first
            warnings.warn(
                f"the node memory tier's budget {BYTES_ENV} ({self.budget_bytes} bytes) is larger than the file "
                f"system that holds {self.directory} ({room} bytes); the tier holds at most {room} bytes",
                RuntimeWarning, stacklevel=3,
            )
            object.__setattr__(self, "budget_bytes", max(room, 1))
        if not isinstance(self.on_full, OnFull):
            raise CheckpointError(f"MemoryConfig.on_full must be an OnFull, got {self.on_full!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> MemoryConfig:
        """A config from the environment (see the module docstring); ``overrides`` win."""
        values: dict[str, Any] = {}
        if os.environ.get(DIR_ENV):
            values["directory"] = os.environ[DIR_ENV]
        if os.environ.get(BYTES_ENV):
            values["budget_bytes"] = parse_bytes(os.environ[BYTES_ENV], BYTES_ENV, minimum=1)
        flag = os.environ.get(FULL_ENV, "").strip().lower()
        if flag:
            try:
                values["on_full"] = OnFull(flag)
            except ValueError:
                raise CheckpointError(
                    f"{FULL_ENV}={flag!r}: use 'error' (a checkpoint that does not fit fails) or 'fallback' "
                    "(it is written to the next tier instead)"
                ) from None
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise CheckpointError(f"unknown MemoryConfig fields {sorted(unknown)}")
        if isinstance(overrides.get("budget_bytes"), str):
            overrides["budget_bytes"] = parse_bytes(overrides["budget_bytes"], "budget_bytes", minimum=1)
        values.update(overrides)
        return cls(**values)
