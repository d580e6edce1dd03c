"""A save's last step: gather every rank's records and commit the generation, or leave no trace of it.

The generation is written beside the committed one and becomes the checkpoint by one compare-and-swap
of ``COMMIT`` against the *base* (the ``COMMIT`` rank 0 read when the save began): of two jobs saving to
one URI from one base exactly one commits. Every way a save can fail before that swap removes what it
wrote (:func:`_discard_generation`, :func:`_discard_uncommitted`); a synchronous save through a
write-back store whose upload fails takes its commit back from the node too (:func:`_withdraw`). After
the swap is shared with every rank, the generations it superseded are handed to :mod:`tierckpt.saving.cleanup`
(:func:`_sweep_superseded`), which removes them in the background.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tierckpt.saving import cleanup
from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.backends.bounded import MAX_RECORD_BYTES
from tierckpt.comm import Comm, StoreCoordinator, describe_error
from tierckpt.errors import CheckpointBusyError, CheckpointError, CheckpointNotFoundError, StorageError, TransientStorageError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.io.staging import FileStream
from tierckpt.native.metadata import CheckpointMeta, PieceMeta, encode_header, encode_pieces, encode_tensors
from tierckpt.monitor import ranks_from_timings
from tierckpt.saving.prepared import _Prepared
from tierckpt.saving.stream import _finish_rank, _put_all

log = logging.getLogger("tierckpt")


def _finish(
    p: _Prepared, stream: FileStream | None, coord: Comm | StoreCoordinator, failure: BaseException | None = None,
) -> CheckpointMeta:
    """Close the data file, write objects, gather records on rank 0, commit, share the outcome.

    ``failure``: this rank could not stage its data; it only reports that, so no rank commits.
    """
    records, error = None, failure
    if failure is None:
        try:
            records = _finish_rank(p, stream)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, raised below
            error = exc
    with p.monitor.phase("gather"):
        gathered = coord.gather((records, describe_error(error)))
    commit_error: BaseException | None = None
    outcome: tuple[str, Any] | None = None
    if coord.rank == 0:
        with p.monitor.phase("commit"):
            outcome, commit_error = _commit_gathered(p, gathered, coord.world_size)
    outcome = coord.broadcast(outcome)
    if error is not None or commit_error is not None or outcome[0] != "ok":
        _drop_from_node(p)
    if outcome[0] == "busy":  # lost the race (whatever failed on the way): every rank says so
        if isinstance(commit_error, CheckpointBusyError):
            raise commit_error
        raise CheckpointBusyError(outcome[1]) from (error or commit_error)
    if error is not None:
        raise error
    if commit_error is not None:
        raise commit_error
    status, value = outcome
    if status != "ok":
        raise CheckpointError(f"saving checkpoint {p.uri!r} failed: {value}")
    # Every rank, after the commit; no collective. Before the save reports committed, so that the node's
    # files are sealed (restart-recoverable from memory) whenever wait("memory") has returned.
    p.replication.start(value.generation)
    if not p.keep_previous:
        if coord.rank == 0:
            _sweep_superseded(p)
        else:
            committed = layout.CommitRecord(value.generation, 0.0, seq=layout.seq_of(value.generation) or 0)
            cleanup.sweep_node_after_commit(p.node, p.uri, committed)
    p.monitor.finish("save", p.uri, coord.rank, ranks_from_timings(value.timings))
    return value


def _drop_from_node(p: _Prepared) -> None:
    """Every rank of a failed save, once it knows the outcome: its node's tiers drop what they hold of the
    generation and stop writing it down (:meth:`~tierckpt.node.face.NodeFace.drop_uncommitted`), so no
    node keeps a generation that was committed nowhere; rank 0 took back the commit itself. A failure here
    is logged: the save's own error is what the caller gets."""
    try:
        get_scheduler().run(p.node.drop_uncommitted(p.generation))
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("rank %d: the failed save's generation %s of %s stays in this node's tier: %s",
                    p.comm.rank, p.generation, p.uri, describe_error(exc))


def _sweep_superseded(p: _Prepared) -> None:
    """Rank 0, once every rank knows the outcome: remove the superseded generations in the background
    (:mod:`tierckpt.saving.cleanup`), so the call does not wait for the deletion."""
    base = p.base.result() if p.base is not None else None
    previous = layout.CommitRecord.decode(base).generation if base else None
    committed = layout.CommitRecord(p.generation, 0.0, seq=layout.next_seq(base))
    cleanup.sweep_after_commit(p.backend, p.uri, committed, previous,
                               find_leftovers=p.node.durable is None)


