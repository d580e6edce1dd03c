"""The write-back engine of the node tiers (``tierckpt.node``): one level type, one exit drain, one
durability answer, the chain's capability hooks, and the bytes each tier lands and reads back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt import store
from tierckpt.backends import Backend, LocalBackend
from tierckpt.node.disk import CacheConfig
from tierckpt.io.scheduled import ScheduledBackend
from tierckpt.node.memory import MemoryConfig, MemoryTier
from tierckpt.node import drain as exit_drain
from tierckpt.node import ledger
from tierckpt.node.levels import WAITABLE, Level
from tierckpt.node.status import LinkStatus, StoreStatus


def _chain(tmp_path: Path, *, memory: bool, cache: bool) -> tierckpt.backends.Backend:
    options: dict[str, object] = {
        "memory": MemoryConfig(directory=str(tmp_path / "mem")) if memory else False,
        "cache": CacheConfig(directory=str(tmp_path / "cache")) if cache else False,
    }
    return store.open_store(f"local://{tmp_path / 'remote'}", options)


def test_one_level_type_for_every_status_and_the_saver() -> None:
    from tierckpt.saving import api as saver

    assert saver.LEVELS is WAITABLE and all(isinstance(level, Level) for level in saver.LEVELS)
    assert [str(level) for level in saver.LEVELS] == ["memory", "replicated", "remote"]
    assert StoreStatus.__dataclass_fields__["state"].type == "Level | None"
    assert issubclass(LinkStatus, StoreStatus)
    plain = StoreStatus(uri="u", generation="g", state=Level.LOCAL, pending_keys=(), pending_bytes=0)
    assert plain.levels() == [] and not plain.only_in_memory


def test_both_links_drain_through_the_one_exit_drain() -> None:
    """The memory tier's write-downs and the node cache's uploads are both in the engine's drain, the
    memory tier first (it feeds the cache)."""
    from tierckpt.node.memory import downdrain

    drainers = exit_drain._drainers()
    depths = [d.depth for d in drainers]
    assert depths == sorted(depths) and {0, 1} <= set(depths)
    assert type(drainers[depths.index(0)]).__module__ == downdrain.__name__
    assert type(drainers[depths.index(1)]).__module__ == store.__name__
    assert store.exit_wait_s() == exit_drain.exit_wait_s()


def test_the_node_face_answers_for_the_chain(tmp_path: Path) -> None:
    """What only the node tiers have is asked of the chain's node face, never of a backend: a chain with both
    tiers answers each, a chain with none says "not here"; the face found from a store is the one assembled."""
    both = _chain(tmp_path, memory=True, cache=True)
    plain = _chain(tmp_path, memory=False, cache=False)
    face, none = store.node_face(both), store.node_face(plain)
    tier = store.memory_tier_of(both)
    assert isinstance(tier, MemoryTier) and tier is face.memory_tier
    assert store.memory_tier_of(plain) is None and none.memory_tier is None
    below = store.without_node_cache(both)  # past the memory link and the node cache: the scheduled remote
    assert isinstance(below, ScheduledBackend) and below.next_link() is not None and below is face.below_node
    assert face.below_memory is both.below and none.below_memory is plain and none.below_node is plain
    assert store.durability_of(both) is both and face.durable is both and face.revocable is both
    assert store.durability_of(plain) is None and none.durable is None and none.revocable is None
    assert face.keep_in_memory("g-00000001-0000000000001-aaaa") is True
    assert none.keep_in_memory("g-00000001-0000000000001-aaaa") is False and none.take_spare(8) is None
    assert none.mapped_writer("k", 8, None) is None
    assert face.without_memory().memory_tier is None and face.without_memory().below_node is below
    local = LocalBackend(str(tmp_path / "x"))
    assert local.next_link() is None and store.without_node_cache(local) is local
    assert store.identity_of(f"local://{tmp_path / 'remote'}", both) == store.identity_of(
        f"local://{tmp_path / 'remote'}", plain)
    hooks = {"node_memory_tier", "keep_in_memory", "take_spare", "mapped_writer", "want_spare", "without_node_cache",
             "without_node_memory", "forget_cached", "drop_uncommitted"}
    assert not hooks & set(dir(Backend)), "a backend knows no node: these belong to tierckpt.node.face.NodeFace"


def test_open_chain_assembles_the_store_and_its_face_once(tmp_path: Path, monkeypatch) -> None:
    """One URI's chain is built once: open_chain returns its store beside its face, both over the same links."""
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "cache"))
    chain = store.open_chain(f"local://{tmp_path / 'remote'}", {"memory": MemoryConfig(directory=str(tmp_path / "mem")),
                                                               "cache": True})
    assert chain.node.store is chain.store and chain.node.memory_tier is store.memory_tier_of(chain.store)
    assert chain.node.below_memory is chain.store.below and chain.node.below_node is chain.store.below.link


