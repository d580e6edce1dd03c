"""The node-local catalogue of the cache: one LMDB environment in the cache directory.

Every process on the node opens the same environment (``<cache dir>/catalog.lmdb``); LMDB's write
transactions serialise writers across processes and readers never block. Files are written first (temp +
rename) and recorded after, and records are removed before files are deleted, so a record always names a
complete file or one that has just been evicted (readers treat a vanished file as a miss).

Named databases (keys are ``<root hash> NUL <key>``; values are the JSON form of the typed records of
:mod:`tierckpt.node.disk.records`, which this module alone encodes and decodes):

* ``roots``   root hash -> remote root URI (so ``sync()`` can reopen every store).
* ``services`` root hash -> the service that holds the root (e.g. ``s3://bucket at http://host:port``): one
  URI on two endpoints is two stores, two root hashes (see :func:`~tierckpt.node.disk.tiered.root_hash`).
* ``objs``    whole objects in the local tier (:class:`ObjRecord`), written here or fetched.
* ``blocks``  ``<rh> NUL <key> NUL <index>`` -> aligned blocks of large remote objects (:class:`BlockRecord`).
* ``sizes``   sizes of remote objects learnt on reads.
* ``pending`` the remote operation each key still needs (:class:`PendingOp`). A key has at most one;
  a newer write replaces it (``ver`` tells them apart).
* ``gens``    ``<rh> NUL <dir>/<generation>`` -> durability of a generation (:class:`GenRecord`).
* ``meta``    ``bytes`` (bytes held by the local tier) and ``ver`` (a counter for ``pending``).

Lifecycle of a written object (the process that writes it):

1. The file lands in the local tier; :meth:`Catalog.record_write` adds ``objs`` and ``pending`` (op ``put``,
   or ``commit`` for a COMMIT record) and moves the generation to ``staged`` (``local`` for a commit), then
   fsyncs the environment.
2. An uploader (this process, or a later one that adopts the record of a dead owner) calls
   :meth:`Catalog.claim`, uploads, then :meth:`Catalog.finish`, which removes the record only when its
   ``ver`` is unchanged (a newer write is uploaded in turn) and marks a committed generation ``remote``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import lmdb

from tierckpt.backends.base import UNCONDITIONAL, Unconditional
from tierckpt.errors import CheckpointBusyError
from tierckpt.native.layout import generation_path
from tierckpt.node.journal import Outstanding, pid_alive
from tierckpt.node.disk.config import cache_error
from tierckpt.node.disk.records import BlockRecord, CommitOrder, Finish, GenRecord, GenState, ObjRecord, Op, PendingOp, Tree

MAP_SIZE = 1 << 30
_DBS = ("roots", "objs", "blocks", "sizes", "pending", "gens", "meta", "services")

R = TypeVar("R")


def _open_env(path: str) -> tuple[lmdb.Environment, dict[str, Any]]:
    """A handle on the environment at ``path`` and its named databases.

    LMDB forbids opening an environment twice in a process: the one :class:`~tierckpt.node.disk.uploader.Uploader`
    of each cache directory (shared through :func:`tierckpt.store.open_store`) owns its catalogue. The
    databases are opened once, inside an explicit write transaction: ``open_db`` without one takes the
    writer lock while holding the GIL, which deadlocks against a thread that holds the writer lock and
    needs the GIL to finish.
    """
    try:
        os.makedirs(path, exist_ok=True)
        env = lmdb.open(path, map_size=MAP_SIZE, max_dbs=len(_DBS), sync=False, metasync=False, max_readers=512,
                        mode=0o600)
        with env.begin(write=True) as txn:
            dbs = {name: env.open_db(name.encode(), txn=txn) for name in _DBS}
    except (OSError, lmdb.Error) as exc:
        raise cache_error(os.path.dirname(path), f"opening its catalogue {path}", exc) from exc
    return env, dbs


def _k(*parts: str | int) -> bytes:
    return "\0".join(f"{p:012d}" if isinstance(p, int) else p for p in parts).encode()


def _dec(decode: Callable[[bytes], R], raw: bytes | None) -> R | None:
    """The record ``raw`` holds (``decode``: a record type's ``from_json``), or ``None`` if there is none."""
    return None if raw is None else decode(raw)


class Catalog:
    """Typed access to the catalogue of one cache directory (see the module docstring)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "catalog.lmdb")
        self.env, self._db = _open_env(self.path)

    def close(self) -> None:
        """Let go of the environment (a forked child must, before it opens the catalogue again)."""
        self.env.close()

    # -- helpers -------------------------------------------------------------------------------
    def _scan(self, txn: lmdb.Transaction, db: str, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        cur = txn.cursor(self._db[db])
        if not cur.set_range(prefix):
            return
        for k, v in cur:
            if not k.startswith(prefix):
                return
            yield k, v

    def _add_bytes(self, txn: lmdb.Transaction, delta: int) -> None:
        cur = int(txn.get(b"bytes", db=self._db["meta"]) or b"0")
        txn.put(b"bytes", str(max(0, cur + delta)).encode(), db=self._db["meta"])

    def _next_ver(self, txn: lmdb.Transaction) -> int:
        ver = int(txn.get(b"ver", db=self._db["meta"]) or b"0") + 1
        txn.put(b"ver", str(ver).encode(), db=self._db["meta"])
        return ver

    def _drop_local(self, txn: lmdb.Transaction, rh: str, key: str) -> list[tuple[Tree, int | None]]:
        """Remove the local records of ``key``; returns what files to delete (tree or block index)."""
        dropped: list[tuple[Tree, int | None]] = []
        obj = _dec(ObjRecord.from_json, txn.get(_k(rh, key), db=self._db["objs"]))
        if obj is not None:
            txn.delete(_k(rh, key), db=self._db["objs"])
            self._add_bytes(txn, -obj.size)
            dropped.append((obj.tree, None))
        for k, v in list(self._scan(txn, "blocks", _k(rh, key) + b"\0")):
            txn.delete(k, db=self._db["blocks"])
            self._add_bytes(txn, -BlockRecord.from_json(v).size)
            dropped.append((Tree.BLOCK, int(k.rsplit(b"\0", 1)[1])))
        txn.delete(_k(rh, key), db=self._db["sizes"])
        return dropped

    def sync(self) -> None:
        """Flush to disk (after recording data that exists nowhere else)."""
        self.env.sync(True)

    # -- roots -----------------------------------------------------------------------------------
    def register_root(self, rh: str, uri: str, service: str) -> None:
        """Record that root ``rh`` is ``uri`` on ``service`` (what its pending uploads were written for)."""
        with self.env.begin() as txn:
            if (txn.get(rh.encode(), db=self._db["roots"]) == uri.encode()
                    and txn.get(rh.encode(), db=self._db["services"]) == service.encode()):
                return
        with self.env.begin(write=True) as txn:
            txn.put(rh.encode(), uri.encode(), db=self._db["roots"])
            txn.put(rh.encode(), service.encode(), db=self._db["services"])

    def roots(self, service: str | None = None) -> dict[str, str]:
        """Root hash -> root URI of every root of the node cache (``service``: only that service's)."""
        with self.env.begin() as txn:
            roots = {k.decode(): v.decode() for k, v in txn.cursor(self._db["roots"])}
            if service is None:
                return roots
            return {rh: uri for rh, uri in roots.items()
                    if txn.get(rh.encode(), db=self._db["services"]) == service.encode()}

    def service_of(self, rh: str) -> str | None:
        """The service root ``rh`` was recorded for (``None``: recorded before services were)."""
        with self.env.begin() as txn:
            return _dec(bytes.decode, txn.get(rh.encode(), db=self._db["services"]))

    # -- writes through the cache ---------------------------------------------------------------
    def record_write(
        self, rh: str, key: str, size: int, crc: int, op: Op, generation: str | None = None,
        publish: Callable[[], None] | None = None, order: CommitOrder | None = None,
        replaces: int | None | Unconditional = UNCONDITIONAL,
    ) -> tuple[int, list[tuple[Tree, int | None]]]:
        """Record a durable local write of ``key`` that the remote still needs (``op`` put/commit;
        ``order``: what a commit's upload waits for).

        ``publish`` (the rename of the file into place) runs inside the write transaction, so
        concurrent writers of one key, in any process, leave the file and its record in agreement.
        ``replaces`` (a compare-and-swap commit): the ``ver`` of the key's pending op the writer checked
        its base against (``None``: none). Another op pending now (another job of the node committed in
        between): nothing is published or recorded, :class:`~tierckpt.errors.CheckpointBusyError` is
        raised. None pending is no conflict: the op checked was uploaded, the upload's own CAS decides."""
        now = time.time()
        with self.env.begin(write=True) as txn:
            old = _dec(PendingOp.from_json, txn.get(_k(rh, key), db=self._db["pending"]))
            if replaces is not UNCONDITIONAL and old is not None and old.ver != replaces:
                raise CheckpointBusyError(
                    f"another job of this node committed {key!r} (pending upload {old and old.ver}) after this "
                    f"commit's base was checked (pending upload {replaces})")
            if publish is not None:
                publish()
            dropped = [d for d in self._drop_local(txn, rh, key) if d[0] != Tree.WRITTEN]
            txn.put(_k(rh, key), ObjRecord(size, crc, now, Tree.WRITTEN).to_json(), db=self._db["objs"])
            self._add_bytes(txn, size)
            ver = self._next_ver(txn)
            if op == Op.COMMIT and order is None:
                order = CommitOrder()
            rec = PendingOp(op=op, ver=ver, owner=os.getpid(), gen=generation, size=size, t=now, order=order,
                            uid=os.geteuid())
            txn.put(_k(rh, key), rec.to_json(), db=self._db["pending"])
            gens = self._db["gens"]
            if op == Op.PUT:
                gp = generation_path(key)
                if gp is not None and txn.get(_k(rh, gp), db=gens) is None:
                    txn.put(_k(rh, gp), GenRecord(GenState.STAGED, now).to_json(), db=gens)
            elif op == Op.COMMIT and generation:
                base = key.rpartition("/")[0]
                gp = f"{base}/{generation}" if base else generation
                if old is not None and old.op == Op.COMMIT and old.gen not in (None, generation):
                    ogp = f"{base}/{old.gen}" if base else old.gen
                    prev = _dec(GenRecord.from_json, txn.get(_k(rh, ogp), db=gens))
                    if prev is not None and prev.state != GenState.REMOTE:
                        txn.put(_k(rh, ogp), GenRecord(GenState.SUPERSEDED, now).to_json(), db=gens)
                txn.put(_k(rh, gp), GenRecord(GenState.LOCAL, now).to_json(), db=gens)
        self.sync()
        return ver, dropped

    def record_delete(self, rh: str, key: str, deferred: bool) -> list[tuple[Tree, int | None]]:
        """Forget ``key`` locally; with ``deferred`` record a pending remote delete, else drop any pending op."""
        with self.env.begin(write=True) as txn:
            dropped = self._drop_local(txn, rh, key)
            if deferred:
                rec = PendingOp(op=Op.DELETE, ver=self._next_ver(txn), owner=os.getpid(), t=time.time(),
                                uid=os.geteuid())
                txn.put(_k(rh, key), rec.to_json(), db=self._db["pending"])
            else:
                txn.delete(_k(rh, key), db=self._db["pending"])
        self.sync()
        return dropped

    # -- pending operations ------------------------------------------------------------------------
    def pending(self, rh: str, key: str) -> PendingOp | None:
        with self.env.begin() as txn:
            return _dec(PendingOp.from_json, txn.get(_k(rh, key), db=self._db["pending"]))

    def pending_under(self, rh: str, prefix: str = "") -> dict[str, PendingOp]:
        with self.env.begin() as txn:
            return {k.split(b"\0", 1)[1].decode(): PendingOp.from_json(v)
                    for k, v in self._scan(txn, "pending", _k(rh, prefix))}

    def outstanding(self, scope: str) -> list[Outstanding]:
        """The journal protocol (:class:`~tierckpt.node.journal.Journal`): root ``scope``'s keys not yet
        uploaded, each with its live owner and its last failure."""
        return [Outstanding(key, rec.owner if rec.owner and pid_alive(rec.owner) else None, rec.error,
                            final=bool(rec.error) and not rec.retrying)
                for key, rec in sorted(self.pending_under(scope).items())]

    def keys_of_root(self, rh: str) -> set[str]:
        """Every key of root ``rh`` the catalogue has a record of: cached whole or in blocks, or pending."""
        prefix = _k(rh, "")
        with self.env.begin() as txn:
            keys = {k[len(prefix):].decode() for db in ("objs", "pending") for k, _ in self._scan(txn, db, prefix)}
            keys |= {k[len(prefix):].rsplit(b"\0", 1)[0].decode() for k, _ in self._scan(txn, "blocks", prefix)}
        return keys

    def pending_all(self) -> list[tuple[str, str, PendingOp]]:
        """Every pending op of the node: ``(root hash, key, op)``."""
        with self.env.begin() as txn:
            out = []
            for k, v in txn.cursor(self._db["pending"]):
                rh, key = k.decode().split("\0", 1)
                out.append((rh, key, PendingOp.from_json(v)))
            return out

    def claim(self, rh: str, key: str, ver: int) -> bool:
        """Make this process the owner of the pending op ``ver`` of ``key``; False if it changed."""
        with self.env.begin(write=True) as txn:
            rec = _dec(PendingOp.from_json, txn.get(_k(rh, key), db=self._db["pending"]))
            if rec is None or rec.ver != ver:
                return False
            txn.put(_k(rh, key), rec.claimed(os.getpid()).to_json(), db=self._db["pending"])
            return True

    def finish(self, rh: str, key: str, ver: int) -> Finish:
        """The remote has op ``ver`` of ``key``: clear it, unless a newer op replaced it or none is left."""
        now = time.time()
        with self.env.begin(write=True) as txn:
            rec = _dec(PendingOp.from_json, txn.get(_k(rh, key), db=self._db["pending"]))
            if rec is None:
                return Finish.GONE
            if rec.ver != ver:
                return Finish.CHANGED
            txn.delete(_k(rh, key), db=self._db["pending"])
            if rec.op == Op.COMMIT and rec.gen:
                base = key.rpartition("/")[0]
                gp = f"{base}/{rec.gen}" if base else rec.gen
                txn.put(_k(rh, gp), GenRecord(GenState.REMOTE, now).to_json(), db=self._db["gens"])
        self.sync()
        return Finish.DONE

    def fail(self, rh: str, key: str, ver: int, message: str, retrying: bool = False) -> None:
        """Record why op ``ver`` of ``key`` failed; ``retrying``: transiently, its uploader tries again."""
        with self.env.begin(write=True) as txn:
            rec = _dec(PendingOp.from_json, txn.get(_k(rh, key), db=self._db["pending"]))
            if rec is not None and rec.ver == ver:
                txn.put(_k(rh, key), rec.failed(message, retrying).to_json(), db=self._db["pending"])

    def drop_pending(self, rh: str, key: str) -> None:
        """Forget the pending op of ``key`` (``tierckpt sync --drop``): it will never reach the remote."""
        with self.env.begin(write=True) as txn:
            txn.delete(_k(rh, key), db=self._db["pending"])
        self.sync()

    # -- generations -------------------------------------------------------------------------------
    def mark_remote(self, rh: str, gen_path: str) -> None:
        """This node uploaded the COMMIT naming ``gen_path`` (even if a newer commit replaced its record)."""
        with self.env.begin(write=True) as txn:
            txn.put(_k(rh, gen_path), GenRecord(GenState.REMOTE, time.time()).to_json(), db=self._db["gens"])

    def generation_state(self, rh: str, gen_path: str) -> GenState | None:
        with self.env.begin() as txn:
            rec = _dec(GenRecord.from_json, txn.get(_k(rh, gen_path), db=self._db["gens"]))
            return None if rec is None else rec.state

    def generations(self, rh: str) -> dict[str, GenState]:
        with self.env.begin() as txn:
            return {k.split(b"\0", 1)[1].decode(): GenRecord.from_json(v).state
                    for k, v in self._scan(txn, "gens", _k(rh, ""))}

    def forget_generations(self, rh: str, prefix: str) -> None:
        with self.env.begin(write=True) as txn:
            for k, _ in list(self._scan(txn, "gens", _k(rh, prefix))):
                txn.delete(k, db=self._db["gens"])

    # -- the local tier ----------------------------------------------------------------------------
    def obj(self, rh: str, key: str) -> ObjRecord | None:
        with self.env.begin() as txn:
            return _dec(ObjRecord.from_json, txn.get(_k(rh, key), db=self._db["objs"]))

    def record_fetch(self, rh: str, key: str, size: int, crc: int) -> bool:
        """Record a whole object fetched from the remote (unless a local write of it is pending)."""
        with self.env.begin(write=True) as txn:
            if txn.get(_k(rh, key), db=self._db["pending"]) is not None:
                return False
            old = _dec(ObjRecord.from_json, txn.get(_k(rh, key), db=self._db["objs"]))
            if old is not None:
                self._add_bytes(txn, -old.size)
            txn.put(_k(rh, key), ObjRecord(size, crc, time.time(), Tree.FETCHED).to_json(), db=self._db["objs"])
            txn.put(_k(rh, key), str(size).encode(), db=self._db["sizes"])
            self._add_bytes(txn, size)
            return True

    def _entry(self, rh: str, key: str, idx: int | None,
               ) -> tuple[bytes, Any, Callable[[bytes], ObjRecord | BlockRecord]]:
        """Catalogue key, database and decoder of a whole object (``idx`` None) or of block ``idx``."""
        if idx is None:
            return _k(rh, key), self._db["objs"], ObjRecord.from_json
        return _k(rh, key, idx), self._db["blocks"], BlockRecord.from_json

    def drop(self, rh: str, key: str, idx: int | None = None, tree: Tree | None = None) -> bool:
        """Forget one cached whole object (``idx`` None; only if it is in ``tree``) or block."""
        k, db, decode = self._entry(rh, key, idx)
        with self.env.begin(write=True) as txn:
            rec = _dec(decode, txn.get(k, db=db))
            if rec is None or (tree is not None and rec.tree != tree):
                return False
            txn.delete(k, db=db)
            self._add_bytes(txn, -rec.size)
            return True

    def touch(self, rh: str, key: str, idx: int | None = None, rec: ObjRecord | BlockRecord | None = None) -> None:
        """Refresh the access time used by LRU eviction (at most once a second per entry; ``rec``: the
        entry as the caller read it)."""
        now = time.time()
        if rec is not None and now - rec.atime < 1.0:
            return
        k, db, decode = self._entry(rh, key, idx)
        with self.env.begin(write=True) as txn:
            raw = txn.get(k, db=db)
            if raw is not None:
                txn.put(k, replace(decode(raw), atime=now).to_json(), db=db)

    def block(self, rh: str, key: str, idx: int) -> BlockRecord | None:
        with self.env.begin() as txn:
            return _dec(BlockRecord.from_json, txn.get(_k(rh, key, idx), db=self._db["blocks"]))

    def record_block(self, rh: str, key: str, idx: int, length: int, crc: int) -> None:
        with self.env.begin(write=True) as txn:
            old = _dec(BlockRecord.from_json, txn.get(_k(rh, key, idx), db=self._db["blocks"]))
            if old is not None:
                self._add_bytes(txn, -old.size)
            txn.put(_k(rh, key, idx), BlockRecord(length, crc, time.time()).to_json(), db=self._db["blocks"])
            self._add_bytes(txn, length)

    def known_size(self, rh: str, key: str) -> int | None:
        with self.env.begin() as txn:
            raw = txn.get(_k(rh, key), db=self._db["sizes"])
            return None if raw is None else int(raw)

    def record_size(self, rh: str, key: str, size: int) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(_k(rh, key), str(size).encode(), db=self._db["sizes"])

    def cached_keys(self, rh: str, prefix: str = "") -> set[str]:
        """Keys with a whole object or a known size in the local tier (the remote had them once)."""
        with self.env.begin() as txn:
            keys = {k.split(b"\0", 1)[1].decode() for k, _ in self._scan(txn, "objs", _k(rh, prefix))}
            keys |= {k.split(b"\0", 1)[1].decode() for k, _ in self._scan(txn, "sizes", _k(rh, prefix))}
            return keys

    def usage(self) -> int:
        with self.env.begin() as txn:
            return int(txn.get(b"bytes", db=self._db["meta"]) or b"0")

    def evict(self, budget: int) -> list[tuple[str, str, Tree, int | None]]:
        """Forget least recently used entries until the tier fits ``budget``; returns
        ``(rh, key, tree, block index)`` of the files to delete. Entries with a pending op stay."""
        with self.env.begin(write=True) as txn:
            total = int(txn.get(b"bytes", db=self._db["meta"]) or b"0")
            if total <= budget:
                return []
            pending = {k for k, _ in txn.cursor(self._db["pending"])}
            candidates: list[tuple[float, str, bytes, int, Tree]] = []
            for k, v in txn.cursor(self._db["objs"]):
                if k not in pending:
                    obj = ObjRecord.from_json(v)
                    candidates.append((obj.atime, "objs", k, obj.size, obj.tree))
            for k, v in txn.cursor(self._db["blocks"]):
                block = BlockRecord.from_json(v)
                candidates.append((block.atime, "blocks", k, block.size, Tree.BLOCK))
            candidates.sort()
            out = []
            for _, db, k, size, tree in candidates:
                if total <= budget:
                    break
                txn.delete(k, db=self._db[db])
                total -= size
                parts = k.decode().split("\0")
                out.append((parts[0], parts[1], tree, int(parts[2]) if db == "blocks" else None))
            txn.put(b"bytes", str(max(total, 0)).encode(), db=self._db["meta"])
            return out
