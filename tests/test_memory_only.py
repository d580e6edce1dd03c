"""Checkpoints held in the node memory tier only (``persist=False``) and the manager's ``persist_every``.

Real parts: a local path as where the URI points (its directory is inspected directly), the node memory
tier in a per-test directory, a real process group for ranks that disagree. What must hold: nothing of a
memory-only checkpoint reaches where the URI points until a ``sync``; asking for ``remote`` raises and
names the sync command instead of waiting or pretending; the commit the chain below names is never
deleted under it; eviction may drop a memory-only copy but never writes one down behind the user's back.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt import CheckpointManager
from tierckpt.native import layout
from tierckpt.saving.cleanup import wait_pending
from tierckpt.errors import CheckpointError, CheckpointNotFoundError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.store import memory_tier_of, open_store
from tierckpt.node.memory import MemoryConfig, MemoryTierFullError, OnFull

NBYTES = 64 * 1024 * 4
"""The tensor bytes of :func:`state`."""


@pytest.fixture(autouse=True)
def _forget_memory_only_at_exit() -> Any:
    """This test process's exit would name each memory-only checkpoint the tests left in their temporary
    tiers (tested in a child process below): forget them after each test."""
    from tierckpt.node.memory import writedown

    yield
    writedown._MEMORY_ONLY.clear()


@pytest.fixture
def memdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "memory-tier"
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(directory))
    return directory


def mem(memdir: Path, budget: int = 1 << 30, **kw: Any) -> dict[str, Any]:
    return {"memory": MemoryConfig(directory=str(memdir), budget_bytes=budget, exit_wait_s=0, **kw)}


def state(seed: int) -> dict[str, Any]:
    return {"w": torch.randn(64, 1024, generator=torch.Generator().manual_seed(seed)), "step": seed}


def loaded(uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    got = {"w": torch.zeros(64, 1024), "step": -1}
    tierckpt.load(uri, got, storage_options=opts)
    return got


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return torch.equal(got["w"], want["w"]) and got["step"] == want["step"]


def levels(uri: str, opts: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    st = get_scheduler().run(open_store(uri, opts).status())
    return {name: (reached, detail) for name, reached, detail in st.levels()}


def test_a_memory_only_save_reaches_the_uri_only_through_sync(tmp_path: Path, memdir: Path) -> None:
    path, opts = tmp_path / "ckpt", mem(memdir)
    handle = tierckpt.async_save(str(path), state(1), storage_options=opts, persist=False)
    meta = handle.wait()
    wait_pending()
    assert not path.exists()  # nothing where the URI points: no file, no COMMIT
    assert same(loaded(str(path), opts), state(1))
    with pytest.raises(CheckpointError, match=f"persist=False.*tierckpt sync {path}"):
        handle.wait("remote", timeout_s=30)
    got = levels(str(path), opts)
    assert got["memory"][0] and not got["remote"][0] and "held in memory only" in got["remote"][1]
    st = get_scheduler().run(open_store(str(path), opts).status())
    assert st.memory_only and not st.written_down and st.pending_keys == ()  # nothing queued: nothing is "pending"
    assert tierckpt.sync(str(path), timeout_s=60, **opts) == [str(path)]
    on_disk = layout.CommitRecord.decode((path / layout.COMMIT).read_bytes())
    assert on_disk.generation == meta.generation
    assert same(loaded(str(path), {"memory": False}), state(1))  # from where the URI points alone
    assert handle.wait("remote", timeout_s=30).generation == meta.generation
    assert levels(str(path), opts)["remote"][0]


def test_a_synchronous_memory_only_save_returns_once_committed_in_memory(tmp_path: Path, memdir: Path) -> None:
    path, opts = tmp_path / "ckpt", mem(memdir)
    meta = tierckpt.save(str(path), state(2), storage_options=opts, persist=False)
    assert memory_tier_of(open_store(str(path), opts)).committed().generation == meta.generation
    assert not path.exists()
    assert same(loaded(str(path), opts), state(2))


def test_persist_false_without_the_memory_tier_fails_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="persist=False.*TIERCKPT_MEMORY=on.*persist=True"):
        tierckpt.save(str(path), state(1), storage_options={"memory": False}, persist=False)
    assert not (path / layout.COMMIT).exists()


def test_ranks_that_disagree_on_persist_fail_together(dist_pool: Any, tmp_path: Path, memdir: Path) -> None:
    from memory_child import ranks_disagree_on_persist

    path = tmp_path / "ckpt"
    config = mem(memdir)["memory"]
    messages = dist_pool.run(ranks_disagree_on_persist, str(path), config)
    assert len(set(messages)) == 1 and "False for ranks [0]" in messages[0] and "True for ranks [1, 2, 3]" in messages[0]
    assert not (path / layout.COMMIT).exists() and not list(memdir.rglob("COMMIT"))


def test_a_memory_only_save_over_a_persisted_one_keeps_that_one_below(tmp_path: Path, memdir: Path) -> None:
    """The sweep of the superseded generation drops it from the tier only: the chain below still names
    it in its COMMIT, so it must stay whole there."""
    path, opts = tmp_path / "ckpt", mem(memdir)
    first = tierckpt.save(str(path), state(1), storage_options=opts)
    second = tierckpt.save(str(path), state(2), storage_options=opts, persist=False)
    wait_pending()  # the sweep of the first generation has run
    tier = memory_tier_of(open_store(str(path), opts))
    assert tier.keys_of(first.generation) == [] and tier.committed().generation == second.generation
    assert layout.CommitRecord.decode((path / layout.COMMIT).read_bytes()).generation == first.generation
    assert same(loaded(str(path), {"memory": False}), state(1))
    assert same(loaded(str(path), opts), state(2))
    tierckpt.sync(str(path), timeout_s=60, **opts)
    assert same(loaded(str(path), {"memory": False}), state(2))


def test_eviction_may_drop_a_memory_only_copy(tmp_path: Path, memdir: Path) -> None:
    """Room for one checkpoint and a half: a second memory-only checkpoint evicts the first (never
    written down, and never to be), where a persisted one that is not down yet would be kept."""
    opts = mem(memdir, budget=NBYTES * 3 // 2)
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    tierckpt.save(first, state(1), storage_options=opts, persist=False)
    tierckpt.save(second, state(2), storage_options=opts, persist=False)
    assert same(loaded(second, opts), state(2))
    with pytest.raises(CheckpointNotFoundError):
        loaded(first, opts)
    assert not (tmp_path / "a").exists()  # evicted, not written down


def test_a_memory_only_checkpoint_that_cannot_fit_raises_even_with_fallback(tmp_path: Path, memdir: Path) -> None:
    path, opts = tmp_path / "ckpt", mem(memdir, budget=NBYTES // 2, on_full=OnFull.FALLBACK)
    with pytest.raises(MemoryTierFullError, match="persist=False"):
        tierckpt.save(str(path), state(1), storage_options=opts, persist=False)
    assert not (path / layout.COMMIT).exists()


def test_manager_persists_every_nth_step_and_keeps_the_newest_persisted(tmp_path: Path, memdir: Path) -> None:
    root, opts = tmp_path / "run", mem(memdir)
    manager = CheckpointManager(str(root), keep_last=1, persist_every=2, storage_options=opts)
    on_disk = []
    for step in range(1, 6):
        manager.save(step, state(step))
        on_disk.append(sorted(layout.step_of(p.name) for p in root.glob("step-*") if (p / layout.COMMIT).exists()))
    # Odd steps never reach the root's directory; the newest persisted step stays until a newer one is there.
    assert on_disk == [[], [2], [2], [4], [4]]
    assert manager.steps() == [4, 5] and manager.latest() == 5
    assert manager.levels(5)["memory"] and not manager.levels(5)["remote"]
    assert (root / "LATEST").read_bytes() == b'{"step": 4}'
    got = {"w": torch.zeros(64, 1024), "step": -1}
    assert manager.load_latest(got) == 5 and same(got, state(5))
    shutil.rmtree(memdir)  # the node's memory is lost: the newest persisted step remains
    got = {"w": torch.zeros(64, 1024), "step": -1}
    assert manager.latest() == 4 and manager.load_latest(got) == 4 and same(got, state(4))
    manager.save(7, state(7), force=True)  # a forced save (the last of a job) is written down
    assert (root / layout.step_name(7) / layout.COMMIT).exists()


def test_manager_persist_every_needs_the_memory_tier(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="persist_every.*TIERCKPT_MEMORY=on"):
        CheckpointManager(str(tmp_path / "run"), persist_every=4, storage_options={"memory": False})


def test_persisted_after_memory_only_saves_to_one_uri_catches_the_uri_up(tmp_path: Path, memdir: Path) -> None:
    """Persisted, memory-only, memory-only, persisted to one URI (a loop writing down every third save):
    the last one's write-down replaces the older commit where the URI points; the memory-only generations
    never reach it."""
    path, opts = tmp_path / "ckpt", mem(memdir)
    metas = []
    for i, persist in enumerate([True, False, False, True]):
        handle = tierckpt.async_save(str(path), state(i), storage_options=opts, persist=persist)
        metas.append(handle.wait())
        if persist:
            handle.wait("remote", timeout_s=60)
    wait_pending()
    assert layout.CommitRecord.decode((path / layout.COMMIT).read_bytes()).generation == metas[3].generation
    assert not (path / metas[1].generation).exists() and not (path / metas[2].generation).exists()
    assert same(loaded(str(path), {"memory": False}), state(3))


def test_a_failed_commit_write_down_keeps_the_generation_the_uri_still_names(
    tmp_path: Path, memdir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sweep of the superseded generation reaches where the URI points only after the newer COMMIT
    is written down there: when that write-down failed for good, the older generation, still named by
    the COMMIT there, stays whole (a leftover, never a COMMIT naming deleted files)."""
    from tierckpt.errors import StorageError
    from tierckpt.node.memory.writedown import WriteDown

    path, opts = tmp_path / "ckpt", mem(memdir)
    first = tierckpt.save(str(path), state(1), storage_options=opts)

    async def refused(*_: Any, **__: Any) -> None:
        raise StorageError("injected: the store refuses this COMMIT for good")

    monkeypatch.setattr(WriteDown, "commit_below", refused)
    handle = tierckpt.async_save(str(path), state(2), storage_options=opts)
    handle.wait()
    with pytest.raises(StorageError, match="injected"):
        handle.wait("remote", timeout_s=60)
    wait_pending()
    assert layout.CommitRecord.decode((path / layout.COMMIT).read_bytes()).generation == first.generation
    assert same(loaded(str(path), {"memory": False}), state(1))
    assert same(loaded(str(path), opts), state(2))  # the node's memory holds the newer one


