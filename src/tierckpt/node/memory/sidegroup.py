"""The side group: one gloo group per process and group that moves the memory tiers' bytes between nodes.

Two things move a node's tier bytes to another node, beside the training's collectives and never on its
groups: the replicator's background transfers (:mod:`.replica`, its steps in :mod:`.wire`) and, in peer
recovery, a load's streamed chunks (:mod:`tierckpt.loading.peer_stream` over :mod:`tierckpt.loading.peer_lanes`).
Both go over the one :class:`SideGroup` of their group, made here on first use (:func:`side_group_of`) and
kept for the process.

It spans the group's ranks and is made with no collective: from the group's own store (torch's, under the
group's prefix: one per group and incarnation of it), under a key of its own (:data:`STORE_PREFIX`), with the
group's timeout and the interfaces the group's devices use (``GLOO_SOCKET_IFNAME``, else the host name's
address, as torch's own constructor does). Its devices connect lazily: making the group exchanges nothing,
and only the pairs that talk ever connect, on their first message.

A gloo group runs a message tagged ``t`` on device ``t mod devices``, each device with its own connection
per pair and its own I/O thread. The side group has :data:`DEVICES` of them, and each user keeps to tags of
its own:

* devices ``0 .. LANES-1``, a load's lanes: the ``j``-th chunk between two ranks goes with tag (lane)
  ``j mod LANES`` (several connections per pair: one socket and one I/O thread moved about 3.8 GB/s on a
  16-core VM's loopback, `benchmarks/bench_wire.py`);
* device :data:`REPLICA_DEVICE`, the replicators': its I/O thread runs at the tier's background priority
  (:mod:`.background`), as the replicators' own threads do; each replicator of the process over the group
  has a channel of its own (:meth:`SideGroup.replica_tag`), so two tier configurations' replicators never
  take each other's messages.

Where the side group cannot be made alike on every rank (a torch without lazily connecting devices, a group
without a store torch shares) :func:`side_group_of` says ``None`` and each user falls back to what needs no
side group: the replicator to a gloo group of its own (``new_group``, every rank), a load to its own group.
The choice depends only on the torch build and the group, never on one rank's state.
"""

from __future__ import annotations

import datetime
import os
import threading
import weakref

import torch
import torch.distributed as dist

from tierckpt.node import lifecycle
from tierckpt.node.memory.background import lower_priority_of_new, started_threads

LANES = 4
"""A load's connections per pair for streamed chunks: on a 16-core VM two processes moved 256 MiB in 70 ms over
one, 64 ms over two and 40 ms over four lanes, in 32 MiB chunks (`benchmarks/bench_wire.py`, docs/benchmarks.md)."""
REPLICA_DEVICE = LANES
"""The device (and the residue of every tag) of the replicators' transfers."""
DEVICES = LANES + 1
"""The side group's devices: the lanes, then the replicators'."""
REPLICA_KINDS = 8
"""Tags per replicator channel (its kinds of message: header, reply, data, ...; room to spare)."""
STORE_PREFIX = "tierckpt/side-group"
"""The side group's keys in the group's store (beside torch's own)."""
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""A message's timeout when the group does not say its own (torch's default for gloo)."""


class SideGroup:
    """The side group of one group in this process: its gloo group ``pg`` (group ranks), the ``timeout``
    it was made with, and which users have used it (``users``: ``"lanes"``, ``"replica"``)."""

    def __init__(self, pg: dist.ProcessGroup, timeout: datetime.timedelta) -> None:
        self.pg, self.timeout = pg, timeout
        self.users: set[str] = set()
        self._channels = 0
        self._lock = threading.Lock()

    def send(self, tensor: torch.Tensor, to: int, tag: int) -> dist.Work:
        """Post ``tensor`` to group rank ``to`` under ``tag`` (on device ``tag mod DEVICES``)."""
        return self.pg.send([tensor], to, tag)

    def recv(self, into: torch.Tensor, frm: int, tag: int) -> dist.Work:
        """Post the receive of ``into`` from group rank ``frm`` under ``tag``."""
        return self.pg.recv([into], frm, tag)

    def next_channel(self) -> int:
        """The replicator channel this process would open next over the group (see :meth:`open_channel`)."""
        with self._lock:
            return self._channels

    def open_channel(self, channel: int) -> int:
        """Take replicator ``channel`` (every rank of the group agreed on it: the highest of their
        :meth:`next_channel`); later ones count from the next. Returns it."""
        with self._lock:
            self._channels = max(self._channels, channel + 1)
            return channel

    @staticmethod
    def replica_tag(channel: int, kind: int) -> int:
        """The tag of a replicator's messages of ``kind`` (``0 <= kind <`` :data:`REPLICA_KINDS`) on
        ``channel``: on :data:`REPLICA_DEVICE`, apart from every other channel's and from the lanes'."""
        return REPLICA_DEVICE + DEVICES * (channel * REPLICA_KINDS + kind)


_made: weakref.WeakKeyDictionary[dist.ProcessGroup, SideGroup | None] = weakref.WeakKeyDictionary()
"""Each group's side group (``None``: it cannot have one), made once per process."""
_made_lock = threading.Lock()


