"""CheckpointManager on S3 under outages, a lagging ``LATEST`` and a second job saving to the same root.

Real moto server behind the fault proxy (``tests/fault_proxy.py``); "another node" is another node-cache
directory. Every outcome is checked where it lands: the bucket's own ``COMMIT`` objects, the steps a fresh
node lists, the tensors ``load_latest`` returns.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt.native import layout
from tierckpt.node.disk import CacheConfig
from tierckpt.errors import NotDurableError
from tierckpt.manager.api import CheckpointManager

from fault_proxy import FaultProxy, Rule  # noqa: E402

pytestmark = pytest.mark.s3_servers  # moto and radosgw


@pytest.fixture
def bucket_root(s3_server: str) -> str:
    import boto3

    bucket = f"mgr-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run"


def node(tmp_path: Path, name: str, endpoint: str) -> dict[str, Any]:
    """Storage options of a node whose cache is ``tmp_path/name``, reaching S3 at ``endpoint``."""
    return {"endpoint_url": endpoint, "cache": CacheConfig(directory=str(tmp_path / name))}


def remote_generation(s3_server: str, root: str, step: int) -> str | None:
    """The generation the bucket's own ``COMMIT`` of ``step`` names (read with boto3, no tierckpt tier)."""
    import boto3

    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    try:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{layout.step_name(step)}/{layout.COMMIT}")["Body"].read()
    except client.exceptions.NoSuchKey:
        return None
    return layout.CommitRecord.decode(body).generation


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.arange(64, dtype=torch.float32) + step, "step": step}


def test_load_latest_finds_a_step_committed_after_latest_local(tmp_path: Path) -> None:
    resumes_from_the_step_latest_lags(str(tmp_path / "run"), {}, {})


def test_load_latest_finds_a_step_committed_after_latest_on_s3(s3_server: str, bucket_root: str, tmp_path: Path) -> None:
    resumes_from_the_step_latest_lags(bucket_root, node(tmp_path, "node-a", s3_server), node(tmp_path, "node-b", s3_server))


def resumes_from_the_step_latest_lags(root: str, options: dict[str, Any], fresh: dict[str, Any]) -> None:
    """A job killed after step 13's COMMIT reached the store but before LATEST moved: LATEST still names 12,
    and a restart (same node, and a fresh node) resumes from 13, bit-exact."""
    manager = CheckpointManager(root, storage_options=options)
    for step in (12, 13):
        manager.save(step, state_of(step))
    manager.wait_durable(timeout_s=60)
    _point_latest(manager, 12)
    for opts in (options, fresh):
        restarted = CheckpointManager(root, storage_options=opts)
        target = {"w": torch.zeros(64), "step": 0}
        assert restarted.latest() == 13
        assert restarted.load_latest(target) == 13
        assert torch.equal(target["w"], state_of(13)["w"]) and target["step"] == 13


def _point_latest(manager: CheckpointManager, step: int) -> None:
    """Rewrite ``LATEST`` to name ``step`` (as a job killed before moving it leaves it), through to the remote."""
    from tierckpt.io.scheduler import get_scheduler

    get_scheduler().run(manager._backend().commit("LATEST", json.dumps({"step": step}).encode()))
    manager.wait_durable(timeout_s=60)
    assert manager._pointed_step() == step


def test_saves_go_on_through_an_outage_and_retention_catches_up(
    s3_server: str, bucket_root: str, proxy: FaultProxy, tmp_path: Path,
) -> None:
    """S3 answers 503 to everything for four saves: none raises (the node cache covers the outage), the
    manager says retention waits, ``wait_durable`` names the steps still uploading at its timeout; S3 back, the next save applies it, and a fresh node finds exactly the
    steps retention keeps, the newest loaded bit-exact."""
    root = bucket_root
    manager = CheckpointManager(root, keep_last=2, use_async=True, storage_options=node(tmp_path, "node-a", proxy.endpoint))
    for step in (1, 2, 3):
        assert manager.save(step, state_of(step))
    manager.wait_durable(timeout_s=60)
    assert manager.deferred is None

    proxy.add_rule(Rule("503", count=None))  # S3 down
    for step in (4, 5, 6, 7):
        assert manager.save(step, state_of(step))  # raised StorageUnreachableError before
    manager.wait()
    assert manager.deferred is not None and "unreachable" in manager.deferred
    assert remote_generation(s3_server, root, 7) is None  # nothing of the outage's saves is on S3 yet
    with pytest.raises(tierckpt.TransientStorageError, match=r"step\(s\) \[(4, 5, )?6, 7\] did not reach the remote"):
        manager.wait_durable(timeout_s=3)  # not durable, not another job's: uploading (4, 5: unless retention took them)

    proxy.clear()  # S3 back
    assert manager.save(8, state_of(8))
    manager.wait_durable(timeout_s=120)
    assert manager.deferred is None
    fresh = CheckpointManager(root, storage_options=node(tmp_path, "node-b", s3_server))
    assert fresh.steps() == [7, 8]
    target = {"w": torch.zeros(64), "step": 0}
    assert fresh.load_latest(target) == 8
    assert torch.equal(target["w"], state_of(8)["w"])
    assert remote_generation(s3_server, root, 8) is not None