def test_a_missing_file_error_names_the_older_commit_where_the_uri_points(tmp_path: Path, memdir: Path) -> None:
    """The newest generation is in this node's memory only and lost a file (as when a node is lost before
    its files reached a peer or the URI): the error names the file, the older generation still committed
    where the URI points, and how to load it — which then loads bit-exact."""
    from tierckpt.errors import MissingFileError

    path, opts = tmp_path / "ckpt", mem(memdir)
    first = tierckpt.save(str(path), state(1), storage_options=opts)
    second = tierckpt.save(str(path), state(2), storage_options=opts, persist=False)
    tier = memory_tier_of(open_store(str(path), opts))
    data = [k for k in tier.keys_of(second.generation) if "/data/" in k]
    Path(tier.path_of(data[0])).unlink()
    with pytest.raises(MissingFileError, match=f"{data[0]}.*older generation {first.generation}.*'memory': False"):
        loaded(str(path), opts)
    assert same(loaded(str(path), {"memory": False}), state(1))


CHILD = """
import sys, torch, tierckpt
path, sync = sys.argv[1], sys.argv[2] == "sync"
tierckpt.save(path, {"w": torch.ones(64, 64)}, storage_options={"memory": True}, persist=False)
if sync:
    tierckpt.sync(path, timeout_s=60, memory=True)
"""


