"""The documentation site builds with warnings as errors (broken links, bad references, API docstrings)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("mkdocs") is None and not (Path(sys.prefix) / "bin" / "mkdocs").exists(),
                    reason="mkdocs is not installed (it comes with the test extra)")
def test_docs_site_builds_strictly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "async_save" in api and "CheckpointManager" in api and "ShardedTensor" in api
