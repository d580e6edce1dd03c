"""The node-cache commands: status, wait, sync, prefetch and gc, on S3 (moto) through the cache."""

import json

import torch

import tierckpt
from tierckpt.cli import main as cli


def _save(uri: str, options: dict) -> None:
    tierckpt.save(uri, {"model.w": torch.arange(10.0), "step": 1}, storage_options=options)


def test_status_wait_prefetch_and_gc(s3_server, s3_bucket_uri, capsys, monkeypatch):
    monkeypatch.setenv("TIERCKPT_S3_ENDPOINT_URL", s3_server)
    options = {"key": "testing", "secret": "testing", "region": "us-east-1"}
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(key, value)
    for step in (100, 200, 300):
        _save(f"{s3_bucket_uri}/step-{step}", options)
    uri = f"{s3_bucket_uri}/step-300"

    assert cli.main(["wait", uri, "--timeout", "60"]) == 0
    assert cli.main(["status", uri, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert doc["state"] == "remote" and doc["durable"] and doc["pending_keys"] == []

    assert cli.main(["sync", "--timeout", "60"]) == 0
    assert cli.main(["prefetch", uri, "--only", "model.*", "--quiet"]) == 0
    assert "bytes in the node cache" in capsys.readouterr().out

    assert cli.main(["gc", s3_bucket_uri, "--keep-last", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert sorted(result["deleted"]) == ["step-100", "step-200"]  # children of the root
    assert result["kept"] == ["step-300"]


def test_bench_compares_with_dcp(capsys):
    assert cli.main(["bench", "--gib", "0.01", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bytes"] > 0 and all(doc[k] > 0 for k in ("tierckpt_save_s", "tierckpt_load_s", "dcp_save_s", "dcp_load_s"))
