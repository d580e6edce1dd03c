"""The node memory tier's file system running out of space (``ENOSPC``), said as what it is.

The tier's budget (``TIERCKPT_MEMORY_BYTES``) is what admission counts against, but the file system
that holds the tier (a tmpfs, shared with whatever else the node keeps there) can fill up first. A
write that the file system refuses is then not a bare ``OSError`` from deep inside the tier:
:func:`no_space_error` names the tier directory, its file system's size and free space, the budget and
the settings; with ``TIERCKPT_MEMORY_FULL=fallback`` the memory link writes that generation to the next
tier instead (:meth:`tierckpt.node.memory.link.MemoryLink.fall_back`).
"""

from __future__ import annotations

import errno
import os

from tierckpt.node.memory.config import BYTES_ENV, FULL_ENV, MemoryConfig, MemoryTierFullError, filesystem_bytes

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is the file system refusing a write for lack of space."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in NO_SPACE:
            return True
        seen = seen.__cause__
    return False


def no_space_error(config: MemoryConfig, what: str, exc: BaseException) -> MemoryTierFullError:
    """The error for the tier's file system refusing to write ``what`` (``exc``: its error)."""
    try:
        st = os.statvfs(config.directory)
        free = f"{st.f_bavail * st.f_frsize} bytes free"
    except OSError:
        free = "free space unknown"
    return MemoryTierFullError(
        f"the node memory tier {config.directory} ran out of space writing {what} ({exc}): its file system holds "
        f"{filesystem_bytes(config.directory)} bytes ({free}), the tier's budget {BYTES_ENV} is "
        f"{config.budget_bytes} bytes. Free space there or lower {BYTES_ENV} to what the file system can hold, "
        f"set {FULL_ENV}=fallback to write such checkpoints to the next tier instead, or save with "
        "storage_options={'memory': False}"
    )
