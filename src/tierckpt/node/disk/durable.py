"""Durability of the node disk cache (a mixin of :class:`~tierckpt.node.disk.tiered.TieredBackend`): its
hooks of the write-back link core (:class:`~tierckpt.node.link.WriteBackLink`: its own wait, what a ``sync``
takes over, a withdrawal's steps), ``status``, and dropping and cancelling pending uploads. Everything here
reads the catalogue, so it sees the uploads of every process of the node."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tierckpt import progress
from tierckpt.native import layout
from tierckpt.comm import describe_error
from tierckpt.backends.bounded import MAX_RECORD_BYTES
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError, TransientStorageError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.node.durability import wait_owed
from tierckpt.node.journal import Outstanding, pid_alive
from tierckpt.node.link import SyncScope, Withdrawal
from tierckpt.node.disk.catalog import generation_path
from tierckpt.node.disk.records import CommitOrder, GenState, Op, PendingOp
from tierckpt.node.levels import Level
from tierckpt.node.status import StoreStatus


@dataclass(slots=True)
class CacheWithdrawal(Withdrawal):
    """A withdrawal from the node disk cache: what it owed of the generation, and its pending ``COMMIT``."""

    owed: dict[str, PendingOp] = field(default_factory=dict)
    """This user's pending ops of the generation, its ``COMMIT`` aside."""
    commit: PendingOp | None = None
    """The pending ``COMMIT`` that names the generation (``None``: none does)."""


