"""Managing a series of checkpoints under one root: save every N steps, keep some, find the latest.

::

    <root>/step-00000100/...     one checkpoint per saved step (see docs/format.md)
    <root>/step-00000200/...
    <root>/LATEST                JSON {"step": 200}, replaced atomically after each commit

Lifecycle of :meth:`CheckpointManager.save` (every rank of the group):

1. If ``step`` is not a multiple of ``save_every`` (and not forced, and no rank received a preemption
   notice: :mod:`tierckpt.manager.preemption`), nothing happens.
2. The state is saved to ``<root>/step-<step>`` (synchronously, or with :func:`tierckpt.async_save`).
3. Once that checkpoint is committed, every rank notes its generation for :meth:`wait_durable`, and rank 0
   points ``LATEST`` at it and applies retention (:mod:`tierckpt.manager.retention`: ``keep_last``,
   ``keep_every``, best-k by metric, the newest step always kept). A store that does not answer defers
   both to a later save (:attr:`~CheckpointManager.deferred`): an outage the node tiers cover never
   makes ``save`` raise.
   For an async save this happens when its handle is waited on (:meth:`wait`, the next :meth:`save`,
   :meth:`load_latest` or :meth:`close`).
4. :meth:`wait_durable` confirms each noted step as this job's on the remote: its ``COMMIT`` there names
   the generation this job wrote (:mod:`tierckpt.manager.durable`), else it raises naming the steps.

``LATEST`` is a hint, never the truth: :meth:`latest` and :meth:`load_latest` take the newest committed
step of the root's listing, this node's memory tier and ``LATEST`` (a job killed between a step's
``COMMIT`` and ``LATEST`` leaves ``LATEST`` behind).

With the node memory tier on (``TIERCKPT_MEMORY=on`` or the storage option ``memory``), the steps the
manager sees are those committed in any tier it can reach: the root's listing (when the remote answers)
plus the checkpoints committed in this node's memory tier, so a restart after a crash resumes from memory
even while the remote is down (``LATEST`` is then read where it can be, else the newest step wins).
:meth:`levels` reports each durability level of a step. :meth:`load_latest` resumes from the newest
step the group can load: one whose files are reachable nowhere (a node lost before its files reached a
peer or the remote) is skipped, with a warning, for the next older one.

``persist_every`` (node memory tier on): every step the manager saves goes into node memory (and to the
peers), but only steps that are a multiple of ``persist_every`` (or of ``keep_every``), and forced saves
(``force=True``, e.g. the last one before the job ends), are written where the root points; the others
are saved with ``persist=False`` (:func:`tierckpt.save`); ``save(..., persist=...)`` overrides it. ``LATEST`` names
the newest step written there; :meth:`latest` also sees the newer steps this node's memory holds.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch.distributed as dist

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.backends.bounded import MAX_RECORD_BYTES
from tierckpt.comm import Comm
from tierckpt.errors import (
    CheckpointError, CheckpointNotFoundError, CollectiveError, MissingFileError, NotDurableError,
    StorageUnreachableError, TransientStorageError,
)
from tierckpt.io.scheduler import get_scheduler
from tierckpt.loading.api import load
from tierckpt.manager.best import BestSteps
from tierckpt.manager.durable import confirm_own_commits
from tierckpt.manager.retention import LATEST, RetentionMixin
from tierckpt.manager.preemption import PreemptionWatch
from tierckpt.saving.api import SaveHandle, async_save, save
from tierckpt.store import (
    durability_of, memory_config_for, memory_keys_under, memory_levels, node_only_reason, open_store,
)

AWAITED_STEPS = 8
"""How many of its newest saved steps the manager checks for ``replicated`` at each save."""
log = logging.getLogger(__name__)


class CheckpointManager(RetentionMixin):
    """Saves, retains and finds the checkpoints of one training run (see the module docstring).

    ``root_uri``: a URI or a local path (``str`` or :class:`os.PathLike`); ``save_every``: steps between
    saves; ``keep_last``/``keep_every``: retention (``None``: keep all); ``best_fn``/``best_mode``/``keep_best``:
    also keep the ``keep_best`` steps whose ``save(..., metrics=...)`` score best (:mod:`tierckpt.manager.best`);
    ``use_async``: save with :func:`tierckpt.async_save`; ``persist_every`` (node memory tier on): write only
    every N-th step where the root points, the others to node memory (and the peers) only;
    ``save_on_preemption``: a SIGTERM makes the next step a forced save (:mod:`tierckpt.manager.preemption`).
    Usable as a context manager: leaving it waits for the save in flight and closes (:meth:`close`).
    """

    def __init__(
        self,
        root_uri: str | os.PathLike[str],
        *,
        save_every: int = 1,
        keep_last: int | None = None,
        keep_every: int | None = None,
        use_async: bool = False,
        group: dist.ProcessGroup | None = None,
        storage_options: Mapping[str, Any] | None = None,
        persist_every: int | None = None,
        best_fn: Callable[[Mapping[str, Any]], float] | None = None,
        best_mode: str = "max",
        keep_best: int | None = None,
        save_on_preemption: bool = False,
    ) -> None:
        if save_every < 1 or any(n is not None and n < 1 for n in (keep_last, keep_every, persist_every, keep_best)):
            raise CheckpointError(
                "save_every, keep_last, keep_every, keep_best and persist_every must be positive integers (or "
                "None: keep all, persist all)"
            )
        if (best_fn is None) != (keep_best is None):
            raise CheckpointError(
                "CheckpointManager: best_fn and keep_best go together (keep the keep_best steps whose metrics "
                "best_fn scores best): pass both, or neither"
            )
        self.root_uri = os.fspath(root_uri).rstrip("/")
        self.save_every = save_every
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.use_async = use_async
        self.group = group
        self.storage_options = dict(storage_options or {})
        self.persist_every = persist_every
        if persist_every is not None and not self._memory_on():
            raise CheckpointError(
                f"CheckpointManager({self.root_uri!r}, persist_every={persist_every}) keeps the steps between "
                "persisted ones in the node memory tier, and it is off for this root: turn it on "
                "(TIERCKPT_MEMORY=on or storage_options memory=True) or leave persist_every unset"
            )
        self._pending: tuple[int, SaveHandle, bool] | None = None
        self._replicated: int | None = None
        """The newest step of this manager's saves that every rank's node records ``replicated`` (memory
        tier on): retention keeps it whatever ``keep_last`` says."""
        self._awaiting: list[int] = []
        """This manager's newest saved steps not yet known ``replicated`` on every node (at most
        :data:`AWAITED_STEPS`)."""
        self.best = BestSteps(best_fn, best_mode, keep_best) if best_fn is not None and keep_best is not None else None
        self._unconfirmed: dict[int, tuple[str, str]] = {}
        """Steps this manager saved where the root points and :meth:`wait_durable` has not yet confirmed as
        its own on the remote: step -> (URI, generation)."""
        self.deferred: str | None = None
        """Why ``LATEST`` or retention was last left for a later save (the store unreachable), else ``None``;
        the next save that reaches the store catches up."""
        self._saved: set[int] = set()
        """The steps this manager saved: :meth:`should_save` does not save one twice."""
        self.preemption = PreemptionWatch() if save_on_preemption else None
        if self.preemption is not None:
            self.preemption.start()

    def uri_of(self, step: int) -> str:
        """Where a save of ``step`` goes: ``<root>/step-00000100``."""
        return f"{self.root_uri}/{layout.step_name(step)}"

    def persists(self, step: int) -> bool:
        """Whether a save of ``step`` is written where the root points (see ``persist_every``)."""
        every = self.persist_every
        return every is None or step % every == 0 or (self.keep_every is not None and step % self.keep_every == 0)

    def _committed_names(self, listed: list[str] | None = None) -> dict[int, str]:
        """Committed step -> its directory (``step-00000100``, or ``step-100`` made by hand; padded wins), in
        the root's listing (``listed``: already read) and in this node's memory tier (the listing may fail
        while the tier answers)."""
        in_memory = self._memory_keys()
        if listed is None:
            try:
                listed = self._listed()
            except TransientStorageError:
                if not in_memory:
                    raise
                listed = []
        return layout.by_step(layout.committed_children(sorted(set(listed) | set(in_memory))))

    def _memory_keys(self) -> list[str]:
        return memory_keys_under(self.root_uri, self.storage_options.get("memory"))

    def _listed(self) -> list[str]:
        """The root's listing: where the root points (through the node cache, when there is one)."""
        return get_scheduler().run(self._backend().list(""))

    def _memory_on(self) -> bool:
        return memory_config_for(self.root_uri, self.storage_options.get("memory")) is not None

    def saved_uri_of(self, step: int) -> str:
        """The URI of the existing checkpoint of ``step``, whatever its name's padding (``step-100`` too)."""
        return f"{self.root_uri}/{self._committed_names().get(step, layout.step_name(step))}"

    def _backend(self) -> Backend:
        return open_store(self.root_uri, self.storage_options)

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` of ``step`` saves: a multiple of ``save_every`` this manager has not saved yet,
        or (``save_on_preemption``) any rank received SIGTERM — then a collective: call it on every rank."""
        self.uri_of(step)  # refuses what is not a step
        if self.reached_preemption(step):
            return step not in self._saved
        return step % self.save_every == 0 and step not in self._saved

    def reached_preemption(self, step: int) -> bool:
        """Whether any rank received SIGTERM (``save_on_preemption``; else ``False``): the job should save
        ``step`` and exit. A collective once watching: every rank calls it at the same step."""
        return self.preemption is not None and self.preemption.reached(Comm(self.group))

    def save(self, step: int, state: Mapping[str, Any], *, force: bool = False,
             metrics: Mapping[str, Any] | None = None, **options: Any) -> bool:
        """Save ``state`` as ``step`` (a non-negative integer) when it is due (or forced, or after a
        preemption notice: :meth:`reached_preemption`); returns whether a save was started. ``metrics``
        (a JSON object) are stored in the step's header and ranked by ``best_fn`` for best-k retention.
        An outage the node tiers cover never makes it raise: ``LATEST`` and retention wait for a later save
        (:attr:`deferred`)."""
        self.uri_of(step)  # refuses what is not a step before anything else
        force = force or self.reached_preemption(step)
        if step % self.save_every and not force:
            return False
        self._agree_replicated()
        self.wait()
        persist = bool(options.pop("persist", force or self.persists(step)))  # a forced save (the last one) persists
        if self.best is not None:
            options["tags"] = {**(options.get("tags") or {}), **self.best.tags_of(self.uri_of(step), metrics)}
        elif metrics is not None:
            raise CheckpointError(f"save of step {step} to {self.root_uri!r}: metrics are ranked by best_fn, and "
                                  "this manager has none; pass best_fn and keep_best, or drop metrics")
        common = dict(group=self.group, storage_options=self.storage_options, persist=persist, **options)
        self._awaiting = [*self._awaiting, step][-AWAITED_STEPS:]
        if self.use_async:
            self._pending = (step, async_save(self.uri_of(step), state, **common), persist)
            self._saved.add(step)
        else:
            meta = save(self.uri_of(step), state, **common)
            self._saved.add(step)
            self._after_commit(step, persist, meta.generation)
        return True

    def wait(self) -> None:
        """Block until an async save in flight is committed, then update ``LATEST`` and retention."""
        if self._pending is not None:
            step, handle, persist = self._pending
            self._pending = None
            meta = handle.wait()
            self._after_commit(step, persist, meta.generation)

    def wait_durable(self, timeout_s: float | None = None) -> None:
        """Block until the save in flight is committed and every step this manager saved where the root
        points since the last such wait is committed there *as its own* — the remote's ``COMMIT`` names the
        generation this job wrote, its uploads done (:mod:`tierckpt.manager.durable`) — then for ``LATEST``.
        An outage is waited through. Raises :class:`~tierckpt.errors.NotDurableError` naming the steps whose
        ``COMMIT`` is another job's (a job still saving to the same root) or whose upload failed for good,
        and :class:`~tierckpt.errors.TransientStorageError` naming those still uploading at ``timeout_s``; the
        steps stay waited for by the next call. A step saved to memory only (``persist_every``) is not
        waited for."""
        pending = self._pending
        self.wait()
        outcome = confirm_own_commits(self._unconfirmed, self.storage_options, timeout_s)
        for step in set(self._unconfirmed) - set(outcome.not_own) - set(outcome.unfinished):
            del self._unconfirmed[step]
        if outcome.not_own:
            unfinished = f"; still uploading: {_named(outcome.unfinished)}" if outcome.unfinished else ""
            raise NotDurableError(
                f"{self.root_uri}: step(s) {sorted(outcome.not_own)} are not durable as this job's saves: "
                f"{_named(outcome.not_own)}{unfinished}. Another job may be saving to the same root: stop it, "
                "or give each job its own root, then save these steps again"
            )
        if outcome.unfinished:
            raise TransientStorageError(
                f"{self.root_uri}: step(s) {sorted(outcome.unfinished)} did not reach the remote within {timeout_s} s "
                f"({_named(outcome.unfinished)}); they stay in the node tiers and upload in the background"
            )
        durable = durability_of(self._backend())
        if durable is not None:
            get_scheduler().run(durable.wait_durable(None, timeout_s))
        if pending is not None and pending[2] and self._memory_on() and Comm(self.group).rank == 0:
            self._retain(pending[0])  # the step kept until this one was written down may go now

    def durable_where_uri_points(self, step: int) -> bool:
        """Whether ``step`` is committed on the remote itself, not only in this node's cache (a write-back
        save whose upload is pending or failed); ``steps()`` and ``latest()`` count both."""
        uri = self.saved_uri_of(step)
        return self._committed(step) and node_only_reason(open_store(uri, self.storage_options)) is None

    def steps(self) -> list[int]:
        """Committed steps under the root, ascending, as this node sees them: including one committed in
        its cache whose upload is still pending (:meth:`durable_where_uri_points` tells them apart)."""
        found = set(self._committed_names())
        pointed = self._pointed_step()
        if pointed is not None and pointed not in found and self._committed(pointed):
            found.add(pointed)
        return sorted(found)

    def latest(self) -> int | None:
        """The newest committed step: the newest of the root's listing, this node's memory tier and
        ``LATEST`` — ``LATEST`` may lag (a job killed between a step's ``COMMIT`` and ``LATEST``, or
        ``LATEST`` deferred by an outage), so it never hides a newer committed step."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _pointed_step(self) -> int | None:
        try:
            return int(json.loads(get_scheduler().run(self._backend().get_capped(LATEST, MAX_RECORD_BYTES)))["step"])
        except (CheckpointNotFoundError, ValueError, KeyError, TypeError):
            return None
        except TransientStorageError:
            if not self._memory_on():
                raise
            return None  # unreachable: the newest step committed in a tier that answers wins

    def levels(self, step: int) -> dict[str, bool] | None:
        """``{level: reached}`` of ``step`` (memory, replicated, local, remote) when the node memory tier is
        on, else ``None`` (then :meth:`durable_where_uri_points` tells node cache from remote)."""
        return memory_levels(open_store(self.saved_uri_of(step), self.storage_options))

    def _committed(self, step: int) -> bool:
        """Whether ``step`` has a COMMIT, asked through the step's own URI (its node-cache scope)."""
        backend = open_store(self.uri_of(step), self.storage_options)
        return bool(get_scheduler().run(backend.exists(layout.COMMIT)))

    def load_latest(self, state: dict[str, Any], *, fall_back: bool = True, **options: Any) -> int | None:
        """Load the newest committed step the group can load into ``state``; returns the step loaded, or
        ``None`` if there is none.

        The ranks first agree on the steps to try (each node may see others in its memory tier): the
        newest any rank finds (:meth:`latest`), then, with ``fall_back``, every older step any rank finds.
        Every rank takes part even when it cannot look: a rank whose listing fails (the remote unreachable,
        nothing in its node's memory — a fresh node that replaced a lost one) contributes "unknown", and
        the steps the others find in the tiers they reach are loaded (the group's load reads what the fresh
        node lacks from its peers). Only when no rank finds a step and some could not look is
        :class:`~tierckpt.errors.StorageUnreachableError` raised, on every rank.
        A step some of whose files the group reaches nowhere (:class:`~tierckpt.errors.MissingFileError`:
        with the node memory tier, a node lost before its files of the step reached a peer or the remote),
        whose files only an unreachable remote holds (:class:`~tierckpt.errors.TransientStorageError`), or
        that is gone (:class:`~tierckpt.errors.CheckpointNotFoundError`) fails before any tensor is
        modified; the next step is then tried, and a warning names each step skipped and why — so a
        restart after a node loss resumes from the newest checkpoint that is whole in the reachable tiers.
        Every other error (a checksum mismatch, a state that does not match) is raised, as is the newest
        step's error when no step loads.
        """
        self.wait()
        comm = Comm(self.group)
        found = comm.all_gather_object(self._found_here(fall_back))  # every rank takes part, even one that sees nothing
        newest = max((latest for latest, _, _ in found if latest is not None), default=None)
        unknown = [error for _, _, error in found if error is not None]
        if newest is None:
            if unknown:  # no rank found a step, and some could not look: not "there is none"
                raise StorageUnreachableError(
                    f"{self.root_uri}: no rank finds a committed step in a tier it reaches, and {len(unknown)} "
                    f"rank(s) could not list the root ({unknown[0]}); check the store's endpoint, then retry"
                )
            return None
        names = {step: name for _, steps, _ in reversed(found) for step, name in steps.items()}
        older = sorted({s for s in names if s < newest}, reverse=True) if fall_back else []
        candidates = [newest, *older]
        first: CheckpointError | None = None
        for step in candidates:
            try:
                uri = f"{self.root_uri}/{names.get(step, layout.step_name(step))}"
                load(uri, state, group=self.group, storage_options=self.storage_options, **options)
            except CollectiveError:
                raise  # the group itself failed: no agreement can be reached
            except CheckpointError as exc:
                unreachable = isinstance(exc, (MissingFileError, CheckpointNotFoundError, TransientStorageError))
                if step == candidates[-1]:
                    raise (first or exc) if unreachable else exc
                # The load's errors are agreed, but their types may differ between ranks: one decision for all.
                if not all(comm.all_gather_object(unreachable)):
                    raise
                first = first or exc
                log.warning("%s: step %d cannot be loaded (%s); trying the next older step", self.root_uri, step, exc)
                continue
            if step != newest:
                log.warning("%s: resumed from step %d, not the newest committed step %d", self.root_uri, step, newest)
            return step
        return None  # not reached: the last candidate either loads or raises

    def _found_here(self, fall_back: bool) -> tuple[int | None, dict[int, str], str | None]:
        """What this rank contributes to :meth:`load_latest`'s agreement: the newest step it finds, the
        steps it finds (step -> directory; only the newest without ``fall_back``), and why it could not
        look (``None``: it could). A rank whose root listing fails (the remote unreachable and nothing in
        this node's memory tier, e.g. a fresh node replacing a lost one) contributes "unknown", not an
        exception, so the ranks that do find steps still agree with it."""
        try:
            latest = self.latest()
            names = self._committed_names() if latest is not None else {}
        except TransientStorageError as exc:
            return None, {}, str(exc)
        if latest is not None and latest not in names:
            names[latest] = layout.step_name(latest)
        if not fall_back:
            names = {latest: names[latest]} if latest is not None else {}
        return latest, names, None

    def close(self) -> None:
        """Wait for the save in flight (committed, ``LATEST`` and retention applied) and stop watching for
        preemption (Orbax's ``close``); uploads go on behind, and the process drains them at exit."""
        try:
            self.wait()
        finally:
            if self.preemption is not None:
                self.preemption.stop()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _named(reasons: Mapping[int, str]) -> str:
    """``step N: why; step M: why`` for an error message."""
    return "; ".join(f"step {step}: {why}" for step, why in sorted(reasons.items()))

