"""Crash and sharing across processes: a save whose uploads are pending when its process is
SIGKILLed is finished by ``sync()`` in another process; two processes read through one cache dir."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

import tierckpt
from tierckpt import progress
from tierckpt.native import layout
from tierckpt.backends import LocalBackend
from tierckpt.node.disk import CacheConfig
from tierckpt.store import node_cache_over
from tierckpt.cache_api import status, sync
from tierckpt.io import get_scheduler

SAVER = textwrap.dedent(
    """
    import asyncio, sys, time
    import torch
    import tierckpt, tierckpt.saving.plan
    from tierckpt.backends import LocalBackend
    from tierckpt.node.disk import CacheConfig
    from tierckpt.store import Chain, node_cache_over, node_face

    class StuckRemote(LocalBackend):
        '''Uploads of data files never finish: the process is killed while they are pending.'''
        async def open_writer(self, key):
            if "/data/" in key:
                await asyncio.sleep(3600)
            return await super().open_writer(key)
        async def put(self, key, data):
            if "/data/" in key:
                await asyncio.sleep(3600)
            await super().put(key, data)

    remote_dir, cache_dir = sys.argv[1], sys.argv[2]
    config = CacheConfig(directory=cache_dir, exit_wait_s=0, poll_s=0.01)
    def open_chain(uri, options=None):
        store = node_cache_over(StuckRemote(uri), config)
        return Chain(store, node_face(store))
    tierckpt.saving.plan.open_chain = open_chain
    torch.manual_seed(0)
    state = {"w": torch.randn(256, 256), "b": torch.arange(1000), "step": 7}
    tierckpt.async_save(remote_dir, state).wait()  # write-back: committed in the node cache
    print("SAVED", flush=True)
    time.sleep(3600)
    """
)

READER = textwrap.dedent(
    """
    import hashlib, random, sys
    from tierckpt.backends import LocalBackend
    from tierckpt.node.disk import CacheConfig
    from tierckpt.io import get_scheduler
    from tierckpt.store import node_cache_over

    remote_dir, cache_dir, expected = sys.argv[1], sys.argv[2], sys.argv[3]
    store = node_cache_over(LocalBackend(remote_dir), CacheConfig(directory=cache_dir, block_bytes=65536, exit_wait_s=0))
    run = get_scheduler().run
    size = run(store.size("big.bin"))
    rng = random.Random()
    async def many():
        import asyncio
        starts = [rng.randrange(0, size - 1000) for _ in range(200)]
        return await asyncio.gather(*(store.get_range("big.bin", s, s + 1000) for s in starts)), starts
    parts, starts = run(many())
    whole = run(store.get("big.bin"))
    assert hashlib.sha256(whole).hexdigest() == expected, "wrong bytes"
    assert all(p == whole[s:s + 1000] for p, s in zip(parts, starts)), "wrong range"
    print("OK", flush=True)
    """
)


def test_sigkilled_save_is_finished_by_sync(tmp_path: Path) -> None:
    remote_dir, cache_dir = tmp_path / "remote" / "step-7", tmp_path / "cache"
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    proc = subprocess.Popen([sys.executable, str(script), str(remote_dir), str(cache_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "SAVED", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The process died with its data uploads pending: the remote has no COMMIT yet.
    assert not (remote_dir / layout.COMMIT).exists()
    assert not list(remote_dir.rglob("rank-*.bin")) or not (remote_dir / layout.COMMIT).exists()
    # The saver forced the node cache over a local folder (a stand-in remote). tierckpt.status() of a local
    # path never opens the node cache (a local path is read and written in place), so the node cache's
    # own view of that store is asked here: the same StoreStatus that status() gives for a remote URI.
    config = CacheConfig(directory=str(cache_dir), exit_wait_s=0, poll_s=0.01)
    cached = node_cache_over(LocalBackend(str(remote_dir)), config)
    before = get_scheduler().run(cached.status())
    assert before.state == "local" and before.pending_bytes > 256 * 256 * 4
    with progress.shown("sync", enabled=False) as bar:  # what tierckpt sync draws: the bytes uploaded
        assert sync(config=config, timeout_s=60) == [str(remote_dir)]
    assert bar.done == bar.total == before.pending_bytes
    after = get_scheduler().run(cached.status())
    assert after.state == "remote" and after.pending_bytes == 0 and after.generation == before.generation
    assert (remote_dir / layout.COMMIT).exists()
    in_place = status(str(remote_dir))  # the folder itself: committed where it is
    assert in_place.state == "remote" and in_place.generation == before.generation
    torch.manual_seed(0)
    expected = {"w": torch.randn(256, 256), "b": torch.arange(1000), "step": 7}
    target = {"w": torch.zeros(256, 256), "b": torch.zeros(1000, dtype=torch.int64), "step": 0}
    tierckpt.load(str(remote_dir), target)  # straight from the remote, no cache
    assert torch.equal(target["w"], expected["w"]) and torch.equal(target["b"], expected["b"])
    assert target["step"] == 7


def test_two_processes_share_one_cache_dir(tmp_path: Path) -> None:
    remote_dir, cache_dir = tmp_path / "remote", tmp_path / "cache"
    data = os.urandom(3 * 2**20 + 123)
    get_scheduler().run(LocalBackend(str(remote_dir)).put("big.bin", data))
    script = tmp_path / "reader.py"
    script.write_text(READER)
    args = [sys.executable, str(script), str(remote_dir), str(cache_dir), hashlib.sha256(data).hexdigest()]
    started = time.monotonic()
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0 and out.strip() == "OK", err
    assert time.monotonic() - started < 120
    # The cache is consistent afterwards: a third reader is served without the remote.
    store = node_cache_over(LocalBackend(str(remote_dir)), CacheConfig(directory=str(cache_dir), block_bytes=65536,
                                                                     exit_wait_s=0))
    os.rename(remote_dir, tmp_path / "gone")
    assert get_scheduler().run(store.get_range("big.bin", 0, 2**20)) == data[: 2**20]
