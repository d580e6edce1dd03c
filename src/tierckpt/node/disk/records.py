"""The typed records of the node-cache catalogue (see :mod:`tierckpt.node.disk.catalog`).

Each record is a frozen dataclass; its JSON form (``to_json`` / ``from_json``) is the catalogue's
on-disk encoding and is used only inside the catalogue. The field names of that encoding are fixed:
a catalogue written by an earlier version of this package is read unchanged, and a field a record
lacks there takes its default (e.g. ``retrying`` before the first upload attempt, or ``cas``/``base``/
``after`` on a commit recorded before they existed). Keys that no field names are ignored.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any


class Op(enum.StrEnum):
    """The remote operation a written key still needs."""

    PUT = "put"
    """Upload the object written through the cache."""
    COMMIT = "commit"
    """Upload a commit record, after what it depends on (see :class:`CommitOrder`)."""
    DELETE = "delete"
    """Delete the key on the remote (deferred until the commits recorded before it are uploaded)."""


class Tree(enum.StrEnum):
    """Where the local tier keeps a file."""

    WRITTEN = "w"
    """Written through this cache (``objects/``)."""
    FETCHED = "f"
    """A whole object fetched from the remote (``fetched/``)."""
    BLOCK = "b"
    """An aligned block of a large remote object (``blocks/``)."""


class GenState(enum.StrEnum):
    """Durability of a checkpoint generation as this node recorded it."""

    STAGED = "staged"
    """Data written through this node, no commit naming the generation yet."""
    LOCAL = "local"
    """Committed in this node's cache, the commit not uploaded yet."""
    REMOTE = "remote"
    """This node uploaded the commit naming it."""
    SUPERSEDED = "superseded"
    """A newer commit of this node replaced its commit before it was uploaded."""


class Finish(enum.StrEnum):
    """What :meth:`~tierckpt.node.disk.catalog.Catalog.finish` found of the op it was asked to clear."""

    DONE = "done"
    """Cleared: the remote has it."""
    CHANGED = "changed"
    """A newer op replaced it: that one is uploaded in turn."""
    GONE = "gone"
    """No op is pending for the key any more (dropped, or deleted locally)."""


