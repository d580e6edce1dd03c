"""Issue "Nothing silent, round 2", API cases: ranks that disagree on the URI (1), a failed synchronous
save that stayed loadable on the saving node (4), first-use papercuts (11) and loading a checkpoint into
a model of another dtype (12). Real gloo groups, the moto S3 server, real CLI commands."""

from __future__ import annotations

import os
import sys
import uuid
import warnings
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt.cli import main as cli
from tierckpt.native import layout
from tierckpt.errors import CheckpointError, StateMismatchError, UnsupportedURIError

sys.path.insert(0, str(Path(__file__).parent))
from distributed import subgroup  # noqa: E402
from fault_proxy import FaultProxy, Rule  # noqa: E402


def _files_under(root: Path) -> list[str]:
    return sorted(str(Path(d, f).relative_to(root)) for d, _, fs in os.walk(root) for f in fs)


# -- 1. every rank must pass the same URI ----------------------------------------------------------------
def save_rank_dependent_uri(root: str) -> str | None:
    """Ranks 0 and 1 save one state, each to its own URI; the error each raised."""
    import torch.distributed as dist

    group = subgroup(2)
    if group is None:
        return None
    rank = dist.get_rank(group)
    try:
        tierckpt.save(f"{root}/rank{rank}", {"w": torch.full((4, 4), float(rank))}, group=group)
    except CheckpointError as exc:
        return str(exc)
    return "returned"


def load_rank_dependent_uri(root: str) -> tuple[str, bool] | None:
    """Ranks 0 and 1 load one state, each from its own URI; the error each raised and whether the
    state was left untouched."""
    import torch.distributed as dist

    group = subgroup(2)
    if group is None:
        return None
    rank = dist.get_rank(group)
    state = {"w": torch.full((4, 4), -1.0)}
    try:
        tierckpt.load(f"{root}/ck{rank}", state, group=group)
    except CheckpointError as exc:
        return str(exc), bool((state["w"] == -1.0).all())
    return "returned", bool((state["w"] == -1.0).all())


def save_relative_path_from_rank_dependent_cwd(root: str) -> str | None:
    """Ranks 0 and 1 save to one relative path, each from its own working directory; the error each raised."""
    import torch.distributed as dist

    group = subgroup(2)
    if group is None:
        return None
    rank = dist.get_rank(group)
    cwd = os.getcwd()
    os.makedirs(f"{root}/cwd{rank}", exist_ok=True)
    os.chdir(f"{root}/cwd{rank}")
    try:
        tierckpt.save("ckpt", {"w": torch.ones(2)}, group=group)
    except CheckpointError as exc:
        return str(exc)
    finally:
        os.chdir(cwd)
    return "returned"


@pytest.mark.multiproc
def test_one_relative_path_from_different_directories_is_refused(dist_pool: Any, tmp_path: Path) -> None:
    _assert_every_rank_names_both(dist_pool.run(save_relative_path_from_rank_dependent_cwd, str(tmp_path)),
                                  f"{tmp_path}/cwd0/ckpt", f"{tmp_path}/cwd1/ckpt")
    assert _files_under(tmp_path) == []


@pytest.mark.multiproc
def test_ranks_saving_to_different_uris_all_raise_and_nothing_is_written(dist_pool: Any, tmp_path: Path) -> None:
    root = tmp_path / "run"
    _assert_every_rank_names_both(dist_pool.run(save_rank_dependent_uri, str(root)), f"{root}/rank0", f"{root}/rank1")
    assert _files_under(tmp_path) == []


def _assert_every_rank_names_both(messages: list[str | None], first: str, second: str) -> None:
    """Both ranks of the save raised the disagreement, each naming both URIs."""
    raised = [m for m in messages if m is not None]
    assert len(raised) == 2, messages
    for message in raised:
        assert "ranks disagree on the URI" in message, message
        assert first in message and second in message, message