def test_the_ledger_counts_each_tier_once_per_byte(tmp_path: Path, monkeypatch) -> None:
    """A synchronous save through memory tier + node disk cache lands each data byte once in each tier
    and reads it back once out of each on its way down."""
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(tmp_path / "mem"))
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "cache"))
    state = {"w": torch.arange(1 << 18, dtype=torch.float32), "b": torch.ones(1 << 16)}
    before = ledger.snapshot()
    tierckpt.save(f"local://{tmp_path / 'remote'}", state, storage_options={"memory": True, "cache": True})
    after = ledger.snapshot()
    delta = {k: after[k] - before[k] for k in after}
    data = sum(p.stat().st_size for p in (tmp_path / "remote").rglob("*") if p.is_file() and "data" in p.parts)
    assert data >= (1 << 18) * 4 + (1 << 16) * 4
    for tier in ("memory", "node-disk"):
        assert data <= delta[f"{tier}.landed"] <= data + 64 * 1024, delta  # + the small metadata files
        assert data <= delta[f"{tier}.read_back"] <= delta[f"{tier}.landed"], delta
    got = tierckpt.load(f"local://{tmp_path / 'remote'}", storage_options={"memory": False, "cache": False})
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert os.path.isdir(tmp_path / "mem")


def test_the_drain_names_the_uploads_the_journal_still_owes(tmp_path: Path) -> None:
    """An upload that cannot land (the remote's directory is a file) stays in the node cache's journal,
    owned by this process: the engine's exit drain names its store and the command that finishes it."""
    (tmp_path / "blocked").write_text("a file where the remote's directory should be")
    uri = f"local://{tmp_path / 'blocked' / 'remote'}"
    cached = store.open_store(uri, {"memory": False, "cache": CacheConfig(directory=str(tmp_path / "cache"))})
    sched = tierckpt.io.scheduler.get_scheduler()
    sched.run(cached.put("g-00000001-0000000000001-aaaa/data/x.bin", b"x" * 100))
    lines = [line for line in store.drain_write_back(10.0) if uri in line]
    assert len(lines) == 1 and "1 upload(s)" in lines[0] and f"tierckpt sync {uri}" in lines[0], lines
    assert "failed:" in lines[0], lines
    outstanding = cached.catalog.outstanding(cached.rh)
    assert [o.key for o in outstanding] == ["g-00000001-0000000000001-aaaa/data/x.bin"] and outstanding[0].error
    sched.run(cached.drop_pending())
    assert [line for line in store.drain_write_back(1.0) if uri in line] == []