def side_group_of(group: dist.ProcessGroup | None, user: str) -> SideGroup | None:
    """The side group of ``group`` (``None``: the default group), made on first use, or ``None`` where it
    cannot be made; ``user`` is recorded as using it. Collective-free: a rank may ask alone."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        return None
    with _made_lock:
        if group not in _made:
            _made[group] = _make(group)
        side = _made[group]
    if side is not None:
        side.users.add(user)
    return side


def side_groups() -> list[SideGroup]:
    """This process's side groups (one per group that has one)."""
    with _made_lock:
        return [side for side in _made.values() if side is not None]


def _make(group: dist.ProcessGroup) -> SideGroup | None:
    """The side group over ``group``'s ranks, or ``None`` (no store torch shares; no lazily connecting devices)."""
    from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

    store = _store_of(group)
    if store is None:
        return None
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]

    def device(k: int) -> object:
        if interfaces:
            return ProcessGroupGloo.create_device(interface=interfaces[k % len(interfaces)], lazy_init=True)
        return ProcessGroupGloo.create_default_device(lazy_init=True)

    options = ProcessGroupGloo._Options()
    try:
        lanes = [device(k) for k in range(LANES)]
        before = started_threads()  # the replicators' device alone: its I/O thread is the one that starts now
        replica = device(REPLICA_DEVICE)
    except TypeError:  # a torch whose devices always connect every pair when the group is made
        return None
    lower_priority_of_new(before)
    options._devices = [*lanes, replica]
    timeout = _timeout_of(group)
    options._timeout = timeout
    pg = ProcessGroupGloo(PrefixStore(STORE_PREFIX, store), dist.get_rank(group), dist.get_world_size(group), options)
    return SideGroup(pg, timeout)


def _store_of(group: dist.ProcessGroup) -> dist.Store | None:
    """The store ``group``'s ranks share (torch keeps it beside the group), or ``None``."""
    try:
        return dist.distributed_c10d._world.pg_map[group][1]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


def _timeout_of(group: dist.ProcessGroup) -> datetime.timedelta:
    """``group``'s own timeout where its gloo backend tells it, else :data:`DEFAULT_TIMEOUT`."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return DEFAULT_TIMEOUT


def _forget_after_fork() -> None:
    """A forked child has none of its parent's groups' threads: it makes its own side groups, and never
    frees the parent's (their destructors would wait for those threads)."""
    global _made_lock
    _made_lock = threading.Lock()
    lifecycle.keep_in_child(side for side in list(_made.values()) if side is not None)
    _made.clear()


lifecycle.after_fork_in_child(_forget_after_fork)