def _json(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _fields(raw: bytes | str) -> dict[str, Any]:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"a catalogue record must be a JSON object, not {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class CommitOrder:
    """What the upload of a commit depends on, as its writer stated it."""

    cas: bool = False
    """Upload as a compare-and-swap against ``base`` (else unconditionally)."""
    base: bytes | None = None
    """The remote commit record this commit was built on (``None``: the key did not exist)."""
    after: Mapping[str, int | None] | None = None
    """Keys (with sizes where known) the remote must hold first; ``None``: everything pending under
    the commit's directory goes first."""
    replaced: tuple[str, ...] = ()
    """Generations of the key's pending commits that this one replaced on the node before they were
    uploaded, oldest first (it inherited their ``base``). An upload of one of them already in flight may
    still land: then, and only then, this commit's compare-and-swap is retried against it. Any other
    commit found on the remote is another writer's, even one uploaded through this node by another job."""


@dataclass(frozen=True, slots=True)
class PendingOp:
    """The remote operation a key still needs (``pending`` database); a key has at most one."""

    op: Op
    ver: int
    """Catalogue-wide counter: a newer write of the key replaces the record with a higher one."""
    owner: int
    """Pid of the process that uploads it (another adopts it when that process is dead)."""
    gen: str | None = None
    """For a commit: the generation its record names."""
    size: int = 0
    error: str | None = None
    """Why the last upload attempt failed, else ``None``."""
    t: float = 0.0
    """When it was recorded (Unix time)."""
    retrying: bool = False
    """The failure was transient: its uploader tries again."""
    order: CommitOrder | None = None
    """For a commit: what its upload waits for (encoded as the fields ``cas``, ``base``, ``after``, ``replaced``)."""
    uid: int | None = None
    """The user whose process recorded it (``None``: recorded before users were); only that user's
    processes upload it (:meth:`mine`). Its store is the root hash it is recorded under."""

    def mine(self) -> bool:
        """Whether this process's user made the op (one recorded before users were counts as its own: it is
        in a node cache directory checked to be this user's)."""
        return self.uid is None or self.uid == os.geteuid()

    def claimed(self, owner: int) -> PendingOp:
        """This op, owned by ``owner``, with no failure recorded."""
        return replace(self, owner=owner, error=None, retrying=False)

    def failed(self, message: str, retrying: bool) -> PendingOp:
        """This op, with its failure recorded."""
        return replace(self, error=message, retrying=retrying)

    def to_json(self) -> bytes:
        value: dict[str, Any] = {"op": str(self.op), "ver": self.ver, "owner": self.owner, "gen": self.gen,
                                 "size": self.size, "error": self.error, "t": self.t, "retrying": self.retrying,
                                 "uid": self.uid}
        if self.order is not None:
            value["cas"] = self.order.cas
            value["base"] = None if self.order.base is None else self.order.base.hex()
            value["after"] = None if self.order.after is None else dict(self.order.after)
            value["replaced"] = list(self.order.replaced)
        return _json(value)

    @classmethod
    def from_json(cls, raw: bytes | str) -> PendingOp:
        d = _fields(raw)
        op = Op(d["op"])
        order = None
        if op == Op.COMMIT:
            base, after = d.get("base"), d.get("after")
            order = CommitOrder(cas=bool(d.get("cas", False)), base=None if base is None else bytes.fromhex(base),
                                after=None if after is None else MappingProxyType(dict(after)),
                                replaced=tuple(str(g) for g in d.get("replaced") or ()))
        return cls(op=op, ver=int(d["ver"]), owner=int(d["owner"]), gen=d.get("gen"), size=int(d.get("size") or 0),
                   error=d.get("error"), t=float(d.get("t") or 0.0), retrying=bool(d.get("retrying", False)),
                   order=order, uid=None if d.get("uid") is None else int(d["uid"]))


@dataclass(frozen=True, slots=True)
class ObjRecord:
    """A whole object in the local tier (``objs`` database)."""

    size: int
    crc: int | None
    """CRC-32C of the file (``None``: unknown, the size alone is checked)."""
    atime: float
    """Last access (Unix time), for LRU eviction."""
    tree: Tree

    def to_json(self) -> bytes:
        return _json({"size": self.size, "crc": self.crc, "atime": self.atime, "tree": str(self.tree)})

    @classmethod
    def from_json(cls, raw: bytes | str) -> ObjRecord:
        d = _fields(raw)
        return cls(size=int(d["size"]), crc=d.get("crc"), atime=float(d.get("atime", 0.0)), tree=Tree(d["tree"]))


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """An aligned block of a large remote object in the local tier (``blocks`` database)."""

    size: int
    """Bytes in the block (encoded as ``len``)."""
    crc: int
    atime: float

    @property
    def tree(self) -> Tree:
        return Tree.BLOCK

    def to_json(self) -> bytes:
        return _json({"len": self.size, "crc": self.crc, "atime": self.atime})

    @classmethod
    def from_json(cls, raw: bytes | str) -> BlockRecord:
        d = _fields(raw)
        return cls(size=int(d["len"]), crc=int(d["crc"]), atime=float(d.get("atime", 0.0)))


@dataclass(frozen=True, slots=True)
class GenRecord:
    """Durability of one checkpoint generation on this node (``gens`` database)."""

    state: GenState
    t: float
    """When it entered ``state`` (Unix time)."""

    def to_json(self) -> bytes:
        return _json({"state": str(self.state), "t": self.t})

    @classmethod
    def from_json(cls, raw: bytes | str) -> GenRecord:
        d = _fields(raw)
        return cls(state=GenState(d["state"]), t=float(d.get("t", 0.0)))