def _commit_gathered(p: _Prepared, gathered: Any, world_size: int) -> tuple[tuple[str, Any], BaseException | None]:
    """Rank 0: build the header from every rank's records and commit; ``("ok", meta)`` or ``("error", why)``."""
    failures = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e is not None]
    if failures:
        _discard_generation(p)
        winner = _committed_meanwhile(p)
        if winner is not None:  # its sweep may have removed this save's files under it: that is the cause
            return ("busy", _busy_message(p, winner, f"; this save failed meanwhile: {'; '.join(failures)}")), None
        return ("error", "; ".join(failures)), None
    records = [r for r, _ in gathered]
    meta = CheckpointMeta(
        generation=p.generation,
        world_size=world_size,
        created_unix=p.started,
        frameworks=tuple(sorted(p.flat.frameworks)),
        files=tuple(f for r in records for f in r[2]),
        objects=tuple(o for r in records for o in r[1]),
        num_tensors=len(p.plan.tensors),
        num_pieces=sum(len(r[0]) for r in records),
        tensor_bytes=sum(t.nbytes for t in p.plan.tensors),
        timings={f"rank{r}.{k}": v for r, rec in enumerate(records) for k, v in rec[3].items()},
        tags=p.tags,
        structure=p.flat.structure,
    )
    try:
        _commit(p, meta, [piece for r in records for piece in r[0]])
    except CheckpointBusyError as exc:
        return ("busy", str(exc)), exc
    except Exception as exc:  # noqa: BLE001 - rank 0 raises it; the others get its description
        _discard_uncommitted(p)
        winner = _committed_meanwhile(p)
        if winner is not None:
            return ("busy", _busy_message(p, winner, f"; this save failed meanwhile: {describe_error(exc)}")), None
        return ("error", f"rank 0: {describe_error(exc)}"), exc
    return ("ok", meta), None


def _committed_meanwhile(p: _Prepared) -> str | None:
    """Rank 0, after a failed save: the generation another job committed since this save read its base
    (``None``: none, or it cannot tell). Its sweep removes this save's generation (it can never commit over
    the newer record), so a save that lost the race may fail writing its own files first. Never raises:
    the save's own error is what its caller gets."""
    base = p.base.result() if p.base is not None else None
    try:
        current = get_scheduler().run(_read_commit(p.backend))
    except Exception as exc:  # noqa: BLE001 - cannot tell; the save's own error stands
        log.debug("could not read COMMIT of %s after its failed save: %s", p.uri, describe_error(exc))
        return None
    if current is None or current == base:
        return None
    record = layout.CommitRecord.decode(current)
    if record.generation == p.generation or (base is not None and record.seq <= layout.CommitRecord.decode(base).seq):
        return None
    return record.generation


def _busy_message(p: _Prepared, winner: str | None, detail: str = "") -> str:
    """Why a save that lost the race to ``winner`` was not committed."""
    base = p.base.result() if p.base is not None else None
    started = layout.CommitRecord.decode(base).generation if base else None
    return (f"another job committed {winner!r} to {p.uri!r} while this save was running (it started from "
            f"{started!r}); this save was not committed and its generation {p.generation!r} was removed; the other "
            f"job's checkpoint is intact. Give concurrent jobs different URIs{detail}")


def _discard_uncommitted(p: _Prepared) -> None:
    """After a failed commit step (a full disk, an outage): remove the generation unless COMMIT names it.
    Never raises (see :func:`_discard_generation`)."""
    try:
        current = get_scheduler().run(_read_commit(p.backend))
        committed = None if current is None else layout.CommitRecord.decode(current).generation
    except Exception as exc:  # noqa: BLE001 - cannot tell: `tierckpt gc` never removes what COMMIT names
        _left_behind(p, exc)
        return
    if committed != p.generation:
        _discard_generation(p)


def _discard_generation(p: _Prepared) -> None:
    """Rank 0, after a failed save: remove what the ranks wrote (every rank has reported, none still writes).

    Never raises: the save's own error is what its caller gets (a failure here raised instead would name
    the wrong cause, and rank 0 would leave before sharing the outcome the other ranks wait for). What
    stays is logged: an uncommitted generation is invisible to loads, and the next save's sweep
    (:mod:`tierckpt.saving.cleanup`) or ``tierckpt gc`` removes it."""
    try:
        get_scheduler().run(p.backend.delete_prefix(f"{p.generation}/"))
    except Exception as exc:  # noqa: BLE001 - see the docstring
        _left_behind(p, exc)


def _left_behind(p: _Prepared, exc: BaseException) -> None:
    """Log that the failed save's generation could not be removed, and why."""
    log.warning("the failed save's generation %s of %s was not removed (%s); loads never read it, and the next "
                "save to %s removes it", p.generation, p.uri, describe_error(exc), p.uri)


