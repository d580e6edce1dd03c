"""Peer replicas: a node's memory-tier files copied to other nodes' memory tiers, in the background.

:class:`Replicator` is built by every rank of a group at the same point (foreground): it all-gathers
the ranks' node ids, plans peers (:mod:`.peers`) and takes a channel of its own on the group's side group
(:mod:`.sidegroup`: the one gloo group per process and group that moves tier bytes between nodes, peer
recovery's streamed loads included; where the group has none, a gloo group of the replicator's own), so
replication never races the training's collectives on their groups; the files themselves go on a data
stream of each transfer's own (:mod:`.transfer`: ``sendfile`` from the tier's pages). Each node's leader
(its lowest rank) runs two background threads, one sending and one receiving. Lifecycle of
:meth:`Replicator.replicate` for one checkpoint generation, called by every rank in the same order:

1. The leader seals its node's files of the generation (:meth:`~.memory.MemoryTier.seal`, origin =
   the node) in the foreground, so no replica arriving later is mistaken for its own; other ranks only
   get a handle that follows the level the leader records.
2. Sender, per target node in turn (reading the files it opened at step 1, so a newer commit that
   deletes the generation meanwhile does not cut its transfer): a header (the manifest, and
   ``COMMIT`` when it names this generation, and where the transfer's data stream listens, with the
   token to say) -> the receiver admits the bytes under its budget, connects to the stream and answers
   go, or answers why it refused -> the files on the stream -> the receiver's acknowledgement -> the
   sender's closing word (``bye``).
3. Receiver, per source node in turn: the sender's files declared arriving (:meth:`~.memory.MemoryTier.expect`:
   from the first one published, neither this node's seal nor its write-down takes them for its own); each
   file from the stream to a temp file with its CRC-32C computed on the way;
   published only if it matches the sender's manifest; then the manifest (origin = the sender) and,
   if newer than its own, ``COMMIT``; then the acknowledgement; then it waits for the sender's ``bye``.
   Every exchange, a refused one included, ends with that ``bye``: the node that answers last stays
   until its answer was taken, so a process that exits as soon as its own transfers are done never
   tears its sockets down under an answer still on the wire (which would leave the sender's level at
   ``memory``). A lost ``bye`` costs nothing: the receiver had published and recorded everything.
4. The level of the generation becomes ``replicated`` only when every target acknowledged. Any error
   (a peer that dies closes its connections; one that hangs exceeds ``timeout_s`` per operation), a
   refusal or a CRC mismatch leaves it at ``memory`` with the reason. The level is recorded in the
   tier (``levels/<generation>.json``), where the node's other ranks, and a restart, read it.

A peer connection that failed once is not used again by this replicator (gloo closes the pair):
later generations report ``memory`` naming the first failure. :meth:`Replicator.close` waits (bounded)
for the queued generations and ends the threads: before the process exits or its groups are destroyed
(:func:`~.replication.stop_replicators`), so no thread is inside a transfer when gloo is torn down.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tierckpt.backends.bounded import MAX_RECORD_BYTES, read_capped
from tierckpt.errors import CheckpointError
from tierckpt.native.layout import COMMIT
from tierckpt.node.host import node_id
from tierckpt.node.memory.replica_record import Level, ReplicaHandle, ReplicaResult
from tierckpt.node.memory.manifest import Manifest
from tierckpt.node.memory.nodememory import NodeMemory
from tierckpt.node.memory.peers import ReplicaPlan, plan_replicas
from tierckpt.node.memory.background import background_nice, lower_priority, lower_priority_of_new, started_threads
from tierckpt.node.memory.sidegroup import SideGroup, side_group_of
from tierckpt.node.memory.transfer import Listener, Offer, Stream, adopt_commit, connect, open_files, receive_file
from tierckpt.node.memory.live import REPLICATORS
from tierckpt.node.memory.wire import Wire

log = logging.getLogger(__name__)

_KIND_CONNECT, _KIND_HEADER, _KIND_REPLY, _KIND_ACK, _KIND_BYE = 0, 1, 2, 3, 4
_DRAIN_BYTES = 1 << 20
"""The receiver's scratch buffer, through which it drains a file it could not take (the stream stays in step)."""


