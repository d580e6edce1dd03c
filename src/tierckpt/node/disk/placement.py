"""Where the node cache lives by default, and its default disk budget, chosen for cluster nodes.

On a cluster the home directory is often a small network share (NFS, Lustre...), a poor place for
checkpoint data every rank of the node reads and writes. So, unless ``TIERCKPT_CACHE_DIR`` names a
directory (:meth:`CacheConfig.from_env`), the directory is the first that works of:

1. ``$XDG_CACHE_HOME/tierckpt`` (``~/.cache/tierckpt``) when that file system is on this node (a
   workstation keeps the cache where it always was, across reboots);
2. ``tierckpt-cache-<uid>`` under the first of ``$TMPDIR``, ``/local``, ``/scratch``, ``/tmp`` that exists,
   is writable and is on a disk of this node (not a network file system, and not ``tmpfs``, whose
   pages would compete with training for memory);
3. ``~/.cache/tierckpt`` even on a network file system; else ``/tmp/tierckpt-cache-<uid>``.

Each is created ``0700`` and, like a directory ``TIERCKPT_CACHE_DIR`` names, must be this user's own when
the cache opens it (:mod:`tierckpt.node.private`): a guessable name another user made first is refused.

The budget, unless ``TIERCKPT_CACHE_BYTES`` or ``CacheConfig.disk_bytes`` sets it, is the smaller of
:data:`DEFAULT_DISK_BYTES` and half the size of the directory's file system.
Each choice comes with the reason, which ``tierckpt status`` prints.
"""

from __future__ import annotations

import os

from tierckpt.monitor import format_bytes

DEFAULT_DISK_BYTES = 100 * 2**30
"""The most the default budget gives the node cache (100 GiB)."""
SIZE_FRACTION = 0.5
"""The share of the file system's size the default budget may take."""
MOUNTS = "/proc/self/mounts"
"""The mount table read to tell file systems on this node from network ones."""
SCRATCH_DIRS = ("/local", "/scratch", "/tmp")
"""Node-local scratch locations tried after ``$TMPDIR``."""
NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "fuse.glusterfs",
    "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "9p", "panfs", "wekafs", "afs", "ocfs2", "orangefs",
})
"""File system types whose data lives off this node."""
MEMORY_FS = frozenset({"tmpfs", "ramfs"})
"""File system types held in this node's memory."""


def fs_type(path: str) -> str | None:
    """The type of the file system holding ``path`` (its nearest mount point in :data:`MOUNTS`), if known."""
    try:
        with open(MOUNTS, encoding="utf-8") as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, kind = "", None
    for row in rows:
        if len(row) < 3:
            continue
        point = row[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, row[2]
    return kind


def _on_node_disk(path: str) -> bool:
    kind = fs_type(path)
    return kind is not None and kind not in NETWORK_FS and kind not in MEMORY_FS


def _usable(directory: str) -> bool:
    """Create ``directory`` if needed (``0700``: node tiers are private to their user); whether this process
    can write there. Whose it is, is checked where the cache opens it (:mod:`tierckpt.node.private`)."""
    try:
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def default_directory() -> tuple[str, str]:
    """The default node cache directory and why it was chosen (see the module docstring)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = os.path.join(base, "tierckpt")
    home_kind = fs_type(base if os.path.exists(base) else os.path.dirname(base) or "/")
    if home_kind is not None and home_kind not in NETWORK_FS and home_kind not in MEMORY_FS and _usable(home):
        return home, f"the user cache directory, on a disk of this node: {home_kind}"
    leaf = f"tierckpt-cache-{os.getuid()}"
    scratch = [("$TMPDIR", os.environ["TMPDIR"])] if os.environ.get("TMPDIR") else []
    scratch += [(d, d) for d in SCRATCH_DIRS]
    for name, root in scratch:
        if os.path.isdir(root) and _on_node_disk(root) and _usable(os.path.join(root, leaf)):
            why = "on a network file system" if home_kind in NETWORK_FS else "not on this node's disk"
            return os.path.join(root, leaf), f"node-local scratch {name}, {fs_type(root)}; {base} is {why}"
    if _usable(home):
        return home, f"the user cache directory, {home_kind or 'file system unknown'}; no node-local scratch found"
    return os.path.join("/tmp", leaf), f"{home} is not writable"


def size_bytes(directory: str) -> int | None:
    """The size of the file system of ``directory`` (or of its nearest existing parent), in bytes."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def default_disk_bytes(directory: str) -> tuple[int, str]:
    """The default budget for a cache in ``directory`` and why (see the module docstring).

    A share of the file system's size, not of its free space: the free space shrinks as the cache
    fills, and a budget computed from it would shrink with every config made."""
    size = size_bytes(directory)
    if size is None:
        return DEFAULT_DISK_BYTES, "the default (the file system's size is unknown)"
    share = int(size * SIZE_FRACTION)
    if share >= DEFAULT_DISK_BYTES:
        return DEFAULT_DISK_BYTES, "the default cap (100 GiB)"
    return share, f"half of its {format_bytes(size)} file system"
