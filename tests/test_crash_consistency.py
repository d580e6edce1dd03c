"""Crash consistency: SIGKILL a saving process at many precise moments, then check the checkpoint.

A child (``tests/crash_child.py``) saves ``make_state(i)`` for ``i = 0, 1, ...`` to one URI and is
killed inside chosen library functions (``TIERCKPT_CRASH_AT=<event>:<n>``, patched in the child
only) or after a random delay. After each kill:

* ``COMMIT`` names the last generation the child reported committed — or, only for kills that can
  land after the commit record was replaced (``.after`` events, deletes, random kills), the
  generation of the save in flight; the checkpoint loads bit-exactly as that iteration's state;
* with nothing committed yet, loading raises :class:`IncompleteCheckpointError` (data left behind)
  or :class:`CheckpointNotFoundError` (nothing visible left behind) — never a partial state;
* the leftover generations (not named by ``COMMIT``) are found by :func:`leftover_generations`;
* saving again to the same URI succeeds and loads, and removes the crash's leftovers (every
  superseded generation, in the background after its commit) without harming the new checkpoint.

To keep the file fast, torch is imported once by a fork server and every kill is one forked child.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tierckpt
from tierckpt.saving import cleanup
from tierckpt.native import layout
from tierckpt.backends import Backend, open_backend
from tierckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError
from tierckpt.io.scheduler import get_scheduler

sys.path.insert(0, str(Path(__file__).parent))
import crash_child  # noqa: E402

CHILD = str(Path(__file__).parent / "crash_child.py")
S3_PART = 5 * 2**20
JOB_TIMEOUT_S = 40.0


# -- helpers ---------------------------------------------------------------------------------------
def leftover_generations(uri: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Generation directories under ``uri`` that ``COMMIT`` does not name (leftovers of crashed saves)."""
    backend = open_backend(uri, **(storage_options or {}))
    sched = get_scheduler()
    try:
        committed: str | None = layout.CommitRecord.decode(sched.run(backend.get(layout.COMMIT))).generation
    except CheckpointNotFoundError:
        committed = None
    generations = {k.split("/", 1)[0] for k in sched.run(backend.list("")) if "/" in k}
    return sorted(g for g in generations if g.startswith("g-") and g != committed)


def committed_generation(backend: Backend) -> str | None:
    try:
        return layout.CommitRecord.decode(get_scheduler().run(backend.get(layout.COMMIT))).generation
    except CheckpointNotFoundError:
        return None


_STATES: dict[int, dict[str, Any]] = {}


def state_of(i: int) -> dict[str, Any]:
    if i not in _STATES:
        _STATES[i] = crash_child.make_state(i)
    return _STATES[i]


class ForkServer:
    """Drives ``crash_child.py --serve``: one forked child per job."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", AWS_EC2_METADATA_DISABLED="true", NO_PROXY="127.0.0.1,localhost")
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        self._buf = b""

    def _line(self, deadline: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the crash child did not answer in time")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise EOFError("the fork server exited")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def run(self, job: dict[str, Any], kill_after_s: float | None = None) -> int:
        """Run one job; SIGKILL the child after ``kill_after_s`` if given. Returns the exit code."""
        assert self.proc.stdin is not None
        deadline = time.monotonic() + JOB_TIMEOUT_S
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        pid = int(self._line(deadline).split()[1])
        if kill_after_s is not None:
            time.sleep(kill_after_s)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            kind, _, code = self._line(deadline).split()
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)  # a hang: kill it and report
            self._line(time.monotonic() + 10)
            raise
        assert kind == "exit"
        return int(code)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module", autouse=True)
def _no_sweep_grace() -> Iterator[None]:
    """The re-save's sweep of superseded generations runs at once in this process, not after
    :data:`tierckpt.saving.cleanup.GRACE_S`: no load races the sweeps here (the checks load one after another),
    so the grace would only add a second to every kill's check. What is swept is decided as before."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cleanup, "GRACE_S", 0.0)
        yield


@pytest.fixture(scope="module")
def fork_server() -> Iterator[ForkServer]:
    server = ForkServer()
    yield server
    server.close()


@dataclass
class Outcome:
    exit_code: int
    gens: dict[int, str]  # iteration -> generation it announced
    committed: list[int]  # iterations reported committed
    error: str | None


def parse_out(path: Path, exit_code: int) -> Outcome:
    gens: dict[int, str] = {}
    committed: list[int] = []
    error = None
    for line in path.read_text().splitlines():
        word, _, rest = line.partition(" ")
        if word == "gen":
            i, g = rest.split()
            gens[int(i)] = g
        elif word == "committed":
            i, g = rest.split()
            assert gens[int(i)] == g
            committed.append(int(i))
        elif word == "error":
            error = rest
    return Outcome(exit_code, gens, committed, error)


# -- the check after a kill ------------------------------------------------------------------------
MAY_COMMIT_BEFORE_DEATH = (".after", "delete", "random")


