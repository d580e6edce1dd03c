"""The handle of an asynchronous save: wait for the levels it reaches (committed, replicated, remote)."""

from __future__ import annotations

import concurrent.futures

from tierckpt.deadline import current as current_deadline
from tierckpt.deadline import operation
from tierckpt.errors import CheckpointBusyError, CheckpointError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native.metadata import CheckpointMeta
from tierckpt.monitor import Monitor
from tierckpt.node.durability import Durable
from tierckpt.node.memory.replication import Replication
from tierckpt.node.levels import WAITABLE

LEVELS = WAITABLE
"""The durability levels :meth:`SaveHandle.wait` waits for (:class:`tierckpt.node.levels.Level`)."""


class SaveHandle:
    """An asynchronous save in flight. ``wait()`` returns the committed checkpoint's metadata once it
    is committed (on a write-back store: in the node cache or memory tier); ``wait("replicated")``
    also waits until the peer nodes hold this node's files; ``wait("remote")`` (= ``wait_durable()``)
    until the store holds it where its URI points (every object uploaded, ``COMMIT`` last)."""

    def __init__(
        self, uri: str, future: concurrent.futures.Future[CheckpointMeta], monitor: Monitor, durable: Durable | None,
        replication: Replication | None = None,
    ) -> None:
        self.uri = uri
        self.durable = durable
        """The store's durability when it writes back (``None``: committed is durable where the URI points)."""
        self.monitor = monitor
        self._future = future
        self._replication = replication if replication is not None else Replication(uri, None, None, None)
        self._reported = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, level: str | float = "memory", timeout_s: float | None = None) -> CheckpointMeta:
        """Block until the checkpoint reached ``level``; return its metadata. Raise the save's error if it failed.

        A number as the first argument is the timeout, as before levels existed: ``wait(30)`` is
        ``wait("memory", timeout_s=30)``.

        * ``"memory"`` (default): committed — in the node memory tier (or node cache) when the store
          has one, else where the URI points.
        * ``"replicated"``: and this node's files are acknowledged, CRC-checked, by its peer nodes'
          memory tiers. Raises :class:`~tierckpt.node.memory.replication.ReplicationError` naming the reason
          when the level stayed ``memory`` (a peer died or refused, one node, ``TIERCKPT_REPLICAS=0``,
          the memory tier off). Each rank waits for its own node's files.
        * ``"remote"``: durable where the URI points (:meth:`wait_durable`).
        """
        if isinstance(level, (int, float)) and not isinstance(level, bool):
            if timeout_s is not None:
                raise CheckpointError(
                    f"SaveHandle.wait({level!r}, timeout_s={timeout_s!r}): a number as the first argument is the "
                    "timeout; pass the level by name, e.g. wait('replicated', timeout_s=30)"
                )
            level, timeout_s = "memory", float(level)
        if level not in LEVELS:
            raise CheckpointError(
                f"SaveHandle.wait(level={level!r}): use 'memory' (committed), 'replicated' (and copied to peer "
                "nodes' memory) or 'remote' (uploaded where the URI points); a timeout goes in timeout_s="
            )
        if level == "remote":
            return self.wait_durable(timeout_s)
        meta = self._committed(timeout_s)
        if level == "replicated":
            self._replication.wait(meta.generation, timeout_s)
        return meta

    def _committed(self, timeout_s: float | None) -> CheckpointMeta:
        bound = current_deadline()  # an operation's deadline (wait_durable's) ends this wait too
        if bound is not None and (timeout_s is None or bound.remaining() < timeout_s):
            timeout_s = max(0.0, bound.remaining())
        else:
            bound = None
        try:
            return self._future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if bound is not None:
                raise bound.exceeded(f"the async save to {self.uri} to commit") from None
            raise CheckpointBusyError(f"async save to {self.uri!r} is still running after {timeout_s}s") from None
        except BaseException:
            self._reported = True
            raise

    def result(self, timeout_s: float | None = None) -> CheckpointMeta:
        """The committed checkpoint's metadata (``wait("memory", timeout_s)``)."""
        return self._committed(timeout_s)

    def wait_durable(self, timeout_s: float | None = None) -> CheckpointMeta:
        """Block until committed and durable where the URI points: on a write-back store (the node
        cache in front of a remote) until every object of the checkpoint is uploaded, ``COMMIT`` last.
        Raises :class:`~tierckpt.errors.StorageError` when an upload failed (the message names the
        ``tierckpt sync`` command that retries it). Without ``timeout_s`` it waits as long as the uploads
        take (``TIERCKPT_TIMEOUT_S`` bounds it), saying on stderr what it waits for once it has waited a
        few seconds, then at growing intervals."""
        with operation("wait_durable", self.uri):
            meta = self._committed(timeout_s)
            if self.durable is not None:
                get_scheduler().run(self.durable.wait_durable(meta.generation, timeout_s))
                self._record_uploads(meta.generation)
        return meta

    def _record_uploads(self, generation: str) -> None:
        """Add this process's uploads of the generation's files to the monitor (``upload``, ``bytes_uploaded``)."""
        uploads = [
            r for r in get_scheduler().metrics.records()
            if r.op == "upload" and r.ok and r.key.startswith(f"{generation}/")
        ]
        self.monitor.add_seconds("upload", sum(r.seconds for r in uploads))
        self.monitor.count("bytes_uploaded", sum(r.nbytes for r in uploads))

    def unreported_error(self) -> BaseException | None:
        if self._reported or not self._future.done():
            return None
        return self._future.exception()
