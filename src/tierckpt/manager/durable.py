"""Whether a :class:`~tierckpt.CheckpointManager`'s saves are durable *as its own* (:meth:`wait_durable`).

A save through a write-back store is committed on this node first and uploaded behind; its ``COMMIT``
reaches the remote by a compare-and-swap against the ``COMMIT`` the save started from. Another job saving
the same steps to the same root (a job restarted while its old self still runs) can win that swap, or
overwrite the commit afterwards: then the step's files are on this node, its uploads may even be done,
and yet the step is not this job's where the root points. So each waited step is confirmed by reading
the remote's own ``COMMIT`` (bypassing the node tiers) until it names the generation this job wrote:

1. wait, in slices of :data:`POLL_S`, for this node's pending uploads of the step's generation
   (:meth:`~tierckpt.store.Durable.wait_durable`, through an outage);
2. read the remote's ``COMMIT``: naming this job's generation with nothing pending is *durable*; naming
   another generation whose sequence number is at least this job's record's (the swap this job's upload
   makes can then never succeed) is *another job's*; so is an upload that failed for good;
3. anything else (uploads pending, the remote unreachable) waits for the next slice, until ``timeout_s``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierckpt.native import layout
from tierckpt.backends.bounded import MAX_RECORD_BYTES
from tierckpt.comm import describe_error
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, StorageError, TransientStorageError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.store import durability_of, open_store

POLL_S = 1.0
"""How long one slice of the wait for a step's uploads lasts before the remote's ``COMMIT`` is read again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Unconfirmed:
    """The steps of one wait that are not durable as this job's, each with why (step -> reason)."""

    not_own: dict[int, str]
    """Steps whose remote ``COMMIT`` is another job's, or whose uploads failed for good: waiting longer
    does not make them durable."""
    unfinished: dict[int, str]
    """Steps still uploading (or the remote unreachable) when the wait's time ran out."""


def confirm_own_commits(
    saved: Mapping[int, tuple[str, str]], storage_options: Mapping[str, Any], timeout_s: float | None,
) -> Unconfirmed:
    """Wait until each saved step (step -> ``(uri, generation)``) is committed on the remote as the generation
    this job wrote, or is known not to be, or ``timeout_s`` runs out (``None``: no limit; an outage is waited
    through). Returns the steps that are not confirmed; those missing from it are durable and this job's."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    not_own: dict[int, str] = {}
    unfinished: dict[int, str] = {}
    for step, (uri, generation) in sorted(saved.items()):
        outcome, reason = _confirm(uri, generation, storage_options, deadline)
        if outcome == "not_own":
            not_own[step] = reason
        elif outcome == "unfinished":
            unfinished[step] = reason
    return Unconfirmed(not_own=not_own, unfinished=unfinished)


def _confirm(uri: str, generation: str, options: Mapping[str, Any], deadline: float | None) -> tuple[str, str]:
    """``("durable", "")``, ``("not_own", why)`` or ``("unfinished", why)`` for one step (module docstring)."""
    sched = get_scheduler()
    store = open_store(uri, dict(options))
    durable = durability_of(store)
    remote = open_store(uri, {**options, "cache": False, "memory": False})
    own_seq = _own_seq(store, generation)
    if isinstance(own_seq, str):
        return "not_own", own_seq
    while True:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        pending = False
        if durable is not None:
            try:
                sched.run(durable.wait_durable(generation, POLL_S if left is None else min(POLL_S, left)))
            except TransientStorageError:
                pending = True  # the slice ended with uploads still pending (or failing transiently)
            except StorageError as exc:
                return "not_own", f"its upload failed: {describe_error(exc)}"
        try:
            record = _read_record(remote)
        except TransientStorageError as exc:
            reason = f"the remote's COMMIT cannot be read: {describe_error(exc)}"
        else:
            named = record.generation if record is not None else None
            if named == generation and not pending:
                return "durable", ""
            if named is not None and named != generation and own_seq is not None and record.seq >= own_seq:
                return "not_own", f"the remote's COMMIT names {named}, another job's save (this job wrote {generation})"
            if not pending:
                return "not_own", (f"nothing of it is pending upload here, and the remote's COMMIT names "
                                   f"{named or 'nothing'} (this job wrote {generation})")
            reason = f"its uploads are still pending (the remote's COMMIT names {named or 'nothing'})"
        if deadline is not None and time.monotonic() >= deadline:
            return "unfinished", reason
        if durable is None:
            time.sleep(POLL_S)  # a plain store: only the remote read repeats


def _own_seq(store: Any, generation: str) -> int | None | str:
    """The sequence number of the ``COMMIT`` this node holds for the step when it names ``generation``
    (``None``: it cannot be read now); a string says why the step is no longer this job's on this node."""
    try:
        record = _read_record(store)
    except CheckpointError:
        return None
    if record is None or record.generation != generation:
        return (f"this node's COMMIT of it names {record.generation if record else 'nothing'} now, not the "
                f"generation this job wrote ({generation})")
    return record.seq


def _read_record(store: Any) -> layout.CommitRecord | None:
    """The decoded ``COMMIT`` of ``store`` (``None``: there is none)."""
    try:
        return layout.CommitRecord.decode(get_scheduler().run(store.get_capped(layout.COMMIT, MAX_RECORD_BYTES)))
    except CheckpointNotFoundError:
        return None
