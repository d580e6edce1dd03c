"""torch DCP's two optimizer conventions, both directions, against the real ``torch.distributed.checkpoint``.

``get_state_dict(model, optim)`` names param group settings by group number by default
(``optim.param_groups.0.lr``) and by parameter when flattened. A DCP directory saved either way loads
in place into a module and optimizer (settings restored exactly); ``tierckpt convert --to dcp`` writes
what the default ``get_state_dict`` + ``dcp.load`` reads, and the flattened form with
``--flatten-optimizer``. One process, and FSDP2 on 2 gloo ranks -> 3. The fresh targets are built with
other lr, weight decay and betas, so a setting that is not restored shows.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tierckpt
from distributed import subgroup
from scenarios import assert_same, make_mesh, train
from scenarios_interop import build, flat_options, full, tierckpt_cli
from tierckpt.cli import main as cli

CONVENTIONS = pytest.mark.parametrize("flatten", [False, True], ids=["indexed", "flattened"])


def _dcp_save(state: dict[str, Any], path: str, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when it runs without a process group
        dcp.save(state, checkpoint_id=path, **kwargs)


def _dcp_load(state: dict[str, Any], path: str, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path, **kwargs)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, optim = build(0)
    train(model, optim, 2, 0)
    return model, optim, copy.deepcopy(full(model, optim))


# -- DCP -> tierckpt, in place ----------------------------------------------------------------------------
@CONVENTIONS
def test_dcp_directory_loads_in_place_strict_either_convention(tmp_path: Path, flatten: bool) -> None:
    model, optim, expected = _trained()
    msd, osd = get_state_dict(model, optim, options=flat_options(flatten))
    _dcp_save({"model": msd, "optim": osd}, str(tmp_path / "dcp"), no_dist=True)
    model, optim = build(1, fresh=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strict: nothing skipped, nothing warned about
        tierckpt.load(str(tmp_path / "dcp"), {"model": model, "optim": optim})
    assert_same(expected, full(model, optim))
    assert [g["lr"] for g in optim.param_groups] == [1e-2, 3e-3]
    assert [g["weight_decay"] for g in optim.param_groups] == [0.1, 0.0]


def test_the_reported_sequential_adam_case_loads_in_place(tmp_path: Path) -> None:
    """The case as reported: nn.Sequential (fqns ``0.bias``) with Adam, default get_state_dict -> dcp.save
    -> a strict tierckpt.load used to say "missing from the checkpoint: 'optim.param_groups.0.bias.amsgrad'"."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01)
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    _dcp_save({"model": msd, "optim": osd}, str(tmp_path / "dcp"), no_dist=True)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.5, weight_decay=0.0)
    tierckpt.load(str(tmp_path / "dcp"), {"model": fresh, "optim": fresh_optim})
    assert_same(optim.state_dict(), fresh_optim.state_dict())
    assert fresh_optim.param_groups[0]["lr"] == 0.01 and fresh_optim.param_groups[0]["weight_decay"] == 0.01


def test_indexed_dcp_directory_loads_into_flattened_dicts(tmp_path: Path) -> None:
    """The flattened get_state_dict dicts (what torchtitan passes) load from an indexed DCP directory too."""
    model, optim, expected = _trained()
    msd, osd = get_state_dict(model, optim)
    _dcp_save({"model": msd, "optim": osd}, str(tmp_path / "dcp"), no_dist=True)
    model, optim = build(1, fresh=True)
    msd, osd = get_state_dict(model, optim, options=flat_options())
    tierckpt.load(str(tmp_path / "dcp"), {"model": msd, "optim": osd})
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=flat_options())
    assert_same(expected, full(model, optim))


# -- tierckpt -> DCP ----------------------------------------------------------------------------------------
@CONVENTIONS
def test_convert_to_dcp_is_read_by_dcp_load_in_that_convention(tmp_path: Path, flatten: bool, capsys) -> None:
    """``tierckpt convert --to dcp`` (default: indexed) and ``--flatten-optimizer``: ``dcp.load`` into
    ``get_state_dict`` in the matching convention, then ``set_state_dict``: bit-exact, settings restored."""
    model, optim, expected = _trained()
    tierckpt.save(str(tmp_path / "ckpt"), {"model": model, "optim": optim})
    args = ["convert", str(tmp_path / "ckpt"), str(tmp_path / "dcp"), "--to", "dcp"]
    assert cli.main(args + (["--flatten-optimizer"] if flatten else [])) == cli.EXIT_OK
    capsys.readouterr()
    model, optim = build(1, fresh=True)
    msd, osd = get_state_dict(model, optim, options=flat_options(flatten))
    _dcp_load({"model": msd, "optim": osd}, str(tmp_path / "dcp"), no_dist=True)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=flat_options(flatten))
    assert_same(expected, full(model, optim))


def test_converted_dcp_directory_loads_back_in_place(tmp_path: Path) -> None:
    """tierckpt -> convert --to dcp (indexed) -> tierckpt.load in place: the round trip closes."""
    model, optim, expected = _trained()
    tierckpt.save(str(tmp_path / "ckpt"), {"model": model, "optim": optim, "step": 2})
    assert cli.main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "dcp"), "--to", "dcp"]) == cli.EXIT_OK
    model, optim = build(1, fresh=True)
    state = {"model": model, "optim": optim, "step": 0}
    tierckpt.load(str(tmp_path / "dcp"), state)
    assert_same(expected, full(model, optim))
    assert state["step"] == 2


