"""``tierckpt convert``: safetensors export (single file, sharded, streaming, flat pieces) and DCP round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tierckpt
from tierckpt.cli import main as cli
from tierckpt.convert import api as convert
from test_verify import sample_state, split_flat

MODEL = sample_state()["model"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes, so comparisons are bit-exact (NaN payloads, -0.0)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(_bits(got[name]), _bits(t)), name


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), sample_state())
    return root


def _load_folder(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


# -- tierckpt -> safetensors ---------------------------------------------------------------------------
def test_single_file_with_prefix(src: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "hf"
    assert cli.main(["convert", str(src), str(out), "--to", "safetensors", "--prefix", "model.", "--json"]) == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["files"] == ["model.safetensors"] and sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert doc["skipped_objects"] == ["data.epoch", "data.name", "step"]
    assert_bit_equal(load_file(str(out / "model.safetensors")), MODEL)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(MODEL)
        assert f.metadata() == {"format": "pt"}


def test_text_output_says_objects_are_skipped(src: Path, tmp_path: Path, capsys) -> None:
    assert cli.main(["convert", str(src), str(tmp_path / "hf"), "--to", "safetensors"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "skipped 3 object(s): data.epoch, data.name, step" in out


def test_without_prefix_keeps_fqns(src: Path, tmp_path: Path) -> None:
    convert.to_safetensors(str(src), tmp_path / "hf")
    assert_bit_equal(load_file(str(tmp_path / "hf/model.safetensors")), {f"model.{k}": v for k, v in MODEL.items()})


def test_sharded_with_index(src: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "hf"
    assert cli.main(["convert", str(src), str(out), "--to", "safetensors", "--prefix", "model.", "--max-shard-bytes", "1KB"]) == 0
    capsys.readouterr()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 2 and all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    assert set(index["weight_map"]) == set(MODEL)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in MODEL.values())
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            assert {k for k, v in index["weight_map"].items() if v == shard} == set(f.keys())
    assert_bit_equal(_load_folder(out), MODEL)


def test_streams_in_bounded_slabs(src: Path, tmp_path: Path, monkeypatch) -> None:
    """No read is larger than slab_bytes (rows permitting): tensors are never held whole."""
    sizes: list[int] = []
    from tierckpt.convert import safetensors as convert_safetensors

    real = convert_safetensors._read_box

    def spy(*args):
        data = real(*args)
        sizes.append(data.numel())
        return data

    monkeypatch.setattr(convert_safetensors, "_read_box", spy)
    convert.to_safetensors(str(src), tmp_path / "hf", prefix="model.", slab_bytes=256)
    assert max(sizes) <= 256 and len(sizes) > len(MODEL)
    assert_bit_equal(load_file(str(tmp_path / "hf/model.safetensors")), MODEL)


def test_flat_sharded_checkpoint_converts(src: Path, tmp_path: Path) -> None:
    """Flat pieces (FSDP1 / ZeRO layout) are assembled into whole tensors, also across slab borders."""
    split_flat(src, "model.embed.weight", [7, 500, 501, 900])
    split_flat(src, "model.positions", [13])
    convert.to_safetensors(str(src), tmp_path / "hf", prefix="model.", slab_bytes=200)
    assert_bit_equal(load_file(str(tmp_path / "hf/model.safetensors")), MODEL)


def test_unmatched_prefix_and_unsupported_dtype(src: Path, tmp_path: Path, capsys) -> None:
    assert cli.main(["convert", str(src), str(tmp_path / "a"), "--to", "safetensors", "--prefix", "nope."]) == cli.EXIT_ERROR
    assert "no tensor" in capsys.readouterr().err
    root = tmp_path / "complex"
    tierckpt.save(str(root), {"z": torch.zeros(2, dtype=torch.complex128)})
    assert cli.main(["convert", str(root), str(tmp_path / "b"), "--to", "safetensors"]) == cli.EXIT_ERROR
    assert "complex128" in capsys.readouterr().err


def test_usage_errors(src: Path, tmp_path: Path, capsys) -> None:
    assert cli.main(["convert", str(src), str(tmp_path / "x"), "--to", "tierckpt"]) == cli.EXIT_USAGE
    assert "supported:" in capsys.readouterr().err
    assert cli.main(["convert", str(src), str(tmp_path / "x"), "--to", "safetensors", "--max-shard-bytes", "lots"]) == cli.EXIT_USAGE
    assert cli.main(["convert", str(tmp_path / "none"), str(tmp_path / "x"), "--to", "safetensors"]) == cli.EXIT_NOT_FOUND


def test_transformers_loads_the_folder(src: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    convert.to_safetensors(str(src), tmp_path / "hf", prefix="model.")
    from transformers.modeling_utils import load_state_dict

    assert_bit_equal(load_state_dict(str(tmp_path / "hf/model.safetensors")), MODEL)


# -- safetensors -> tierckpt ---------------------------------------------------------------------------
def test_from_safetensors_folder(src: Path, tmp_path: Path, capsys) -> None:
    hf = tmp_path / "hf"
    convert.to_safetensors(str(src), hf, prefix="model.", max_shard_bytes=1000)
    back = tmp_path / "back"
    args = ["convert", str(hf), str(back), "--from", "safetensors", "--to", "tierckpt", "--prefix", "model."]
    assert cli.main(args) == cli.EXIT_OK
    capsys.readouterr()
    state = {"model": {k: torch.empty_like(v) for k, v in MODEL.items()}}
    tierckpt.load(str(back), state)
    assert_bit_equal(state["model"], MODEL)


def test_from_single_safetensors_file(tmp_path: Path) -> None:
    save_file(MODEL, str(tmp_path / "w.safetensors"))
    convert.from_safetensors(tmp_path / "w.safetensors", str(tmp_path / "back"))
    state = {k: torch.empty_like(v) for k, v in MODEL.items()}
    tierckpt.load(str(tmp_path / "back"), state)
    assert_bit_equal(state, MODEL)


# -- DCP -----------------------------------------------------------------------------------------------
def test_round_trip_through_dcp(src: Path, tmp_path: Path, capsys) -> None:
    dcp_dir, back = tmp_path / "dcp", tmp_path / "back"
    assert cli.main(["convert", str(src), str(dcp_dir), "--to", "dcp", "--json"]) == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"] == 4 and doc["objects"] == 3 and ".metadata" in doc["files"]
    assert cli.main(["convert", str(dcp_dir), str(back), "--from", "dcp", "--to", "tierckpt"]) == cli.EXIT_OK
    capsys.readouterr()
    state = {"model": {k: torch.empty_like(v) for k, v in MODEL.items()}, "step": None, "data": {"epoch": None, "name": None}}
    tierckpt.load(str(back), state)
    assert_bit_equal(state["model"], MODEL)
    assert state["step"] == 12 and state["data"] == {"epoch": 3, "name": "run"}


def test_dcp_output_loads_with_dcp(src: Path, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    convert.to_dcp(str(src), tmp_path / "dcp")
    state = {f"model.{k}": torch.empty_like(v) for k, v in MODEL.items()}
    state["step"] = 0
    with convert._quiet_dcp():
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert_bit_equal({k: v for k, v in state.items() if k != "step"}, {f"model.{k}": v for k, v in MODEL.items()})
    assert state["step"] == 12


def test_from_dcp_saved_by_dcp(tmp_path: Path) -> None:
    """A DCP checkpoint written by DCP from a nested state imports with dotted fqns."""
    import torch.distributed.checkpoint as dcp

    with convert._quiet_dcp():
        dcp.save({"model": dict(MODEL), "epoch": 4}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    report = convert.from_dcp(tmp_path / "dcp", str(tmp_path / "back"))
    assert report.tensors == 4 and report.objects == 1
    state = {"model": {k: torch.empty_like(v) for k, v in MODEL.items()}, "epoch": None}
    tierckpt.load(str(tmp_path / "back"), state)
    assert_bit_equal(state["model"], MODEL)
    assert state["epoch"] == 4


def test_from_missing_dcp(tmp_path: Path) -> None:
    assert cli.main(["convert", str(tmp_path / "none"), str(tmp_path / "x"), "--from", "dcp", "--to", "tierckpt"]) == cli.EXIT_NOT_FOUND


def test_from_dcp_of_a_plain_optimizer_state_dict(tmp_path: Path) -> None:
    """DCP's list-indexed param groups of numbered parameters (``Optimizer.state_dict()``) import as one
    ``param_groups`` list, which is how tierckpt stores that dict: it loads back into one, strict."""
    import torch.distributed.checkpoint as dcp

    def stepped(lr: float, momentum: float) -> torch.optim.Optimizer:
        param = torch.nn.Parameter(torch.arange(3.0))
        optim = torch.optim.SGD([param], lr=lr, momentum=momentum)
        param.grad = torch.full((3,), 0.5)
        optim.step()
        return optim

    saved = stepped(0.1, 0.9)
    with convert._quiet_dcp():
        dcp.save({"optim": saved.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    convert.from_dcp(tmp_path / "dcp", str(tmp_path / "back"))
    optim = stepped(0.7, 0.3)
    optim.param_groups[0]["params"][0].grad = torch.full((3,), 2.0)
    optim.step()
    target = {"optim": optim.state_dict()}
    tierckpt.load(str(tmp_path / "back"), target)
    optim.load_state_dict(target["optim"])
    assert optim.state_dict()["param_groups"] == saved.state_dict()["param_groups"]
    assert_bit_equal({"m": optim.state_dict()["state"][0]["momentum_buffer"]}, {"m": saved.state_dict()["state"][0]["momentum_buffer"]})