class DurableMixin:
    """See the module docstring; it uses the store's ``catalog``, ``rh``, ``link``, ``remote``, ``config``,
    ``uploader``, ``root_uri`` and ``uri_of``/``get``/``schedule``/``_adopt``/``_drop_tail``."""

    def _relevant(self, generation: str | None) -> dict[str, PendingOp]:
        """This user's pending ops of this store (of ``generation``, when given): what its waits wait for."""
        pending = {k: r for k, r in self.catalog.pending_under(self.rh).items() if r.mine()}
        if generation is None:
            return pending
        name = generation.rstrip("/").rpartition("/")[2]
        return {k: r for k, r in pending.items()
                if (generation_path(k) or "").rpartition("/")[2] == name or r.gen == name}

    async def _wait_own(self, generation: str | None, timeout_s: float | None, *, through_outage: bool) -> None:
        """Wait until every pending op (of ``generation``, a name or ``dir/name``) reached the remote: the
        engine's one wait (:func:`~tierckpt.node.durability.wait_owed`) over the catalogue (:class:`_Uploads`).

        Raises :class:`StorageError` when an upload failed for good (a missing bucket, denied access), and
        :class:`TransientStorageError` at ``timeout_s``; with ``through_outage=False`` (a synchronous save)
        also as soon as an upload failed transiently (it goes on retrying in the background), and when the
        commit naming ``generation`` will never reach the remote (see :meth:`_check_own_commit`)."""
        await wait_owed(_Uploads(self, generation), timeout_s, through_outage=through_outage)
        if generation is not None and not through_outage:
            await self._check_own_commit(generation)

    async def _check_own_commit(self, generation: str) -> None:
        """A synchronous save's last check: the commit naming ``generation`` (a name or ``dir/name``) is on
        the remote, not merely replaced there by a later one. Another job of this node may commit on top of
        this save's commit while it still waits for its upload (building on it as this node's view of
        ``COMMIT``): that commit is then uploaded in its place, and this one never is. Raises
        :class:`StorageError` naming the commit that replaced it (the save then reports that it lost)."""
        gen_path = generation.rstrip("/")
        if self.catalog.generation_state(self.rh, gen_path) in (None, GenState.REMOTE):
            return
        directory = gen_path.rpartition("/")[0]
        key = f"{directory}/{layout.COMMIT}" if directory else layout.COMMIT
        await self.uploader.runner.settle(lambda tkey: tkey == (self.rh, key))  # an upload of it in flight lands first
        state = self.catalog.generation_state(self.rh, gen_path)
        if state in (None, GenState.REMOTE):
            return
        replaced = self.catalog.pending(self.rh, key)
        by = f"by {replaced.gen!r} " if replaced is not None and replaced.gen else ""
        raise StorageError(
            f"the commit of {generation!r} to {self.uri_of(key)} was replaced on this node {by}before it was "
            f"uploaded ({state}): it never reached the remote, so this save did not commit there"
        )

    def _waiting_for(self, pending: dict[str, PendingOp]) -> str:
        key, rec = sorted(pending.items())[0]
        error = f", which failed: {rec.error}; retrying" if rec.error else ""
        return f"{len(pending)} upload(s) to {self.root_uri} to reach the remote (e.g. {key}{error})"

    async def _sync_scope(self) -> SyncScope:
        """A ``sync`` finishes every pending op of this store (its root in the catalogue)."""
        return SyncScope(self.rh, None)

    async def _take_over(self, scope: SyncScope, key: str) -> None:
        """This process uploads the pending op of ``key`` when this user recorded it (an op of another user
        is never uploaded with this user's credentials: :meth:`sync` names it)."""
        rec = self.catalog.pending(self.rh, key)
        if rec is not None and rec.mine():
            self.catalog.claim(self.rh, key, rec.ver)
            self.schedule(key)

    async def sync(self, timeout_s: float | None = None) -> None:
        """Resume every pending op of this store (left by this or a dead process, or failed for good), then
        wait for them (the link core's :meth:`~tierckpt.node.link.WriteBackLink.sync`).

        Only this user's and this store's: ops written for the same URI on another service (another S3
        endpoint) are never uploaded here; when some are left without a live uploader,
        :class:`CheckpointError` names their service and how to sync them, after this store's own are done."""
        await super().sync(timeout_s)  # type: ignore[misc]  # the link core, after this mixin in the MRO
        others = sorted({r.uid for r in self.catalog.pending_under(self.rh).values() if not r.mine()})
        if others:
            raise CheckpointError(
                f"uploads of {self.root_uri} pending in the node cache {self.config.directory} were recorded by "
                f"another user (uid {others[0]}); they are never uploaded with this user's credentials. That "
                f"user syncs them; this user's node cache should be a directory of its own (TIERCKPT_CACHE_DIR)"
            )
        elsewhere = self._stranded_elsewhere()
        if elsewhere:
            service, count = sorted(elsewhere.items())[0]
            raise CheckpointError(
                f"{count} upload(s) of {self.root_uri} pending in this node's cache were written for the store at "
                f"{service}, not the one these settings open ({self.remote.service}); they were not uploaded here. "
                f"Sync them with the settings they were saved with (e.g. storage_options={{'endpoint_url': ...}} "
                f"naming that endpoint), or discard them there with tierckpt sync --drop"
            )

    def _stranded_elsewhere(self) -> dict[str, int]:
        """Service -> count of ops pending for this URI on other services with no live uploader."""
        out: dict[str, int] = {}
        for rh, uri in self.catalog.roots().items():
            if rh == self.rh or uri.rstrip("/") != self.root_uri.rstrip("/"):
                continue
            stranded = [r for r in self.catalog.pending_under(rh).values()
                        if (r.error and not r.retrying) or not pid_alive(r.owner)]
            if stranded:
                service = self.catalog.service_of(rh) or "an unrecorded endpoint"
                out[service] = out.get(service, 0) + len(stranded)
        return out

    async def status(self) -> StoreStatus:
        """What is committed on this node and on the remote, and what is still pending (see :class:`StoreStatus`)."""
        pending = self._relevant(None)
        generation: str | None = None
        state: Level | None = None
        remote_generation, remote_error, unreachable = await self._remote_generation()
        commit = pending.get(layout.COMMIT)
        if commit is not None and commit.op == Op.COMMIT:
            generation = commit.gen
        else:
            try:
                generation = layout.CommitRecord.decode(await self.get_capped(layout.COMMIT, MAX_RECORD_BYTES)).generation
            except (CheckpointNotFoundError, TransientStorageError):
                generation = None
        if generation is not None:
            # no pending commit: this COMMIT came from the remote (uploaded, or fetched from it)
            state = Level.LOCAL if commit is not None else Level.REMOTE
        elif any(r.op == Op.PUT for r in pending.values()):
            state = Level.STAGED
        return StoreStatus(
            uri=self.root_uri,
            generation=generation,
            state=state,
            pending_keys=tuple(sorted(pending)),
            pending_bytes=sum(r.size for r in pending.values()),
            errors=tuple(f"{k}: {r.error}" for k, r in sorted(pending.items()) if r.error),
            remote_generation=remote_generation,
            remote_error=remote_error,
            remote_unreachable=unreachable,
        )

    async def _remote_generation(self) -> tuple[str | None, str | None, bool]:
        """The generation the remote's own COMMIT names, why it could not be read (else ``None``), and
        whether that is because the store did not answer."""
        try:
            data = await self.link.call("get", self.remote.get_capped, layout.COMMIT, MAX_RECORD_BYTES, retries=2)
        except CheckpointNotFoundError as exc:
            return None, (str(exc) if "bucket" in str(exc) else None), False
        except CheckpointError as exc:
            return None, describe_error(exc), isinstance(exc, TransientStorageError)
        try:
            return layout.CommitRecord.decode(data).generation, None, False
        except CorruptCheckpointError as exc:
            return None, describe_error(exc), False

    # -- a withdrawal's steps (the link core's withdraw) ------------------------------------------------
    async def _stop_copies(self, name: str) -> CacheWithdrawal:
        """Stop this process's uploads of generation ``name`` and of its pending ``COMMIT`` (they stay pending
        until :meth:`_drop_withdrawn`); why they failed."""
        key = layout.COMMIT
        owed = {k: r for k, r in self._relevant(name).items() if k != key}
        pending = self.catalog.pending(self.rh, key)
        commit = pending if pending is not None and pending.op == Op.COMMIT and pending.gen == name else None
        await self._stop_uploads({*owed, *([key] if commit is not None else [])})
        failures = [f"{self.uri_of(k)}: {r.error}" for k, r in sorted(owed.items()) if r.error]
        if commit is not None and commit.error:
            failures.append(f"{self.uri_of(key)}: {commit.error}")
        return CacheWithdrawal(name, failures, owed, commit)

    async def _landed(self, record: bytes, withdrawal: CacheWithdrawal) -> bool:
        """The remote holds ``record`` and it is this node's pending commit of the generation: its upload
        landed (the op is cleared), the save succeeded."""
        key = layout.COMMIT
        try:
            landed = await self.link.call("get", self.remote.get, key, retries=2) == record
        except CheckpointError:
            landed = False
        if landed and withdrawal.commit is not None:
            self.catalog.finish(self.rh, key, withdrawal.commit.ver)
            return True
        return False

    async def _drop_withdrawn(self, withdrawal: CacheWithdrawal, record: bytes, base: bytes | None) -> None:
        """Drop the generation's pending ops and cached copies; this node's view of ``COMMIT`` is ``base`` again
        (the commit the save started from: pending again if it was pending here, else the remote's)."""
        key, name, commit = layout.COMMIT, withdrawal.name, withdrawal.commit
        for k in [*withdrawal.owed, *([key] if commit is not None else [])]:
            self._small.drop(k)
            self._unlink_dropped(k, self.catalog.record_delete(self.rh, k, deferred=False))
        self.catalog.forget_generations(self.rh, name)
        if commit is None:
            return
        order = commit.order
        previous = layout.CommitRecord.decode(base).generation if base is not None else None
        known = previous is not None and self.catalog.generation_state(self.rh, previous) is not None
        if known and order is not None and order.base != base:  # base was committed here only
            restored = CommitOrder(cas=order.cas, base=order.base, after=None)
            await self._write_whole(key, base, Op.COMMIT, previous, restored)  # type: ignore[arg-type]
        elif base is not None and order is not None and order.base == base:  # the remote's
            await self._store_fetched(key, base)  # for reads while the remote is unreachable

    async def _stop_uploads(self, keys: set[str]) -> None:
        """Stop this process's upload tasks (and uploads that follow a write) of ``keys``; they stay pending."""

        async def cancel() -> None:
            for key in keys:
                tail = self.uploader.tails.get((self.rh, key))
                if tail is not None:
                    await self._drop_tail(key, tail)
            await self.uploader.runner.stop(lambda tkey: tkey[0] == self.rh and tkey[1] in keys, cancel=True)

        await asyncio.wrap_future(get_scheduler().submit(cancel()))

    async def drop_pending(self) -> list[str]:
        """Discard every upload still pending to this store (e.g. to a mistyped bucket): the objects stay
        readable in the node cache until evicted, but never reach the remote. Returns the keys dropped."""
        await self.cancel_uploads()
        pending = self.catalog.pending_under(self.rh)
        for key in pending:
            self.catalog.drop_pending(self.rh, key)
        return sorted(pending)

    async def cancel_uploads(self) -> None:
        """Stop this process's upload tasks for this store; the ops stay pending for ``sync()``."""

        async def cancel() -> None:
            for (rh, key), tail in list(self.uploader.tails.items()):
                if rh == self.rh:
                    await self._drop_tail(key, tail)
            await self.uploader.runner.stop(lambda tkey: tkey[0] == self.rh, cancel=True)

        await asyncio.wrap_future(get_scheduler().submit(cancel()))


