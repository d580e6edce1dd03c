"""The benchmark matrix's report: the ratio table goes between its markers (replacing the last one) and
the chart beside the Markdown; without matplotlib the report says so. (A ``--quick`` run spawns seven
process groups and takes longer than a unit test should, so the measuring part is smoke-run by hand.)"""

from __future__ import annotations

import argparse
import builtins
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_matrix  # noqa: E402

pytest.importorskip("matplotlib")


def records(scale: float) -> list[dict]:
    out = []
    for r in range(3):
        for lib, seconds in (("tierckpt", 1.0), ("dcp", 1.5), ("bytecheckpoint", 0.8)):
            out.append({"case": "ddp", "op": "load", "lib": lib, "repeat": r, "seconds": seconds * scale + r * 0.01})
        out.append({"case": "s3", "op": "save", "lib": "tierckpt", "repeat": r, "seconds": 2.0})
        out.append({"case": "s3", "op": "save", "lib": "dcp", "repeat": r, "seconds": 3.0})
    return out


def write(tmp_path: Path, scale: float) -> tuple[Path, str]:
    out = tmp_path / "docs" / "benchmarks.md"  # a folder that does not exist yet: the report makes it
    args = argparse.Namespace(out=str(out), chart="matrix.png", repeats=3)
    body = bench_matrix.report(records(scale), args, bench_matrix.SIZES["quick"], ["tierckpt", "dcp", "bytecheckpoint"],
                               None, False, str(tmp_path))
    bench_matrix.C.publish(body, str(out), "bench_matrix")
    return out, body


def test_report_writes_the_table_between_markers_and_the_chart_beside_it(tmp_path):
    out, _ = write(tmp_path, 1.0)
    out.write_text(out.read_text() + "\nhand-written notes stay\n")
    out, body = write(tmp_path, 2.0)  # a second run replaces the table
    text = out.read_text()
    assert text.count("<!-- bench_matrix -->") == 1 and text.count("<!-- /bench_matrix -->") == 1
    assert "hand-written notes stay" in text
    assert "| ddp | load | 2.010 | 3.010 | 1.610 | **1.50x** | **0.80x** (slower) |" in text
    assert "| s3 | save | 2.000 | 3.000 | - | **1.50x** | - |" in text
    assert "![matrix](matrix.png)" in body
    assert (out.parent / "matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out, body = write(tmp_path, 1.0)
    assert bench_matrix.MATPLOTLIB_MISSING in body and "![matrix]" not in body
    assert bench_matrix.MATPLOTLIB_MISSING in capsys.readouterr().err
    assert not (out.parent / "matrix.png").exists()
