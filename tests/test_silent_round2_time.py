"""Nothing silent, round 2: time bounds, an unreachable endpoint, and the manager after a node loss while
S3 is down.

* An unreachable endpoint is a connection error (exit 7) for ``ls`` and ``status``, never "no checkpoints".
* ``CheckpointManager.load_latest`` finds the newest step any reachable tier holds, agreed across ranks,
  when a lost node is replaced and S3 is unreachable (2 simulated nodes, ``tests/recovery_child.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed import free_port
from test_memory_recovery import Job, lose


@pytest.mark.multiproc
def test_load_latest_after_a_node_loss_with_s3_unreachable(tmp_path: Path) -> None:
    """Step 1 replicated across two nodes while S3 is down; node-0 is lost and replaced by a fresh node-2.
    The fresh node's listing fails (S3 unreachable) and its memory holds nothing: it contributes
    "unknown", the survivor's memory tier names step 1, and both ranks load it bit-exact."""
    down = {"TIERCKPT_S3_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "k",
            "AWS_SECRET_ACCESS_KEY": "s"}
    root = "s3://bucket/run"
    uri = f"{root}/step-00000001"
    saved = Job(tmp_path, ["node-0", "node-1"], "shard", extra_env=down, node_caches=True,
                saves=[{"uri": uri, "seed": 1, "level": "replicated"}]).wait()
    assert all(r["saves"][uri]["ok"] for r in saved), saved
    lose(tmp_path, "node-0")
    resumed = Job(tmp_path, ["node-2", "node-1"], "shard", extra_env={**down, "TIERCKPT_CACHE": "off"}, node_caches=True,
                  latest={"root": root, "seeds": {"1": 1}}).wait(timeout_s=120)
    for r in resumed:
        assert "error" not in r["latest"], r["latest"].get("trace")
        assert r["latest"] == {"step": 1, "differs": []}, r["latest"]
