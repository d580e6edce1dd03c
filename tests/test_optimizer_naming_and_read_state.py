"""Fitting the trainers around tierckpt: optimizer names without the model in the call, optimizers
that hold their state elsewhere, the template-free load, and the step names of other trainers.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_optimizer_state_dict, get_state_dict, set_optimizer_state_dict,
)

import scenarios
import tierckpt
from distributed import subgroup
from scenarios import assert_same, make_mesh, train
from scenarios_interop import build, full
from tierckpt.backends import open_backend
from tierckpt.loading.api import read_checkpoint

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _keys(uri: str) -> set[str]:
    ckpt = read_checkpoint(open_backend(uri))
    return set(ckpt.tensors) | {o.key for o in ckpt.meta.objects}


def _trained_with_scheduler() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model, optim = build(0)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    train(model, optim, 2, 0)
    sched.step()
    return model, optim, sched


# -- 2. optimizer names independent of what else is in the call ---------------------------------------------
def test_optimizer_paired_with_its_model_loads_without_the_model(tmp_path: Path) -> None:
    """Saved as {"model", "optim", "sched"}; loaded apart, as Hugging Face's hooks do: the model alone,
    then {"optim": (model, optim), "sched": sched}, strict, bit-exact, settings restored."""
    model, optim, sched = _trained_with_scheduler()
    expected = copy.deepcopy(full(model, optim))
    tierckpt.save(str(tmp_path / "c"), {"model": model, "optim": optim, "sched": sched})
    fresh, fresh_optim = build(1, fresh=True)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_optim, step_size=1, gamma=0.5)
    tierckpt.load(str(tmp_path / "c"), {"model": fresh})
    tierckpt.load(str(tmp_path / "c"), {"optim": (fresh, fresh_optim), "sched": fresh_sched})
    assert_same(expected, full(fresh, fresh_optim))
    assert fresh_sched.state_dict() == sched.state_dict()


def test_paired_save_writes_the_keys_of_a_save_with_the_model(tmp_path: Path) -> None:
    model, optim, _ = _trained_with_scheduler()
    tierckpt.save(str(tmp_path / "with"), {"model": model, "optim": optim})
    tierckpt.save(str(tmp_path / "pair"), {"optim": (model, optim)})
    assert _keys(str(tmp_path / "pair")) == {k for k in _keys(str(tmp_path / "with")) if not k.startswith("model.")}


def test_optimizer_built_from_named_parameters_names_them_itself(tmp_path: Path) -> None:
    """An optimizer built from ``named_parameters()`` carries its parameters' names: saved without the
    model, its keys are the fqns a save with the model writes; it loads without the model, and paired."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.named_parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    optim.step()
    tierckpt.save(str(tmp_path / "c"), {"optim": optim})
    assert "optim.state.1.weight.exp_avg" in _keys(str(tmp_path / "c"))
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    for target in ("alone", "paired"):
        fresh_optim = torch.optim.AdamW(fresh.named_parameters(), lr=0.5)
        tierckpt.load(str(tmp_path / "c"), {"optim": fresh_optim if target == "alone" else (fresh, fresh_optim)})
        assert_same(optim.state_dict(), fresh_optim.state_dict())


def test_unnamed_optimizer_load_says_how_to_name_the_parameters(tmp_path: Path) -> None:
    model, optim, sched = _trained_with_scheduler()
    tierckpt.save(str(tmp_path / "c"), {"model": model, "optim": optim, "sched": sched})
    _, fresh_optim = build(1, fresh=True)
    with pytest.raises(tierckpt.StateMismatchError, match=r"param_group0\.param0.*pair them \({'optim': \(model, optim\)}\)"):
        tierckpt.load(str(tmp_path / "c"), {"optim": fresh_optim})


class Container(torch.optim.Optimizer):
    """A stand-in for torchtitan's ``OptimizersContainer``: an Optimizer over several model parts whose
    state lives in one inner optimizer per part (its own ``state`` stays empty); ``state_dict`` merges
    the parts' flattened ``get_optimizer_state_dict``."""

    def __init__(self, parts: list[torch.nn.Module], lr: float, weight_decay: float) -> None:
        self.parts = parts
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=lr, weight_decay=weight_decay) for p in parts]
        torch.optim.Optimizer.__init__(self, [p for part in parts for p in part.parameters()], {"lr": lr})

    def step(self, closure: Any = None) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        get = functools.partial(get_optimizer_state_dict, options=FLAT)
        return {k: v for sd in map(get, self.parts, self.optimizers) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, o in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, o, optim_state_dict=state_dict, options=FLAT)


class LazyContainer(Container):
    """Like :class:`Container`, but its ``state_dict`` lists only state that exists (none before a step)."""

    def state_dict(self) -> dict[str, Any]:
        names = {id(p): n for part in self.parts for n, p in part.named_parameters()}
        return {f"state.{names[id(p)]}.{k}": v for o in self.optimizers for p, s in o.state.items() for k, v in s.items()}


