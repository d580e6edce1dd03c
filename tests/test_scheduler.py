"""The I/O scheduler: sync bridge, priorities, retries, split reads, fork safety, timeouts."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierckpt.backends import Backend, LocalBackend, MemoryBackend
from tierckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    TransientStorageError,
)
from tierckpt.io import IOScheduler, Priority, ReadRequest, get_scheduler
from tierckpt.io.scheduled import ScheduledBackend


@pytest.fixture
def scheduler() -> Iterator[IOScheduler]:
    sched = IOScheduler()
    yield sched
    sched.close()


@pytest.fixture
def backend() -> MemoryBackend:
    return MemoryBackend("memory://scheduler-tests")


# -- the sync bridge -------------------------------------------------------------------------------
def test_run_returns_results_and_raises_errors(scheduler: IOScheduler, backend: MemoryBackend) -> None:
    scheduler.run(backend.put("k", b"value"))
    assert scheduler.run(backend.get("k")) == b"value"
    with pytest.raises(CheckpointNotFoundError):
        scheduler.run(backend.get("missing"))


def test_run_executes_on_the_loop_thread(scheduler: IOScheduler) -> None:
    async def loop_of_caller() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    assert scheduler.run(loop_of_caller()) is scheduler.loop


def test_run_from_the_loop_thread_is_refused(scheduler: IOScheduler) -> None:
    async def nested() -> None:
        scheduler.run(asyncio.sleep(0))

    with pytest.raises(CheckpointError, match="loop thread"):
        scheduler.run(nested())


def test_submit_returns_a_future(scheduler: IOScheduler, backend: MemoryBackend) -> None:
    scheduler.run(backend.put("k", b"abc"))
    future = scheduler.submit(backend.get("k"))
    assert future.result(timeout=10) == b"abc"


def test_timeout_cancels_and_runs_cleanup(scheduler: IOScheduler) -> None:
    cleaned_up = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            cleaned_up.append(True)

    started = time.monotonic()
    with pytest.raises(TransientStorageError, match="did not finish within 0.2 s"):
        scheduler.run(slow(), timeout_s=0.2)
    assert time.monotonic() - started < 5
    assert cleaned_up == [True]


def test_a_timeout_error_raised_by_the_work_itself_is_not_relabelled(scheduler: IOScheduler) -> None:
    async def fails() -> None:
        raise TimeoutError("the provider's own timeout")

    with pytest.raises(TimeoutError, match="provider's own"):
        scheduler.run(fails(), timeout_s=10)


def test_cancelling_a_submitted_task_cancels_its_backend_call(
    scheduler: IOScheduler, backend: MemoryBackend
) -> None:
    started = asyncio.Event()
    outcome: list[str] = []

    async def blocking_op() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    future = scheduler.submit(scheduler.slotted(backend, backend.root_uri, "op", blocking_op))
    scheduler.run(asyncio.wait_for(started.wait(), 10))
    future.cancel()

    async def cancellation_seen() -> None:
        while not outcome:
            await asyncio.sleep(0.001)

    scheduler.run(cancellation_seen(), timeout_s=10)
    assert outcome == ["cancelled"]
    assert scheduler.metrics.snapshot()["op"].errors == 1


def test_slotted_call_outside_the_scheduler_loop_is_refused(
    scheduler: IOScheduler, backend: MemoryBackend
) -> None:
    with pytest.raises(CheckpointError, match="scheduler's own loop"):
        asyncio.run(scheduler.slotted(backend, backend.root_uri, "get", backend.get, "k"))


# -- priorities and slots --------------------------------------------------------------------------
def test_foreground_overtakes_queued_background_calls(backend: MemoryBackend) -> None:
    scheduler = IOScheduler(max_concurrency=1)
    order: list[str] = []

    async def op(name: str, release: asyncio.Event | None = None) -> None:
        order.append(name)
        if release is not None:
            await release.wait()

    async def scenario() -> None:
        release = asyncio.Event()
        holder = asyncio.create_task(scheduler.slotted(backend, backend.root_uri, "op", op, "holder", release))
        await asyncio.sleep(0)
        queued = [
            asyncio.create_task(scheduler.slotted(backend, backend.root_uri, "op", op, f"bg{i}", priority=Priority.BACKGROUND))
            for i in range(3)
        ]
        await asyncio.sleep(0)
        foreground = scheduler.slotted(backend, backend.root_uri, "op", op, "fg", priority=Priority.FOREGROUND)
        queued.append(asyncio.create_task(foreground))
        await asyncio.sleep(0.01)
        assert order == ["holder"]  # the single slot is taken; everyone else waits
        release.set()
        await asyncio.gather(holder, *queued)

    try:
        scheduler.run(scenario(), timeout_s=10)
    finally:
        scheduler.close()
    assert order == ["holder", "fg", "bg0", "bg1", "bg2"]


def test_concurrency_is_limited_per_backend(tmp_path: Path) -> None:
    scheduler = IOScheduler(max_concurrency=3)
    first, second = MemoryBackend("memory://one"), LocalBackend(str(tmp_path))
    running: dict[str, int] = {"one": 0, "two": 0}
    peak: dict[str, int] = {"one": 0, "two": 0}

    async def op(name: str) -> None:
        running[name] += 1
        peak[name] = max(peak[name], running[name])
        await asyncio.sleep(0.01)
        running[name] -= 1

    async def scenario() -> None:
        await asyncio.gather(
            *(scheduler.slotted(first, first.root_uri, "op", op, "one") for _ in range(10)),
            *(scheduler.slotted(second, second.root_uri, "op", op, "two") for _ in range(10)),
        )

    try:
        scheduler.run(scenario(), timeout_s=10)
    finally:
        scheduler.close()
    assert peak == {"one": 3, "two": 3}


# -- retries and metrics ---------------------------------------------------------------------------
def test_transient_errors_are_retried(scheduler: IOScheduler, backend: MemoryBackend) -> None:
    failures = {"left": 3}

    async def flaky(key: str) -> bytes:
        if failures["left"]:
            failures["left"] -= 1
            raise TransientStorageError(f"SlowDown while reading {key}")
        return b"finally"

    result = scheduler.run(scheduler.slotted(backend, backend.root_uri, "get", flaky, "obj", nbytes=7, retries=5), timeout_s=10)
    assert result == b"finally"
    (record,) = scheduler.metrics.records()
    assert (record.op, record.key, record.attempts, record.ok, record.nbytes) == ("get", "obj", 4, True, 7)
    totals = scheduler.metrics.snapshot()["get"]
    assert (totals.count, totals.retries, totals.bytes, totals.errors) == (1, 3, 7, 0)
    scheduler.metrics.reset()
    assert scheduler.metrics.snapshot() == {}


def test_retries_stop_after_the_last_attempt(scheduler: IOScheduler, backend: MemoryBackend) -> None:
    calls = []

    async def always_throttled() -> None:
        calls.append(1)
        raise TransientStorageError("503 Service Unavailable")

    with pytest.raises(TransientStorageError):
        scheduler.run(scheduler.slotted(backend, backend.root_uri, "put", always_throttled, retries=3), timeout_s=10)
    assert len(calls) == 3
    assert scheduler.metrics.snapshot()["put"].errors == 1


def test_permanent_errors_are_not_retried(scheduler: IOScheduler, backend: MemoryBackend) -> None:
    with pytest.raises(CheckpointNotFoundError):
        scheduler.run(scheduler.slotted(backend, backend.root_uri, "get", backend.get, "missing"), timeout_s=10)
    (record,) = scheduler.metrics.records()
    assert record.attempts == 1 and not record.ok


# -- split reads -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "local"])
def test_read_fills_buffers_in_parts(scheduler: IOScheduler, tmp_path: Path, kind: str) -> None:
    backend: Backend = MemoryBackend("memory://reads") if kind == "memory" else LocalBackend(str(tmp_path))
    blobs = {"a.bin": os.urandom(3 * 2**20 + 17), "b.bin": os.urandom(70_001)}
    for key, blob in blobs.items():
        scheduler.run(backend.put(key, blob))
    big = bytearray(len(blobs["a.bin"]) - 5)
    small = bytearray(1000)
    empty = bytearray(0)
    requests = [
        ReadRequest("a.bin", 5, memoryview(big)),
        ReadRequest("b.bin", 69_001, memoryview(small)),
        ReadRequest("b.bin", 0, memoryview(empty)),
    ]
    part = 256 * 1024
    sched = get_scheduler()  # the scheduling link's scheduler slots and counts each part
    sched.metrics.reset()
    sched.run(sched.read(ScheduledBackend(backend), requests, part_bytes=part), timeout_s=30)
    assert big == blobs["a.bin"][5:]
    assert small == blobs["b.bin"][69_001:]
    totals = sched.metrics.snapshot()["read_into"]
    assert totals.count == -(-len(big) // part) + 1
    assert totals.bytes == len(big) + len(small)


def test_read_failure_is_raised_and_cancels_the_rest(scheduler: IOScheduler) -> None:
    cancelled: list[str] = []

    class SlowForOneKey(MemoryBackend):
        async def read_into(self, key: str, start: int, out: memoryview) -> None:
            if key == "slow.bin":
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    cancelled.append(key)
                    raise
            await super().read_into(key, start, out)

    backend = SlowForOneKey("memory://failing-reads")
    scheduler.run(backend.put("slow.bin", b"s" * 100))
    scheduler.run(backend.put("short.bin", b"x" * 100))
    requests = [
        ReadRequest("slow.bin", 0, memoryview(bytearray(100))),
        ReadRequest("short.bin", 50, memoryview(bytearray(100))),  # runs 50 bytes past the end
    ]
    started = time.monotonic()
    with pytest.raises(CorruptCheckpointError, match="short.bin"):
        scheduler.run(scheduler.read(backend, requests, part_bytes=40), timeout_s=10)
    assert time.monotonic() - started < 5
    assert cancelled == ["slow.bin"] * 3  # every part of the slow request was cancelled


# -- the per-process instance ----------------------------------------------------------------------
def test_get_scheduler_is_a_singleton() -> None:
    assert get_scheduler() is get_scheduler()


def test_fork_child_gets_a_fresh_working_scheduler() -> None:
    parent = get_scheduler()
    assert parent.run(asyncio.sleep(0, result=1)) == 1
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            child = get_scheduler()
            ok = child is not parent and child.run(asyncio.sleep(0.01, result="child"), timeout_s=10) == "child"
            code = 0 if ok else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung using the scheduler")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0
    assert parent.run(asyncio.sleep(0, result=2)) == 2