@pytest.mark.parametrize("sync", [False, True])
def test_exit_says_when_the_newest_checkpoint_is_in_memory_only(tmp_path: Path, memdir: Path, sync: bool) -> None:
    """A process that ends with its newest checkpoint of a URI in node memory only says so on stderr, with
    the command that writes it down; once written down, nothing is said."""
    import os
    import subprocess
    import sys

    path = tmp_path / "ckpt"
    env = {**os.environ, "TIERCKPT_MEMORY_DIR": str(memdir), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), "sync" if sync else "no"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = f"newest checkpoint of {path}" in done.stderr and f"tierckpt sync {path}" in done.stderr
    assert said is not sync, done.stderr
    assert (path / layout.COMMIT).exists() is sync


def _slow_write_down(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every file written down into a local directory through the kernel-side/direct path takes ``seconds``."""
    import time

    from tierckpt.backends import local

    original = local._LocalWriter._copy_through

    def slow(self: Any, *args: Any) -> None:
        time.sleep(seconds)
        original(self, *args)

    monkeypatch.setattr(local._LocalWriter, "_copy_through", slow)


def _commit_below(uri: str) -> layout.CommitRecord | None:
    path = Path(uri) / layout.COMMIT
    return layout.CommitRecord.decode(path.read_bytes()) if path.exists() else None


@pytest.mark.parametrize("newer_persists", [False, True])
def test_remote_is_said_only_once_the_chain_below_commits_this_generation_or_a_newer_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_sweep_grace: None, newer_persists: bool) -> None:
    """A save written down slowly, superseded by a newer commit before its write-down is done. With the newer
    one ``persist=False``, the older is what the directory is to hold: the sweep of the newer commit keeps it
    until it is written down, and ``wait("remote")`` returns once the directory's ``COMMIT`` names it. With
    both persisted, ``wait("remote")`` returns once the directory's ``COMMIT`` is at least as new, never while
    it has none (both were said before, with nothing committed in the directory)."""
    _slow_write_down(monkeypatch, 1.0)
    uri = str(tmp_path / "ckpt")
    opts = {"memory": MemoryConfig(directory=str(tmp_path / "mem"))}
    first = tierckpt.async_save(uri, {"w": torch.full((1 << 22,), 1.0)}, storage_options=opts)  # 16 MiB
    first.wait("memory")
    second = tierckpt.async_save(uri, {"w": torch.full((1 << 22,), 2.0)}, storage_options=opts, persist=newer_persists)
    second.wait("memory")
    wait_pending()  # the sweep of the first generation ran (no grace) while its write-down goes on
    generation = first.wait("remote").generation
    below = _commit_below(uri)
    assert below is not None, "wait('remote') returned with no COMMIT where the URI points"
    assert below.seq >= layout.seq_of(generation)
    if not newer_persists:
        assert below.generation == generation
        got = tierckpt.load(uri, storage_options={"memory": False})
        assert torch.equal(got["w"], torch.full((1 << 22,), 1.0))
    else:
        second.wait("remote")
