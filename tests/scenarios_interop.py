"""Moving training checkpoints (model and optimizer) between tierckpt and torch DCP.

Shared by tests/test_interop_dcp_naming.py (one process) and run on every rank of the worker pool
for the FSDP2 round trips. Every comparison is bit-exact and includes the optimizer's param group
settings (lr, betas, weight decay...), which the fresh targets are built with different values of.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import tierckpt
from distributed import subgroup
from scenarios import assert_same, make_mesh, train
from tierckpt.demo.model import TinyTransformer


def build(seed: int, *, fresh: bool = False, mesh: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A TinyTransformer (tied head) with AdamW in two param groups; FSDP2 on ``mesh`` when given.

    ``fresh`` builds the optimizer with other settings, so a load that does not restore them shows.
    """
    torch.manual_seed(seed)
    model = TinyTransformer()
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    scale = 7.0 if fresh else 1.0
    optim = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1 * scale}, {"params": vectors, "weight_decay": 0.0, "lr": 3e-3 * scale}],
        lr=1e-2 * scale, betas=(0.5, 0.6) if fresh else (0.8, 0.95),
    )
    return model, optim


def full(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state (param groups included) as full tensors, by torch's own utilities."""
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd}


def flat_options(flatten: bool = True) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=flatten)


def tierckpt_cli(*args: str) -> None:
    """Run the ``tierckpt`` command in its own process, as a user converts (one process, no group)."""
    subprocess.run([sys.executable, "-m", "tierckpt", *args], check=True, capture_output=True)


def fsdp2_native_to_dcp(root: str) -> bool:
    """FSDP2 x2: native tierckpt save -> ``convert --to dcp --flatten-optimizer`` -> ``dcp.load`` + ``set_state_dict``
    (flattened) under FSDP2 x2. The default (indexed) output: tests/test_dcp_optimizer_conventions.py."""
    mesh = make_mesh((2,))
    group = subgroup(2)
    if group is not None:
        model, optim = build(0, mesh=mesh)
        train(model, optim, 2, dist.get_rank())
        expected = full(model, optim)
        tierckpt.save(f"{root}/ckpt", {"model": model, "optim": optim}, group=group)
        if dist.get_rank() == 0:
            tierckpt_cli("convert", f"{root}/ckpt", f"{root}/dcp", "--to", "dcp", "--flatten-optimizer")
        dist.barrier(group)
        model, optim = build(1, fresh=True, mesh=mesh)
        msd, osd = get_state_dict(model, optim, options=flat_options())
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp", process_group=group)
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=flat_options())
        assert_same(expected, full(model, optim))
    dist.barrier()
    return True


def fsdp2_dcp_to_native(root: str, flatten: bool) -> bool:
    """FSDP2 x2: ``dcp.save`` of ``get_state_dict`` dicts -> ``convert --from dcp`` -> ``tierckpt.load``
    under FSDP2 x2 into a module and optimizer, and into ``get_state_dict`` dicts, strict."""
    mesh = make_mesh((2,))
    group = subgroup(2)
    if group is not None:
        model, optim = build(0, mesh=mesh)
        train(model, optim, 2, dist.get_rank())
        expected = full(model, optim)
        msd, osd = get_state_dict(model, optim, options=flat_options(flatten))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp", process_group=group)
        if dist.get_rank() == 0:
            tierckpt_cli("convert", f"{root}/dcp", f"{root}/ckpt", "--from", "dcp", "--to", "tierckpt")
        dist.barrier(group)
        model, optim = build(1, fresh=True, mesh=mesh)
        tierckpt.load(f"{root}/ckpt", {"model": model, "optim": optim}, group=group)
        assert_same(expected, full(model, optim))
        for flat in (True, False):
            model, optim = build(2, fresh=True, mesh=mesh)
            msd, osd = get_state_dict(model, optim, options=flat_options(flat))
            tierckpt.load(f"{root}/ckpt", {"model": msd, "optim": osd}, group=group)
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=flat_options(flat))
            assert_same(expected, full(model, optim))
    dist.barrier()
    return True


def convert_inside_a_group(root: str) -> str:
    """Calling a DCP conversion on one rank of a process group fails at once, naming the command."""
    from tierckpt.convert import api as convert

    if dist.get_rank() == 0:
        try:
            convert.to_dcp(f"{root}/none", f"{root}/dcp")
        except tierckpt.CheckpointError as exc:
            return str(exc)
        raise AssertionError("to_dcp ran inside a process group")
    return ""