class _Uploads:
    """A durability wait's view of the catalogue (:class:`~tierckpt.node.durability.Owed`): this user's
    pending ops of the store (of ``generation``); a command's progress bar shows the bytes still to upload."""

    def __init__(self, store: DurableMixin, generation: str | None) -> None:
        self.store, self.generation = store, generation
        self.pending: dict[str, PendingOp] = {}
        """What the last look found."""

    async def outstanding(self) -> list[Outstanding]:
        self.pending = self.store._relevant(self.generation)
        bar = progress.current()
        if bar is not None:  # a command's bar (tierckpt wait/sync)
            bar.remaining(self.store.root_uri, sum(r.size for r in self.pending.values()))
        return [Outstanding(key, rec.owner if rec.owner and pid_alive(rec.owner) else None, rec.error or None,
                            final=not rec.retrying)
                for key, rec in sorted(self.pending.items())]

    def waiting_for(self, left: list[Outstanding]) -> str:
        return self.store._waiting_for(self.pending)

    def failed(self, failed: list[Outstanding], left: list[Outstanding]) -> Exception:
        store = self.store
        return StorageError(
            f"upload of {store.uri_of(failed[0].key)} failed ({failed[0].error}); {len(left)} object(s) of the "
            f"checkpoint are committed in this node's cache only. Fix the remote, then run: tierckpt sync "
            f"{store.root_uri} (or drop them: tierckpt sync --drop {store.root_uri})"
        )

    def resume(self, left: list[Outstanding]) -> None:
        self.store._adopt(self.pending)

    def overdue(self, left: list[Outstanding], timeout_s: float) -> Exception:
        return TransientStorageError(
            f"{len(left)} object(s) of {self.store.root_uri} did not reach the remote within {timeout_s} s "
            f"(e.g. {left[0].key!r}); they stay in the node cache and upload in the background"
        )

    def pause_s(self, left: list[Outstanding]) -> float:
        return self.store.config.poll_s