@pytest.mark.multiproc
def test_ranks_loading_from_different_uris_all_raise(dist_pool: Any, tmp_path: Path) -> None:
    for n in range(2):
        tierckpt.save(str(tmp_path / f"ck{n}"), {"w": torch.full((4, 4), float(n))})
    outcomes = [o for o in dist_pool.run(load_rank_dependent_uri, str(tmp_path)) if o is not None]
    assert len(outcomes) == 2
    for message, untouched in outcomes:
        assert "ranks disagree on the URI" in message and f"{tmp_path}/ck1" in message, message
        assert untouched


# -- 4. a failed synchronous save is loadable nowhere ----------------------------------------------------
def test_a_save_to_a_missing_bucket_is_not_loadable_on_the_saving_node(
    s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node"))
    uri = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    with pytest.raises(tierckpt.StorageError, match="does not exist") as raised:
        tierckpt.save(uri, {"w": torch.ones(10)})
    assert "was not committed" in str(raised.value), raised.value
    st = tierckpt.status(uri)
    assert st.generation is None and not st.pending_keys, st
    with pytest.raises(tierckpt.CheckpointNotFoundError, match="does not exist"):
        tierckpt.load(uri, {"w": torch.zeros(10)})
    assert cli.main(["ls", uri]) != 0
    capsys.readouterr()


@pytest.fixture
def behind_proxy(s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, FaultProxy, Any]]:
    """A URI in a fresh bucket reached through a fault proxy, this test's own node cache, and a reader of
    the bucket's objects under the URI straight from S3 (``remote("COMMIT")``)."""
    import boto3

    bucket = f"r2-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    proxy = FaultProxy(s3_server)
    monkeypatch.setenv("TIERCKPT_S3_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node"))
    try:
        yield f"s3://{bucket}/run", proxy, lambda key: client.get_object(Bucket=bucket, Key=f"run/{key}")
    finally:
        proxy.close()


def test_a_save_that_failed_during_an_outage_leaves_the_previous_checkpoint(behind_proxy: tuple[str, FaultProxy, Any]) -> None:
    uri, proxy, remote = behind_proxy
    first = tierckpt.save(uri, {"w": torch.full((10,), 1.0)})
    proxy.add_rule(Rule("503", method="PUT", path="/COMMIT", count=None))
    with pytest.raises(tierckpt.StorageError, match="was not committed"):
        tierckpt.save(uri, {"w": torch.full((10,), 2.0)})
    out = {"w": torch.zeros(10)}
    tierckpt.load(uri, out)  # this node sees the previous commit, not the failed one
    assert torch.equal(out["w"], torch.full((10,), 1.0))
    assert tierckpt.status(uri).generation == first.generation
    proxy.clear()
    tierckpt.sync(uri, timeout_s=60)  # nothing of the failed save is left to land later
    body = remote("COMMIT")["Body"].read()
    assert layout.CommitRecord.decode(body).generation == first.generation


def test_a_failed_save_after_an_async_save_leaves_the_async_save_pending(
    behind_proxy: tuple[str, FaultProxy, Any], capsys: pytest.CaptureFixture[str],
) -> None:
    """An async save committed on this node (its COMMIT not uploaded yet), then a synchronous save that
    fails: the node is back at the async save, still node-only (``ls`` says so) and still to be uploaded."""
    uri, proxy, remote = behind_proxy
    proxy.add_rule(Rule("503", method="PUT", path="/COMMIT", count=None))
    pending = tierckpt.async_save(uri, {"w": torch.full((10,), 1.0)}).wait()
    with pytest.raises(tierckpt.StorageError, match="was not committed"):
        tierckpt.save(uri, {"w": torch.full((10,), 2.0)})
    out = {"w": torch.zeros(10)}
    tierckpt.load(uri, out)
    assert torch.equal(out["w"], torch.full((10,), 1.0))
    st = tierckpt.status(uri)
    assert st.generation == pending.generation and not st.committed_on_remote
    assert cli.main(["ls", uri]) == 0 and "node-only" in capsys.readouterr().out
    proxy.clear()
    tierckpt.sync(uri, timeout_s=60)
    body = remote("COMMIT")["Body"].read()
    assert layout.CommitRecord.decode(body).generation == pending.generation