def check_after_kill(uri: str, opts: dict[str, Any] | None, out: Outcome, label: str) -> dict[str, Any]:
    """Every assertion of the module docstring; returns figures for the summary."""
    assert out.exit_code == -signal.SIGKILL, f"{label}: the child was not killed (exit {out.exit_code}, {out.error})"
    assert out.error is None, f"{label}: the child failed before the kill: {out.error}"
    backend = open_backend(uri, **(opts or {}))
    committed_gen = committed_generation(backend)
    last = out.committed[-1] if out.committed else None
    in_flight = max(out.gens) if out.gens and (last is None or max(out.gens) > last) else None
    expected: int | None = last
    if committed_gen is not None and in_flight is not None and committed_gen == out.gens[in_flight]:
        assert any(m in label for m in MAY_COMMIT_BEFORE_DEATH), (
            f"{label}: COMMIT names the in-flight generation of save {in_flight}, but the kill came before its commit"
        )
        expected = in_flight
    elif last is not None:
        assert committed_gen == out.gens[last], f"{label}: COMMIT names {committed_gen}, last committed {out.gens[last]}"
    else:
        assert committed_gen is None, f"{label}: COMMIT names {committed_gen} but nothing was committed"

    leftovers = leftover_generations(uri, opts)
    target = crash_child.empty_state()
    if expected is None:
        # nothing committed: never a partial load
        if leftovers:
            with pytest.raises(IncompleteCheckpointError):
                tierckpt.load(uri, target, storage_options=opts)
        else:
            with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)):
                tierckpt.load(uri, target, storage_options=opts)
    else:
        tierckpt.load(uri, target, storage_options=opts, verify=True)
        assert crash_child.states_equal(target, state_of(expected)), f"{label}: loaded state differs from save {expected}"
    if committed_gen is not None:
        assert committed_gen not in leftovers

    # saving again to the same URI succeeds and loads
    again = 1000 + len(out.gens)
    tierckpt.save(uri, state_of(again), storage_options=opts)
    target = crash_child.empty_state()
    tierckpt.load(uri, target, storage_options=opts)
    assert crash_child.states_equal(target, state_of(again)), f"{label}: the re-save does not load"
    # the re-save removes every superseded generation (in the background, after its commit): the
    # crashed saves' leftovers go, the new checkpoint stays intact
    cleanup.wait_pending()
    after = leftover_generations(uri, opts)
    assert after == [], f"{label}: the re-save left superseded generations: {leftovers} -> {after}"
    target = crash_child.empty_state()
    tierckpt.load(uri, target, storage_options=opts)
    assert crash_child.states_equal(target, state_of(again))
    return {"expected": expected, "leftovers": len(leftovers)}


# -- the kill moments ------------------------------------------------------------------------------
# (event, n, saves): each fires in the first or second save. Per local save: 4 whole-object puts
# (objects, tensors, pieces, header) and one commit (COMMIT, under its lock), 6 publishes/renames (data
# file + those 5), 8 data-file
# writes/stream puts; the second save also removes the first one's directory (its 5 files unlinked in turn).
LOCAL_KILLS = [
    ("local.open_writer", 1, 1), ("local.open_writer", 2, 2),
    ("local.write", 2, 1), ("local.write", 5, 2), ("local.write", 11, 2), ("local.write", 16, 2),
    ("local.close", 1, 1), ("local.close", 2, 2),
    *[("local.put", n, 2) for n in (1, 2, 3, 4, 5, 6, 7, 8)],
    ("local.put.after", 1, 2), ("local.put.after", 4, 2), ("local.put.after", 5, 2), ("local.put.after", 8, 2),
    ("local.commit", 1, 1), ("local.commit", 2, 2), ("local.commit.after", 1, 2), ("local.commit.after", 2, 2),
    ("local.delete_prefix", 1, 2), ("local.unlink", 1, 2), ("local.unlink", 4, 2),
    ("local.publish", 1, 1), ("local.publish", 2, 2), ("local.publish", 8, 2), ("local.publish", 12, 2),
    ("local.replace", 3, 2), ("local.replace", 12, 2), ("local.replace.after", 12, 2),
    ("saver.commit", 1, 1), ("saver.commit", 2, 2), ("saver.commit.after", 2, 2),
    ("saver.finish_rank", 2, 2),
    ("staging.put", 1, 1), ("staging.put", 12, 2), ("staging.finish", 2, 2),
]
S3_KILLS = [  # per S3 save: 4 part uploads of 5 MiB, 5 put_object (objects, 3 metadata docs, COMMIT)
    ("s3op.upload_part", 2, 1), ("s3op.upload_part.after", 6, 2),
    ("s3op.complete_multipart_upload", 1, 1), ("s3.mpu_close", 2, 2),
    ("s3op.put_object", 3, 1), ("s3op.put_object", 5, 1), ("s3op.put_object", 8, 2),
    ("s3op.put_object.after", 10, 2), ("s3.commit", 2, 2),
    ("s3.delete_prefix", 1, 2), ("s3op.delete_objects", 1, 2),
]
RANDOM_LOCAL = 6
RANDOM_S3 = 2

SUMMARY: list[tuple[str, str, dict[str, Any]]] = []


