"""Nothing silent, round 2: time bounds, an unreachable endpoint, and the manager after a node loss while
S3 is down.

* Every operation has an overall deadline: ``sync --timeout`` bounds the whole process (its exit drain
  included) against an endpoint that takes PUTs and never answers; ``ls``/``status``/``inspect``/``verify``
  end at ``--timeout`` against a tarpit (accepts connections, never answers); a load from an endpoint that
  dribbles 2 KiB every 1.5 s fails with ``timeout_s=2``; a synchronous save ends at ``TIERCKPT_TIMEOUT_S``;
  ``wait_durable()`` while the remote is down says on stderr what it waits for.
* An unreachable endpoint is a connection error (exit 7) for ``ls`` and ``status``, never "no checkpoints".
* ``CheckpointManager.load_latest`` finds the newest step any reachable tier holds, agreed across ranks,
  when a lost node is replaced and S3 is unreachable (2 simulated nodes, ``tests/recovery_child.py``).

Each command runs in a subprocess with a timeout, so a hang fails its test, not the suite; the S3 store is
the moto server behind ``tests/fault_proxy.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from fault_proxy import FaultProxy, Rule
from test_memory_recovery import Job, lose

BOUND_S = 90
"""A subprocess that has not ended after this long failed its test (the deadlines under test are 3-8 s)."""

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def child_env(tmp_path: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCKPT_")}
    return {**env, **CREDENTIALS, "TIERCKPT_S3_ENDPOINT_URL": endpoint, "TIERCKPT_CACHE_DIR": str(tmp_path / "cache"),
            "TIERCKPT_MEMORY": "off", **extra}


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], what: str) -> tuple[int, str, str]:
    """``proc``'s exit status, stdout and stderr; it failing to end within :data:`BOUND_S` fails the test."""
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{what} did not end within {BOUND_S} s; stderr: {err[-2000:]}")
    return proc.returncode, out, err


