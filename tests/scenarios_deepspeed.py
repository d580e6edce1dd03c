"""The model of the DeepSpeed fixtures (tests/fixtures/deepspeed/generate.py) and what a load must give.

Used by tests/test_deepspeed_format.py in one process and, for FSDP2 on 3 gloo ranks, in the worker pool.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

import tierckpt
from distributed import subgroup
from scenarios import make_mesh

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"


class Tiny(torch.nn.Module):
    """The generator's model: 174 parameters in two param groups (weights, biases) and a buffer; with
    ``frozen``, the generator's TinyFrozen: a frozen 7x7 ``mix`` too (in no param group)."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(7, 13)
        self.fc2 = torch.nn.Linear(13, 5)
        self.register_buffer("scale", torch.zeros(5))
        if frozen:
            self.mix = torch.nn.Parameter(torch.randn(7, 7), requires_grad=False)


def build(mesh: Any = None, *, frozen: bool = False) -> tuple[Tiny, torch.optim.Optimizer]:
    """A fresh model (other values than the fixtures') and AdamW with other settings than the fixtures';
    FSDP2 on ``mesh`` when given; the model with a frozen parameter with ``frozen``."""
    torch.manual_seed(123)
    model = Tiny(frozen)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(
        [{"params": [model.fc1.weight, model.fc2.weight]}, {"params": [model.fc1.bias, model.fc2.bias]}],
        lr=0.5, betas=(0.1, 0.2), eps=1e-3, weight_decay=0.7,
    )
    return model, optim


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def observed(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything the reference holds, read back from ``model`` and ``optim`` under the reference's names."""
    out: dict[str, Any] = {f"model.{k}": _full(v).detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optim.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            for k, v in optim.state[p].items():
                out[f"optim.state.{name}.{k}"] = _full(v).detach().clone()
            out.update({f"optim.param_groups.{name}.{k}": v for k, v in group.items() if k != "params"})
    return out


def reference(fixture: int | str) -> dict[str, Any]:
    """What DeepSpeed's own consolidation gives for the ZeRO-``stage`` fixture, or the fixture named (see generate.py)."""
    name = f"zero{fixture}" if isinstance(fixture, int) else fixture
    return torch.load(FIXTURES / f"{name}_reference.pt", weights_only=True)


def mismatches(expected: dict[str, Any], got: dict[str, Any], *, cast: bool = False) -> list[str]:
    """Keys whose values differ (tensors bitwise, with dtype and shape; settings by type and value).
    ``cast``: each expected tensor is first cast to the dtype of the one got (a load into an fp32 model
    of fp16 frozen weights), an expected number made the float32 tensor torch's Adam makes of an int step."""
    bad = [k for k in expected if k not in got]
    for key, want in expected.items():
        have = got.get(key)
        if cast and isinstance(have, torch.Tensor) and type(want) in (int, float):
            want = torch.tensor(float(want), dtype=torch.float32)
        if cast and isinstance(have, torch.Tensor) and isinstance(want, torch.Tensor):
            want = want.to(have.dtype)
        if isinstance(want, torch.Tensor):
            if not (isinstance(have, torch.Tensor) and have.dtype == want.dtype and have.shape == want.shape
                    and torch.equal(_bits(have), _bits(want))):
                bad.append(key)
        elif key in got and (type(have) is not type(want) or have != want):
            bad.append(key)
    return bad + [k for k in got if k not in expected]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, as integers of its element size (so -0.0 differs from 0.0 and NaNs compare)."""
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def fsdp2_loads(folder: str, stage: int) -> bool:
    """3 ranks load a DeepSpeed folder saved by 2 into FSDP2 + AdamW and match the reference exactly."""
    mesh = make_mesh((3,))
    group = subgroup(3)
    if group is None:
        return True
    model, optim = build(mesh)
    tierckpt.load(folder, {"model": model, "optim": optim}, group=group)
    bad = mismatches(reference(stage), observed(model, optim))
    assert not bad, f"rank {torch.distributed.get_rank()}: {bad}"
    assert hasattr(model.fc1.weight, "full_tensor")  # it really is sharded
    return True


def ddp_loads(folder: str, stage: int) -> bool:
    """3 ranks load a DeepSpeed folder saved by 2 into a DDP-wrapped module + AdamW, each rank a full replica."""
    group = subgroup(3)
    if group is None:
        return True
    model, optim = build()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    tierckpt.load(folder, {"model": ddp, "optim": optim}, group=group)
    bad = mismatches(reference(stage), observed(model, optim))
    assert not bad, f"rank {torch.distributed.get_rank()}: {bad}"
    return True


def fsdp2_resumes_offload(folder: str, fixture: str) -> bool:
    """3 ranks load a 2-rank CPU-offload folder (CPU Adam's int step, a frozen parameter) into FSDP2 + AdamW
    with ``strict=False`` (AdamW's settings CPU Adam has not stay its own) and match every key both have."""
    mesh = make_mesh((3,))
    group = subgroup(3)
    if group is None:
        return True
    model, optim = build(mesh, frozen=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tierckpt.load(folder, {"model": model, "optim": optim}, group=group, strict=False)
    expected, got = reference(fixture), observed(model, optim)
    common = expected.keys() & got.keys()
    assert len(common) == 6 + 4 * (3 + 5), sorted(common)  # 6 model tensors; 3 states and 5 settings of 4 parameters
    bad = mismatches({k: expected[k] for k in common}, {k: got[k] for k in common}, cast=True)
    assert not bad, f"rank {torch.distributed.get_rank()}: {bad}"
    assert hasattr(model.mix, "full_tensor")  # the frozen parameter is sharded too
    return True