# -- 11. papercuts ---------------------------------------------------------------------------------------
def test_an_empty_uri_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedURIError, match="empty URI"):
        tierckpt.save("", {"w": torch.ones(2)})
    with pytest.raises(UnsupportedURIError, match="empty URI"):
        tierckpt.load("", {"w": torch.ones(2)})
    assert _files_under(tmp_path) == []


def test_loading_into_a_meta_device_model_raises(tmp_path: Path) -> None:
    tierckpt.save(str(tmp_path / "ck"), {"model": nn.Linear(3, 2)})
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    with pytest.raises(StateMismatchError, match=r"meta device.*'model\.weight'.*to_empty"):
        tierckpt.load(str(tmp_path / "ck"), {"model": model})


def test_torch_argument_order_is_named(tmp_path: Path) -> None:
    path, state = str(tmp_path / "ck"), {"w": torch.ones(2)}
    with pytest.raises(CheckpointError, match=r"the URI comes first: tierckpt\.save\(uri, state\)"):
        tierckpt.save(state, path)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"the URI comes first: tierckpt\.async_save\(uri, state\)"):
        tierckpt.async_save(state, path)  # type: ignore[arg-type]
    tierckpt.save(path, state)
    with pytest.raises(CheckpointError, match=r"the URI comes first: tierckpt\.load\(uri, state\)"):
        tierckpt.load(state, path)  # type: ignore[arg-type]


def test_a_misspelt_storage_option_is_named_with_the_valid_ones(tmp_path: Path, s3_bucket_uri: str) -> None:
    with pytest.raises(CheckpointError, match=r"'cahce'.*valid.*'cache'.*'memory'") as raised:
        tierckpt.save(str(tmp_path / "ck"), {"w": torch.ones(2)}, storage_options={"cahce": False})
    assert "__init__" not in str(raised.value)
    with pytest.raises(CheckpointError, match=r"'endpoint'.*valid.*'endpoint_url'"):
        tierckpt.save(s3_bucket_uri, {"w": torch.ones(2)}, storage_options={"endpoint": "http://x"})
    assert _files_under(tmp_path) == []


def test_status_and_prefetch_take_storage_options(s3_bucket_uri: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node"))
    tierckpt.save(s3_bucket_uri, {"w": torch.ones(4)})
    options = {"timeout_s": 20.0}
    assert tierckpt.status(s3_bucket_uri, storage_options=options).committed_on_remote
    assert tierckpt.prefetch(s3_bucket_uri, progress=False, storage_options=options).result(60) > 0
    assert tierckpt.status(s3_bucket_uri, timeout_s=20.0).committed_on_remote  # the documented keyword form
    with pytest.raises(CheckpointError, match=r"'timeout'.*valid.*'timeout_s'"):
        tierckpt.status(s3_bucket_uri, storage_options={"timeout": 1})
    with pytest.raises(CheckpointError, match=r"'bogus'.*valid"):
        tierckpt.prefetch(s3_bucket_uri, progress=False, bogus=1)


def test_a_typo_in_if_busy_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"if_busy='eror'.*'wait'.*'error'"):
        tierckpt.async_save(str(tmp_path / "ck"), {"w": torch.ones(2)}, if_busy="eror")  # type: ignore[arg-type]
    assert _files_under(tmp_path) == []