def test_a_failed_save_leaves_the_tier_of_a_node_that_did_not_commit_it(tmp_path: Path) -> None:
    """``drop_uncommitted`` (every rank of a failed save): the node's files of the generation leave its
    memory tier and their write-downs stop; a generation the tier's COMMIT names is kept; a chain without
    a memory tier does nothing."""
    from tierckpt.native import layout

    link = store.open_store(str(tmp_path / "remote"), {"memory": MemoryConfig(directory=str(tmp_path / "mem"))})
    tier = store.memory_tier_of(link)
    assert tier is not None
    sched = tierckpt.io.scheduler.get_scheduler()
    failed, kept = "g-00000002-0000000000002-bbbb", "g-00000001-0000000000001-aaaa"
    sched.run(link.put(f"{kept}/data/rank-00001.bin", b"k" * 100))
    sched.run(link.commit(layout.COMMIT, layout.CommitRecord(kept, 1.0, seq=1).encode(), expected=None))
    sched.run(link.put(f"{failed}/data/rank-00001.bin", b"f" * 100))
    assert tier.keys_of(failed) == [f"{failed}/data/rank-00001.bin"]
    face = store.node_face(link)
    sched.run(face.drop_uncommitted(failed))
    sched.run(face.drop_uncommitted(kept))
    assert tier.keys_of(failed) == [] and link.writedown.runner.entry(f"{failed}/data/rank-00001.bin") is None
    assert tier.keys_of(kept) == [f"{kept}/data/rank-00001.bin"]
    assert sched.run(link.get(f"{kept}/data/rank-00001.bin")) == b"k" * 100
    plain = _chain(tmp_path, memory=False, cache=False)
    sched.run(store.node_face(plain).drop_uncommitted(failed))  # no tier: nothing to drop, no error


