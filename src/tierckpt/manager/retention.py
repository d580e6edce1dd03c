"""Retention of a :class:`~tierckpt.CheckpointManager` (a mixin of it): after each commit, point ``LATEST``
at the step and delete the steps no rule keeps; :meth:`RetentionMixin.delete` deletes one on request.

Rules (:meth:`RetentionMixin._kept`): the newest ``keep_last`` steps, the multiples of ``keep_every`` and the
newest step (:func:`tierckpt.native.layout.retention`); the ``keep_best`` best by metric
(:mod:`tierckpt.manager.best`); with the node memory tier on, the newest step every node records
``replicated`` and the newest step where the root points. A step is deleted ``COMMIT`` first, so a crash
midway leaves an uncommitted directory, never a committed step missing files. A store that does not answer
(listing, ``LATEST``, a deletion) defers the rest to a later save and says so (``deferred``): an outage the
node tiers cover never fails a save.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from tierckpt.native import layout
from tierckpt.comm import Comm
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, TransientStorageError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.manager.best import BestSteps
from tierckpt.store import open_chain
from tierckpt.node.memory.replica_record import recorded_level
from tierckpt.node.levels import Level

LATEST = "LATEST"
"""The root's pointer at the newest step written where it points: JSON ``{"step": N}``."""
log = logging.getLogger("tierckpt.manager.api")


class RetentionMixin:
    """See the module docstring. It uses the manager's ``root_uri``, ``storage_options``, ``group``,
    ``keep_last``, ``keep_every``, ``best``, ``deferred``, ``_replicated``, ``_awaiting``, ``_unconfirmed``
    and ``uri_of``/``wait``/``_backend``/``_listed``/``_committed_names``/``_memory_on``."""

    root_uri: str
    storage_options: dict[str, Any]
    group: Any
    keep_last: int | None
    keep_every: int | None
    best: BestSteps | None
    deferred: str | None
    _replicated: int | None
    _awaiting: list[int]
    _unconfirmed: dict[int, tuple[str, str]]

    def _agree_replicated(self) -> None:
        """With the node memory tier on and retention on: agree, in one all-gather at the start of a
        save (every rank is there), on the newest step of this manager's saves that every rank's node
        records ``replicated``. Retention keeps that step: deleting the previous step as soon as a newer one
        commits (``keep_last=1``) would leave no step whole in memory if a node were lost while the newer
        one is replicated. A step whose replication failed or is still running is not counted."""
        if not self._awaiting or (self.keep_last is None and self.best is None) or not self._memory_on():
            return
        mine = [step for step in self._awaiting if self._replicated_here(step)]
        everywhere = set.intersection(*(set(steps) for steps in Comm(self.group).all_gather_object(mine)))
        if everywhere:
            self._replicated = max(everywhere)
            self._awaiting = [step for step in self._awaiting if step > self._replicated]

    def _replicated_here(self, step: int) -> bool:
        """Whether this node's memory tier records this manager's save of ``step`` as ``replicated``; a
        record that cannot be read counts as not (the rank must still reach the agreement)."""
        try:
            tier = open_chain(self.uri_of(step), self.storage_options).node.memory_tier
            committed = tier.committed() if tier is not None else None
            result = recorded_level(tier, committed.generation) if tier is not None and committed is not None else None
        except (CheckpointError, OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("%s: the replication level of step %d is unreadable here (%s)", self.root_uri, step, exc)
            return False
        return result is not None and result.level is Level.REPLICATED

    def _after_commit(self, step: int, persisted: bool, generation: str) -> None:
        """Once ``step`` is committed (as ``generation``): every rank notes it for :meth:`wait_durable`; rank 0
        points ``LATEST`` at it (when written where the root points), then applies retention. The step is
        committed whatever happens here: an unreachable store defers both (:attr:`deferred`), never raises."""
        if persisted:
            self._unconfirmed[step] = (self.uri_of(step), generation)
        if Comm(self.group).rank != 0:
            return
        self.deferred = None
        try:
            if persisted:
                get_scheduler().run(self._backend().commit(LATEST, json.dumps({"step": step}).encode()))
        except TransientStorageError as exc:
            self._defer(f"LATEST not pointed at step {step} (the newest committed step is found without it)", exc)
        self._retain(step)

    def _defer(self, what: str, exc: TransientStorageError) -> None:
        """Report work left for a later save because the store did not answer (:attr:`deferred`)."""
        self.deferred = f"{what}: the store is unreachable ({exc}); the next save that reaches it catches up"
        log.warning("%s: %s", self.root_uri, self.deferred)

    def _retain(self, step: int) -> None:
        """Rank 0: delete the steps retention does not keep (``step`` is the newest saved); a store that does
        not answer (listing or deleting) defers it to a later save."""
        if self.keep_last is None and self.best is None:
            return  # no keep_last nor keep_best: every checkpoint is kept
        try:
            listed = self._listed()
        except TransientStorageError as exc:
            self._defer(f"retention not applied after step {step}", exc)
            return
        below = layout.by_step(layout.committed_children(listed))
        names = self._committed_names(listed)
        found = {s: names.get(s, layout.step_name(s)) for s in set(names) | {step}}
        keep = self._kept(found)
        if self._replicated in found:
            keep.add(found[self._replicated])  # the newest step whole in memory on every node (_agree_replicated)
        if below and self._memory_on():
            keep.add(below[max(below)])  # the newest step where the root points, until a newer one is there
        for name in sorted(n for n in found.values() if n not in keep):
            try:
                self._delete_named(name)
            except TransientStorageError as exc:
                self._defer(f"retention stopped before deleting {name}", exc)
                return

    def _kept(self, found: Mapping[int, str]) -> set[str]:
        """The names retention keeps of ``found`` (step -> name): :func:`tierckpt.native.layout.retention`'s (the
        newest ``keep_last`` — all without it —, multiples of ``keep_every``, the newest) and best-k's."""
        # Steps are unique here, so no commit time is needed to order them (0.0).
        entries = [(s, 0.0, n) for s, n in found.items()]
        keep = layout.retention(entries, self.keep_last, self.keep_every) if self.keep_last else set(found.values())
        if self.best is not None:
            if self.keep_last is None:  # best-k alone: the newest and keep_every's multiples, plus the best
                keep = layout.retention(entries, 1, self.keep_every)
            keep |= self.best.kept({n: f"{self.root_uri}/{n}" for n in found.values()}, self.storage_options)
        return keep

    def _delete_named(self, name: str) -> None:
        """Delete the step directory ``name``: its ``COMMIT`` first, so that a crash midway leaves an
        uncommitted directory (never a committed step missing files); the root's store also drops what the
        step's own URI still has pending in the node cache."""
        step = layout.step_of(name)
        if step is not None:
            self._unconfirmed.pop(step, None)  # deleted on purpose: no longer waited for
        backend = self._backend()
        sched = get_scheduler()
        sched.run(backend.delete(f"{name}/{layout.COMMIT}"))
        sched.run(backend.delete_prefix(f"{name}/"))

    def delete(self, step: int) -> None:
        """Delete the checkpoint of ``step`` (Orbax's ``delete``): every rank calls it, rank 0 deletes.
        Raises :class:`~tierckpt.errors.CheckpointNotFoundError` when no committed step ``step`` exists."""
        self.wait()
        names = self._committed_names()
        if step not in names:
            raise CheckpointNotFoundError(f"{self.root_uri}: no committed step {step} to delete (committed steps: "
                                          f"{sorted(names) or 'none'})")
        self._unconfirmed.pop(step, None)
        if Comm(self.group).rank == 0:
            self._delete_named(names[step])

