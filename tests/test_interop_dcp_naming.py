"""Optimizer state under torch's names: tierckpt <-> torch DCP with model and optimizer, both ways.

Native saves use exactly the keys of torch's flattened ``get_state_dict``; checkpoints move to DCP
and back and load strict into a module and optimizer or into ``get_state_dict`` dicts, bit-exact,
param group settings included; format 1.0 checkpoints (the old names) still load. The user guide's
"torch DCP, optimizer included" code is run here as written.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import scenarios_interop
import tierckpt
from tamper import reseal
from scenarios import assert_same, train
from scenarios_interop import build, flat_options, full
from tierckpt.cli import main as cli
from tierckpt.convert import api as convert
from tierckpt.native import layout
from tierckpt.backends import open_backend
from tierckpt.loading.api import read_checkpoint

GUIDE = Path(__file__).parent.parent / "docs" / "user-guide.md"


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, optim = build(seed)
    train(model, optim, 2, 0)
    return model, optim, copy.deepcopy(full(model, optim))


def _keys(uri: str) -> set[str]:
    ckpt = read_checkpoint(open_backend(uri))
    return set(ckpt.tensors) | {o.key for o in ckpt.meta.objects}


def test_native_keys_are_torch_get_state_dict_keys(tmp_path: Path) -> None:
    """A module and optimizer save under exactly the keys of torch's flattened get_state_dict, and the
    unflattened get_state_dict dicts save under the same keys."""
    model, optim, _ = _trained()
    tierckpt.save(str(tmp_path / "native"), {"model": model, "optim": optim})
    msd, osd = get_state_dict(model, optim, options=flat_options())
    assert _keys(str(tmp_path / "native")) == {f"model.{k}" for k in msd} | {f"optim.{k}" for k in osd}
    assert "state.embed.weight.exp_avg" in osd and "optim.param_groups.norm.bias.lr" in _keys(str(tmp_path / "native"))
    msd, osd = get_state_dict(model, optim)
    tierckpt.save(str(tmp_path / "dicts"), {"model": msd, "optim": osd})
    assert _keys(str(tmp_path / "dicts")) == _keys(str(tmp_path / "native"))
    assert read_checkpoint(open_backend(str(tmp_path / "native"))).meta.format_minor == 1


def test_optimizer_over_several_modules_keeps_the_module_keys(tmp_path: Path) -> None:
    """One optimizer over two modules of the state: its parameter names keep the module key, so
    two modules' ``weight`` stay apart, and the state round-trips."""
    torch.manual_seed(0)
    enc, dec = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
    optim = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=0.1)
    dec(enc(torch.randn(4, 3))).sum().backward()
    optim.step()
    tierckpt.save(str(tmp_path / "c"), {"enc": enc, "dec": dec, "optim": optim})
    keys = _keys(str(tmp_path / "c"))
    assert {"optim.state.enc.weight.exp_avg", "optim.state.dec.weight.exp_avg", "optim.param_groups.dec.bias.lr"} <= keys
    enc2, dec2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
    optim2 = torch.optim.Adam([*enc2.parameters(), *dec2.parameters()], lr=0.5)
    tierckpt.load(str(tmp_path / "c"), {"enc": enc2, "dec": dec2, "optim": optim2})
    assert_same(optim.state_dict(), optim2.state_dict())


def _guide_blocks() -> list[tuple[str, str]]:
    """The fenced code blocks of the user guide's "torch DCP, optimizer included" subsection."""
    text = GUIDE.read_text()
    start = text.index("### torch DCP, optimizer included")
    end = min((i for i in (text.find("\n## ", start), text.find("\n### ", start + 1)) if i != -1), default=len(text))
    return re.findall(r"```(\w+)\n(.*?)```", text[start:end], flags=re.S)


def _run_shell(code: str) -> None:
    for line in code.strip().splitlines():
        args = shlex.split(line)
        assert args[0] == "tierckpt", line
        assert cli.main(args[1:]) == cli.EXIT_OK, line