def test_both_links_run_the_one_link_core() -> None:
    """``sync``, ``wait_durable``, ``withdraw`` and the rule that a delete below follows a pending ``COMMIT``
    are the link core's (``node/link.py``), inherited by both links; each medium answers only the core's
    hooks, and the memory link's withdrawal and deletes have no module of their own any more."""
    import importlib.util

    from tierckpt.node.disk import TieredBackend
    from tierckpt.node.link import WriteBackLink
    from tierckpt.node.memory.link import MemoryLink

    hooks = ("_wait_own", "_sync_scope", "_take_over", "_commit_pending", "_delete_now", "_delete_after_commit",
             "_stop_copies", "_landed", "_drop_withdrawn")
    for link in (TieredBackend, MemoryLink):
        assert issubclass(link, WriteBackLink)
        for shape in ("wait_durable", "withdraw", "_delete_below"):
            assert getattr(link, shape) is getattr(WriteBackLink, shape), f"{link.__name__}.{shape} is its own"
        for hook in hooks:
            assert getattr(link, hook) is not getattr(WriteBackLink, hook), f"{link.__name__} lacks {hook}"
    assert MemoryLink.sync is WriteBackLink.sync  # the cache's adds its refusals after the core's (the next test)
    for retired in ("withdraw", "linkdeletes"):
        assert importlib.util.find_spec(f"tierckpt.node.memory.{retired}") is None


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_sync_takes_over_what_a_dead_process_left_through_the_one_core(tmp_path: Path, tier: str, monkeypatch) -> None:
    """A process commits a generation through either node tier and dies while every copy down fails (the
    remote's directory cannot be made). Its journal entries then name nobody (``owner=None``); a ``sync`` of
    a later process takes each over through the link core's ``sync`` (the medium's ``_take_over`` called
    from it, ``COMMIT`` last), and the remote holds the file bit-exactly and the commit naming it."""
    from tierckpt.native import layout
    from tierckpt.node.link import WriteBackLink

    generation = "g-00000001-0000000000001-aaaa"
    key = f"{generation}/data/rank-00000.bin"
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the remote's parent directory should be")
    uri = f"local://{blocked / 'remote'}"
    directory = tmp_path / tier
    child = subprocess.run([sys.executable, str(Path(__file__).with_name("dead_writer_child.py")), tier, uri,
                            str(directory), generation], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout + child.stderr
    blocked.unlink()
    blocked.mkdir()
    link = store.open_store(uri, {
        "memory": MemoryConfig(directory=str(directory)) if tier == "memory" else False,
        "cache": CacheConfig(directory=str(directory), poll_s=0.01) if tier == "disk" else False,
    })
    scope = link.rh if tier == "disk" else generation
    left = link.journal.outstanding(scope)
    assert sorted(o.key for o in left) == sorted([key, layout.COMMIT]) and {o.owner for o in left} == {None}, left
    taken: list[tuple[str, bool]] = []
    medium = type(link)
    take_over = medium._take_over

    async def spy(self, scope, key):  # noqa: ANN001, ANN202
        taken.append((key, sys._getframe(1).f_code is WriteBackLink.sync.__code__))
        await take_over(self, scope, key)

    monkeypatch.setattr(medium, "_take_over", spy)
    sched = tierckpt.io.scheduler.get_scheduler()
    sched.run(link.sync(120))
    assert taken == [(key, True), (layout.COMMIT, True)]
    remote = LocalBackend(str(blocked / "remote"))
    from dead_writer_child import DATA

    assert sched.run(remote.get(key)) == DATA
    assert layout.CommitRecord.decode(sched.run(remote.get(layout.COMMIT))).generation == generation
    assert link.journal.outstanding(scope) == []


class _HeldCommits(LocalBackend):
    """A local remote whose ``COMMIT`` writes wait while :attr:`held` is set (a commit copy still pending)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.held = threading.Event()

    async def commit(self, key: str, data: bytes | memoryview, **kwargs: object) -> None:
        while key.rpartition("/")[2] == "COMMIT" and self.held.is_set():
            await asyncio.sleep(0.01)
        await super().commit(key, data, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_delete_below_follows_the_pending_commit_through_the_one_core(tmp_path: Path, tier: str, monkeypatch) -> None:
    """The saver's sweep deletes the superseded generation right after committing the new one. On either
    node tier, while the new ``COMMIT``'s copy down is still pending, the link core's rule defers the delete
    below (the medium's ``_delete_after_commit``, called from the core's ``_delete_below``): the remote keeps
    the old generation until it holds the new ``COMMIT``, so it never names a generation that is gone."""
    from tierckpt.native import layout
    from tierckpt.node.link import WriteBackLink
    from tierckpt.node.memory.link import MemoryLink

    remote = _HeldCommits(str(tmp_path / "remote"))
    if tier == "memory":
        link: Backend = MemoryLink(ScheduledBackend(remote), MemoryConfig(directory=str(tmp_path / "mem")))
    else:
        link = store.node_cache_over(remote, CacheConfig(directory=str(tmp_path / "cache"), poll_s=0.01))
    deferred: list[bool] = []
    medium = type(link)
    defer = medium._delete_after_commit

    async def spy(self, what, *, exact, superseded):  # noqa: ANN001, ANN202
        deferred.append(sys._getframe(1).f_code is WriteBackLink._delete_below.__code__)
        await defer(self, what, exact=exact, superseded=superseded)

    monkeypatch.setattr(medium, "_delete_after_commit", spy)
    sched = tierckpt.io.scheduler.get_scheduler()
    old, new = "g-00000001-0000000000001-aaaa", "g-00000002-0000000000002-bbbb"
    records = {g: layout.CommitRecord(g, 1.0, seq=i).encode() for i, g in enumerate((old, new), 1)}
    sched.run(link.put(f"{old}/data/rank-00000.bin", b"o" * 1000))
    sched.run(link.commit(layout.COMMIT, records[old], expected=None))
    sched.run(link.wait_durable(old))  # type: ignore[attr-defined]
    assert deferred == [] and sched.run(remote.get(layout.COMMIT)) == records[old]
    remote.held.set()
    sched.run(link.put(f"{new}/data/rank-00000.bin", b"n" * 1000))
    sched.run(link.commit(layout.COMMIT, records[new], expected=records[old]))
    sched.run(link.delete_prefix(f"{old}/"))
    assert deferred and all(deferred), deferred
    assert sched.run(remote.get(f"{old}/data/rank-00000.bin")) == b"o" * 1000  # kept: COMMIT still names it
    remote.held.clear()
    deadline = time.monotonic() + 60
    while sched.run(remote.exists(f"{old}/data/rank-00000.bin")):
        assert time.monotonic() < deadline, "the deferred delete never reached the remote"
        time.sleep(0.02)
    assert sched.run(remote.get(layout.COMMIT)) == records[new]  # the delete followed the new commit
    assert sched.run(remote.get(f"{new}/data/rank-00000.bin")) == b"n" * 1000
