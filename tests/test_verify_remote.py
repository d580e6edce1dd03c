"""``tierckpt verify`` of a remote checkpoint checks the remote's bytes, not this node's copy of them, and says
so; with the remote down it says "unreachable", never "node only". Real S3 servers (moto and radosgw), a real
node cache per node (a directory each), the real CLI."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import boto3
import pytest
import torch

import tierckpt
from tierckpt.cli import main as cli
from tierckpt.cache_api import prefetch

sys.path.insert(0, str(Path(__file__).parent))
from fault_proxy import FaultProxy, Rule  # noqa: E402

pytestmark = pytest.mark.s3_servers


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _corrupt_one_data_file(s3_server: str, uri: str) -> str:
    """Flip one bit in the middle of a data file of ``uri`` on the server itself; the key it changed."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
    key = next(item["Key"] for item in listed if "/data/" in item["Key"])
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x10
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    client.close()
    return key


def test_verify_on_the_saving_node_reads_the_remote(
    s3_server: str, s3_bucket_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node-a"))
    uri = f"{s3_bucket_uri}/ckpt"
    tierckpt.save(uri, {"w": torch.arange(100_000.0)})  # through this node's cache, uploaded before it returns
    code, out = _run(["verify", uri], capsys)
    assert code == cli.EXIT_OK and out.startswith("ok:") and "read from the remote" in out, out
    _corrupt_one_data_file(s3_server, uri)
    code, out = _run(["verify", uri], capsys)
    assert code == cli.EXIT_CORRUPT and out.startswith("CORRUPT") and "checksum" in out, out
    code, out = _run(["verify", uri, "--node"], capsys)  # this node's copy is sound, and says whose it is
    assert code == cli.EXIT_OK and "read from this node's copy" in out and f"tierckpt verify {uri}" in out, out


def test_verify_with_the_remote_down_says_unreachable_not_node_only(
    s3_server: str, s3_bucket_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An eval node that prefetched the checkpoint, then lost the remote: nothing is pending on it."""
    uri = f"{s3_bucket_uri}/ckpt-{uuid.uuid4().hex[:6]}"
    tierckpt.save(uri, {"w": torch.arange(1000.0)}, storage_options={"cache": False})
    proxy = FaultProxy(s3_server)
    monkeypatch.setenv("TIERCKPT_S3_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "eval-node"))
    prefetch(uri)
    proxy.add_rule(Rule("reset", count=None))  # the remote is gone: every connection is reset
    try:
        code, out = _run(["verify", uri, "--timeout", "30"], capsys)
    finally:
        proxy.close()
    assert code == cli.EXIT_UNREACHABLE and "NODE ONLY" not in out and "tierckpt sync" not in out, out
    assert "unreachable" in out.lower(), out
