"""The typed records of the node-cache catalogue keep its on-disk JSON form: a catalogue written
before the records were typed (plain JSON objects, fields added over time) is read and finished."""

from __future__ import annotations

import json
import os
from pathlib import Path

import crc32c
import pytest

from tierckpt.native import layout
from tierckpt.backends import LocalBackend
from tierckpt.node.disk import CacheConfig
from tierckpt.store import node_cache_over
from tierckpt.node.disk.records import (
    BlockRecord, CommitOrder, GenRecord, GenState, ObjRecord, Op, PendingOp, Tree,
)

# Records exactly as the catalogue stored them when they were plain dicts.
PUT = b'{"op":"put","ver":7,"owner":4242,"gen":null,"size":5000,"error":null,"t":1700000000.5}'
FAILED_PUT = (b'{"op":"put","ver":8,"owner":4242,"gen":null,"size":10,"error":"S3 said no","t":1700000001.0,'
              b'"retrying":true}')
COMMIT = (b'{"op":"commit","ver":9,"owner":4242,"gen":"g-2","size":120,"error":null,"t":1700000002.0,'
          b'"cas":true,"base":"6869","after":{"g-2/data/rank-00000.bin":5000,"g-2/header.json":null}}')
OLD_COMMIT = b'{"op":"commit","ver":3,"owner":1,"gen":"g-1","size":60,"error":null,"t":1.0}'
DELETE = b'{"op":"delete","ver":10,"owner":4242,"gen":null,"size":0,"error":null,"t":1700000003.0}'


def test_pending_records_decode_from_their_stored_json() -> None:
    put = PendingOp.from_json(PUT)
    assert put == PendingOp(op=Op.PUT, ver=7, owner=4242, gen=None, size=5000, error=None, t=1700000000.5,
                            retrying=False, order=None)
    failed = PendingOp.from_json(FAILED_PUT)
    assert failed.error == "S3 said no" and failed.retrying is True
    commit = PendingOp.from_json(COMMIT)
    assert commit.op is Op.COMMIT and commit.gen == "g-2" and commit.ver == 9
    assert commit.order == CommitOrder(cas=True, base=b"hi",
                                       after={"g-2/data/rank-00000.bin": 5000, "g-2/header.json": None})
    # a commit recorded before cas/base/after existed: unconditional, waits for its whole directory
    assert PendingOp.from_json(OLD_COMMIT).order == CommitOrder(cas=False, base=None, after=None)
    assert PendingOp.from_json(DELETE).op is Op.DELETE


@pytest.mark.parametrize("raw", [PUT, FAILED_PUT, COMMIT, DELETE])
def test_pending_records_encode_with_the_same_fields(raw: bytes) -> None:
    rec = PendingOp.from_json(raw)
    again = json.loads(rec.to_json())
    old = json.loads(raw)
    assert {k: again[k] for k in old} == old  # every stored field kept, with its value
    assert PendingOp.from_json(rec.to_json()) == rec


def test_local_tier_and_generation_records_decode_from_their_stored_json() -> None:
    obj = ObjRecord.from_json(b'{"size":12,"crc":305419896,"atime":1700000000.0,"tree":"w"}')
    assert obj == ObjRecord(size=12, crc=305419896, atime=1700000000.0, tree=Tree.WRITTEN)
    assert ObjRecord.from_json(b'{"size":1,"crc":2,"atime":3.0,"tree":"f"}').tree is Tree.FETCHED
    block = BlockRecord.from_json(b'{"len":4096,"crc":77,"atime":5.0}')
    assert block == BlockRecord(size=4096, crc=77, atime=5.0) and block.tree is Tree.BLOCK
    assert json.loads(block.to_json()) == {"len": 4096, "crc": 77, "atime": 5.0}
    for state in ("staged", "local", "remote", "superseded"):
        gen = GenRecord.from_json(f'{{"state":"{state}","t":2.5}}'.encode())
        assert gen.state is GenState(state) and json.loads(gen.to_json()) == {"state": state, "t": 2.5}


def test_a_record_is_frozen() -> None:
    rec = PendingOp.from_json(PUT)
    with pytest.raises(AttributeError):
        rec.ver = 8  # type: ignore[misc]