@dataclass(frozen=True, slots=True)
class _Job:
    uri: str
    generation: str
    manifest: Manifest
    commit: bytes | None
    handle: ReplicaHandle
    files: dict[str, int] = field(default_factory=dict)
    """The generation's files, opened when it was committed: a newer commit that deletes the generation
    while it is still being sent takes its names, not the bytes the sender reads."""
    received: threading.Event = field(default_factory=threading.Event)
    """Set once this node's receiver took what its source nodes sent of the same generation."""


class Replicator:
    """Copies this node's memory-tier files of each generation to its peer nodes (see the module docstring).

    ``group``: the ranks that replicate (default: the whole default group); every one of them builds
    the replicator at the same point. ``durable_below()``: copy ids a lower tier holds, which a
    receiver may evict to make room; ``owed_below()``: superseded copy ids the chain below is still owed,
    which it keeps (see :mod:`.eviction`). ``timeout_s``: the longest any one transfer step may wait.
    """

    def __init__(
        self,
        memory: NodeMemory | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        replicas: int | None = None,
        timeout_s: float = 60.0,
        durable_below: Callable[[], Iterable[str]] = frozenset,
        owed_below: Callable[[], Iterable[str]] = frozenset,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise CheckpointError("peer replicas need torch.distributed: call init_process_group first")
        self.memory = memory if memory is not None else NodeMemory()
        self._ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.side_group: SideGroup | None = side_group_of(group, "replica")
        """The group's side group this replicator's transfers go over (``None``: a group of its own)."""
        # Every rank says its node and the channel it would open next on the side group: the channel is the
        # highest of them, so ranks whose processes built different replicators before still agree.
        said: list[tuple[str, int]] = [("", 0)] * len(self._ranks)
        next_channel = self.side_group.next_channel() if self.side_group is not None else 0
        dist.all_gather_object(said, (node_id(), next_channel), group=group)
        self.rank_nodes = tuple(node for node, _ in said)
        self.plan: ReplicaPlan = plan_replicas(self.rank_nodes, replicas)
        self.node = self.plan.node_of(self.rank_nodes, self._ranks.index(dist.get_rank()))
        self.is_leader = self._ranks[self.plan.leaders[self.node]] == dist.get_rank()
        background_nice()  # a bad TIERCKPT_BACKGROUND_NICE fails here, in the foreground, not in a thread
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._durable_below = durable_below
        self._owed_below = owed_below
        if self.side_group is not None:
            channel = self.side_group.open_channel(max(channel for _, channel in said))
            self._wire = Wire(self._ranks, self._timeout, side=self.side_group, channel=channel)
        else:
            # Over the whole world (the default group, or a group of every rank) every rank calls new_group,
            # which names the group by a count all ranks share; the hashed names of local synchronization can
            # differ between ranks of a long-lived process, so only a group of some ranks takes them.
            threads = started_threads()
            some_ranks = len(self._ranks) < dist.get_world_size()
            own = dist.new_group(self._ranks, backend="gloo", timeout=self._timeout, use_local_synchronization=some_ranks)
            lower_priority_of_new(threads)  # the group's own gloo threads: background work too
            self._wire = Wire(self._ranks, self._timeout, own=own)
        self._broken: dict[int, str] = {}
        if self.is_leader and self.plan.replicas:  # the leaders' pairs connected now, each within timeout_s
            peers = (*self.plan.targets(self.node), *self.plan.sources(self.node))
            self._broken.update(self._wire.connect((self._leader(peer) for peer in peers), _KIND_CONNECT))
        self._receiving: collections.OrderedDict[tuple[str, str], threading.Event] = collections.OrderedDict()
        self._jobs: list[_Job] = []
        """Queued jobs not yet finished both ways (sent and acknowledged, the peers' replicas received)."""
        self._jobs_lock = threading.Lock()
        self._closed: str | None = None
        """Why the background threads were stopped (``None`` while they run)."""
        self._queues: list[queue.Queue[_Job | None]] = []
        self._threads: list[threading.Thread] = []
        if self.is_leader and self.plan.replicas:
            for name, loop in (("send", self._send_loop), ("receive", self._receive_loop)):
                q: queue.Queue[_Job | None] = queue.Queue()
                # Not a daemon: a daemon thread that returns from a gloo wait during interpreter teardown
                # aborts the process; this one is stopped by close() (the exit drain), or outlives it by at
                # most one transfer's timeout.
                thread = threading.Thread(target=loop, args=(q,), name=f"tierckpt-replica-{name}", daemon=False)
                thread.start()
                self._queues.append(q)
                self._threads.append(thread)
            REPLICATORS.add(self)

    def _node_name(self, node: int) -> str:
        return self.plan.nodes[node]

    def _leader(self, node: int) -> int:
        return self._ranks[self.plan.leaders[node]]

    def replicate(self, uri: str, generation: str, keys: Iterable[str] | None = None) -> ReplicaHandle:
        """Start replicating ``generation`` of ``uri`` (every rank of the group, in the same order).

        ``keys``: the node's own files of the generation (default: every file no other origin lists).
        """
        tier = self.memory.tier(uri)
        peers = tuple(self._node_name(t) for t in self.plan.targets(self.node))
        handle = ReplicaHandle(tier, generation, peers)
        if not self.is_leader:
            return handle
        manifest = tier.seal(generation, origin=self._node_name(self.node), keys=keys)
        if not self.plan.replicas:
            handle._finish(ReplicaResult(
                uri=tier.uri, generation=generation, level=Level.MEMORY, peers=(), acknowledged=(),
                reason="no peer holds a replica: the job spans one node or TIERCKPT_REPLICAS is 0",
            ))
            return handle
        record = tier.committed()
        commit = None
        if record is not None and record.generation == generation:
            commit = read_capped(tier.path_of(COMMIT), MAX_RECORD_BYTES)
        job = _Job(tier.uri, generation, manifest, commit, handle, open_files(tier, manifest))
        with self._jobs_lock:
            if self._closed is not None:
                for fd in job.files.values():
                    os.close(fd)
                handle._finish(ReplicaResult(
                    uri=tier.uri, generation=generation, level=Level.MEMORY, peers=peers, acknowledged=(),
                    reason=f"not replicated: {self._closed} before this save (replication stopped)",
                ))
                return handle
            self._jobs = [j for j in self._jobs if not _settled(j)] + [job]
            self._receiving[(tier.uri, generation)] = job.received
            while len(self._receiving) > 64:
                self._receiving.popitem(last=False)
            for q in self._queues:
                q.put(job)
        return handle

    def wait_received(self, uri: str, generation: str, timeout_s: float | None = None) -> bool:
        """Wait until this node took its source nodes' replicas of ``generation`` (or gave up on them: the
        transfers' own timeouts bound it). Only a leader receives; elsewhere it returns at once. A
        process should not exit before this returns, or its peers' replication of the generation fails."""
        event = self._receiving.get((uri.rstrip("/"), generation))
        return True if event is None else event.wait(timeout_s)

    def busy(self) -> bool:
        """Whether a queued generation is still being sent or received."""
        with self._jobs_lock:
            return not all(_settled(j) for j in self._jobs)

    def close(self, timeout_s: float | None = None, why: str = "the replicator was closed") -> list[str]:
        """Wait up to ``timeout_s`` (``None``: no limit) for the queued jobs to finish both ways, then
        end the background threads (a sentinel each, joined), so that none is inside a transfer of the
        replicator's group when the process tears its groups down. Later :meth:`replicate` calls
        report ``memory`` naming ``why``.

        A job not finished in time is cut short: unless its level is already known, it is recorded as
        ``memory`` with ``why`` (a transfer that completes later changes nothing); a thread inside a
        transfer (gloo cannot interrupt it) reads its sentinel once that transfer fails. Returns one line
        per job cut short or thread left running (empty when all finished)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._jobs_lock:
            self._closed = why
            jobs, self._jobs = self._jobs, []

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        cut: list[str] = []
        for job in jobs:
            sent, received = job.handle.finished(left()), job.received.wait(left())
            if sent and received:
                continue
            what = (f"tierckpt: peer replication of {job.uri} generation {job.generation} did not finish within "
                    f"{timeout_s:.3g}s ({why})")
            if not sent and job.handle._finish(ReplicaResult(
                uri=job.uri, generation=job.generation, level=Level.MEMORY,
                peers=tuple(self._node_name(t) for t in self.plan.targets(self.node)), acknowledged=(),
                reason=f"replication cut short: {why} before every peer acknowledged this node's files",
            )):
                cut.append(f"{what}: its level stays 'memory' (this node's files are committed in its memory only)")
            if not received:
                cut.append(f"{what}: this node did not take every peer's replica of it (the peers report their level)")
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join(None if deadline is None else max(1.0, deadline - time.monotonic()))  # idle: prompt
            if thread.is_alive():  # inside a transfer that gloo cannot interrupt: it ends at the timeout
                cut.append(
                    f"tierckpt: the replication thread {thread.name} is still inside a transfer ({why}); it stops "
                    f"when that transfer fails (a transfer step waits at most {self._timeout.total_seconds():g}s)"
                )
        self._queues, self._threads = [], []
        REPLICATORS.discard(self)
        return cut

    # -- the sending side --------------------------------------------------------------------------------
    def _send_loop(self, jobs: queue.Queue[_Job | None]) -> None:
        lower_priority()
        while (job := jobs.get()) is not None:
            try:
                result = self._replicate_job(job)
            except Exception as exc:  # noqa: BLE001 - never a lost handle: the level stays memory, with why
                result = ReplicaResult(
                    uri=job.uri, generation=job.generation, level=Level.MEMORY, peers=(), acknowledged=(),
                    reason=f"replication failed: {type(exc).__name__}: {exc}",
                )
            finally:
                for fd in job.files.values():
                    os.close(fd)
            job.handle._finish(result)

    def _replicate_job(self, job: _Job) -> ReplicaResult:
        """Send one generation to every target in turn; its level from their answers."""
        acknowledged: list[str] = []
        reasons: list[str] = []
        for target in self.plan.targets(self.node):
            name, dst = self._node_name(target), self._leader(target)
            if dst in self._broken:
                reasons.append(f"peer {name} (rank {dst}) is unreachable since: {self._broken[dst]}")
                continue
            try:
                refusal = self._send_job(job, dst, f"peer {name} (rank {dst})")
            except Exception as exc:  # noqa: BLE001 - a dead or hung peer: reported, never raised
                self._broken[dst] = f"{type(exc).__name__}: {exc}"
                reasons.append(f"peer {name} (rank {dst}) failed during replication: {self._broken[dst]}")
                continue
            if refusal:
                reasons.append(f"peer {name} (rank {dst}) refused: {refusal}")
            else:
                acknowledged.append(name)
        peers = tuple(self._node_name(t) for t in self.plan.targets(self.node))
        return ReplicaResult(
            uri=job.uri, generation=job.generation, level=Level.MEMORY if reasons else Level.REPLICATED,
            peers=peers, acknowledged=tuple(acknowledged), reason="; ".join(reasons) or None,
        )

    def _send_job(self, job: _Job, dst: int, target: str) -> str | None:
        """Send one generation to one peer; the peer's refusal, or ``None`` once it acknowledged.

        The header offers the transfer's data stream (:mod:`.transfer`); a peer that takes the transfer
        connects to it before it answers, and the files go on it with ``sendfile``, straight from the
        tier's pages. The header and the answers go over the replicator's gloo pair."""
        with Listener(self._timeout.total_seconds()) as listener:
            header = {"manifest": job.manifest.encode().decode(), "stream": listener.offer.encode(),
                      "commit": None if job.commit is None else job.commit.decode()}
            self._wire.send_bytes(json.dumps(header).encode(), dst, _KIND_HEADER)
            answer = self._wire.answer(dst, _KIND_REPLY)
            if answer != "ok":
                self._bye(dst)
                return answer
            with listener.accept(target) as stream:
                for key, entry in job.manifest.files:
                    stream.send_file(job.files[key], entry.size, key)
        answer = self._wire.answer(dst, _KIND_ACK)
        self._bye(dst)
        return None if answer == "ok" else answer

    def _bye(self, dst: int) -> None:
        """Tell the peer its last answer was taken (it waits for this before it may exit). A failure here
        changes no level: the answer is in hand; the peer is only marked unusable for later transfers."""
        try:
            self._wire.send(torch.ones(1, dtype=torch.uint8), dst, _KIND_BYE)
        except Exception as exc:  # noqa: BLE001 - the answer already arrived; later jobs skip this peer
            self._broken[dst] = f"{type(exc).__name__}: {exc}"
            log.info("closing the exchange with rank %d failed after its answer arrived: %s", dst, self._broken[dst])

    # -- the receiving side ------------------------------------------------------------------------------
    def _receive_loop(self, jobs: queue.Queue[_Job | None]) -> None:
        lower_priority()
        scratch = memoryview(bytearray(_DRAIN_BYTES))
        while (job := jobs.get()) is not None:  # one job per generation to receive
            self._receive_sources(scratch)
            job.received.set()

    def _receive_sources(self, scratch: memoryview) -> None:
        """Receive one generation from each source node in turn (a failed source is logged; its sender reports it)."""
        for source in self.plan.sources(self.node):
            src = self._leader(source)
            if src in self._broken:
                continue
            try:
                self._receive_job(src, scratch)
            except Exception as exc:  # noqa: BLE001 - the sender reports the failure as its level
                self._broken[src] = f"{type(exc).__name__}: {exc}"
                log.warning("receiving replicas from rank %d failed: %s", src, self._broken[src])

    def _receive_job(self, src: int, scratch: memoryview) -> None:
        header = json.loads(self._wire.recv_bytes(src, _KIND_HEADER))
        stream: Stream | None = None
        try:
            manifest = Manifest.decode(header["manifest"].encode(), f"the header from rank {src}")
            tier = self.memory.tier(manifest.uri)
            admission = self.memory.admit(manifest.uri, manifest.generation, manifest.nbytes, self._durable_below,
                                          owed_below=self._owed_below)
            refusal = None if admission.fits else admission.reason
            if refusal is None:
                # Connected before the answer: the sender finds the connection waiting, and a sender that
                # died since its header is seen here at once (its port is closed), not after a timeout.
                offer = Offer.decode(str(header.get("stream")), f"rank {src}")
                stream = connect(offer, self._timeout.total_seconds(), f"rank {src}")
                tier.expect(manifest)  # its files are the sender's from the first one published
        except CheckpointError as exc:
            refusal = str(exc)
        except OSError as exc:
            refusal = f"cannot take the replica: {exc}"
        if refusal is not None and stream is not None:
            stream.close()
            stream = None
        self._wire.reply(refusal or "ok", src, _KIND_REPLY)
        if stream is None:
            self._await_bye(src)
            return
        with stream:
            failures = [f for key, entry in manifest.files if (f := receive_file(tier, key, entry, stream, scratch))]
        if not failures:
            try:
                tier.record(manifest)
                if header["commit"] is not None:
                    adopt_commit(tier, header["commit"].encode())
            except (CheckpointError, OSError) as exc:
                failures.append(f"recording {manifest.generation} of {tier.uri} failed: {exc}")
        self._wire.reply("; ".join(failures) or "ok", src, _KIND_ACK)
        self._await_bye(src)

    def _await_bye(self, src: int) -> None:
        """Wait until the sender took this node's last answer (its ``bye``): until then this process may
        not exit (the exit drain waits for the generation's ``received``), or the answer could be lost."""
        self._wire.recv(torch.zeros(1, dtype=torch.uint8), src, _KIND_BYE)


def _settled(job: _Job) -> bool:
    """Whether ``job`` is finished both ways: its level recorded and the peers' replicas received."""
    return job.handle.finished(0) and job.received.is_set()
