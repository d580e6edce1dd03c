"""Hugging Face Accelerate checkpoints through tierckpt: :func:`save_state` and :func:`load_state`.

They stand in for ``Accelerator.save_state`` / ``Accelerator.load_state``::

    from tierckpt.integrations.accelerate import load_state, save_state
    save_state(accelerator, "s3://bucket/run/step-200")   # was accelerator.save_state(dir)
    load_state(accelerator, "s3://bucket/run/step-200")   # was accelerator.load_state(dir)

Each is one collective :func:`tierckpt.save` / :func:`tierckpt.load` (every process calls it, as with
accelerate) of what ``Accelerator.save_state`` saves for the objects the accelerator prepared:

================  ==============================================================================
key               what
================  ==============================================================================
``model_<i>``     the i-th prepared model, unwrapped (``module.`` and compile wrappers removed)
``optimizer_<i>`` the i-th optimizer (unwrapped from ``AcceleratedOptimizer``), its state named by
                  its parameters' names in the model that holds them (the models are in the same save)
``scheduler_<i>`` the i-th LR scheduler's ``state_dict``
``dataloader_<i>`` the i-th prepared dataloader's epoch counter (``iteration``) and its sampler's
                  seed and epoch (``SeedableRandomSampler``) or generator state
``scaler``        the AMP gradient scaler, when there is one
``rng``           every rank's random generators (:class:`tierckpt.RNGState`)
``step``          ``accelerator.step`` (the gradient accumulation step counter)
``custom_<i>``    the i-th object registered with ``accelerator.register_for_checkpointing``
``extra.<name>``  the keyword arguments of :func:`save_state` (epoch, global step...)
================  ==============================================================================

:func:`load_state` checks that the checkpoint holds as many models, optimizers, schedulers,
dataloaders and registered objects as the accelerator has prepared (as accelerate checks registered
objects) and restores them all in place; it returns the ``extra`` values asked for by name.

The position inside an epoch is not part of a prepared dataloader's state (as with accelerate): resume
mid-epoch with ``accelerator.skip_first_batches(dataloader, batches_done)``; with shuffling, the order is
the same only with ``DataLoaderConfiguration(use_seedable_sampler=True)``. Refused, with the reason:
DeepSpeed and Megatron-LM (their engines save their own checkpoints), torchdata's stateful dataloaders
(``use_stateful_dataloader``), and ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``
hooks (they expect a local folder of accelerate's files).

This module imports ``accelerate`` (``pip install accelerate``); ``import tierckpt`` does not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

try:
    from accelerate import Accelerator
    from accelerate.data_loader import SeedableRandomSampler, get_sampler
    from accelerate.utils import DistributedType
except ImportError as exc:
    raise ImportError(f"tierckpt.integrations.accelerate needs accelerate ({exc}): pip install accelerate") from exc

from tierckpt.errors import CheckpointError
from tierckpt.loading.api import load
from tierckpt.formats.select import read_checkpoint
from tierckpt.saving.api import save
from tierckpt.store import open_store
from tierckpt.state.training import RNGState

__all__ = ["DataLoaderState", "load_state", "save_state"]

SAVED_BY = "tierckpt.integrations.accelerate"
_COUNTED = re.compile(r"^(model|optimizer|scheduler|dataloader|custom)_(\d+)$")
"""The top-level keys holding one prepared (or registered) object each, by kind and index (top-level: tierckpt
names an optimizer's state by the parameters of the modules at the top of the same state)."""


class DataLoaderState:
    """What a prepared dataloader carries from one epoch to the next: its epoch counter (``iteration``,
    which accelerate passes to the sampler's ``set_epoch``) and its sampler's seed and epoch
    (``SeedableRandomSampler``) or random generator state (the shuffling ``RandomSampler`` of a
    multi-process run). Equal on every rank, so saved once."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader

    def _sampler(self) -> Any:
        return get_sampler(self.dataloader)

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"iteration": int(getattr(self.dataloader, "iteration", 0))}
        sampler = self._sampler()
        if isinstance(sampler, SeedableRandomSampler):
            sd["sampler"] = {"initial_seed": int(sampler.initial_seed), "epoch": int(sampler.epoch)}
        generator = getattr(sampler, "generator", None)
        if isinstance(generator, torch.Generator):
            sd["generator"] = generator.get_state()
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if hasattr(self.dataloader, "iteration"):
            self.dataloader.iteration = int(sd["iteration"])
        sampler = self._sampler()
        if "sampler" in sd and isinstance(sampler, SeedableRandomSampler):
            sampler.initial_seed = int(sd["sampler"]["initial_seed"])
            sampler.set_epoch(int(sd["sampler"]["epoch"]))
        generator = getattr(sampler, "generator", None)
        if "generator" in sd and isinstance(generator, torch.Generator):
            generator.set_state(sd["generator"])


def _plain_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (which holds no state of its own)."""
    inner = getattr(optimizer, "optimizer", None)
    return _plain_optimizer(inner) if isinstance(inner, torch.optim.Optimizer) else optimizer


def _model(accelerator: Accelerator, model: nn.Module) -> nn.Module:
    """The module whose parameters are saved: unwrapped from DDP and ``torch.compile`` (so the names do not
    depend on them); an FSDP model as prepared, since unwrapping FSDP1 leaves its inner wrappers and flat
    parameters, which tierckpt names through the root wrapper."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return model
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def _check_supported(accelerator: Accelerator, action: str) -> None:
    """Refuse what this module cannot save or load the way accelerate does (module docstring)."""
    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise CheckpointError(
            f"tierckpt {action}: {kind.value} saves and loads its own engine checkpoints; use "
            f"accelerator.save_state / accelerator.load_state with {kind.value}"
        )
    hooks = accelerator._save_model_state_pre_hook if action == "save_state" else accelerator._load_model_state_pre_hook
    if hooks:
        raise CheckpointError(
            f"tierckpt {action}: the accelerator has {len(hooks)} register_{action}_pre_hook hook(s), which expect "
            "a local folder of accelerate's files and are not called here; remove them (handle.remove()) and pass "
            f"what they save as keyword arguments of save_state, or use accelerator.{action}"
        )
    for i, dataloader in enumerate(accelerator._dataloaders):
        if getattr(dataloader, "use_stateful_dataloader", False):
            raise CheckpointError(
                f"tierckpt {action}: prepared dataloader {i} is a torchdata StatefulDataLoader "
                "(use_stateful_dataloader=True), whose per-rank position is not saved here; use "
                "accelerator.save_state / load_state, or a plain DataLoader with accelerator.skip_first_batches"
            )


def _state(accelerator: Accelerator) -> dict[str, Any]:
    """The tierckpt state of everything the accelerator prepared (module docstring), without ``extra``."""
    models = [_model(accelerator, m) for m in accelerator._models]
    sections = {
        "model": models,
        "optimizer": [_plain_optimizer(o) for o in accelerator._optimizers],
        "scheduler": [getattr(s, "scheduler", s) for s in accelerator._schedulers],
        "dataloader": [DataLoaderState(d) for d in accelerator._dataloaders],
        "custom": list(accelerator._custom_objects),
    }
    state: dict[str, Any] = {f"{kind}_{i}": v for kind, values in sections.items() for i, v in enumerate(values)}
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    state["rng"] = RNGState()
    state["step"] = int(accelerator.step)
    return state


def save_state(accelerator: Accelerator, uri: str, *, storage_options: Mapping[str, Any] | None = None,
               **extra: Any) -> None:
    """Save what ``accelerator.save_state`` saves (module docstring) to ``uri`` (a local directory,
    ``s3://``...) with one collective :func:`tierckpt.save`; every process calls it. ``extra`` values
    (numbers, strings, lists, dicts, tensors, objects with ``state_dict``) are saved under ``extra``."""
    _check_supported(accelerator, "save_state")
    state = _state(accelerator)
    if extra:
        state["extra"] = dict(extra)
    save(uri, state, storage_options=storage_options, tags={"saved_by": SAVED_BY})
    accelerator.project_configuration.iteration += 1  # as accelerator.save_state counts its saves


def _saved_keys(uri: str, storage_options: Mapping[str, Any] | None) -> set[str]:
    """The top-level keys of the checkpoint at ``uri``."""
    ckpt = read_checkpoint(open_store(uri, dict(storage_options or {})))
    return {k.split(".", 1)[0] for k in [*ckpt.tensors, *(o.key for o in ckpt.meta.objects)]}


def load_state(accelerator: Accelerator, uri: str, *, storage_options: Mapping[str, Any] | None = None,
               **extra: Any) -> dict[str, Any]:
    """Restore in place what :func:`save_state` saved at ``uri`` into the accelerator's prepared objects,
    its RNG and its step counter, with one collective :func:`tierckpt.load`; every process calls it.
    ``extra``: the saved keyword arguments to read, each given a template (a value of the same kind,
    or an object with ``load_state_dict``, filled in place); returns them by name."""
    _check_supported(accelerator, "load_state")
    state = _state(accelerator)
    top = _saved_keys(uri, storage_options)
    saved = {k for k in top if _COUNTED.match(k)}
    if "rng" not in top or "step" not in top:
        raise CheckpointError(
            f"{uri!r} was not saved by tierckpt.integrations.accelerate.save_state (it holds no 'rng'/'step'); "
            "load it with tierckpt.load(uri, {...})"
        )
    live = {k for k in state if _COUNTED.match(k)}
    if saved != live:
        raise CheckpointError(
            f"{uri!r} holds {sorted(saved)} but this accelerator has {sorted(live)} (prepared models, optimizers, "
            "schedulers, dataloaders and register_for_checkpointing objects): prepare and register the same "
            "objects, in the same order, as the run that saved it"
        )
    if accelerator.scaler is not None and "scaler" not in top:
        raise CheckpointError(f"{uri!r} holds no gradient scaler but this accelerator has one (mixed precision "
                              "differs from the run that saved it)")
    if extra:
        state["extra"] = dict(extra)
    load(uri, state, storage_options=storage_options)
    accelerator.step = int(state["step"])
    return dict(state.get("extra", {}))
