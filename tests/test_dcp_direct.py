"""``tierckpt.load`` and ``tierckpt inspect`` on torch DCP directories, read in place.

DCP saves on 2 gloo ranks and tierckpt loads on 3 with another sharding: every element bit-exact,
every tensor byte read once by the group (read amplification 1.00), the only other bytes read being
the zip headers of each chunk and the objects. Also one process, S3 (moto), a hostile ``.metadata``
pickle, and what cannot be read in place.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import scenarios
import tierckpt
from distributed import subgroup
from tierckpt.cli import main as cli
from tierckpt.backends import open_backend
from tierckpt.formats.dcp_chunks import PROBE_BYTES
from tierckpt.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.formats.verify import verify

S3_OPTIONS = {"key": "testing", "secret": "testing", "region": "us-east-1"}
DATA_OPS = ("read_into", "read_runs", "read_segments")
"""Scheduler ops that move file bytes (ranged reads into buffers): data, chunk headers, objects."""


def _io_bytes() -> int:
    snap = get_scheduler().metrics.snapshot()
    return sum(snap[op].bytes for op in DATA_OPS if op in snap)


def _dcp_save(state: dict[str, Any], path: str, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when it runs without a process group
        dcp.save(state, checkpoint_id=path, **kwargs)


# -- scenarios (every rank of the pool) ------------------------------------------------------------------
def dcp_save_sharded(path: str, mesh: tuple[int, ...], spec: str) -> None:
    """``dcp.save`` of DTensors laid out as ``spec`` on ``mesh``, and a step object."""
    world = scenarios._size(mesh)
    group = subgroup(world)
    state = scenarios._layout_state(mesh, spec, fill=True)
    if group is not None:
        dcp.save({"s": state, "step": 7}, checkpoint_id=path, process_group=group)
    dist.barrier()


def tierckpt_load_sharded(path: str, mesh: tuple[int, ...], spec: str, storage_options: dict | None = None) -> dict[str, int]:
    """``tierckpt.load`` of the same state laid out as ``spec`` on ``mesh``; every element checked."""
    group = subgroup(scenarios._size(mesh))
    targets = scenarios._layout_state(mesh, spec, fill=False)
    stats: dict[str, int] = {}
    if group is not None:
        monitor = tierckpt.Monitor()
        state = {"s": targets, "step": 0}
        before = _io_bytes()
        tierckpt.load(path, state, group=group, monitor=monitor, storage_options=storage_options)
        stats = {"io_bytes": _io_bytes() - before, **monitor.counters}
        for name, (shape, dtype) in scenarios.SPECS.items():
            scenarios.check_tensor(name, targets[name], scenarios.reference(name, shape, dtype))
        assert state["step"] == 7
    dist.barrier()
    return stats


def _needed() -> int:
    return sum(scenarios.reference(n, s, d).nbytes for n, (s, d) in scenarios.SPECS.items())


def _assert_read_once(stats: list[dict[str, int]], uri: str, storage_options: dict | None = None) -> None:
    """Tensor bytes read once by the group; everything else read is chunk headers (bounded) and objects.

    From a local directory on one node the 0-d tensor (replicated on every loading rank) is read by each
    rank, as for tierckpt's own checkpoints: a page-cache copy is cheaper than a message."""
    needed = _needed()
    if "://" not in uri:
        needed += (sum(1 for s in stats if s) - 1) * scenarios.SPECS["scalar"][1].itemsize
    data = sum(s.get("bytes_read", 0) for s in stats)
    assert data == needed, f"group read {data} tensor bytes for {needed} needed (amplification {data / needed:.3f})"
    _assert_overhead(sum(s.get("io_bytes", 0) for s in stats) - needed, uri, storage_options)


# -- 2 ranks (DCP) -> 3 ranks (tierckpt), another sharding ---------------------------------------------------
@pytest.mark.multiproc
def test_dcp_saved_on_2_ranks_loads_resharded_on_3(dist_pool, tmp_path: Path) -> None:
    path = str(tmp_path / "dcp")
    dist_pool.run(dcp_save_sharded, path, (2,), "S0")
    assert not (tmp_path / "dcp" / "COMMIT").exists() and (tmp_path / "dcp" / ".metadata").exists()
    stats = dist_pool.run(tierckpt_load_sharded, path, (3,), "S1")
    _assert_read_once(stats, path)


@pytest.mark.multiproc
def test_dcp_on_s3_loads_resharded_on_3(dist_pool, tmp_path: Path, s3_bucket_uri: str, s3_server: str) -> None:
    """The same DCP directory uploaded to S3 (moto): every rank reads its ranges from the server."""
    path = tmp_path / "dcp"
    dist_pool.run(dcp_save_sharded, str(path), (2,), "S0")
    _upload(path, s3_bucket_uri, s3_server)
    options = {"endpoint_url": s3_server, **S3_OPTIONS}
    stats = dist_pool.run(tierckpt_load_sharded, s3_bucket_uri, (3,), "S0", options)
    _assert_read_once(stats, s3_bucket_uri, options)