def python(code: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return start(["-c", textwrap.dedent(code)], env)


@pytest.fixture
def tarpit(proxy: FaultProxy) -> FaultProxy:
    proxy.add_rule(Rule("tarpit", count=None))
    return proxy


def make_bucket(s3_server: str) -> str:
    import boto3

    name = f"time-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=name)
    return name


SAVE_ASYNC_THEN_DIE = """
    import os, torch, tierckpt
    handle = tierckpt.async_save({uri!r}, {{"w": torch.arange(1000, dtype=torch.float32)}})
    handle.wait()  # committed in the node cache; the uploads fail (the endpoint resets them)
    os._exit(0)   # the process dies: the uploads stay pending in the catalogue
"""


# -- 8: an unreachable endpoint is a connection error --------------------------------------------------------
@pytest.mark.multiproc
def test_ls_and_status_call_a_closed_port_a_connection_error(tmp_path: Path, refused_endpoint: str) -> None:
    endpoint = refused_endpoint
    env = child_env(tmp_path, endpoint)
    procs = {cmd: start(["-m", "tierckpt", cmd, "s3://bucket/run"], env) for cmd in ("ls", "status")}
    for cmd, proc in procs.items():
        rc, _, err = finish(proc, f"tierckpt {cmd}")
        assert rc == 7, (cmd, rc, err)
        assert "no checkpoint" not in err, err
        assert f"cannot reach s3://bucket at {endpoint}" in err and "check the endpoint" in err, err


# -- 6 (and 8 through a tarpit): every command ends at its deadline ----------------------------------------
@pytest.mark.multiproc
def test_commands_against_a_tarpit_end_at_their_timeout(tmp_path: Path, tarpit: FaultProxy) -> None:
    env = child_env(tmp_path, tarpit.endpoint)
    procs = {cmd: start(["-m", "tierckpt", cmd, "s3://bucket/run", "--timeout", "5"], env)
             for cmd in ("ls", "status", "inspect", "verify")}
    for cmd, proc in procs.items():
        rc, _, err = finish(proc, f"tierckpt {cmd}")
        assert rc == 7, (cmd, rc, err)
        assert f"tierckpt {cmd} s3://bucket/run did not finish within 5 s (--timeout) waiting for" in err, err
        assert f"s3://bucket at {tarpit.endpoint} to answer" in err, err  # the endpoint that did not answer


CLI_WITH_SHORT_DEFAULT = """
import sys
from tierckpt.cli import deadline as cli_deadline
cli_deadline.DATA_DEFAULT_S = 4.0  # the default deadline of the data commands, shortened for the test
from tierckpt.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.multiproc
def test_data_commands_against_a_tarpit_end_at_their_default_deadline(tmp_path: Path, tarpit: FaultProxy) -> None:
    """Without ``--timeout`` or ``TIERCKPT_TIMEOUT_S``, ``verify`` and ``prefetch`` end at their default deadline
    (it hung ~150 s: they had none), naming the command, the endpoint, and the settings that raise it."""
    env = child_env(tmp_path, tarpit.endpoint)
    procs = {cmd: start(["-c", CLI_WITH_SHORT_DEFAULT, cmd, "s3://bucket/run"], env) for cmd in ("verify", "prefetch")}
    for cmd, proc in procs.items():
        rc, _, err = finish(proc, f"tierckpt {cmd}")
        assert rc == 7, (cmd, rc, err)
        assert (f"tierckpt {cmd} s3://bucket/run did not finish within 4 s (--timeout, default 4 s; or "
                "TIERCKPT_TIMEOUT_S) waiting for") in err, err
        assert f"s3://bucket at {tarpit.endpoint} to answer" in err and "or raise --timeout" in err, err


@pytest.mark.multiproc
def test_sync_timeout_bounds_the_process_and_its_exit_drain(tmp_path: Path, proxy: FaultProxy) -> None:
    """Uploads left pending by a dead process; ``sync --timeout 6`` against an endpoint that takes the PUTs
    and never answers ends at 6 s (it took 150 s: the exit drain retried the uploads 5 x 30 s), says what it
    waits for after 5 s, and names what is left. The save and the sync use one endpoint (the proxy): uploads
    pending for one endpoint are never synced through another. It resets every connection while the save
    runs (its uploads fail), then takes every request and never answers while the sync runs."""
    uri = "s3://bucket/ckpt"
    env = child_env(tmp_path, proxy.endpoint)
    proxy.add_rule(Rule("reset", count=None))
    rc, _, err = finish(python(SAVE_ASYNC_THEN_DIE.format(uri=uri), env), "the save")
    assert rc == 0, err
    proxy.clear()
    proxy.add_rule(Rule("tarpit", count=None))
    rc, _, err = finish(start(["-m", "tierckpt", "sync", uri, "--timeout", "6"], env), "tierckpt sync")
    assert rc == 7, err
    assert f"tierckpt sync {uri} did not finish within 6 s (--timeout)" in err, err
    assert f"upload(s) to {uri} to reach the remote" in err, "a wait of more than 5 s says what it waits for"
    assert "did not finish before exit" in err and f"tierckpt sync {uri}" in err, err
    assert proxy.hits["tarpit"] >= 1


@pytest.mark.multiproc
def test_a_synchronous_save_to_a_tarpit_ends_at_its_deadline(tmp_path: Path, tarpit: FaultProxy) -> None:
    code = """
        import torch, tierckpt
        from tierckpt.errors import DeadlineExceededError
        try:
            tierckpt.save("s3://bucket/ckpt", {"w": torch.ones(100)}, storage_options={"cache": False})
        except DeadlineExceededError as exc:
            print("raised:", exc)
    """
    rc, out, err = finish(python(code, child_env(tmp_path, tarpit.endpoint, TIERCKPT_TIMEOUT_S="3")), "the save")
    assert rc == 0, err
    assert "raised: save s3://bucket/ckpt did not finish within 3 s (TIERCKPT_TIMEOUT_S)" in out, (out, err)
    assert tarpit.endpoint in out, out


@pytest.mark.multiproc
def test_wait_durable_says_what_it_waits_for_while_the_remote_is_down(tmp_path: Path, refused_endpoint: str) -> None:
    code = """
        import torch, tierckpt
        from tierckpt.errors import DeadlineExceededError
        handle = tierckpt.async_save("s3://bucket/ckpt", {"w": torch.ones(100)})
        try:
            handle.wait_durable()
        except DeadlineExceededError as exc:
            print("raised:", exc)
    """
    env = child_env(tmp_path, refused_endpoint, TIERCKPT_TIMEOUT_S="8")
    rc, out, err = finish(python(code, env), "wait_durable")
    assert "raised: wait_durable s3://bucket/ckpt did not finish within 8 s (TIERCKPT_TIMEOUT_S)" in out, (out, err)
    assert "tierckpt: waiting 5 s so far for" in err and "upload(s) to s3://bucket/ckpt to reach the remote" in err, err
    assert "the wait_durable deadline passes in" in err, err


@pytest.mark.multiproc
def test_a_load_from_a_dribbling_endpoint_fails_within_its_request_timeout(
    tmp_path: Path, proxy: FaultProxy, s3_server: str,
) -> None:
    """2 KiB every 1.5 s passes every per-read timeout; each attempt as a whole must end within
    ``timeout_s`` plus its bytes at 1 MiB/s, so the load fails (it hung for good)."""
    uri = f"s3://{make_bucket(s3_server)}/ckpt"
    import torch

    import tierckpt

    tierckpt.save(uri, {"w": torch.arange(65536, dtype=torch.float32)},
                  storage_options={"endpoint_url": s3_server, "cache": False})
    proxy.add_rule(Rule("dribble", method="GET", count=None, seconds=1.5, chunk=2048))
    code = f"""
        import torch, tierckpt
        from tierckpt.errors import StorageUnreachableError
        try:
            tierckpt.load({uri!r}, {{"w": torch.zeros(65536)}}, storage_options={{"cache": False, "timeout_s": 2}})
        except StorageUnreachableError as exc:
            print("raised:", exc)
    """
    rc, out, err = finish(python(code, child_env(tmp_path, proxy.endpoint)), "the load")
    assert rc == 0, err
    assert "raised:" in out and "gave no complete answer within 2 s" in out and "timeout_s" in out, (out, err)
    assert proxy.hits["dribble"] >= 1


# -- 9: load_latest after a node loss with S3 unreachable ---------------------------------------------------
@pytest.mark.multiproc
def test_load_latest_after_a_node_loss_with_s3_unreachable(tmp_path: Path, refused_endpoint: str) -> None:
    """Step 1 replicated across two nodes while S3 is down; node-0 is lost and replaced by a fresh node-2.
    The fresh node's listing fails (S3 unreachable) and its memory holds nothing: it contributes
    "unknown", the survivor's memory tier names step 1, and both ranks load it bit-exact (the fresh node's
    listing raised, and the survivor's agreement then failed as a CollectiveError)."""
    down = {"TIERCKPT_S3_ENDPOINT_URL": refused_endpoint, "AWS_ACCESS_KEY_ID": "k",
            "AWS_SECRET_ACCESS_KEY": "s"}
    root = "s3://bucket/run"
    uri = f"{root}/step-00000001"
    saved = Job(tmp_path, ["node-0", "node-1"], "shard", extra_env=down, node_caches=True,
                saves=[{"uri": uri, "seed": 1, "level": "replicated"}]).wait()
    assert all(r["saves"][uri]["ok"] for r in saved), saved
    lose(tmp_path, "node-0")
    # The node cache off: the fresh node's listing raises at once (with it on, the cache holds nothing there and
    # raises the same way).
    resumed = Job(tmp_path, ["node-2", "node-1"], "shard", extra_env={**down, "TIERCKPT_CACHE": "off"}, node_caches=True,
                  latest={"root": root, "seeds": {"1": 1}}).wait(timeout_s=120)
    for r in resumed:
        assert "error" not in r["latest"], r["latest"].get("trace")
        assert r["latest"] == {"step": 1, "differs": []}, r["latest"]


# -- the deadline itself, in this process ---------------------------------------------------------------------
def test_a_deadline_ends_the_waits_and_foreground_work_of_its_operation_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``deadline.operation``, a wait on the I/O loop and the work the operation submits end at its
    deadline with ``DeadlineExceededError`` naming the operation, the target and the setting; work submitted
    as background (write-downs, sweeps) and operations outside it are not cut."""
    import asyncio
    import time

    from tierckpt import deadline
    from tierckpt.errors import DeadlineExceededError, TransientStorageError
    from tierckpt.io.scheduler import get_scheduler
    from tierckpt.backends.retry import retry_transient

    sched = get_scheduler()
    monkeypatch.delenv(deadline.ENV, raising=False)
    with deadline.operation("load", "s3://b/ckpt", 0.3, "TIERCKPT_TIMEOUT_S"):
        with pytest.raises(DeadlineExceededError, match=r"load s3://b/ckpt did not finish within 0.3 s \(TIERCKPT_TIMEOUT_S\)"):
            sched.run(asyncio.sleep(30))
        foreground = sched.submit(asyncio.sleep(30, "fg"))
        background = sched.submit(asyncio.sleep(0.6, "bg"), background=True)
        with pytest.raises(DeadlineExceededError):
            foreground.result(timeout=BOUND_S)
        assert background.result(timeout=BOUND_S) == "bg", "background work outlives the operation"

        attempts = 0

        async def failing() -> None:
            nonlocal attempts
            attempts += 1
            raise TransientStorageError("503 SlowDown")

    with deadline.operation("save", "s3://b/ckpt", 0.05, "TIERCKPT_TIMEOUT_S"):
        time.sleep(0.06)  # the deadline has passed: no retry backs off past it
        with pytest.raises(DeadlineExceededError, match="503 SlowDown"):
            sched.run(retry_transient(failing, attempts=5), timeout_s=BOUND_S)  # run's own timeout is not the deadline
    assert attempts == 1
    assert sched.run(asyncio.sleep(0.01, "outside")) == "outside"  # no deadline outside an operation


@pytest.mark.multiproc
def test_convert_against_a_tarpit_ends_at_its_default_deadline(tmp_path: Path, tarpit: FaultProxy) -> None:
    """``convert`` reads every byte of a checkpoint: without ``--timeout`` it ends at the data commands'
    default deadline (it had none), naming the command, its source and the endpoint that did not answer."""
    env = child_env(tmp_path, tarpit.endpoint)
    proc = start(["-c", CLI_WITH_SHORT_DEFAULT, "convert", "s3://bucket/run", str(tmp_path / "out"), "--to", "safetensors"], env)
    rc, _, err = finish(proc, "tierckpt convert")
    assert rc == 7, (rc, err)
    assert ("tierckpt convert s3://bucket/run did not finish within 4 s (--timeout, default 4 s; or "
            "TIERCKPT_TIMEOUT_S) waiting for") in err, err
    assert f"s3://bucket at {tarpit.endpoint} to answer" in err, err
