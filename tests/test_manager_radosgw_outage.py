"""CheckpointManager on a real S3 server that really stops: Ceph's radosgw killed mid-run (its port refuses
connections) and started again on the same port, with the same objects (``tests/radosgw.py``).

With the node cache on, saves go on through the outage and land when radosgw is back; without it, a save fails
naming the endpoint and the step committed before stays the newest. Every outcome is checked where it lands:
the bucket's own ``COMMIT`` objects (read with boto3), the steps a fresh node finds, the tensors
``load_latest`` returns.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt import cache_api
from tierckpt.errors import StorageUnreachableError, TransientStorageError
from tierckpt.manager.api import CheckpointManager
from tierckpt.node.disk import CacheConfig
from tierckpt.node.levels import Level

from test_manager_outages import remote_generation

pytestmark = pytest.mark.parametrize("s3_server", ["radosgw"], indirect=True)

BIG_ELEMENTS = 8 * 2**20
"""Elements of the tensor saved as radosgw is stopped: 32 MiB of float32, an upload still under way when it stops."""

WAIT_TIMEOUT_S = 3.0
"""The short ``wait_durable`` timeout during the outage."""


@pytest.fixture
def bucket_root(s3_server: str) -> str:
    import boto3

    bucket = f"outage-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run"


def state_of(step: int, elements: int = 64) -> dict[str, Any]:
    return {"w": torch.arange(elements, dtype=torch.float32) + step, "step": step}


def loaded_latest(manager: CheckpointManager, elements: int = 64) -> tuple[int | None, dict[str, Any]]:
    target = {"w": torch.zeros(elements), "step": -1}
    return manager.load_latest(target), target


def test_saves_go_on_while_radosgw_is_stopped_and_land_when_it_is_back(
    s3_server: str, radosgw: Any, bucket_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """radosgw killed while step 2 uploads, step 3 saved while it is down: neither save raises, ``status`` says
    the steps are local with uploads pending and the remote unreachable (never durable), ``wait_durable``
    names them at its timeout, this node resumes from step 3 and a fresh node refuses to guess. radosgw back:
    the uploads land, every step's COMMIT on the bucket is this node's, and both nodes resume from step 4."""
    options = {"endpoint_url": s3_server, "cache": CacheConfig(directory=str(tmp_path / "node-a"))}
    manager = CheckpointManager(bucket_root, keep_last=2, use_async=True, storage_options=options)
    assert manager.save(1, state_of(1))
    manager.wait_durable(timeout_s=60)

    assert manager.save(2, state_of(2, BIG_ELEMENTS))
    radosgw.stop_gateway()  # the save is writing to the node cache, its uploads under way
    assert manager.save(3, state_of(3))  # waits for step 2's commit on this node, then saves 3
    manager.wait()

    for step in (2, 3):
        st = cache_api.status(manager.uri_of(step), storage_options=options)
        assert st.state == Level.LOCAL and st.pending_keys and not st.durable, (step, st)
        assert st.remote_unreachable and st.remote_generation is None and s3_server in st.remote_error, st

    started = time.monotonic()
    with pytest.raises(TransientStorageError, match=r"step\(s\) \[2, 3\] did not reach the remote"):
        manager.wait_durable(timeout_s=WAIT_TIMEOUT_S)
    assert time.monotonic() - started < WAIT_TIMEOUT_S + 20  # the timeout bounds the wait through the outage

    step, target = loaded_latest(CheckpointManager(bucket_root, storage_options=options))  # this node has it
    assert step == 3 and torch.equal(target["w"], state_of(3)["w"]) and target["step"] == 3
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node-b"))
    with pytest.raises(StorageUnreachableError, match=s3_server):
        CheckpointManager(bucket_root, storage_options={"endpoint_url": s3_server}).load_latest({"w": torch.zeros(64)})

    radosgw.start_gateway()
    manager.wait_durable(timeout_s=120)
    for step in (2, 3):  # the bucket's own COMMIT names the generation this node committed
        node_generation = cache_api.status(manager.uri_of(step), storage_options=options).generation
        assert node_generation is not None and remote_generation(s3_server, bucket_root, step) == node_generation
    target = {"w": torch.zeros(BIG_ELEMENTS), "step": -1}  # the step whose upload radosgw's stop cut, from S3 itself
    tierckpt.load(manager.uri_of(2), target, storage_options={"endpoint_url": s3_server, "cache": False})
    assert torch.equal(target["w"], state_of(2, BIG_ELEMENTS)["w"]) and target["step"] == 2

    assert manager.save(4, state_of(4))
    manager.wait_durable(timeout_s=120)
    assert manager.deferred is None
    assert [remote_generation(s3_server, bucket_root, step) is None for step in (1, 2, 3, 4)] == [True, True, False, False]
    fresh = CheckpointManager(bucket_root, storage_options={"endpoint_url": s3_server})  # TIERCKPT_CACHE_DIR node-b
    assert fresh.steps() == [3, 4]  # retention (keep_last=2) caught up
    for resumed in (manager, fresh):
        step, target = loaded_latest(resumed)
        assert step == 4 and torch.equal(target["w"], state_of(4)["w"]) and target["step"] == 4


@pytest.mark.parametrize("cache", ["off", "on"])
def test_a_synchronous_save_fails_naming_the_endpoint_and_the_last_step_stays(
    s3_server: str, radosgw: Any, bucket_root: str, tmp_path: Path, cache: str,
) -> None:
    """A synchronous save is durable on S3 when it returns, so the node cache cannot cover an outage for it:
    radosgw stopped, it raises :class:`StorageUnreachableError` naming the endpoint, within seconds, and is
    committed nowhere (with the cache on, not on this node either). radosgw back, step 1 is still the newest
    committed step, loaded bit-exact, and nothing of step 2 is committed on the bucket."""
    options = {"endpoint_url": s3_server, "cache": CacheConfig(directory=str(tmp_path / "node")) if cache == "on" else False}
    manager = CheckpointManager(bucket_root, storage_options=options)
    manager.save(1, state_of(1))
    radosgw.stop_gateway()
    started = time.monotonic()
    with pytest.raises(StorageUnreachableError, match=s3_server):
        manager.save(2, state_of(2))
    assert time.monotonic() - started < 60
    if cache == "on":  # this node, still without S3, resumes from step 1: step 2 is committed nowhere
        step, target = loaded_latest(CheckpointManager(bucket_root, storage_options=options))
        assert step == 1 and torch.equal(target["w"], state_of(1)["w"])
    radosgw.start_gateway()
    assert remote_generation(s3_server, bucket_root, 2) is None
    for resumed in (manager, CheckpointManager(bucket_root, storage_options=options)):
        step, target = loaded_latest(resumed)
        assert step == 1 and torch.equal(target["w"], state_of(1)["w"]) and target["step"] == 1
