"""The ``tierckpt demo`` job: FSDP2 on 2 ranks, checkpoint, resume resharded on 3 ranks and on 1."""

from __future__ import annotations

from pathlib import Path

import pytest

import tierckpt
from tierckpt.backends import open_backend
from tierckpt.demo.run import run_demo


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_demo_resumes_match_uninterrupted_run(tmp_path: Path) -> None:
    report = run_demo(root=str(tmp_path), steps=2, quiet=True)
    assert report.checkpoint == str(tmp_path.resolve() / "step-2")
    assert (Path(report.checkpoint) / "COMMIT").is_file()
    ckpt = tierckpt.read_checkpoint(open_backend(report.checkpoint))
    assert ckpt.meta.world_size == 2 and "optimizer" in ckpt.meta.frameworks
    assert len(report.reference) == len(report.resumed_3) == len(report.resumed_1) == 2
    for ref, r3, r1 in zip(report.reference, report.resumed_3, report.resumed_1):
        assert r3 == pytest.approx(ref, rel=report.tolerance)
        assert r1 == pytest.approx(ref, rel=report.tolerance)
    assert report.ok and report.max_rel_diff <= report.tolerance
    assert report.save.bytes["bytes_written"] >= ckpt.meta.tensor_bytes  # data files include alignment padding
    assert report.load_1.bytes["bytes_read"] == ckpt.meta.tensor_bytes
    assert "max relative difference" in report.render()
