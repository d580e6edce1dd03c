"""``tierckpt status`` and ``tierckpt ls`` with the remote down say what they do not know: a checkpoint this node
uploaded (nothing of it pending) is ``unreachable`` (never ``remote``, ``durable`` or ``node-only``), one with
uploads pending is ``local`` / ``node-only`` (its ``COMMIT`` is known not to be there), a listing made from this
node's tiers says so, and both exit 7. The remote goes down for real: radosgw stopped (``tests/radosgw.py``), or the
port of a proxy in front of moto closed. The real CLI, in this process; a real node cache per test.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

from tierckpt import cache_api
from tierckpt.cli import main as cli
from tierckpt.manager.api import CheckpointManager

from fault_proxy import FaultProxy, Rule


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main([*argv, "--timeout", "60"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _bucket_root(endpoint: str) -> str:
    bucket = f"down-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run"


def _save_then_lose_the_remote(root: str, stop: Any) -> CheckpointManager:
    """Step 1 saved and durable, the remote stopped (``stop()``), step 2 saved: committed on this node only."""
    manager = CheckpointManager(root, use_async=True)
    manager.save(1, {"w": torch.arange(64.0)})
    manager.wait_durable(timeout_s=60)
    stop()
    manager.save(2, {"w": torch.arange(64.0) + 2})
    manager.wait()
    return manager


def _says_what_it_does_not_know(manager: CheckpointManager, endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The assertions of both tests: ``status`` and ``ls`` of the uploaded step 1 and the pending step 2."""
    code, out = _run(["status", manager.uri_of(1)], capsys)
    assert code == cli.EXIT_UNREACHABLE and ": remote unreachable (" in out and endpoint in out, out
    code, out = _run(["status", manager.uri_of(1), "--json"], capsys)
    doc = json.loads(out)
    assert code == cli.EXIT_UNREACHABLE and (doc["state"], doc["durable"], doc["remote_unreachable"]) == (
        "unreachable", False, True), doc
    code, out = _run(["status", manager.uri_of(2), "--json"], capsys)  # pending upload here: known not durable
    doc = json.loads(out)
    assert (doc["state"], doc["durable"], doc["remote_unreachable"]) == ("local", False, True), doc
    assert doc["pending_keys"] and code == (cli.EXIT_ERROR if doc["errors"] else cli.EXIT_OK), doc  # 1: a failed try

    code, out = _run(["ls", manager.uri_of(1)], capsys)  # uploaded, nothing pending: unknown, not node-only
    assert code == cli.EXIT_UNREACHABLE and "the remote did not answer: listed from this node's tiers only" in out, out
    assert "node-only" not in out and " unreachable " in out.splitlines()[-1], out
    code, out = _run(["ls", manager.uri_of(1), "--json"], capsys)
    doc = json.loads(out)
    (entry,) = doc["checkpoints"]
    assert code == cli.EXIT_UNREACHABLE and endpoint in doc["remote_unreachable"], doc
    assert entry["status"] == "unreachable" and "node_only" not in entry, entry
    assert "whether the remote holds it is unknown" in entry["error"] and endpoint in entry["error"], entry

    code, out = _run(["ls", manager.root_uri, "--json"], capsys)  # the root: what this node has pending is listed
    doc = json.loads(out)
    assert code == cli.EXIT_UNREACHABLE and endpoint in doc["remote_unreachable"], doc
    (entry,) = [e for e in doc["checkpoints"] if e["step"] == 2]  # its COMMIT is pending here: known not there
    assert entry["status"] == "node-only" and "the remote is unreachable" in entry["node_only"], entry


class ClosablePort:
    """A proxy in front of moto (:attr:`endpoint`) whose port :meth:`close` closes for good: connections kept
    alive from before are cut, new ones refused; the port stays bound (never listening) until the test ends, so
    no other process takes it meanwhile."""

    def __init__(self, upstream: str) -> None:
        self.proxy = FaultProxy(upstream)
        self.endpoint = self.proxy.endpoint
        self.held = socket.socket()

    def close(self) -> None:
        self.proxy.add_rule(Rule("reset", count=None))  # a request on a connection kept alive: cut
        self.proxy.close()
        self.held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.held.bind(("127.0.0.1", int(self.endpoint.rpartition(":")[2])))


@pytest.fixture
def closed_port_remote(moto_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ClosablePort]:
    """The S3 endpoint of this test (a :class:`ClosablePort` in front of moto); this node's cache in ``tmp_path``."""
    port = ClosablePort(moto_server)
    monkeypatch.setenv("TIERCKPT_S3_ENDPOINT_URL", port.endpoint)
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node"))
    yield port
    port.proxy.close()
    port.held.close()


def test_status_and_ls_with_the_remote_port_closed(
    moto_server: str, closed_port_remote: ClosablePort, capsys: pytest.CaptureFixture[str],
) -> None:
    manager = _save_then_lose_the_remote(_bucket_root(moto_server), closed_port_remote.close)
    _says_what_it_does_not_know(manager, closed_port_remote.endpoint, capsys)
    for uri in (manager.root_uri, manager.uri_of(2)):  # the port never opens again: no upload left for the exit
        cache_api.drop(uri)


@pytest.mark.parametrize("s3_server", ["radosgw"], indirect=True)
def test_status_and_ls_with_radosgw_stopped(
    s3_server: str, radosgw: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node"))
    manager = _save_then_lose_the_remote(_bucket_root(s3_server), radosgw.stop_gateway)
    _says_what_it_does_not_know(manager, s3_server, capsys)
    radosgw.start_gateway()
    manager.wait_durable(timeout_s=120)
    code, out = _run(["status", manager.uri_of(1), "--json"], capsys)
    assert code == cli.EXIT_OK and json.loads(out)["state"] == "remote" and json.loads(out)["durable"], out
    code, out = _run(["ls", manager.root_uri], capsys)
    assert code == cli.EXIT_OK and "did not answer" not in out and out.count("committed") == 2, out


def test_ls_with_the_remote_down_never_says_there_is_no_checkpoint(
    moto_server: str, closed_port_remote: ClosablePort, capsys: pytest.CaptureFixture[str],
) -> None:
    """Every step uploaded, the port then closed: this node's cache lists none of them (only what is pending), so
    ``ls`` cannot tell what the root holds: exit 7 naming the remote, never exit 3 "no checkpoints"."""
    manager = CheckpointManager(_bucket_root(moto_server), use_async=True)
    manager.save(1, {"w": torch.arange(64.0)})
    manager.wait_durable(timeout_s=60)
    closed_port_remote.close()
    code, out = _run(["ls", manager.root_uri], capsys)
    assert code == cli.EXIT_UNREACHABLE and "no checkpoints" not in out, out
    assert f"cannot list {manager.root_uri!r}: the remote did not answer" in out and closed_port_remote.endpoint in out, out
