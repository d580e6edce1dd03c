"""CheckpointManager: cadence, LATEST pointer, retention, async saves, local and S3."""

from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt.native import layout
from tierckpt.manager.api import CheckpointManager


def test_retention_rule():
    """The one rule (layout.retention) the manager and gc share: newest keep_last, multiples of keep_every, the newest."""

    def kept(steps, keep_last, keep_every):
        return sorted(int(n) for n in layout.retention([(s, 0.0, str(s)) for s in steps], keep_last, keep_every))

    assert kept([1, 2, 3, 4, 5], 2, None) == [4, 5]
    assert kept([10, 20, 30, 40, 50], 1, 20) == [20, 40, 50]
    assert kept([7], 1, None) == [7]
    assert kept([1, 2, 3], None, 2) == [2, 3]  # gc's keep_every-only policy keeps the newest too


def test_manager_without_keep_last_keeps_every_step(tmp_path):
    """keep_every alone does not delete: the manager applies retention only with keep_last."""
    manager = CheckpointManager(str(tmp_path / "run"), keep_every=2)
    for step in (1, 2, 3):
        manager.save(step, {"w": torch.full((2,), float(step))})
    assert manager.steps() == [1, 2, 3]


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


def _data_file(root, step: int):
    (path,) = (root / layout.step_name(step)).glob("g-*/data/rank-00000.bin")
    return path


def _three_steps(root) -> CheckpointManager:
    manager = CheckpointManager(str(root))
    for step in (1, 2, 3):
        manager.save(step, {"w": torch.full((64,), float(step)), "step": step})
    return manager


def test_load_latest_skips_a_step_whose_files_are_gone(tmp_path, caplog):
    """The newest steps' data files are reachable nowhere (a node lost before they reached a peer or the
    remote, here deleted): load_latest resumes from the newest step that loads, and says which it skipped."""
    root = tmp_path / "run"
    manager = _three_steps(root)
    _data_file(root, 3).unlink()
    _data_file(root, 2).unlink()
    target = {"w": torch.zeros(64), "step": 0}
    with caplog.at_level("WARNING", logger="tierckpt.manager.api"):
        assert manager.load_latest(target) == 1
    assert torch.equal(target["w"], torch.full((64,), 1.0)) and target["step"] == 1
    assert "step 3 cannot be loaded" in caplog.text and "step 2 cannot be loaded" in caplog.text
    assert "resumed from step 1, not the newest committed step 3" in caplog.text
    with pytest.raises(tierckpt.MissingFileError, match="rank-00000.bin' of checkpoint .*step-00000003' is missing"):
        manager.load_latest(target, fall_back=False)


def test_load_latest_never_skips_a_corrupt_step(tmp_path):
    """A flipped bit is not a reason to resume from an older step: the newest step's error is raised."""
    root = tmp_path / "run"
    manager = _three_steps(root)
    path = _data_file(root, 3)
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    target = {"w": torch.zeros(64), "step": 0}
    with pytest.raises(tierckpt.CorruptCheckpointError, match="checksum mismatch") as raised:
        manager.load_latest(target)
    assert not isinstance(raised.value, tierckpt.MissingFileError)


def test_load_latest_raises_the_newest_error_when_no_step_loads(tmp_path):
    root = tmp_path / "run"
    manager = _three_steps(root)
    for step in (1, 2, 3):
        _data_file(root, step).unlink()
    with pytest.raises(tierckpt.MissingFileError, match="step-00000003"):
        manager.load_latest({"w": torch.zeros(64), "step": 0})


def test_an_unreadable_replication_record_does_not_fail_a_save(tmp_path):
    """The manager reads each recent step's replication level at the start of a save (retention keeps the
    newest replicated one): a damaged record counts as not replicated, the save goes on."""
    from tierckpt.store import memory_tier_of, open_store
    from tierckpt.node.memory import MemoryConfig
    from tierckpt.node.memory.replica_record import level_path

    config = MemoryConfig(directory=str(tmp_path / "shm"), budget_bytes=64 << 20, exit_wait_s=0)
    manager = CheckpointManager(str(tmp_path / "run"), keep_last=1, storage_options={"memory": config})
    manager.save(1, {"w": torch.ones(8)})
    tier = memory_tier_of(open_store(manager.uri_of(1), manager.storage_options))
    record = Path(level_path(tier, tier.committed().generation))
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("{not json")
    assert manager.save(2, {"w": torch.full((8,), 2.0)})
    assert manager.steps() == [2] and manager._replicated is None


def test_status_on_a_manager_root_says_how_to_load_it(tmp_path, capsys):
    """``tierckpt status <root>`` names the root a CheckpointManager root and how to load it, as ``load`` does
    (it said only "no checkpoint")."""
    from tierckpt.cli import main as cli

    root = tmp_path / "run"
    manager = CheckpointManager(root)
    manager.save(1, {"w": torch.ones(2)})
    manager.save(2, {"w": torch.ones(2)})
    assert cli.main(["status", str(root)]) == 3
    err = capsys.readouterr().err
    assert "is a CheckpointManager root holding 2 step checkpoint(s)" in err, err
    assert f"CheckpointManager('{root}').load_latest(state)" in err
    assert cli.main(["status", str(tmp_path / "nothing")]) == 3
    assert "nothing committed, and nothing pending" in capsys.readouterr().err
