"""Saves to ``s3://`` through the node cache in real processes that exit normally (issue "Nothing silent",
items 1, 2 and 8): a synchronous save is committed on S3 when it returns; write-back saves (``async_save``,
the manager) are drained at exit or name the ``tierckpt sync`` command on stderr; a missing bucket or a
bad endpoint fails the save within seconds, cache on or off; a write-back save to a new URI during an
outage succeeds in the node cache and reaches S3 once the remote is back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt.native import layout
from tierckpt.node.disk import CacheConfig

sys.path.insert(0, str(Path(__file__).parent))
from conftest import free_port  # noqa: E402
from processes import communicate_all  # noqa: E402
from fault_proxy import FaultProxy, Rule  # noqa: E402
from writeback_child import state  # noqa: E402

CHILD = str(Path(__file__).parent / "writeback_child.py")
EXIT_LIMIT_S = 120


def _bucket(endpoint: str) -> str:
    import boto3

    name = f"wb-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def _remote_commit(endpoint: str, uri: str) -> layout.CommitRecord | None:
    """The COMMIT on S3 itself (not through any cache)."""
    import boto3

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    try:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{layout.COMMIT}")["Body"].read()
    except client.exceptions.NoSuchKey:
        return None
    return layout.CommitRecord.decode(body)


def _run(mode: str, uri: str, world: int, cache_dir: Path, *, cache: str = "on",
         env: dict[str, str] | None = None, limit_s: float = EXIT_LIMIT_S) -> list[subprocess.CompletedProcess]:
    port = free_port()
    child_env = {**os.environ, "TIERCKPT_CACHE_DIR": str(cache_dir), "PYTHONPATH": os.pathsep.join(sys.path),
                 **(env or {})}
    procs = [subprocess.Popen([sys.executable, CHILD, mode, uri, str(r), str(world), str(port), cache],
                              env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    return communicate_all(procs, limit_s, f"{mode} to {uri}")


def _load_remote(uri: str, step: int, world: int) -> None:
    """Load from S3 without any cache and compare bit-exactly with what the ranks saved."""
    target: dict[str, Any] = {"w": torch.zeros(64, 256), "step": -1}
    target.update({f"rank{r}": torch.zeros(32, 128) for r in range(world)})
    tierckpt.load(uri, target, storage_options={"cache": False})
    expected: dict[str, Any] = {}
    for r in range(world):
        expected.update(state(step, r, world))
    assert target.keys() == expected.keys()
    assert all(torch.equal(target[k], expected[k]) for k in expected if k != "step") and target["step"] == step


@pytest.mark.parametrize("world", [1, 2])
def test_sync_save_returns_committed_on_s3(s3_server: str, tmp_path: Path, world: int) -> None:
    uri = f"s3://{_bucket(s3_server)}/run"
    results = _run("sync", uri, world, tmp_path / "cache")
    for r in results:
        assert r.returncode == 0, r.stderr
    record = _remote_commit(s3_server, uri)
    assert record is not None, "save() returned but S3 has no COMMIT"
    _load_remote(uri, 1, world)


@pytest.mark.parametrize("world", [1, 2])
def test_async_save_twice_then_exit_leaves_s3_committed(s3_server: str, tmp_path: Path, world: int) -> None:
    uri = f"s3://{_bucket(s3_server)}/run"
    results = _run("async2", uri, world, tmp_path / "cache")
    for r in results:
        assert r.returncode == 0, r.stderr
    record = _remote_commit(s3_server, uri)
    if record is None or record.seq != 2:  # allowed only when the process said so, naming the command that finishes it
        assert any("tierckpt sync" in r.stderr for r in results), [r.stderr for r in results]
    else:
        _load_remote(uri, 2, world)


def test_manager_async_then_exit_leaves_s3_committed(s3_server: str, tmp_path: Path) -> None:
    root = f"s3://{_bucket(s3_server)}/run"
    results = _run("manager", root, 1, tmp_path / "cache")
    assert results[0].returncode == 0, results[0].stderr
    assert _remote_commit(s3_server, f"{root}/{layout.step_name(3)}") is not None
    _load_remote(f"{root}/{layout.step_name(3)}", 3, 1)


@pytest.mark.parametrize("cache", ["on", "off"])
@pytest.mark.parametrize("fault", ["missing-bucket", "bad-endpoint"])
def test_unusable_remote_fails_the_save_fast(s3_server: str, tmp_path: Path, cache: str, fault: str, refused_endpoint: str) -> None:
    env: dict[str, str] = {}
    if fault == "missing-bucket":
        uri, thing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run", "does not exist"
    else:
        uri, thing = f"s3://{_bucket(s3_server)}/run", "connection"
        env["TIERCKPT_S3_ENDPOINT_URL"] = refused_endpoint
    started = time.monotonic()
    [result] = _run("sync", uri, 1, tmp_path / "cache", cache=cache, env=env, limit_s=90)
    elapsed = time.monotonic() - started
    assert result.returncode != 0, result.stdout
    assert "returned" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert uri.split("/")[2] in last and thing in last, last
    assert elapsed < 60, f"the save took {elapsed:.0f} s to fail"


def test_write_back_to_a_new_uri_during_an_outage(s3_server: str, tmp_path: Path) -> None:
    """A write-back save to a URI never seen before succeeds in the node cache while the remote is down,
    and reaches S3 when it is back; the node's pending COMMIT is the base of the next save."""
    proxy = FaultProxy(s3_server)
    try:
        uri = f"s3://{_bucket(s3_server)}/run"
        options: dict[str, Any] = {"endpoint_url": proxy.endpoint, "timeout_s": 2.0,
                                   "cache": CacheConfig(directory=str(tmp_path / "cache"))}
        proxy.add_rule(Rule("503", count=None))
        tierckpt.async_save(uri, state(1, 0, 1), storage_options=options).wait(timeout_s=60)
        handle = tierckpt.async_save(uri, state(2, 0, 1), storage_options=options)
        meta = handle.wait(timeout_s=60)
        st = tierckpt.status(uri, **options)
        assert st.generation == meta.generation and st.state == "local" and not st.durable
        assert _remote_commit(s3_server, uri) is None
        proxy.clear()
        handle.wait_durable(timeout_s=60)
        record = _remote_commit(s3_server, uri)
        assert record is not None and record.generation == meta.generation
        _load_remote(uri, 2, 1)
    finally:
        proxy.close()