def test_unknown_op_in_the_catalogue_is_an_error() -> None:
    with pytest.raises(ValueError, match="'copy'"):
        PendingOp.from_json(b'{"op":"copy","ver":1,"owner":1}')


async def test_a_catalogue_in_the_stored_json_form_is_uploaded_by_sync(tmp_path: Path) -> None:
    """Records written as the catalogue stored them before they were typed: a put and the commit
    that depends on it (compare-and-swap against no COMMIT) reach the remote through ``sync()``."""
    remote = LocalBackend(str(tmp_path / "remote"))
    config = CacheConfig(directory=str(tmp_path / "cache"), exit_wait_s=0, poll_s=0.01)
    store = node_cache_over(remote, config)
    gen = layout.new_generation()
    data_key, data = f"{gen}/data/rank-00000.bin", os.urandom(5000)
    record = layout.CommitRecord(gen, 1.0).encode()
    me = os.getpid()
    raw = {
        "objs": {data_key: {"size": len(data), "crc": crc32c.crc32c(data), "atime": 1.0, "tree": "w"},
                 layout.COMMIT: {"size": len(record), "crc": crc32c.crc32c(record), "atime": 1.0, "tree": "w"}},
        "pending": {data_key: {"op": "put", "ver": 1, "owner": me, "gen": None, "size": len(data), "error": None,
                               "t": 1.0},
                    layout.COMMIT: {"op": "commit", "ver": 2, "owner": me, "gen": gen, "size": len(record),
                                    "error": None, "t": 1.0, "cas": True, "base": None,
                                    "after": {data_key: len(data)}}},
        "gens": {gen: {"state": "local", "t": 1.0}},
    }
    for key, body in ((data_key, data), (layout.COMMIT, record)):
        path = Path(store.written.path_of(key))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    env = store.catalog.env
    with env.begin(write=True) as txn:
        for name, entries in raw.items():
            db = env.open_db(name.encode(), txn=txn)
            for key, value in entries.items():
                txn.put(f"{store.rh}\0{key}".encode(), json.dumps(value, separators=(",", ":")).encode(), db=db)
        meta = env.open_db(b"meta", txn=txn)
        txn.put(b"bytes", str(len(data) + len(record)).encode(), db=meta)
        txn.put(b"ver", b"2", db=meta)

    assert store.catalog.pending(store.rh, layout.COMMIT).order == CommitOrder(True, None, {data_key: len(data)})
    st = await store.status()
    assert st.generation == gen and st.state == "local" and st.pending_bytes == len(data) + len(record)
    await store.sync(timeout_s=30)
    assert await remote.get(data_key) == data and await remote.get(layout.COMMIT) == record
    assert store.catalog.pending_under(store.rh) == {}
    assert store.catalog.generation_state(store.rh, gen) is GenState.REMOTE
    assert await store.get(data_key) == data


async def test_another_jobs_commit_uploaded_through_this_node_is_not_retried_over(tmp_path: Path) -> None:
    """Two jobs share the node cache. Job 1 commits a fresh URI and its commit is uploaded. Job 2 checked the
    node's view before that (no COMMIT anywhere) and records its own commit just after, with nothing pending
    to conflict with: its upload's compare-and-swap (no COMMIT expected) is what decides, and the remote
    refuses it. The upload must fail and the remote keep job 1's commit. Before, the refusal was retried
    against job 1's commit because this node had uploaded it, and both jobs were told committed."""
    from tierckpt.errors import CheckpointError

    remote = LocalBackend(str(tmp_path / "remote"))
    store = node_cache_over(remote, CacheConfig(directory=str(tmp_path / "cache"), exit_wait_s=0, poll_s=0.01))
    first, second = (layout.CommitRecord(layout.new_generation(), 1.0).encode() for _ in range(2))
    await store.commit(layout.COMMIT, first, expected=None)
    await store.sync(timeout_s=30)
    assert await remote.get(layout.COMMIT) == first

    async def checked_before_the_first_commit(*_: object) -> None:
        return None  # job 2's check of the node's view ran before job 1 committed: it saw no COMMIT

    store._check_node_view = checked_before_the_first_commit  # type: ignore[method-assign]
    await store.commit(layout.COMMIT, second, expected=None)
    with pytest.raises(CheckpointError):
        await store.sync(timeout_s=30)
    assert await remote.get(layout.COMMIT) == first