async def _read_commit(backend: Backend, offline_ok: bool = False) -> bytes | None:
    """The bytes of ``COMMIT`` (``None``: nothing committed yet). ``offline_ok`` (a write-back store):
    an unreachable remote that this node knows nothing of counts as none; the store's upload is a
    compare-and-swap against that, so a remote that does hold a commit refuses it later, loudly."""
    try:
        return await backend.get_capped(layout.COMMIT, MAX_RECORD_BYTES)
    except CheckpointNotFoundError:
        return None
    except TransientStorageError:
        if offline_ok:
            return None
        raise


def _commit(p: _Prepared, meta: CheckpointMeta, pieces: list[PieceMeta]) -> None:
    """Rank 0: metadata, then COMMIT — one compare-and-swap against the base, so of two jobs saving to
    one URI from the same base exactly one commits; the other removes its generation and raises."""
    sched = get_scheduler()
    backend, gen = p.backend, p.generation
    base = p.base.result() if p.base is not None else None
    documents = {  # the header last: it lists every file
        layout.TENSORS: encode_tensors(p.plan.tensors),
        layout.PIECES: encode_pieces(pieces),
        layout.HEADER: encode_header(meta),
    }
    # The two tables at once (a round trip less on an object store), then the header.
    _put_all(backend, {layout.in_generation(gen, k): documents[k] for k in (layout.TENSORS, layout.PIECES)}).result()
    sched.run(backend.put(layout.in_generation(gen, layout.HEADER), documents[layout.HEADER]))
    record = layout.CommitRecord(
        gen, time.time(), seq=layout.next_seq(base),
        checksums=tuple(sorted((key, layout.FileChecksum.of(data)) for key, data in documents.items())),
    ).encode()
    try:
        # The commit depends on every file of the generation (a write-back store uploads it after them).
        after = {layout.in_generation(gen, f.key): f.size for f in meta.files}
        after.update({layout.in_generation(gen, key): len(data) for key, data in documents.items()})
        sched.run(backend.commit(layout.COMMIT, record, expected=base, after=after))
    except CheckpointBusyError as exc:
        current = sched.run(_read_commit(backend))
        if current != record:  # not a retried request whose first attempt landed: another job won
            _discard_generation(p)
            if current == base:  # refused, yet nobody committed: the store does not compare as it must
                raise _refused_unchanged(p, base, exc) from exc
            winner = layout.CommitRecord.decode(current).generation if current else None
            raise CheckpointBusyError(_busy_message(p, winner)) from exc
    durable = p.node.durable
    if durable is not None and not p.write_back and p.persist:  # a synchronous save commits where the URI points
        try:
            sched.run(durable.wait_durable(gen, None, through_outage=False))
        except StorageError as exc:
            _withdraw(p, record, base, exc)


def _refused_unchanged(p: _Prepared, base: bytes | None, refusal: CheckpointBusyError) -> StorageError:
    """The error of a commit the store refused although ``COMMIT`` still holds the save's base: no other job
    committed, so the store's conditional write (``If-Match``, ``If-None-Match``) is what failed; saying
    "another job committed" would send the user after a writer that does not exist."""
    started = layout.CommitRecord.decode(base).generation if base else None
    return StorageError(
        f"saving {p.uri!r} failed: the store refused the conditional write of COMMIT ({refusal}) although COMMIT "
        f"is unchanged since this save began (it still names {started or 'no checkpoint'}): no other job committed, "
        f"the store does not honour conditional writes as S3 does. The save was not committed and its generation "
        f"{p.generation!r} was removed; use a store with conditional writes (S3, Ceph radosgw, MinIO) or report the "
        "server's answer"
    )


def _withdraw(p: _Prepared, record: bytes, base: bytes | None, failure: StorageError) -> None:
    """Rank 0, a synchronous save whose commit did not reach where the URI points: take it back from the
    node cache too (a failed save is loadable nowhere), then raise; return if the commit landed after all."""
    revocable = p.node.revocable
    if revocable is None:
        raise failure
    errors = get_scheduler().run(revocable.withdraw(p.generation, record, base))
    if errors is None:
        return
    previous = layout.CommitRecord.decode(base).generation if base else None
    raise StorageError(
        f"saving {p.uri!r} failed: its upload did not complete ({'; '.join(errors[:2]) or failure}). The save was "
        f"not committed anywhere (this node's cache and memory tier included); the last committed checkpoint "
        f"({previous or 'none'}) is unchanged. Fix the store and save again"
    ) from failure
