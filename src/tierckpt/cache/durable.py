"""Durability of a write-back store (a mixin of :class:`~tierckpt.cache.tiered.TieredBackend`): the
:class:`~tierckpt.store.Durable` protocol (``wait_durable``, ``status``, ``sync``) plus dropping and
cancelling pending uploads. Everything here reads the catalogue, so it sees the uploads of every
process of the node."""

from __future__ import annotations

import asyncio
import os
import time

from .. import layout
from ..comm import describe_error
from ..bounded import MAX_RECORD_BYTES
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError, TransientStorageError
from ..io.scheduler import get_scheduler
from .catalog import generation_path, pid_alive
from .records import Op, PendingOp
from .status import Durability, StoreStatus


class DurableMixin:
    """See the module docstring; it uses the store's ``catalog``, ``rh``, ``link``, ``remote``, ``config``,
    ``uploader``, ``root_uri`` and ``uri_of``/``get``/``schedule``/``_adopt``/``_drop_tail``."""

    def _relevant(self, generation: str | None) -> dict[str, PendingOp]:
        pending = self.catalog.pending_under(self.rh)
        if generation is None:
            return pending
        name = generation.rstrip("/").rpartition("/")[2]
        return {k: r for k, r in pending.items()
                if (generation_path(k) or "").rpartition("/")[2] == name or r.gen == name}

    async def wait_durable(self, generation: str | None = None, timeout_s: float | None = None, *,
                           through_outage: bool = True) -> None:
        """Wait until every pending op (of ``generation``, a name or ``dir/name``) reached the remote.

        Raises :class:`StorageError` when an upload failed for good (a missing bucket, denied access), and
        :class:`TransientStorageError` at ``timeout_s``; with ``through_outage=False`` (a synchronous save)
        also as soon as an upload failed transiently (it goes on retrying in the background)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        adopted = False
        while True:
            pending = self._relevant(generation)
            if not pending:
                return
            failed = {k: r.error for k, r in pending.items()
                      if r.error and not (through_outage and r.retrying)}
            if failed:
                key, error = sorted(failed.items())[0]
                raise StorageError(
                    f"upload of {self.uri_of(key)} failed ({error}); {len(pending)} object(s) of the checkpoint are "
                    f"committed in this node's cache only. Fix the remote, then run: tierckpt sync {self.root_uri} "
                    f"(or drop them: tierckpt sync --drop {self.root_uri})"
                )
            if not adopted:
                self._adopt(pending)
                adopted = True
            if deadline is not None and time.monotonic() > deadline:
                raise TransientStorageError(
                    f"{len(pending)} object(s) of {self.root_uri} did not reach the remote within {timeout_s} s "
                    f"(e.g. {sorted(pending)[0]!r}); they stay in the node cache and upload in the background"
                )
            await asyncio.sleep(self.config.poll_s)

    async def sync(self, timeout_s: float | None = None) -> None:
        """Resume every pending op of this store (left by this or a dead process), then wait for them."""
        me = os.getpid()
        for key, rec in self.catalog.pending_under(self.rh).items():
            if rec.error or rec.owner == me or not pid_alive(rec.owner):
                self.catalog.claim(self.rh, key, rec.ver)
                self.schedule(key)
        await self.wait_durable(None, timeout_s)

    async def status(self) -> StoreStatus:
        """What is committed on this node and on the remote, and what is still pending (see :class:`StoreStatus`)."""
        pending = self.catalog.pending_under(self.rh)
        generation: str | None = None
        state: Durability | None = None
        remote_generation, remote_error = await self._remote_generation()
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
            state = Durability.LOCAL if commit is not None else Durability.REMOTE
        elif any(r.op == Op.PUT for r in pending.values()):
            state = Durability.STAGED
        return StoreStatus(
            uri=self.root_uri,
            generation=generation,
            state=state,
            pending_keys=tuple(sorted(pending)),
            pending_bytes=sum(r.size for r in pending.values()),
            errors=tuple(f"{k}: {r.error}" for k, r in sorted(pending.items()) if r.error),
            remote_generation=remote_generation,
            remote_error=remote_error,
        )

    async def _remote_generation(self) -> tuple[str | None, str | None]:
        """The generation the remote's own COMMIT names, and why it could not be read (else ``None``)."""
        try:
            data = await self.link.call("get", self.remote.get_capped, layout.COMMIT, MAX_RECORD_BYTES, retries=2)
        except CheckpointNotFoundError as exc:
            return None, (str(exc) if "bucket" in str(exc) else None)
        except CheckpointError as exc:
            return None, describe_error(exc)
        try:
            return layout.CommitRecord.decode(data).generation, None
        except CorruptCheckpointError as exc:
            return None, describe_error(exc)

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
            tasks = [t for (rh, _), t in list(self.uploader.tasks.items()) if rh == self.rh]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        await asyncio.wrap_future(get_scheduler().submit(cancel()))