def _parts(seed: int) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [torch.nn.ModuleDict({"embed": torch.nn.Linear(4, 5)}), torch.nn.ModuleDict({"head": torch.nn.Linear(5, 3)})]


def _container_step(parts: list[torch.nn.Module], optim: torch.optim.Optimizer) -> None:
    x = torch.randn(6, 4)
    parts[1]["head"](parts[0]["embed"](x)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def test_optimizer_container_is_saved_through_its_state_dict(tmp_path: Path) -> None:
    """An Optimizer subclass with empty own state (wrapping one optimizer per model part) saves its
    inner optimizers' state under the native keys and loads it back exactly, lr and weight decay included."""
    parts = _parts(0)
    optim = Container(parts, lr=0.01, weight_decay=0.1)
    for _ in range(2):
        _container_step(parts, optim)
    tierckpt.save(str(tmp_path / "c"), {"model0": parts[0], "model1": parts[1], "optim": optim})
    assert {"optim.state.embed.weight.exp_avg", "optim.state.head.bias.exp_avg_sq", "optim.param_groups.head.weight.lr"} <= _keys(str(tmp_path / "c"))
    fresh = _parts(1)
    fresh_optim = Container(fresh, lr=0.5, weight_decay=0.0)
    tierckpt.load(str(tmp_path / "c"), {"model0": fresh[0], "model1": fresh[1], "optim": fresh_optim})
    for a, b in zip(optim.optimizers, fresh_optim.optimizers):
        assert_same(a.state_dict(), b.state_dict())
    assert [g["lr"] for o in fresh_optim.optimizers for g in o.param_groups] == [0.01, 0.01]
    assert [g["weight_decay"] for o in fresh_optim.optimizers for g in o.param_groups] == [0.1, 0.1]


def test_container_without_state_to_load_into_is_refused(tmp_path: Path) -> None:
    parts = _parts(0)
    optim = LazyContainer(parts, lr=0.01, weight_decay=0.1)
    _container_step(parts, optim)
    tierckpt.save(str(tmp_path / "c"), {"optim": optim})
    assert "optim.state.embed.weight.exp_avg" in _keys(str(tmp_path / "c"))
    fresh = _parts(1)
    with pytest.raises(tierckpt.StateMismatchError, match=r"'optim' \(LazyContainer\) keeps its state outside its own `state`"):
        tierckpt.load(str(tmp_path / "c"), {"optim": LazyContainer(fresh, lr=0.5, weight_decay=0.0)})


# -- 3. the template-free load ------------------------------------------------------------------------------
def test_read_state_gives_the_nested_state_as_saved(tmp_path: Path) -> None:
    model, optim, sched = _trained_with_scheduler()
    state = {
        "model": model, "optim": optim, "sched": sched, "step": 7,
        "loops": {"fit": {"epoch": 3, "done": [1, 2]}, "names.with.dots": "x"},
        "state_dict": {"layer.0.weight": torch.arange(6.0).reshape(2, 3), "layer.0.bias": torch.ones(2)},
    }
    tierckpt.save(str(tmp_path / "c"), state)
    got = tierckpt.load(str(tmp_path / "c"))
    msd, osd = get_state_dict(model, optim, options=FLAT)
    assert_same({
        "model": msd, "optim": osd, "sched": sched.state_dict(), "step": 7,
        "loops": {"fit": {"epoch": 3, "done": [1, 2]}, "names.with.dots": "x"},
        "state_dict": {"layer.0.weight": torch.arange(6.0).reshape(2, 3), "layer.0.bias": torch.ones(2)},
    }, got)
    assert_same(got, tierckpt.read_state(str(tmp_path / "c")))


def test_read_state_of_a_state_without_recorded_structure_is_flat(tmp_path: Path) -> None:
    """A torch DCP directory records no nesting: its keys come back flat."""
    import torch.distributed.checkpoint as dcp
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": {"b": torch.ones(2)}, "step": 3}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert_same({"a.b": torch.ones(2), "step": 3}, tierckpt.read_state(str(tmp_path / "dcp")))


@pytest.mark.fast
def test_read_state_nests_plain_dicts_without_dotted_names(tmp_path: Path) -> None:
    """A state of plain nested dicts (no module, no dotted name: the recorded structure is empty) comes back
    nested as it was saved, by read_state and by a template-free load."""
    saved = {"model": {"w": torch.ones(2)}, "cfg": {"lr": 0.1, "name": "x"}, "step": 3}
    tierckpt.save(str(tmp_path / "c"), saved)
    for got in (tierckpt.read_state(str(tmp_path / "c")), tierckpt.load(str(tmp_path / "c"))):
        assert sorted(got) == ["cfg", "model", "step"] and got["cfg"] == {"lr": 0.1, "name": "x"}, got
        assert list(got["model"]) == ["w"] and torch.equal(got["model"]["w"], torch.ones(2)) and got["step"] == 3


@pytest.mark.fast
def test_read_state_of_a_header_saved_before_the_structure_is_flat(tmp_path: Path) -> None:
    """A header without the ``structure`` field (saved before it was recorded) comes back flat."""
    import json

    from tamper import reseal
    from tierckpt.native import layout

    uri = str(tmp_path / "c")
    tierckpt.save(uri, {"cfg": {"lr": 0.1}, "w": torch.ones(2)})
    header = Path(uri) / layout.header_key(read_checkpoint(open_backend(uri)).meta.generation)
    doc = json.loads(header.read_text())
    assert doc.pop("structure") == {}
    header.write_text(json.dumps(doc))
    reseal(header.parents[2])
    got = tierckpt.read_state(uri)
    assert sorted(got) == ["cfg.lr", "w"] and got["cfg.lr"] == 0.1 and torch.equal(got["w"], torch.ones(2)), got


def save_nested_on_2(root: str) -> bool:
    """FSDP2 model + optimizer, DTensor shards, shared and per-rank objects, saved on 2 ranks; the
    full expected state written by rank 0."""
    mesh = make_mesh((2,))
    group = subgroup(2)
    if group is not None:
        model, optim = build(0, mesh=mesh)
        train(model, optim, 2, dist.get_rank())
        msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True))
        shards = scenarios._layout_state((2,), "S0", fill=True)
        tierckpt.save(f"{root}/c", {
            "model": model, "optim": optim, "tensors": {"sharded": shards},
            "meta": {"step": 11, "rank": dist.get_rank(), "cfg.name": "tiny"},
        }, group=group)
        if dist.get_rank() == 0:
            full_shards = {n: scenarios.reference(n, s, d) for n, (s, d) in scenarios.SPECS.items()}
            torch.save({"model": msd, "optim": osd, "tensors": {"sharded": full_shards},
                        "meta": {"step": 11, "rank": 0, "cfg.name": "tiny"}}, f"{root}/expected.pt")
    else:
        scenarios._layout_state((2,), "S0", fill=True)  # the mesh is made by every rank
    dist.barrier()
    return True


