"""The engine's task runner (:mod:`tierckpt.node.runner`) on its own, with an in-memory journal.

Each test drives :class:`TaskRunner` through fake jobs whose ops are numbered versions of a key and whose
journal is a list of events, so the runner's rules are checked without either node tier: one task per
key and supersede, retry of a transient failure by the retry rule, a permanent failure recorded and
final, a commit after what it depends on, and what the exit drain sees.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from tierckpt.errors import CheckpointError, TransientStorageError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.backends.retry import RetryPolicy
from tierckpt.node.runner import Entry, TaskRunner

QUICK = RetryPolicy(first_s=0.001, max_s=0.005)


class Journal:
    """What a link would keep on the node: the newest op of each key and the events of each attempt."""

    def __init__(self) -> None:
        self.newest: dict[str, int] = {}
        self.below: dict[str, int] = {}
        self.events: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()

    def write(self, key: str) -> int:
        with self.lock:
            self.newest[key] = self.newest.get(key, 0) + 1
            return self.newest[key]

    def log(self, what: str, key: str, op: int) -> None:
        with self.lock:
            self.events.append((what, key, op))

    def of(self, what: str, key: str | None = None) -> list[tuple[str, int]]:
        with self.lock:
            return [(k, op) for w, k, op in self.events if w == what and key in (None, k)]


class FakeJob:
    """One key's job: performs the key's newest op by calling ``action(key, op)``."""

    retry = QUICK
    poll = QUICK

    def __init__(self, journal: Journal, key: str, action, waits_for=lambda op: ()) -> None:
        self.journal, self.key, self.action, self.waits_for = journal, key, action, waits_for

    async def take(self, attempt: int) -> int | None:
        op = self.journal.newest.get(self.key)
        return None if op is None or self.journal.below.get(self.key) == op else op

    async def ready(self, op: int):
        return self.waits_for(op)

    async def perform(self, op: int) -> bool:
        await self.action(self.key, op)
        return True

    async def failed(self, op: int, exc: Exception, retrying: bool, attempt: int) -> bool:
        if self.journal.newest[self.key] != op:
            return False  # superseded: the newer op goes at once
        self.journal.log("retrying" if retrying else "failed", self.key, op)
        return True

    async def done(self, op: int) -> bool:
        self.journal.below[self.key] = op
        self.journal.log("done", self.key, op)
        return self.journal.newest[self.key] != op


def _wait_for(entry: Entry, timeout_s: float = 10.0) -> None:
    try:
        entry.future.result(timeout=timeout_s)
    except Exception:  # noqa: BLE001 - the test reads entry.failure
        pass


def _until(predicate, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def test_a_newer_op_supersedes_the_one_in_flight_on_the_same_task() -> None:
    journal, runner = Journal(), TaskRunner()
    gate = threading.Event()
    started: list[int] = []

    async def action(key: str, op: int) -> None:
        started.append(op)
        if op == 1:
            await asyncio.to_thread(gate.wait, 10)

    journal.write("k")
    first = runner.ensure("k", FakeJob(journal, "k", action))
    _until(lambda: started == [1])
    journal.write("k")
    journal.write("k")  # two newer writes while the first is copied: only the newest goes down
    again = runner.ensure("k", FakeJob(journal, "k", action))
    assert again is first and len(runner.running()) == 1  # one task per key
    gate.set()
    _wait_for(first)
    assert started == [1, 3] and journal.of("done") == [("k", 1), ("k", 3)]
    assert runner.entry("k") is None and runner.outstanding() == []


class PinnedJob(FakeJob):
    """A job that carries its op itself (the memory tier's commit: its record is in the job, not a journal)."""

    def __init__(self, journal: Journal, key: str, action, op: int) -> None:
        super().__init__(journal, key, action)
        self.op = op

    async def take(self, attempt: int) -> int | None:
        return None if self.journal.below.get(self.key) == self.op else self.op

    async def done(self, op: int) -> bool:
        await super().done(op)
        return False


def test_a_job_ensured_while_its_key_runs_is_taken_after_the_op_in_hand() -> None:
    journal, runner = Journal(), TaskRunner()
    gate = threading.Event()
    performed: list[int] = []

    async def action(key: str, op: int) -> None:
        performed.append(op)
        if op == 1:
            await asyncio.to_thread(gate.wait, 10)

    journal.write("k")
    first = runner.ensure("k", PinnedJob(journal, "k", action, 1))
    _until(lambda: performed == [1])
    assert runner.ensure("k", PinnedJob(journal, "k", action, 2)) is first
    gate.set()
    _wait_for(first)
    assert performed == [1, 2] and journal.below == {"k": 2} and runner.entry("k") is None


def test_a_transient_failure_is_recorded_and_retried_until_it_lands() -> None:
    journal, runner = Journal(), TaskRunner()
    attempts: list[int] = []

    async def flaky(key: str, op: int) -> None:
        attempts.append(op)
        if len(attempts) < 3:
            raise TransientStorageError("the store is out (injected)")

    journal.write("k")
    entry = runner.ensure("k", FakeJob(journal, "k", flaky))
    _wait_for(entry)
    assert attempts == [1, 1, 1]
    assert journal.of("retrying") == [("k", 1), ("k", 1)] and journal.of("done") == [("k", 1)]
    assert entry.failure is None and entry.error is None and runner.entry("k") is None


def test_a_permanent_failure_is_recorded_once_and_ends_the_task() -> None:
    journal, runner = Journal(), TaskRunner()
    attempts: list[int] = []

    async def refused(key: str, op: int) -> None:
        attempts.append(op)
        raise CheckpointError("the store refuses it (injected)")

    journal.write("k")
    entry = runner.ensure("k", FakeJob(journal, "k", refused))
    _wait_for(entry)
    assert attempts == [1] and journal.of("failed") == [("k", 1)] and journal.of("done") == []
    assert isinstance(entry.failure, CheckpointError) and "refuses" in str(entry.failure)
    assert runner.entry("k") is entry and not entry.running()  # kept: what a wait reports
    assert entry.error == "CheckpointError: the store refuses it (injected)"

    async def fine(key: str, op: int) -> None:
        attempts.append(op)

    retried = runner.ensure("k", FakeJob(journal, "k", fine))  # a sync takes it again: a fresh task
    _wait_for(retried)
    assert retried is not entry and journal.of("done") == [("k", 1)] and runner.entry("k") is None


def test_a_failure_of_a_superseded_op_is_not_recorded_and_the_newer_op_goes_at_once() -> None:
    journal, runner = Journal(), TaskRunner()

    async def action(key: str, op: int) -> None:
        if op == 1:
            journal.write("k")  # rewritten while its copy ran; then the copy fails
            raise CheckpointError("the old bytes are gone (injected)")

    journal.write("k")
    entry = runner.ensure("k", FakeJob(journal, "k", action))
    _wait_for(entry)
    assert journal.of("failed") == [] and journal.of("done") == [("k", 2)] and entry.failure is None


def test_a_commit_goes_after_everything_it_depends_on() -> None:
    journal, runner = Journal(), TaskRunner()
    gates = {k: threading.Event() for k in ("a", "b")}

    async def copy(key: str, op: int) -> None:
        await asyncio.to_thread(gates[key].wait, 10)
        journal.log("copied", key, op)

    async def commit(key: str, op: int) -> None:
        journal.log("committed", key, op)

    for key in ("a", "b", "COMMIT"):
        journal.write(key)
    files = [runner.ensure(k, FakeJob(journal, k, copy)) for k in ("a", "b")]
    deps = FakeJob(journal, "COMMIT", commit, waits_for=lambda op: {k for k in ("a", "b") if k not in journal.below})
    entry = runner.ensure("COMMIT", deps)
    time.sleep(0.05)
    assert journal.of("committed") == []  # both files are still being copied
    gates["b"].set()
    _until(lambda: "b" in journal.below)
    time.sleep(0.05)
    assert journal.of("committed") == []
    gates["a"].set()
    _wait_for(entry)
    for f in files:
        _wait_for(f)
    order = [what for what, _, _ in journal.events if what in ("copied", "committed")]
    assert order == ["copied", "copied", "committed"]


def test_a_commit_whose_dependency_failed_for_good_is_not_attempted() -> None:
    from tierckpt.node.runner import Blocked

    journal, runner = Journal(), TaskRunner()

    async def refused(key: str, op: int) -> None:
        raise CheckpointError(f"{key} refused (injected)")

    async def commit(key: str, op: int) -> None:
        journal.log("committed", key, op)

    journal.write("a")
    journal.write("COMMIT")
    runner.ensure("a", FakeJob(journal, "a", refused))

    def waits_for(op: int) -> set[str]:
        dep = runner.entry("a")
        if dep is not None and dep.failure is not None:
            raise Blocked(dep.failure)
        return set() if "a" in journal.below else {"a"}

    entry = runner.ensure("COMMIT", FakeJob(journal, "COMMIT", commit, waits_for))
    _wait_for(entry)
    assert journal.of("committed") == [] and str(entry.failure) == "a refused (injected)"
    assert journal.of("failed") == [("a", 1)]  # recorded for the file only: its record says why


def test_the_exit_drain_sees_what_is_outstanding_and_why() -> None:
    journal, runner = Journal(), TaskRunner()
    out = threading.Event()

    async def outage(key: str, op: int) -> None:
        if not out.is_set():
            raise TransientStorageError("connection refused (injected)")

    journal.write("k")
    entry = runner.ensure("k", FakeJob(journal, "k", outage))
    _until(lambda: bool(journal.of("retrying")))
    (left,) = runner.outstanding()
    assert (left.key, left.owner) == ("k", os.getpid())
    assert left.error == "TransientStorageError: connection refused (injected)"
    began = time.monotonic()
    runner.wait(0.2)  # the drain waits its time out, no longer
    assert 0.15 < time.monotonic() - began < 2.0 and entry.running()
    out.set()
    runner.wait(10)
    assert runner.outstanding() == [] and not entry.running()


def test_stop_ends_a_task_before_its_next_attempt() -> None:
    journal, runner = Journal(), TaskRunner()
    attempts: list[int] = []

    async def outage(key: str, op: int) -> None:
        attempts.append(op)
        raise TransientStorageError("still out (injected)")

    journal.write("k")
    entry = runner.ensure("k", FakeJob(journal, "k", outage))
    _until(lambda: len(attempts) >= 2)
    get_scheduler().run(runner.stop(lambda key: key == "k"))
    seen = len(attempts)
    time.sleep(0.05)
    assert not entry.running() and entry.failure is None and len(attempts) == seen
    assert runner.entry("k") is None and runner.outstanding() == []


@pytest.mark.parametrize("cancel", [False, True])
def test_settle_waits_for_a_running_task(cancel: bool) -> None:
    journal, runner = Journal(), TaskRunner()
    gate = threading.Event()

    async def slow(key: str, op: int) -> None:
        await asyncio.to_thread(gate.wait, 10)

    journal.write("k")
    entry = runner.ensure("k", FakeJob(journal, "k", slow))
    threading.Timer(0.05, gate.set).start()
    if cancel:
        get_scheduler().run(runner.stop(lambda key: True, cancel=True))
        assert entry.future.cancelled() and journal.of("done") == []
    else:
        get_scheduler().run(runner.settle(lambda key: True))
        assert journal.of("done") == [("k", 1)]
    assert not entry.running()