def _upload(directory: Path, uri: str, endpoint: str) -> None:
    import boto3

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for f in directory.iterdir():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())
    client.close()


# -- one process ------------------------------------------------------------------------------------------
def _model_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 300), torch.nn.Linear(300, 5))
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "half": torch.randn(40, 7).to(torch.bfloat16),
        "u16": torch.arange(12).to(torch.uint16).reshape(3, 4),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "step": 11,
        "config": {"lr": 0.5, "names": ["a", "b"]},
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
        for k, v in state.items()
    }


def _assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        if isinstance(v, dict):
            _assert_same(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
        else:
            assert got[k] == v, k


def test_one_process_load_is_bit_exact_and_reads_each_byte_once(tmp_path: Path) -> None:
    state = _model_state()
    path = str(tmp_path / "dcp")
    _dcp_save(state, path, no_dist=True)
    target = _zeros_like(state)
    monitor = tierckpt.Monitor()
    before = _io_bytes()
    tierckpt.load(path, target, monitor=monitor)
    io_bytes = _io_bytes() - before
    _assert_same(target, state)
    tensor_bytes = sum(t.nbytes for t in [*state["model"].values(), state["half"], state["u16"], state["scalar"]])
    assert monitor.counters["bytes_read"] == tensor_bytes
    _assert_overhead(io_bytes - tensor_bytes, path)


def _assert_overhead(overhead: int, uri: str, storage_options: dict | None = None) -> None:
    """Bytes read besides the tensors': at most two probes per chunk, and the objects twice (CRC, then load)."""
    meta = tierckpt.read_checkpoint(open_backend(uri, **(storage_options or {})), accept_foreign=True).meta
    assert 0 < overhead <= meta.num_pieces * 2 * PROBE_BYTES + 2 * sum(o.byte_length for o in meta.objects)


@pytest.mark.filterwarnings("ignore:state does not match checkpoint")
def test_load_a_subset_and_a_shape_mismatch(tmp_path: Path) -> None:
    state = _model_state()
    path = str(tmp_path / "dcp")
    _dcp_save(state, path, no_dist=True)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    tierckpt.load(path, target, strict=False)
    _assert_same(target["model"], state["model"])
    with pytest.raises(tierckpt.StateMismatchError, match="shape mismatch 'half': checkpoint has shape \\[40, 7\\]"):
        tierckpt.load(path, {"half": torch.zeros(7, 40, dtype=torch.bfloat16)})


def test_load_from_s3_in_one_process(tmp_path: Path, s3_bucket_uri: str, s3_server: str) -> None:
    state = _model_state()
    _dcp_save(state, str(tmp_path / "dcp"), no_dist=True)
    _upload(tmp_path / "dcp", s3_bucket_uri, s3_server)
    target = _zeros_like(state)
    tierckpt.load(s3_bucket_uri, target)
    _assert_same(target, state)


def test_rewritten_dcp_directory_on_s3_is_read_fresh(tmp_path: Path, s3_bucket_uri: str, s3_server: str) -> None:
    """DCP rewrites files in place: a second save to the same prefix is what the next load sees (no stale cache)."""
    first = _model_state()
    _dcp_save(first, str(tmp_path / "one"), no_dist=True)
    _upload(tmp_path / "one", s3_bucket_uri, s3_server)
    tierckpt.load(s3_bucket_uri, _zeros_like(first))
    second = {k: (v * 2 if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in first.items()}
    second["model"] = {k: v + 1 for k, v in first["model"].items()}
    _dcp_save(second, str(tmp_path / "two"), no_dist=True)
    _upload(tmp_path / "two", s3_bucket_uri, s3_server)
    target = _zeros_like(second)
    tierckpt.load(s3_bucket_uri, target)
    _assert_same(target, second)


def test_inspect_shows_a_dcp_directory(tmp_path: Path, capsys) -> None:
    state = _model_state()
    path = str(tmp_path / "dcp")
    _dcp_save(state, path, no_dist=True)
    assert cli.main(["inspect", path]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "torch DCP checkpoint (metadata version 1.0.0)" in out and "model.0.weight" in out and "step" in out
    assert cli.main(["inspect", path, "--json", "--pieces"]) == cli.EXIT_OK
    import json

    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "torch DCP"
    weight = next(t for t in doc["tensors"] if t["fqn"] == "model.0.weight")
    assert weight["shape"] == [300, 24] and weight["piece_list"][0]["file"] == "__0_0.distcp"
    piece = weight["piece_list"][0]
    raw = (tmp_path / "dcp" / piece["file"]).read_bytes()[piece["byte_offset"] : piece["byte_offset"] + piece["byte_length"]]
    assert raw == state["model"]["0.weight"].numpy().tobytes()


# -- never 'interrupted', and what is not read in place -----------------------------------------------------
def test_a_dcp_directory_is_never_an_interrupted_save(tmp_path: Path) -> None:
    state = _model_state()
    path = str(tmp_path / "dcp")
    _dcp_save(state, path, no_dist=True)
    for call in (
        lambda: tierckpt.load(path, _zeros_like(state), verify=True),
        lambda: verify(path),
        lambda: tierckpt.read_checkpoint(open_backend(path)),
    ):
        with pytest.raises(CheckpointError) as info:
            call()
        assert not isinstance(info.value, IncompleteCheckpointError)
        assert "torch DCP checkpoint" in str(info.value)
        assert f"tierckpt convert --from dcp --to tierckpt {path} OUT" in str(info.value)


def test_other_dcp_layouts_are_named(tmp_path: Path) -> None:
    """Per-rank metadata (use_collectives=False) is named as such; data without .metadata is a DCP save that did not finish."""
    state = _model_state()
    per_rank = tmp_path / "per-rank"
    _dcp_save(state, str(per_rank), no_dist=True, use_collectives=False)
    assert not (per_rank / ".metadata").exists()
    with pytest.raises(CheckpointError, match="torch DCP checkpoint saved with use_collectives=False"):
        tierckpt.load(str(per_rank), _zeros_like(state))
    unfinished = tmp_path / "unfinished"
    _dcp_save(state, str(unfinished), no_dist=True)
    (unfinished / ".metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match="torch DCP data files but no .metadata"):
        tierckpt.load(str(unfinished), _zeros_like(state))


def _rewrite_metadata(path: Path, change: Any) -> None:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()  # trusted: the test wrote it
    change(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def test_stream_transforms_name_the_format_and_the_conversion(tmp_path: Path) -> None:
    state = _model_state()
    path = tmp_path / "dcp"
    _dcp_save(state, str(path), no_dist=True)

    def compressed(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            info.transform_descriptors = ["zstd"]

    _rewrite_metadata(path, compressed)
    with pytest.raises(CheckpointError, match=r"torch DCP checkpoint .* stream transforms \['zstd'\].*tierckpt convert --from dcp"):
        tierckpt.load(str(path), _zeros_like(state))


def test_channels_last_chunks_name_the_conversion(tmp_path: Path) -> None:
    state = {"conv": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)}
    path = str(tmp_path / "dcp")
    _dcp_save(state, path, no_dist=True)
    with pytest.raises(CheckpointError, match=r"not row-major .*tierckpt convert --from dcp"):
        tierckpt.load(path, {"conv": torch.zeros(2, 3, 4, 5)})


# -- hostile .metadata ------------------------------------------------------------------------------------
class _RunsCode:
    def __init__(self, fn: Any, arg: str) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return self.fn, (self.arg,)


@pytest.mark.parametrize("via", ["os.system", "builtins.eval"])
def test_hostile_metadata_pickle_is_refused_and_runs_nothing(tmp_path: Path, via: str, capsys) -> None:
    state = _model_state()
    path = tmp_path / "dcp"
    _dcp_save(state, str(path), no_dist=True)
    marker = tmp_path / "pwned"
    payload = (
        _RunsCode(os.system, f"touch {marker}") if via == "os.system"
        else _RunsCode(eval, f"open({str(marker)!r}, 'w').close()")
    )

    def poison(metadata: Any) -> None:
        metadata.planner_data = payload

    _rewrite_metadata(path, poison)
    with pytest.raises(CorruptCheckpointError, match=r"refers to (posix|os|builtins)\.(system|eval).*not unpickled"):
        tierckpt.load(str(path), _zeros_like(state))
    assert cli.main(["inspect", str(path)]) == cli.EXIT_CORRUPT
    assert "not unpickled" in capsys.readouterr().err
    assert not marker.exists()
    # The payload is live: plain pickle would have run it.
    pickle.loads((path / ".metadata").read_bytes())
    assert marker.exists()


def test_hostile_chunk_pickle_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    """A chunk's data.pkl is read by an unpickler that builds nothing: one naming os.system is refused."""
    import io

    path = tmp_path / "dcp"
    _dcp_save({"w": torch.randn(4, 4)}, str(path), no_dist=True)
    marker = tmp_path / "pwned"
    payload = io.BytesIO()
    torch.save(_RunsCode(os.system, f"touch {marker}"), payload)
    data = (path / "__0_0.distcp").read_bytes()
    (path / "__0_0.distcp").write_bytes(data + payload.getvalue())

    def point_w_at_payload(metadata: Any) -> None:
        for index, info in metadata.storage_data.items():
            if index.fqn == "w":
                info.offset, info.length = len(data), len(payload.getvalue())

    _rewrite_metadata(path, point_w_at_payload)
    with pytest.raises(CheckpointError, match=r"not a plain tensor \(its data.pkl refers to (posix|os)\.system\)"):
        tierckpt.load(str(path), {"w": torch.zeros(4, 4)})
    assert not marker.exists()
