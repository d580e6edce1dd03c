"""Every status surface tells "committed on this node" from "committed on the remote", on every node
(issue "Nothing silent", item 3), and pending uploads can be finished with a deadline or dropped.

The saving node writes back through its cache while S3 answers 503 (a fault proxy in front of moto);
"another node" is a second cache directory. Real CLI commands, real S3 server.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt.cli import main as cli
from tierckpt.native import layout

sys.path.insert(0, str(Path(__file__).parent))
from fault_proxy import FaultProxy, Rule  # noqa: E402


@pytest.fixture
def outage(s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A bucket behind a proxy that answers 503 to every write of a COMMIT (the data reaches S3, the commit
    does not); the node cache in ``tmp_path/node-a``."""
    import boto3

    bucket = f"nvr-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    proxy = FaultProxy(s3_server)
    monkeypatch.setenv("TIERCKPT_S3_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node-a"))
    proxy.add_rule(Rule("503", method="PUT", path="/COMMIT", count=None))
    yield proxy, f"s3://{bucket}/run"
    proxy.close()


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    print(captured.err, file=sys.stderr)
    return code, captured.out


def test_surfaces_tell_node_from_remote(outage: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    proxy, root = outage
    manager = tierckpt.CheckpointManager(root, use_async=True)
    manager.save(1, {"w": torch.arange(1000.0), "step": 1})
    manager.wait()  # committed on this node
    uri = manager.uri_of(1)
    assert manager.steps() == [1] and not manager.durable_where_uri_points(1)

    # the saving node: committed here, not on the remote
    code, out = _run(["ls", root, "--json"], capsys)
    [entry] = json.loads(out)["checkpoints"]
    assert code == 0 and entry["status"] == "node-only" and "tierckpt sync" in entry["node_only"]
    code, out = _run(["verify", uri], capsys)
    assert code == cli.EXIT_INCOMPLETE and out.startswith("NODE ONLY") and "tierckpt sync" in out
    deadline = time.monotonic() + 60
    while not tierckpt.status(uri).errors and time.monotonic() < deadline:
        time.sleep(0.2)  # the uploads fail (503 after the scheduler's retries) and keep retrying
    code, out = _run(["status", uri], capsys)
    assert code == 1 and "upload error" in out and "committed on the remote: " in out, out
    assert "committed on this node: g-" in out
    code, out = _run(["status", uri, "--json"], capsys)
    doc = json.loads(out)
    assert code == 1 and doc["committed_on_node"] and not doc["committed_on_remote"] and not doc["durable"]

    # a deadline is honoured during the outage
    started = time.monotonic()
    assert cli.main(["sync", uri, "--timeout", "3"]) != 0
    assert time.monotonic() - started < 30
    capsys.readouterr()

    # another node (its own cache): the remote has the data but no COMMIT
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node-b"))
    code, out = _run(["ls", root, "--json"], capsys)
    assert [e["status"] for e in json.loads(out)["checkpoints"]] == ["incomplete"]
    assert cli.main(["verify", uri]) == cli.EXIT_INCOMPLETE

    # back on the saving node, remote up: sync finishes it, and every surface agrees
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node-a"))
    proxy.clear()
    capsys.readouterr()
    assert cli.main(["sync", uri, "--timeout", "60"]) == 0
    manager.wait_durable(timeout_s=60)
    capsys.readouterr()
    assert manager.durable_where_uri_points(1)
    code, out = _run(["status", uri, "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["committed_on_node"] and doc["committed_on_remote"] and doc["durable"]
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node-b"))
    assert cli.main(["verify", uri]) == 0


def test_pending_uploads_to_a_missing_bucket_can_be_dropped(s3_server: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node"))
    uri = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    handle = tierckpt.async_save(uri, {"w": torch.ones(10), "step": 1})
    handle.wait()
    with pytest.raises(tierckpt.StorageError, match="does not exist"):
        handle.wait_durable(timeout_s=60)
    code, out = _run(["status", uri], capsys)
    assert code == 1 and "does not exist" in out and "--drop" in out
    started = time.monotonic()
    assert cli.main(["sync", uri, "--timeout", "5"]) != 0
    assert time.monotonic() - started < 30
    code, out = _run(["sync", "--drop", uri], capsys)
    assert code == 0 and "dropped" in out and layout.COMMIT in out
    st = tierckpt.status(uri)
    assert not st.pending_keys and not st.errors