@pytest.mark.multiproc
def test_state_saved_on_2_ranks_reads_whole_in_one_process(dist_pool, tmp_path: Path) -> None:
    assert all(dist_pool.run(save_nested_on_2, str(tmp_path)))
    got = tierckpt.read_state(str(tmp_path / "c"))
    assert_same(torch.load(tmp_path / "expected.pt", weights_only=True), got)


# -- 5. other trainers' step names --------------------------------------------------------------------------
HF_NAMES = ["checkpoint-100", "checkpoint-200", "checkpoint-300"]
LIGHTNING_NAMES = ["epoch=0-step=100.ckpt", "epoch=1-step=200-v1.ckpt", "epoch=2-step=300.ckpt"]


@pytest.mark.parametrize("names", [HF_NAMES, LIGHTNING_NAMES], ids=["huggingface", "lightning"])
def test_other_trainers_step_names_are_steps_to_ls_gc_and_the_manager(tmp_path: Path, names: list[str], capsys) -> None:
    import json

    from tierckpt.cli import main as cli

    for i, name in enumerate(names):
        tierckpt.save(str(tmp_path / name), {"x": torch.full((2,), float(i))})
    manager = tierckpt.CheckpointManager(str(tmp_path))
    assert manager.steps() == [100, 200, 300] and manager.latest() == 300
    state = {"x": torch.zeros(2)}
    assert manager.load_latest(state) == 300 and torch.equal(state["x"], torch.full((2,), 2.0))
    assert cli.main(["ls", str(tmp_path), "--json"]) == cli.EXIT_OK
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(r["path"], r["step"], r["latest"]) for r in rows] == [(n, s, s == 300) for n, s in zip(names, [100, 200, 300])]
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == cli.EXIT_OK
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir() if (p / "COMMIT").exists()) == [names[-1]]


def test_names_that_are_not_steps() -> None:
    from tierckpt.native.layout import step_of

    assert [step_of(n) for n in ("last.ckpt", "checkpoint-", "mystep=4", "epoch=1-step=x.ckpt", "ckpt100", "step-1a")] == [None] * 6
    assert [step_of(n) for n in ("run/checkpoint-7", "epoch=3-step=42-val_loss=0.12.ckpt", "step=9")] == [7, 42, 9]


def test_malformed_structure_in_the_header_is_corruption(tmp_path: Path) -> None:
    import json

    from tamper import reseal
    from tierckpt.native import layout

    uri = str(tmp_path / "c")
    tierckpt.save(uri, {"model": torch.nn.Linear(2, 2)})
    header = Path(uri) / layout.header_key(read_checkpoint(open_backend(uri)).meta.generation)
    doc = json.loads(header.read_text())
    assert doc["structure"] == {"model": []}
    doc["structure"] = {"model": 5}
    header.write_text(json.dumps(doc))
    reseal(header.parents[2])
    with pytest.raises(tierckpt.CorruptCheckpointError, match="field 'structure' is malformed"):
        tierckpt.read_state(uri)
