"""Commits that hold on every S3 server (moto and Ceph's radosgw): saves to one URI, one after another or two
jobs at once on two nodes, with the node cache off and on. What the remote ``COMMIT`` names is read with boto3,
beside tierckpt, so a save is never taken at its word."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

import tierckpt
from tierckpt.native import layout
from tierckpt.node.disk import CacheConfig
from tierckpt.errors import CheckpointBusyError, StorageError

pytestmark = [pytest.mark.s3_servers, pytest.mark.multiproc]

CHILD = str(Path(__file__).parent / "racing_child.py")


def remote_commit(s3_server: str, uri: str) -> str | None:
    """The generation the ``COMMIT`` object on the server names (``None``: no object), read with boto3."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    try:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{layout.COMMIT}")["Body"].read()
    except client.exceptions.NoSuchKey:
        return None
    finally:
        client.close()
    return layout.CommitRecord.decode(body).generation


def storage_options(cache_dir: Path | None) -> dict[str, Any]:
    """The node cache in ``cache_dir`` (one node's), or no node cache."""
    return {"cache": CacheConfig(directory=str(cache_dir))} if cache_dir is not None else {"cache": False}


@pytest.mark.parametrize("cached", [False, True], ids=["cache-off", "cache-on"])
def test_three_saves_to_one_uri_commit_and_read_back(
    s3_server: str, s3_bucket_uri: str, tmp_path: Path, cached: bool,
) -> None:
    uri = f"{s3_bucket_uri}/ckpt"
    options = storage_options(tmp_path / "node" if cached else None)
    for step in (1, 2, 3):
        state = {"w": torch.randn(64, 33, generator=torch.Generator().manual_seed(step)), "step": step}
        meta = tierckpt.save(uri, state, storage_options=options)
        assert remote_commit(s3_server, uri) == meta.generation, f"save {step}: the remote COMMIT names another"
        for read_options in (options, storage_options(None)):  # through this node, and from the remote alone
            loaded = tierckpt.load(uri, {"w": torch.zeros(64, 33), "step": 0}, storage_options=read_options)
            assert loaded["step"] == step and torch.equal(loaded["w"], state["w"])


def race_on_two_nodes(uri: str, rounds: int, tmp_path: Path, cached: bool) -> list[dict]:
    """Two jobs (processes), each its own node (its own cache directory, or none), save to ``uri`` at the same
    moment for ``rounds`` rounds (tests/racing_child.py); their JSON lines."""
    gates = tmp_path / "gates"
    gates.mkdir()
    jobs = []
    for role in (0, 1):
        env = dict(os.environ, TIERCKPT_CACHE_DIR=str(tmp_path / f"node{role}"))
        if cached:
            env["RACING_CHILD_CACHE"] = "on"
        jobs.append(subprocess.Popen([sys.executable, CHILD, "race", uri, str(role), str(rounds), str(gates)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    lines = []
    for job in jobs:
        out, err = job.communicate(timeout=600)
        assert job.returncode == 0, err[-3000:]
        lines += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return lines


@pytest.mark.s3_servers("radosgw")  # a real server's conditional writes; moto's race in test_commit_cas.py
@pytest.mark.parametrize("cached", [False, True], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("start", ["fresh", "overwrite"])
def test_two_nodes_racing_one_uri_have_one_winner_the_remote_commit_names(
    s3_server: str, s3_bucket_uri: str, tmp_path: Path, cached: bool, start: str,
) -> None:
    """Every round: exactly one job is told committed, the other gets CheckpointBusyError naming the winner,
    the remote COMMIT names the winner's generation and its state loads whole."""
    rounds = 4
    uri = f"{s3_bucket_uri}/ckpt"
    if start == "overwrite":
        tierckpt.save(uri, {"w": torch.ones(3), "step": -5}, storage_options={"cache": False})
    lines = race_on_two_nodes(uri, rounds, tmp_path, cached)
    for r in range(rounds):
        outcomes = sorted(x["outcome"] for x in lines if x.get("round") == r and "outcome" in x)
        assert outcomes == ["busy", "won"], f"round {r}: {[x for x in lines if x.get('round') == r]}"
        winner = next(x for x in lines if x.get("round") == r and x.get("outcome") == "won")
        loser = next(x for x in lines if x.get("round") == r and x.get("outcome") == "busy")
        assert f"another job committed {winner['generation']!r}" in loser["message"], loser["message"]
        check = next(x["check"] for x in lines if x.get("round") == r and "check" in x)
        assert check["remote_commit"] == winner["generation"], f"round {r}: {check}"
        assert check["step"] == winner["value"] and check["exact"] and check["verify_ok"], f"round {r}: {check}"


def test_a_store_refusing_the_conditional_commit_is_an_error_not_a_rival(
    s3_server: str, s3_bucket_uri: str, proxy: Any,
) -> None:
    """A store that refuses every conditional write of COMMIT (the proxy answers 412) while nobody else
    writes: the save fails with a StorageError saying so, never "another job committed", and leaves nothing."""
    from fault_proxy import Rule

    proxy.add_rule(Rule("412", method="PUT", path=f"/{layout.COMMIT}", count=None))
    uri = f"{s3_bucket_uri}/ckpt"
    for attempt in ("fresh", "overwrite"):
        with pytest.raises(StorageError, match="no other job committed") as info:
            tierckpt.save(uri, {"w": torch.ones(4)}, storage_options={"endpoint_url": proxy.endpoint, "cache": False})
        assert not isinstance(info.value, CheckpointBusyError)
        if attempt == "fresh":
            assert remote_commit(s3_server, uri) is None
            assert objects(s3_server, uri) == []
            proxy.clear()
            first = tierckpt.save(uri, {"w": torch.zeros(4)}, storage_options={"cache": False})
            proxy.add_rule(Rule("412", method="PUT", path=f"/{layout.COMMIT}", count=None))
    assert remote_commit(s3_server, uri) == first.generation
    assert {key.split("/")[0] for key in objects(s3_server, uri)} == {layout.COMMIT, first.generation}


def objects(s3_server: str, uri: str) -> list[str]:
    """The keys under ``uri`` on the server, relative to it."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    try:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
    finally:
        client.close()
    return sorted(item["Key"].removeprefix(f"{prefix}/") for item in listed)
