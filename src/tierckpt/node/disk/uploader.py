"""The :class:`Uploader`: what this process has in flight through one node-cache directory.

One per process and cache directory (:func:`tierckpt.store.uploader_of` keeps it and shares it between
every store of that directory), it owns the directory's catalogue (LMDB allows one handle per process),
the engine's task runner of its uploads (:class:`~tierckpt.node.runner.TaskRunner`, one task per
``(root hash, key)``), the uploads that follow a file while it is written (``tail_upload``), the limit on
concurrent uploads, the files already checked, and the exit drain's wait for them. The tails and the
slots are touched on the I/O scheduler's loop; the runner and the checked-files set are thread-safe.
"""

from __future__ import annotations

import asyncio
import os

from tierckpt.errors import NodeTierNotPrivateError
from tierckpt.node.journal import Outstanding
from tierckpt.node.private import private_directory
from tierckpt.node.runner import TaskRunner
from tierckpt.node.disk.catalog import Catalog
from tierckpt.node.disk.config import cache_error
from tierckpt.node.disk.local_files import VerifiedFiles
from tierckpt.node.disk.tail_upload import TailUpload

EXIT_STALL_S = 5.0
"""The exit drain stops waiting once uploads fail and none has finished for this long (it then reports)."""


class Uploader:
    """This process's uploads through the cache directory ``directory`` (see the module docstring)."""

    def __init__(self, directory: str, upload_concurrency: int, exit_wait_s: float) -> None:
        self.directory = directory
        try:  # the node cache is this user's own (writeback.private), checked before its catalogue is read
            private_directory(directory, "node cache", "TIERCKPT_CACHE_DIR")
        except NodeTierNotPrivateError:
            raise
        except OSError as exc:
            raise cache_error(directory, "creating it", exc) from exc
        self.catalog = Catalog(directory)
        """The catalogue of the directory: this process's one handle on it (LMDB allows no second)."""
        self.upload_concurrency = upload_concurrency
        self.exit_wait_s = exit_wait_s
        self.runner = TaskRunner()
        """The task uploading each pending op of this process, keyed by ``(root hash, key)``."""
        self.tails: dict[tuple[str, str], TailUpload] = {}
        """(root hash, key) -> the upload following the key's file while it is written."""
        self.verified = VerifiedFiles()
        self._slots: asyncio.Semaphore | None = None

    def slots(self) -> asyncio.Semaphore:
        """At most ``upload_concurrency`` uploads at once (created on the loop that uses it)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.upload_concurrency)
        return self._slots

    def drain(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` for this process's uploads (the I/O loop must still run); one line per
        store left with ops this process owns, naming the command that finishes them."""
        if not os.path.exists(self.catalog.path):
            return []  # the directory is gone (a test's temporary cache)
        catalog, me = self.catalog, os.getpid()

        def mine() -> list[tuple[str, Outstanding]]:  # the journal protocol: what this process still owes
            return [(rh, o) for rh in catalog.roots() for o in catalog.outstanding(rh) if o.owner == me]

        self.runner.wait(timeout_s, stall_s=EXIT_STALL_S)  # failing and stalled: report instead
        roots = catalog.roots()
        left: dict[str, list[Outstanding]] = {}
        for rh, rec in mine():
            left.setdefault(roots[rh], []).append(rec)
        lines = []
        for uri, recs in sorted(left.items()):
            errors = [r.error for r in recs if r.error]
            why = f"failed: {errors[0]}" if errors else "not finished"
            lines.append(
                f"tierckpt: {len(recs)} upload(s) to {uri} did not finish before exit ({why}); what they hold is "
                f"committed in this node's cache only. Finish them: TIERCKPT_CACHE_DIR={self.directory} tierckpt "
                f"sync {uri} (or discard them: tierckpt sync --drop {uri})"
            )
        return lines
