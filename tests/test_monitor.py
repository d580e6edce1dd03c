"""Monitoring: phases and counters per call, straggler report, trace, JSON lines, Prometheus."""

import json

import torch

import tierckpt
from tierckpt.loading.api import read_checkpoint
from tierckpt.backends import open_backend
from tierckpt.monitor import ranks_from_timings, straggler_report


def test_save_and_load_record_phases_and_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERCKPT_TRACE", str(tmp_path / "trace"))
    monkeypatch.setenv("TIERCKPT_METRICS", str(tmp_path / "metrics"))
    state = {"w": torch.randn(64, 64), "step": 1}
    saved, loaded = tierckpt.Monitor(), tierckpt.Monitor()
    tierckpt.save(str(tmp_path / "c"), state, monitor=saved)
    tierckpt.load(str(tmp_path / "c"), {"w": torch.zeros(64, 64), "step": 0}, monitor=loaded)

    assert {"plan", "stage", "write", "checksum", "file_write", "commit"} <= set(saved.seconds)
    assert saved.counters["bytes_written"] == 64 * 64 * 4
    assert loaded.counters["bytes_read"] == 64 * 64 * 4 and loaded.ranks == [loaded.summary()]

    timings = read_checkpoint(open_backend(str(tmp_path / "c"))).meta.timings
    per_rank = ranks_from_timings(timings)
    assert len(per_rank) == 1 and per_rank[0]["bytes_written"] == 64 * 64 * 4

    events = json.loads((tmp_path / "trace.rank0.json").read_text().rstrip(",\n") + "]")
    assert {e["name"] for e in events} >= {"plan", "write", "read"} and all(e["ph"] == "X" for e in events)
    lines = [json.loads(line) for line in (tmp_path / "metrics.rank0.jsonl").read_text().splitlines()]
    assert [line["op"] for line in lines] == ["save", "load"]

    text = tierckpt.prometheus_text()
    assert 'tierckpt_calls_total{op="save"}' in text and 'name="bytes_read"' in text


def test_straggler_report_names_the_slowest_rank():
    report = straggler_report([{"write_s": 1.0, "read_s": 2.0}, {"write_s": 3.0, "read_s": 2.0}])
    assert report["write"]["slowest_rank"] == 1 and report["write"]["skew"] == 1.5
    assert report["read"]["skew"] == 1.0
