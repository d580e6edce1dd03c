"""A Hypothesis state machine: TieredBackend (over a local 'remote') against a dict model.

Rules write (put, streamed writer, commit), read (get, get_range, size, exists), list, delete,
force eviction (a tiny disk budget), wait for uploads, and 'restart' (a crash: this process's
uploads are cancelled, a fresh TieredBackend opens the same cache dir, ``sync()`` resumes). After
every step the store must agree with the model; after ``sync`` the remote must too.
"""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierckpt.backends import LocalBackend
from tierckpt.node.disk import CacheConfig, TieredBackend, Uploader
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from tierckpt.io import get_scheduler

KEYS = st.sampled_from(["a", "b/c", "b/d", "g-1/data/x", "g-1/meta/y", "COMMIT"])
DATA = st.binary(min_size=0, max_size=3000)


class TieredMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="tierckpt-sm-")
        self.run = get_scheduler().run
        self.remote = LocalBackend(f"{self.tmp}/remote")
        self.budget = 10**9
        self.uploader = Uploader(f"{self.tmp}/cache", 8, 0)  # this process's uploads (open_store shares one)
        self.store = self._open()
        self.model: dict[str, bytes] = {}

    def _open(self) -> TieredBackend:
        config = CacheConfig(directory=f"{self.tmp}/cache", block_bytes=1024, disk_bytes=self.budget,
                             memory_bytes=4096, exit_wait_s=0, poll_s=0.005)
        return TieredBackend(self.remote, config, self.uploader)

    def teardown(self) -> None:
        self.run(self.store.cancel_uploads())
        self.uploader.catalog.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @rule(key=KEYS, data=DATA)
    def put(self, key: str, data: bytes) -> None:
        if key == "COMMIT":
            self.run(self.store.commit(key, data))
        else:
            self.run(self.store.put(key, data))
        self.model[key] = data

    @rule(key=KEYS, data=DATA, cut=st.integers(0, 3000))
    def stream(self, key: str, data: bytes, cut: int) -> None:
        async def go() -> None:
            writer = await self.store.open_writer(key)
            await writer.write(data[:cut])
            await writer.write(data[cut:])
            await writer.close()

        self.run(go())
        self.model[key] = data

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        if key in self.model:
            assert self.run(self.store.get(key)) == self.model[key]
            assert self.run(self.store.size(key)) == len(self.model[key])
        else:
            try:
                self.run(self.store.get(key))
            except CheckpointNotFoundError:
                pass
            else:
                raise AssertionError(f"{key} should be missing")

    @rule(key=KEYS, a=st.integers(0, 3100), b=st.integers(0, 3100))
    def get_range(self, key: str, a: int, b: int) -> None:
        start, end = min(a, b), max(a, b)
        if key not in self.model:
            return
        data = self.model[key]
        if end <= len(data):
            assert self.run(self.store.get_range(key, start, end)) == data[start:end]
        else:
            try:
                self.run(self.store.get_range(key, start, end))
            except CorruptCheckpointError:
                pass
            else:
                raise AssertionError("read past the end must fail")

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        self.run(self.store.delete(key))
        self.model.pop(key, None)

    @rule(data=DATA, key=st.sampled_from(["big/one", "big/two"]))
    def remote_only_object(self, data: bytes, key: str) -> None:
        """Another node wrote an object: the cache must read it through (whole or in blocks)."""
        if key in self.model:
            return
        self.run(self.remote.put(key, data * 2))
        self.model[key] = data * 2

    @rule()
    def evict(self) -> None:
        self.budget = 2000 if self.budget > 2000 else 10**9
        self.store = TieredBackend(self.remote, self._open().config, self.uploader)

    @rule()
    def wait(self) -> None:
        self.run(self.store.wait_durable())
        assert self.run(self.remote.list()) == sorted(self.model)

    @rule()
    def restart(self) -> None:
        self.run(self.store.cancel_uploads())
        self.store = self._open()

    @rule()
    def sync(self) -> None:
        self.run(self.store.sync())
        assert self.run(self.remote.list()) == sorted(self.model)
        for key, data in self.model.items():
            assert self.run(self.remote.get(key)) == data

    @invariant()
    def listing_matches(self) -> None:
        assert self.run(self.store.list()) == sorted(self.model)
        assert self.run(self.store.list("b/")) == sorted(k for k in self.model if k.startswith("b/"))


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
