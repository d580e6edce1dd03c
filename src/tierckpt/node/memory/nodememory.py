"""The node memory tier directory as a whole: :class:`NodeMemory` (every URI's tier, admission under the budget).

One URI's files are a :class:`~.memory.MemoryTier`; this is the directory they all live in
(``TIERCKPT_MEMORY_DIR``), with the node-wide lock under which admissions evict (:mod:`.eviction`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from tierckpt.errors import StorageError
from tierckpt.backends.bounded import MAX_URI_FILE_BYTES, read_capped
from tierckpt.native.layout import CommitRecord, is_superseded
from tierckpt.node import lifecycle
from tierckpt.node.private import private_directory
from tierckpt.node.memory.config import DIR_ENV, MemoryConfig
from tierckpt.node.memory.eviction import Admission, TierCopy, copy_id, plan_admission
from tierckpt.node.memory.memory import SPARE_PREFIX, MemoryTier
from tierckpt.node.memory.pagepool import retire


CREDIT_SHARE = 16
CREDIT_MAX = 1 << 30
CREDIT_S = 2.0
"""After an admission, a process may write up to 1/16 of the tier's free room (at most 1 GiB) into the tier
— of any checkpoint, for :data:`CREDIT_S` — before its next admission walks the node's tier again: 16
processes writing at once at most fill the free room, so the budget holds for up to 16 writers of a node.
A save loop that checkpoints every few hundred milliseconds then walks the tier about once per save and
node process instead of once per file (each walk lists and stats every generation of every URI); the
time bound keeps a credit from outliving the room it was measured against."""

_credits: dict[tuple[str, int], tuple[int, float]] = {}
"""This process's credit in each tier (directory, budget): bytes, and until when (``time.monotonic``)."""
_credit_lock = threading.Lock()


def _forget_credits_after_fork() -> None:
    """A forked child starts without its parent's credit (it would be spent twice)."""
    global _credit_lock
    _credit_lock = threading.Lock()
    _credits.clear()


lifecycle.after_fork_in_child(_forget_credits_after_fork)


class NodeMemory:
    """The node memory tier directory as a whole: every URI's copies, and admission under the budget."""

    def __init__(self, config: MemoryConfig | None = None) -> None:
        self.config = config if config is not None else MemoryConfig.from_env()
        private_directory(self.config.directory, "node memory tier", DIR_ENV, create=False)

    def tier(self, uri: str) -> MemoryTier:
        return MemoryTier(uri, self.config)

    def tiers(self) -> list[MemoryTier]:
        """Every URI with a directory in the tier."""
        out = []
        base = self.config.directory
        for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            path = os.path.join(base, name, "URI")
            if os.path.isfile(path):
                out.append(self.tier(read_capped(path, MAX_URI_FILE_BYTES).decode(errors="replace")))
        return out

    def copies(self) -> list[TierCopy]:
        return [c for t in self.tiers() for c in t.copies()]

    def admit(self, uri: str, generation: str, nbytes: int,
              durable_below: Iterable[str] | Callable[[], Iterable[str]], *, evict: bool = True,
              owed_below: Iterable[str] | Callable[[], Iterable[str]] = ()) -> Admission:
        """Make room for ``nbytes`` of ``generation`` of ``uri`` before writing it, evicting what
        :func:`~.eviction.plan_admission` allows, under the node-wide lock (see :mod:`.eviction`).
        The generation being admitted is never evicted for itself (replicas of a generation arrive
        beside the node's own files of it). ``durable_below`` and ``owed_below`` may be functions: they
        are called (under the lock) only when something must be evicted. ``evict=False``: admitted only
        into free room (what holds no checkpoint, a spare, never evicts one)."""
        if self.take_credit(nbytes):
            return Admission(fits=True, evict=(), used_bytes=None)
        incoming = copy_id(uri, generation)
        with self._locked():
            tiers = {t.uri: t for t in self.tiers()}
            copies = [c for t in tiers.values() for c in t.copies()]
            used = sum(c.nbytes for c in copies)
            fits = used + nbytes <= self.config.budget_bytes
            if not fits and not evict:
                return Admission(fits=False, evict=(), used_bytes=used, reason="no free room, and it may not evict")
            durable = set() if fits else set(durable_below() if callable(durable_below) else durable_below) - {incoming}
            owed = set() if fits else set(owed_below() if callable(owed_below) else owed_below)
            admission = plan_admission(
                copies, nbytes, self.config.budget_bytes, durable, incoming=incoming, on_full=self.config.on_full,
                owed_below=owed,
            )
            for victim in admission.evict:
                owner, _, gen = victim.rpartition("/")
                tiers[owner].evict(gen)
            if admission.fits:
                free = self.config.budget_bytes - used - nbytes  # before the evictions: never more than there is
                with _credit_lock:
                    _credits[self._credit_key] = (max(0, min(free // CREDIT_SHARE, CREDIT_MAX)),
                                                  time.monotonic() + CREDIT_S)
            return admission

    @property
    def _credit_key(self) -> tuple[str, int]:
        return self.config.directory, self.config.budget_bytes

    def take_credit(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit into this process's credit (taken from it): admitted without walking the
        node's tier (see :data:`CREDIT_SHARE`)."""
        with _credit_lock:
            credit, until = _credits.get(self._credit_key, (0, 0.0))
            if nbytes > credit or time.monotonic() > until:
                return False
            _credits[self._credit_key] = (credit - nbytes, until)
            return True

    def retire(self, tier: MemoryTier, generation: str, committed: CommitRecord | None = None) -> int:
        """Drop ``generation`` of ``tier`` (a deletion, not an admission): when ``committed`` (the group's commit,
        known to the caller), else the tier's ``COMMIT``, makes it superseded, its data files nobody reads go to
        the tier's page pool (:mod:`.pagepool`) instead of being unlinked. Returns the bytes pooled."""
        with self._locked():
            record = committed if committed is not None else tier.committed()
            pooled = 0
            if record is not None and generation != record.generation and is_superseded(generation, record) \
                    and not generation.startswith(SPARE_PREFIX):
                pooled = retire(tier.root, generation)
            tier.evict(generation)
            return pooled

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The node-wide lock of admissions (a usage walk sees no file move under it)."""
        path = os.path.join(private_directory(self.config.directory, "node memory tier", DIR_ENV), ".lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # never a bare OSError: it may surface from a failed save's cleanup
            raise StorageError(f"the node memory tier's lock {path} cannot be opened ({exc.strerror}); point "
                               f"{DIR_ENV} at a directory of your own") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