def test_groups_with_equal_settings_need_the_flattened_form(tmp_path: Path, capsys) -> None:
    """The flattened names do not say which group a parameter was in: two groups saved with equal
    settings come out as one indexed group, and dcp.load says so (never a silent mix); the flattened
    form loads them exactly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    optim = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    tierckpt.save(str(tmp_path / "ckpt"), {"model": model, "optim": optim})
    for flatten in (False, True):
        out = str(tmp_path / f"dcp{flatten}")
        assert cli.main(["convert", str(tmp_path / "ckpt"), out, "--to", "dcp"] + (["--flatten-optimizer"] if flatten else [])) == 0
        fresh = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
        fresh_optim = torch.optim.SGD([{"params": fresh[0].parameters()}, {"params": fresh[1].parameters()}], lr=0.7, momentum=0.9)
        msd, osd = get_state_dict(fresh, fresh_optim, options=flat_options(flatten))
        if not flatten:
            with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optim\.param_groups\.1\."):
                _dcp_load({"model": msd, "optim": osd}, out, no_dist=True)
            continue
        _dcp_load({"model": msd, "optim": osd}, out, no_dist=True)
        set_state_dict(fresh, fresh_optim, model_state_dict=msd, optim_state_dict=osd, options=flat_options(True))
        assert_same(full(model, optim), full(fresh, fresh_optim))
    capsys.readouterr()


def test_flatten_optimizer_is_only_for_dcp_output(tmp_path: Path, capsys) -> None:
    tierckpt.save(str(tmp_path / "ckpt"), {"x": torch.ones(2)})
    code = cli.main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "st"), "--to", "safetensors", "--flatten-optimizer"])
    assert code == cli.EXIT_USAGE
    assert "--flatten-optimizer is for --to dcp" in capsys.readouterr().err


# -- FSDP2, 2 gloo ranks -> 3 -------------------------------------------------------------------------------
def _expected_path(root: str) -> str:
    return f"{root}/expected.pt"


def _train_on_2(root: str) -> tuple[Any, Any, Any]:
    """FSDP2 x2: build, train 2 steps, write the full expected state (rank 0). Every rank calls it."""
    mesh = make_mesh((2,))
    group = subgroup(2)
    if group is None:
        return None, None, None
    model, optim = build(0, mesh=mesh)
    train(model, optim, 2, dist.get_rank())
    expected = full(model, optim)
    if dist.get_rank() == 0:
        torch.save(expected, _expected_path(root))
    return model, optim, group


def _load_on_3(root: str, fill: Any) -> bool:
    """FSDP2 x3: a fresh model and optimizer (other settings) filled by ``fill(model, optim, group)``,
    compared bit-exactly with the expected state. Every rank calls it."""
    mesh = make_mesh((3,))
    group = subgroup(3)
    if group is not None:
        expected = torch.load(_expected_path(root), weights_only=True)
        model, optim = build(1, fresh=True, mesh=mesh)
        fill(model, optim, group)
        assert_same(expected, full(model, optim))
    dist.barrier()
    return True


def fsdp2_dcp_in_place(root: str, flatten: bool) -> bool:
    """dcp.save of get_state_dict (either convention) on 2 ranks -> tierckpt.load in place on 3."""
    model, optim, group = _train_on_2(root)
    if group is not None:
        msd, osd = get_state_dict(model, optim, options=flat_options(flatten))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp", process_group=group)
    dist.barrier()
    return _load_on_3(root, lambda m, o, g: tierckpt.load(f"{root}/dcp", {"model": m, "optim": o}, group=g))


def fsdp2_converted_to_dcp(root: str, flatten: bool) -> bool:
    """tierckpt.save on 2 ranks -> `tierckpt convert --to dcp [--flatten-optimizer]` -> dcp.load into
    get_state_dict (that convention) + set_state_dict on 3."""
    model, optim, group = _train_on_2(root)
    if group is not None:
        tierckpt.save(f"{root}/ckpt", {"model": model, "optim": optim}, group=group)
        if dist.get_rank() == 0:
            tierckpt_cli("convert", f"{root}/ckpt", f"{root}/dcp", "--to", "dcp", *(["--flatten-optimizer"] if flatten else []))
    dist.barrier()

    def fill(model: Any, optim: Any, group: Any) -> None:
        msd, osd = get_state_dict(model, optim, options=flat_options(flatten))
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp", process_group=group)
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=flat_options(flatten))

    return _load_on_3(root, fill)


@pytest.mark.multiproc
@CONVENTIONS
def test_fsdp2_dcp_saved_on_2_loads_in_place_on_3(dist_pool, tmp_path: Path, flatten: bool) -> None:
    assert all(dist_pool.run(fsdp2_dcp_in_place, str(tmp_path), flatten))


@pytest.mark.multiproc
@CONVENTIONS
def test_fsdp2_saved_on_2_converts_to_dcp_loaded_on_3(dist_pool, tmp_path: Path, flatten: bool) -> None:
    assert all(dist_pool.run(fsdp2_converted_to_dcp, str(tmp_path), flatten))