def test_user_guide_dcp_section_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Both directions of the guide, run block by block: bit-exact, param group settings restored."""
    monkeypatch.chdir(tmp_path)
    blocks = _guide_blocks()
    assert [lang for lang, _ in blocks] == ["python", "bash", "python", "python", "bash", "python", "python"]
    model, optim, expected = _trained()
    ns: dict[str, Any] = {"tierckpt": tierckpt, "model": model, "optim": optim}

    def run(i: int, fresh_seed: int | None = None) -> None:
        if fresh_seed is not None:
            ns["model"], ns["optim"] = build(fresh_seed, fresh=True)
        lang, code = blocks[i]
        if lang == "bash":
            _run_shell(code)
            capsys.readouterr()
        else:
            exec(compile(code, f"user-guide block {i}", "exec"), ns)  # noqa: S102 - the guide's own code

    run(0)  # tierckpt.save
    run(1)  # convert --to dcp
    run(2, fresh_seed=1)  # dcp.load + set_state_dict
    assert_same(expected, full(ns["model"], ns["optim"]))
    ns["model"], ns["optim"] = model, optim
    run(3)  # dcp.save of get_state_dict dicts
    run(4)  # convert --from dcp
    run(5, fresh_seed=2)  # native load
    assert_same(expected, full(ns["model"], ns["optim"]))
    run(6, fresh_seed=3)  # load into get_state_dict dicts + set_state_dict
    assert_same(expected, full(ns["model"], ns["optim"]))


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "nested"])
def test_dcp_save_imports_and_loads_strict_every_way(tmp_path: Path, flatten: bool) -> None:
    """dcp.save of get_state_dict dicts (flattened or nested) -> from_dcp -> strict loads into a
    module and optimizer, and into flattened and nested get_state_dict dicts."""
    model, optim, expected = _trained()
    msd, osd = get_state_dict(model, optim, options=flat_options(flatten))
    with convert._quiet_dcp():
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    convert.from_dcp(tmp_path / "dcp", str(tmp_path / "ckpt"))
    model, optim = build(1, fresh=True)
    tierckpt.load(str(tmp_path / "ckpt"), {"model": model, "optim": optim})
    assert_same(expected, full(model, optim))
    for flat in (True, False):
        model, optim = build(2, fresh=True)
        msd, osd = get_state_dict(model, optim, options=flat_options(flat))
        tierckpt.load(str(tmp_path / "ckpt"), {"model": msd, "optim": osd})
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=flat_options(flat))
        assert_same(expected, full(model, optim))


def test_round_trip_through_dcp_keeps_keys(tmp_path: Path) -> None:
    """native -> DCP -> tierckpt gives back the same keys, and the optimizer loads from it."""
    model, optim, expected = _trained()
    tierckpt.save(str(tmp_path / "a"), {"model": model, "optim": optim, "step": 2})
    convert.to_dcp(str(tmp_path / "a"), tmp_path / "dcp")
    convert.from_dcp(tmp_path / "dcp", str(tmp_path / "b"))
    assert _keys(str(tmp_path / "b")) == _keys(str(tmp_path / "a"))
    model, optim = build(1, fresh=True)
    state = {"model": model, "optim": optim, "step": 0}
    tierckpt.load(str(tmp_path / "b"), state)
    assert_same(expected, full(model, optim))
    assert state["step"] == 2


def test_model_only_load_of_a_training_checkpoint_is_strict(tmp_path: Path) -> None:
    """{"model": model} loads from a model + optimizer + step checkpoint in the default strict mode."""
    model, optim, expected = _trained()
    tierckpt.save(str(tmp_path / "c"), {"model": model, "optim": optim, "step": 2})
    fresh, _ = build(1, fresh=True)
    tierckpt.load(str(tmp_path / "c"), {"model": fresh})
    assert_same(expected["model"], full(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))["model"])


def test_param_groups_that_disagree_with_the_checkpoint_are_named(tmp_path: Path) -> None:
    """Parameters saved in groups with different settings cannot share one group on load."""
    model, optim, _ = _trained()
    tierckpt.save(str(tmp_path / "c"), {"model": model, "optim": optim})
    fresh, _ = build(1)
    one_group = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    with pytest.raises(tierckpt.StateMismatchError, match="share a param group") as info:
        tierckpt.load(str(tmp_path / "c"), {"model": fresh, "optim": one_group})
    assert "weight_decay" in str(info.value) or "lr" in str(info.value)


# -- format 1.0 (the old names) ------------------------------------------------------------------
def write_format_1_0(uri: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """What format 1.0 wrote for ``{"model": model, "optim": optim, "step": 2}``: parameters named
    with their module's state key (``optim.state.model.<fqn>.<name>``), the param groups as one
    ``optim.param_groups`` list, and a header without ``format_minor``."""
    names = {id(p): f"model.{n}" for n, p in model.named_parameters()}
    state: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    groups = []
    for group in optim.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            state.update({f"optim.state.{names[id(p)]}.{k}": v for k, v in optim.state[p].items()})
    state["optim.param_groups"] = groups
    state["step"] = 2
    tierckpt.save(uri, state)
    _drop_format_minor(uri)


def _drop_format_minor(uri: str) -> None:
    """Make the header what format 1.0 wrote: no ``format_minor``."""
    header = Path(uri) / layout.header_key(read_checkpoint(open_backend(uri)).meta.generation)
    doc = json.loads(header.read_text())
    del doc["format_minor"]
    header.write_text(json.dumps(doc))
    reseal(header.parents[2])


def test_format_1_0_checkpoint_of_get_state_dict_dicts_loads_into_them(tmp_path: Path) -> None:
    """Format 1.0 stored a nested get_state_dict optimizer dict as ``optim.state.<fqn>.<name>`` and one
    ``optim.param_groups`` list; it still loads into such dicts."""
    model, optim, expected = _trained()
    msd, osd = get_state_dict(model, optim)
    state: dict[str, Any] = {f"model.{k}": v for k, v in msd.items()}
    state.update({f"optim.state.{fqn}.{k}": v for fqn, s in osd["state"].items() for k, v in s.items()})
    state["optim.param_groups"] = osd["param_groups"]
    tierckpt.save(str(tmp_path / "old"), state)
    _drop_format_minor(str(tmp_path / "old"))
    model, optim = build(1, fresh=True)
    msd, osd = get_state_dict(model, optim)
    tierckpt.load(str(tmp_path / "old"), {"model": msd, "optim": osd})
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    assert_same(expected, full(model, optim))


def test_format_1_0_checkpoint_loads_natively(tmp_path: Path) -> None:
    model, optim, expected = _trained()
    write_format_1_0(str(tmp_path / "old"), model, optim)
    ckpt = read_checkpoint(open_backend(str(tmp_path / "old")))
    assert ckpt.meta.format_minor == 0 and "optim.state.model.embed.weight.exp_avg" in ckpt.tensors
    model, optim = build(1, fresh=True)
    state = {"model": model, "optim": optim, "step": 0}
    tierckpt.load(str(tmp_path / "old"), state)
    assert_same(expected, full(model, optim))
    assert state["step"] == 2


def test_format_1_0_checkpoint_converts_to_dcp_under_torch_names(tmp_path: Path) -> None:
    model, optim, expected = _trained()
    write_format_1_0(str(tmp_path / "old"), model, optim)
    for flatten in (False, True):  # torch's default get_state_dict names, and the flattened ones
        convert.to_dcp(str(tmp_path / "old"), tmp_path / f"dcp{flatten}", flatten_optimizer=flatten)
        model, optim = build(1, fresh=True)
        msd, osd = get_state_dict(model, optim, options=flat_options(flatten))
        with convert._quiet_dcp():
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / f"dcp{flatten}"), no_dist=True)
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=flat_options(flatten))
        assert_same(expected, full(model, optim))


# -- FSDP2 on 2 gloo ranks -----------------------------------------------------------------------
@pytest.mark.multiproc
def test_fsdp2_native_to_dcp(dist_pool, tmp_path: Path) -> None:
    dist_pool.run(scenarios_interop.fsdp2_native_to_dcp, str(tmp_path))


@pytest.mark.multiproc
@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "nested"])
def test_fsdp2_dcp_to_native(dist_pool, tmp_path: Path, flatten: bool) -> None:
    dist_pool.run(scenarios_interop.fsdp2_dcp_to_native, str(tmp_path), flatten)


# -- many small objects ---------------------------------------------------------------------------
def test_param_group_settings_are_read_in_one_request_per_file(tmp_path: Path) -> None:
    """Every parameter holds its group's settings (hundreds of small objects): a load fetches them
    with one ranged read per objects file, not one read each."""
    from tierckpt.io.scheduler import get_scheduler

    model, optim, expected = _trained()
    tierckpt.save(str(tmp_path / "c"), {"model": model, "optim": optim})
    ckpt = read_checkpoint(open_backend(str(tmp_path / "c")))
    assert len(ckpt.meta.objects) > 100
    model, optim = build(1, fresh=True)
    get_scheduler().metrics.reset()
    tierckpt.load(str(tmp_path / "c"), {"model": model, "optim": optim})
    object_ops = [r.op for r in get_scheduler().metrics.records() if "/objects/" in r.key]
    assert len({o.file for o in ckpt.meta.objects}) == 1
    assert sorted(object_ops) == sorted(["size", "read_into"])  # its size is checked, then one ranged read
    assert_same(expected, full(model, optim))


def test_equal_mutable_objects_load_as_separate_values(tmp_path: Path) -> None:
    """Equal small values decode once only when immutable: two equal lists stay two lists; values
    that compare equal but differ in type or bits (1, 1.0, True; 0.0, -0.0) stay apart."""
    saved = {"a": [1, 2], "b": [1, 2], "c": (0.9, 0.95), "d": (0.9, 0.95), "e": 0.0, "f": -0.0, "g": 1, "h": 1.0, "i": True}
    tierckpt.save(str(tmp_path / "c"), saved)
    target: dict[str, Any] = dict.fromkeys(saved)
    tierckpt.load(str(tmp_path / "c"), target)
    assert [repr(target[k]) for k in saved] == [repr(v) for v in saved.values()]
    target["a"].append(3)
    assert target["b"] == [1, 2]


@pytest.mark.multiproc
def test_dcp_conversion_inside_a_process_group_says_to_run_the_command(dist_pool, tmp_path: Path) -> None:
    message = dist_pool.run(scenarios_interop.convert_inside_a_group, str(tmp_path))[0]
    assert "runs in one process" in message and "tierckpt convert --to dcp" in message


def test_object_past_the_end_of_its_file_is_refused_before_allocating(tmp_path: Path) -> None:
    """A header claiming a 32 TiB object fails as corrupt, naming it, without allocating a buffer for it."""
    uri = str(tmp_path / "c")
    tierckpt.save(uri, {"x": 5, "y": [1]})
    header = Path(uri) / layout.header_key(read_checkpoint(open_backend(uri)).meta.generation)
    doc = json.loads(header.read_text())
    (y,) = [o for o in doc["objects"] if o["key"] == "y"]
    y["byte_length"] = 2**45
    header.write_text(json.dumps(doc))
    reseal(header.parents[2])
    with pytest.raises(tierckpt.CorruptCheckpointError, match="'y' runs past the end"):
        tierckpt.load(uri, {"x": None, "y": None})
