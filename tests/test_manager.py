"""CheckpointManager: cadence, LATEST pointer, retention, async saves, local and S3."""

import pytest
import torch

import tierckpt
from tierckpt.manager import CheckpointManager, retention_victims


def test_retention_rule():
    assert retention_victims([1, 2, 3, 4, 5], keep_last=2, keep_every=None) == [1, 2, 3]
    assert retention_victims([10, 20, 30, 40, 50], keep_last=1, keep_every=20) == [10, 30]
    assert retention_victims([7], keep_last=1, keep_every=None) == []
    assert retention_victims([1, 2, 3], keep_last=None, keep_every=2) == []


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run"), {}
    endpoint = request.getfixturevalue("s3_server")
    uri = request.getfixturevalue("s3_bucket_uri")
    return uri, {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "region": "us-east-1"}


@pytest.mark.parametrize("use_async", [False, True])
def test_save_every_keep_last_and_load_latest(root, use_async):
    uri, options = root
    manager = CheckpointManager(uri, save_every=2, keep_last=2, keep_every=4, use_async=use_async, storage_options=options)
    weights = torch.zeros(8)
    for step in range(1, 11):
        weights.fill_(step)
        started = manager.save(step, {"w": weights, "step": step})
        assert started == (step % 2 == 0)
    manager.wait()
    assert manager.steps() == [4, 8, 10]  # newest two (8, 10) and every 4th (4, 8)
    assert manager.latest() == 10
    target = {"w": torch.zeros(8), "step": 0}
    assert manager.load_latest(target) == 10
    assert torch.equal(target["w"], torch.full((8,), 10.0)) and target["step"] == 10


def test_empty_root_has_no_latest(tmp_path):
    manager = CheckpointManager(str(tmp_path / "none"))
    assert manager.latest() is None
    assert manager.load_latest({"w": torch.zeros(1)}) is None


def test_latest_ignores_a_step_without_commit(tmp_path):
    """A crashed save leaves a step directory with no COMMIT: it is not the latest."""
    manager = CheckpointManager(str(tmp_path / "run"))
    manager.save(1, {"w": torch.ones(2)})
    (tmp_path / "run" / "step-00000002" / "g-0").mkdir(parents=True)
    assert manager.steps() == [1] and manager.latest() == 1


def test_invalid_settings():
    with pytest.raises(tierckpt.CheckpointError, match="positive"):
        CheckpointManager("/tmp/x", save_every=0)