def test_wait_durable_raises_for_steps_another_job_committed(
    s3_server: str, bucket_root: str, proxy: FaultProxy, tmp_path: Path,
) -> None:
    """A job restarted while its old self still runs on another node: both save steps 21 and 22; the old
    job's COMMITs reach S3 first (the new job's are held back by 503s), the new job also saves 23, which
    only it writes. ``wait_durable`` names 21 and 22 — the bucket's COMMITs of them are the old job's —
    and a retry still does; 23 is confirmed."""
    root = bucket_root
    new = CheckpointManager(root, use_async=True, storage_options=node(tmp_path, "node-new", proxy.endpoint))
    old = CheckpointManager(root, storage_options=node(tmp_path, "node-old", s3_server))
    proxy.add_rule(Rule("503", method="PUT", path=f"/{layout.COMMIT}", count=None))
    for step in (21, 22):
        new.save(step, state_of(step))
        new.wait()  # committed on the new job's node
    for step in (21, 22):
        old.save(step, state_of(step + 100))  # the old job's synchronous saves commit on S3
    proxy.clear()
    new.save(23, state_of(23))
    with pytest.raises(NotDurableError) as raised:
        new.wait_durable(timeout_s=120)
    message = str(raised.value)
    assert "[21, 22]" in message and "step 21:" in message and "step 22:" in message and "step 23" not in message
    for step in (21, 22):  # what S3 holds of them is the old job's
        target = {"w": torch.zeros(64), "step": 0}
        tierckpt.load(new.uri_of(step), target, storage_options={"cache": False, "endpoint_url": s3_server})
        assert torch.equal(target["w"], state_of(step + 100)["w"])
    with pytest.raises(NotDurableError, match=r"\[21, 22\]"):
        new.wait_durable(timeout_s=60)  # never told durable later either
    assert remote_generation(s3_server, root, 23) is not None


KILLS = [  # (stage:n, the newest committed step on the saving node, on a fresh node), 4 saves, keep_last=2
    ("commit:3", 2, 2),  # step 3 about to write its COMMIT
    ("upload:3", 3, 2),  # step 3 committed in the node cache, its COMMIT not on S3
    ("latest:3", 3, 3),  # step 3 committed on S3, LATEST still names 2
    ("retain:3", 3, 3),  # LATEST moved to 3, retention not run
    ("delete:1", 3, 3),  # retention about to delete step 1
    ("delete_prefix:1", 3, 3),  # step 1's COMMIT deleted, its files not yet
]


@pytest.mark.multiproc
@pytest.mark.parametrize("kill_at, on_node, on_fresh_node", KILLS, ids=[k for k, _, _ in KILLS])
def test_a_job_killed_at_each_stage_resumes_from_the_newest_committed_step(
    s3_server: str, bucket_root: str, tmp_path: Path, kill_at: str, on_node: int, on_fresh_node: int,
) -> None:
    """SIGKILL at each stage of save, upload, LATEST and retention; a restart on the same node (its cache,
    with what the dead job left pending) and on a fresh node loads the newest step committed where it looks,
    bit-exact, and the restarted job's next save is durable as its own."""
    import os
    import signal
    import subprocess
    import sys

    node_a = tmp_path / "node-a"
    env = {**os.environ, "TIERCKPT_KILL_AT": kill_at, "TIERCKPT_CACHE_DIR": str(node_a),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "manager_kill_child.py"), bucket_root, "4", "2",
         json.dumps({"endpoint_url": s3_server})],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    assert child.stdout == "saved 1\nsaved 2\n"  # every kill lands inside the save of step 3
    for name, expected in (("node-a", on_node), ("node-b", on_fresh_node)):
        restarted = CheckpointManager(bucket_root, keep_last=2, storage_options=node(tmp_path, name, s3_server))
        assert restarted.steps()[-1] == expected, name
        target = {"w": torch.zeros(64)}
        assert restarted.load_latest(target) == expected, name
        assert torch.equal(target["w"], torch.arange(64, dtype=torch.float32) + expected), name
    restarted = CheckpointManager(bucket_root, keep_last=2, storage_options=node(tmp_path, "node-a", s3_server))
    restarted.save(on_node + 1, {"w": torch.arange(64, dtype=torch.float32) + on_node + 1})
    restarted.wait_durable(timeout_s=120)
    assert remote_generation(s3_server, bucket_root, on_node + 1) is not None


def test_wait_durable_does_not_wait_out_a_commit_that_can_never_land(
    s3_server: str, bucket_root: str, proxy: FaultProxy, tmp_path: Path,
) -> None:
    """The new job's node cannot write to S3 (every PUT answers 503) while the old job commits step 21: the
    new job's COMMIT is pending behind its files, with no error. Its swap can never succeed (the remote's
    COMMIT is another generation of the same sequence), so ``wait_durable`` says so at once rather than
    waiting out its timeout as "still uploading"."""
    root = bucket_root
    new = CheckpointManager(root, use_async=True, storage_options=node(tmp_path, "node-new", proxy.endpoint))
    old = CheckpointManager(root, storage_options=node(tmp_path, "node-old", s3_server))
    proxy.add_rule(Rule("503", method="PUT", count=None))
    new.save(21, state_of(21))
    new.wait()
    old.save(21, state_of(121))
    with pytest.raises(NotDurableError, match=r"step 21: the remote's COMMIT names g-.*another job's save"):
        new.wait_durable(timeout_s=60)
    proxy.clear()
