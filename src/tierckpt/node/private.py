"""Node tiers are private to their user: the one check of a node tier's directory (:func:`private_directory`).

A node may have other users. The node cache and the memory tier hold checkpoint data (private weights)
and pending uploads (which ``sync`` sends with this user's credentials), so another user must neither
read them nor plant or swap anything in them. Each tier's directory is created ``0700`` (its files
are then reachable by this user alone, whatever their own modes) and checked every time a process
opens it, before anything is read or written there:

* the directory is owned by this user (the effective uid) and not writable by group or others;
* no directory above it is writable by another user who could replace it (a directory writable by
  others is safe only with the sticky bit, as ``/tmp`` and ``/dev/shm`` have, and only when root
  or this user owns it);
* no symlink on the way is another user's (root's and this user's own are theirs to make).

Anything else raises :class:`~tierckpt.errors.NodeTierNotPrivateError` naming the directory, its owner
and mode, and the setting that moves the tier.
"""

from __future__ import annotations

import os
import stat

from tierckpt.errors import NodeTierNotPrivateError

TRUSTED_UIDS = frozenset({0})
"""Owners besides this user whose directories and symlinks on the way are trusted (root)."""


_PASSED: dict[str, tuple[int, int, int, int, int]] = {}
"""Directories this process found private: path -> the directory's (device, inode, owner, mode) then, and the
user who checked. A directory that passed can change only by this user's or root's hand (no other user may
write it or any directory above it), so the next check of the same directory, unchanged, is one ``stat``
instead of a walk up to ``/`` (a checkpoint's save opens its node tiers several times)."""


def private_directory(path: str, what: str, setting: str, *, create: bool = True) -> str:
    """Check (``create``: first make, ``0700``) the directory ``path`` of the node tier ``what`` (e.g.
    ``"node cache"``), moved by the environment variable ``setting``; return ``path``. A directory that
    does not exist and is not created is not checked (nothing can be read from it)."""
    me = os.geteuid()
    if create and not os.path.lexists(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass  # made meanwhile by another process: checked below like any other
        else:
            os.chmod(path, 0o700)  # whatever the umask
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if create:
            raise
        return path
    identity = (st.st_dev, st.st_ino, st.st_uid, st.st_mode, me)
    if _PASSED.get(path) == identity:
        return path
    problem = _ancestry_problem(path, me)
    if problem is None and not stat.S_ISDIR(st.st_mode):
        problem = "it is not a directory"
    elif problem is None and st.st_uid != me:
        problem = f"it belongs to uid {st.st_uid}, not to this user (uid {me})"
    elif problem is None and st.st_mode & 0o022:
        problem = "other users may write to it"
    if problem is not None:
        raise NodeTierNotPrivateError(
            f"the {what} directory {path} is not private to this user: {problem} (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}). Another user could read its checkpoints or plant data there, so "
            f"nothing in it was used. Point {setting} at a directory of your own (it is created 0700), or, if "
            f"{path} is yours, make it so: chown {me} {path} && chmod 700 {path}"
        )
    _PASSED[path] = identity
    return path


def _ancestry_problem(path: str, me: int) -> str | None:
    """Why the way to ``path`` is not this user's to trust (``None``: it is): a symlink of another user on
    it, or a directory above it that another user may write without the sticky bit's protection."""
    trusted = TRUSTED_UIDS | {me}
    current = os.path.abspath(path)
    parts = current.strip("/").split("/")
    walked = "/"
    for i, part in enumerate(parts):
        walked = os.path.join(walked, part)
        st = os.lstat(walked)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
            return f"{walked} on its path is a symlink of uid {st.st_uid}"
        if i == len(parts) - 1:
            break
        target = os.stat(walked)
        shared = target.st_mode & 0o022 and not (target.st_mode & stat.S_ISVTX and target.st_uid in trusted)
        if target.st_uid not in trusted or shared:
            return f"{walked} above it may be changed by another user (owner uid {target.st_uid}, mode " \
                   f"{stat.S_IMODE(target.st_mode):04o})"
    return None