def test_prefetch_only_that_matches_nothing_fails(s3_bucket_uri: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node"))
    tierckpt.save(s3_bucket_uri, {"w": torch.ones(4), "b": torch.ones(2)})
    code = cli.main(["prefetch", s3_bucket_uri, "--only", "nomatch.*", "--quiet"])
    err = capsys.readouterr().err
    assert code != 0 and "'nomatch.*'" in err and "matched no tensor" in err and "'w'" in err, err
    assert cli.main(["prefetch", s3_bucket_uri, "--only", "w", "--quiet"]) == 0


def test_a_negative_step_is_refused(tmp_path: Path) -> None:
    manager = tierckpt.CheckpointManager(str(tmp_path / "run"))
    with pytest.raises(CheckpointError, match=r"step -1.*non-negative"):
        manager.save(-1, {"w": torch.ones(2)})
    assert _files_under(tmp_path) == []


# -- 12. a checkpoint of another dtype is cast, as torch DCP does -----------------------------------------
def test_an_fp32_checkpoint_loads_into_a_bf16_model_cast_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = torch.randn(8, 6) * 1000
    tierckpt.save(str(tmp_path / "ck"), {"w": saved, "b": saved[0].clone()})
    expected = saved.to(torch.bfloat16)
    for strict in (True, False):
        out = {"w": torch.zeros(8, 6, dtype=torch.bfloat16), "b": torch.zeros(6, dtype=torch.bfloat16)}
        target = out["w"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tierckpt.load(str(tmp_path / "ck"), out, strict=strict)
        assert out["w"] is target and out["w"].dtype == torch.bfloat16
        assert torch.equal(out["w"].view(torch.int16), expected.view(torch.int16))
        assert torch.equal(out["b"].view(torch.int16), expected[0].view(torch.int16))


def test_a_resharded_load_casts_too(tmp_path: Path) -> None:
    torch.manual_seed(1)
    saved = torch.randn(8, 6)
    tierckpt.save(str(tmp_path / "ck"), {"w": saved})
    box = tierckpt.ShardedTensor(torch.zeros(4, 3, dtype=torch.bfloat16), (8, 6), (2, 3))
    flat = tierckpt.FlatShardedTensor(torch.zeros(10, dtype=torch.float16), (8, 6), 7)
    tierckpt.load(str(tmp_path / "ck"), {"w": box})
    assert torch.equal(box.local.view(torch.int16), saved[2:6, 3:6].to(torch.bfloat16).view(torch.int16))
    tierckpt.load(str(tmp_path / "ck"), {"w": flat})
    assert torch.equal(flat.local.view(torch.int16), saved.reshape(-1)[7:17].half().view(torch.int16))


def test_complex_into_real_is_refused_naming_both_dtypes(tmp_path: Path) -> None:
    tierckpt.save(str(tmp_path / "ck"), {"z": torch.ones(3, dtype=torch.complex64)})
    target = {"z": torch.zeros(3)}
    with pytest.raises(StateMismatchError, match=r"'z'.*complex64.*float32.*imaginary"):
        tierckpt.load(str(tmp_path / "ck"), target)
    with pytest.warns(UserWarning, match="imaginary"):
        tierckpt.load(str(tmp_path / "ck"), target, strict=False)
    assert torch.equal(target["z"], torch.zeros(3))


def test_a_failed_save_through_the_node_memory_tier_is_not_loadable_either(
    s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same with the node memory tier on top of the node cache: a checkpoint saved to memory only
    (``persist=False``) before the failed save is this node's commit again; nothing of the failed one stays."""
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "node"))
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(tmp_path / "memory"))
    uri, options = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run", {"memory": True}
    kept = tierckpt.save(uri, {"w": torch.full((10,), 1.0)}, storage_options=options, persist=False)
    with pytest.raises(tierckpt.StorageError, match="was not committed"):
        tierckpt.save(uri, {"w": torch.full((10,), 2.0)}, storage_options=options)
    out = {"w": torch.zeros(10)}
    tierckpt.load(uri, out, storage_options=options)
    assert torch.equal(out["w"], torch.full((10,), 1.0))
    assert tierckpt.status(uri, storage_options=options).generation == kept.generation
    assert not tierckpt.status(uri, storage_options={"memory": False}).pending_keys
    with pytest.raises(tierckpt.CheckpointNotFoundError, match="does not exist"):
        tierckpt.load(uri, {"w": torch.zeros(10)}, storage_options={"memory": False})