@pytest.fixture
def crash_dir(tmp_path: Path) -> Iterator[Path]:
    """Where a local checkpoint goes: tmpfs when there is one (fsync is free there; a process kill is
    what is tested, not power loss), else pytest's tmp_path."""
    import shutil
    import tempfile

    if os.access("/dev/shm", os.W_OK):
        path = Path(tempfile.mkdtemp(prefix="tierckpt-crash-", dir="/dev/shm"))
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path


def _job(tmp_path: Path, uri: str, crash_at: str | None, saves: int, opts: dict[str, Any] | None) -> dict[str, Any]:
    return {"uri": uri, "saves": saves, "start": 0, "crash_at": crash_at, "out": str(tmp_path / "out.txt"),
            "storage_options": opts}


@pytest.mark.parametrize(("event", "n", "saves"), LOCAL_KILLS, ids=[f"{e}:{n}" for e, n, _ in LOCAL_KILLS])
def test_kill_local(fork_server: ForkServer, tmp_path: Path, crash_dir: Path, event: str, n: int, saves: int) -> None:
    uri = str(crash_dir / "ckpt")
    code = fork_server.run(_job(tmp_path, uri, f"{event}:{n}", saves, None))
    figures = check_after_kill(uri, None, parse_out(tmp_path / "out.txt", code), f"{event}:{n}")
    SUMMARY.append(("local", f"{event}:{n}", figures))


@pytest.fixture
def s3_opts(s3_server: str) -> dict[str, Any]:
    return {"endpoint_url": s3_server, "key": "testing", "secret": "testing", "region": "us-east-1",
            "timeout_s": 10, "part_size": S3_PART, "cache": False}


@pytest.mark.parametrize(("event", "n", "saves"), S3_KILLS, ids=[f"{e}:{n}" for e, n, _ in S3_KILLS])
def test_kill_s3(fork_server: ForkServer, tmp_path: Path, s3_bucket_uri: str, s3_opts: dict[str, Any],
                 event: str, n: int, saves: int) -> None:
    code = fork_server.run(_job(tmp_path, s3_bucket_uri, f"{event}:{n}", saves, s3_opts))
    figures = check_after_kill(s3_bucket_uri, s3_opts, parse_out(tmp_path / "out.txt", code), f"{event}:{n}")
    SUMMARY.append(("s3", f"{event}:{n}", figures))


@pytest.mark.parametrize("seed", range(RANDOM_LOCAL))
def test_kill_local_random(fork_server: ForkServer, tmp_path: Path, crash_dir: Path, seed: int) -> None:
    uri = str(crash_dir / "ckpt")
    delay = random.Random(seed).uniform(0.05, 1.0)
    code = fork_server.run(_job(tmp_path, uri, None, 30, None), kill_after_s=delay)
    figures = check_after_kill(uri, None, parse_out(tmp_path / "out.txt", code), f"random:{delay:.3f}s")
    SUMMARY.append(("local", f"random:{delay:.3f}s", figures))


@pytest.mark.parametrize("seed", range(RANDOM_S3))
def test_kill_s3_random(fork_server: ForkServer, tmp_path: Path, s3_bucket_uri: str, s3_opts: dict[str, Any], seed: int) -> None:
    delay = random.Random(100 + seed).uniform(0.2, 2.0)
    code = fork_server.run(_job(tmp_path, s3_bucket_uri, None, 30, s3_opts), kill_after_s=delay)
    figures = check_after_kill(s3_bucket_uri, s3_opts, parse_out(tmp_path / "out.txt", code), f"random:{delay:.3f}s")
    SUMMARY.append(("s3", f"random:{delay:.3f}s", figures))


def test_standalone_child_env_crash(tmp_path: Path) -> None:
    """The documented standalone mode: TIERCKPT_CRASH_AT in the environment, lines on stdout."""
    uri = str(tmp_path / "ckpt")
    env = dict(os.environ, TIERCKPT_CRASH_AT="local.put:8", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, CHILD, uri, "--saves", "3"], env=env, capture_output=True, timeout=60)
    (tmp_path / "out.txt").write_bytes(proc.stdout)
    out = parse_out(tmp_path / "out.txt", proc.returncode)
    assert out.committed == [0]
    figures = check_after_kill(uri, None, out, "standalone local.put:8")
    SUMMARY.append(("local", "standalone local.put:8", figures))


def test_summary() -> None:
    """Runs last in the module: the figures for docs/reliability.md."""
    stores = {s for s, _, _ in SUMMARY}
    kills = len(SUMMARY)
    print(f"\nkilled at {kills} moments on {sorted(stores)}; "
          f"nothing committed yet: {sum(f['expected'] is None for _, _, f in SUMMARY)}; "
          f"with leftovers: {sum(f['leftovers'] > 0 for _, _, f in SUMMARY)}")
    if kills == len(LOCAL_KILLS) + len(S3_KILLS) + RANDOM_LOCAL + RANDOM_S3 + 1:  # the whole module ran
        assert kills >= 50 and stores == {"local", "s3"}
