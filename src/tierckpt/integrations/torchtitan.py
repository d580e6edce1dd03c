"""torchtitan checkpoints through tierckpt: :class:`TierckptCheckpointManager`, a ``BaseCheckpointManager``.

Switch a torchtitan ``Trainer`` over in its config::

    from tierckpt.integrations.torchtitan import TierckptCheckpointManager
    config = Trainer.Config(..., checkpoint=TierckptCheckpointManager.Config(enable=True, interval=500))

Each save is one collective :func:`tierckpt.save` to ``<dump_folder>/<folder>/step-<N>`` (``folder`` may
be any tierckpt URI: ``s3://bucket/run``...) through a :class:`tierckpt.CheckpointManager`, of

================  ==========================================================================================
key               what
================  ==========================================================================================
``model``         every model part's state dict, by canonical fqn (FSDP2/TP DTensors stay shards)
``optimizer``     ``OptimizersContainer.state_dict()``: torchtitan's flattened, fqn-keyed optimizer state
``lr_scheduler``  ``LRSchedulersContainer.state_dict()``
``dataloader``    the dataloader's state dict (per data-parallel rank)
``train_state``   and any other entry of torchtitan's ``states`` (the trainer's step and tokens seen)
================  ==========================================================================================

A load fills them in place, resharded onto this run's layout (2 -> 3 ranks, another mesh); the
dataloader's state only loads at the data-parallel degree it was saved with (else the load is refused
by name: put ``"dataloader"`` in ``exclude_from_loading``). Step 0 (a seed checkpoint) loads the model
alone, as torchtitan's own manager does; ``initial_load_path`` names a tierckpt checkpoint to start
from when ``folder`` holds none. The policies of ``BaseCheckpointManager.Config`` apply (``interval``,
``keep_latest_k``, ``last_save_model_only`` with ``export_dtype``, ``load_only``,
``enable_first_step_checkpoint``, ``load_step``); Hugging Face safetensors in and out
(``initial_load_in_hf``, ``last_save_in_hf``) are refused when the manager is built.

This module imports ``torchtitan`` (``pip install 'tierckpt[torchtitan]'``); ``import tierckpt`` does not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

try:
    from torchtitan.components.checkpointer import (
        DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER, BaseCheckpointManager, ModelWrapper,
    )
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem
except ImportError as exc:
    raise ImportError(
        f"tierckpt.integrations.torchtitan needs torchtitan ({exc}): pip install 'tierckpt[torchtitan]' "
        "(or pip install 'torchtitan>=0.3')"
    ) from exc

from tierckpt.errors import CheckpointError, CheckpointNotFoundError
from tierckpt.loading.api import load
from tierckpt.manager.api import CheckpointManager

__all__ = ["TierckptCheckpointManager"]

log = logging.getLogger("tierckpt")


class TierckptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, saving and loading through tierckpt (see the module doc).

    Built by torchtitan from :class:`TierckptCheckpointManager.Config` with the trainer's runtime objects.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """``BaseCheckpointManager.Config``'s policies; ``folder`` may be any tierckpt URI."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.enable and (self.initial_load_in_hf or self.last_save_in_hf):
                raise CheckpointError(
                    "TierckptCheckpointManager does not read or write Hugging Face safetensors from torchtitan "
                    "(initial_load_in_hf / last_save_in_hf); turn them off, and convert a saved step with "
                    "`tierckpt convert --to safetensors` (or use torchtitan's CheckpointManager for HF I/O)"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.model = ModelWrapper(model_parts)
        self.states: dict[str, Any] = dict(states)
        self.states.update({OPTIMIZER: optimizers, LR_SCHEDULER: lr_schedulers})
        if dataloader is not None:
            self.states[DATALOADER] = _DataloaderState(dataloader)
        known = {*self.states, DATALOADER}
        unknown = [key for key in config.exclude_from_loading if key not in known]
        if unknown:
            raise CheckpointError(
                f"checkpoint.exclude_from_loading names {unknown}, which this trainer does not checkpoint; "
                f"the keys it does: {sorted(known)}"
            )
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.manager = CheckpointManager(self.folder, keep_last=config.keep_latest_k or None)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save ``curr_step`` when it is due (every ``interval`` steps, step 1 with
        ``enable_first_step_checkpoint``, the last step); the last one holds the model alone, in
        ``export_dtype``, with ``last_save_model_only``."""
        due = last_step or curr_step % self.config.interval == 0 or (
            curr_step == 1 and self.config.enable_first_step_checkpoint
        )
        if self.config.load_only or not due:
            return False
        if last_step and self.config.last_save_model_only:
            model = {k: _exported(v, self.export_dtype) for k, v in self.model.state_dict().items()}
            state: dict[str, Any] = {MODEL: model}
        else:
            state = {MODEL: self.model.state_dict(), **self.states}
        return self.manager.save(curr_step, state, force=True)

    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (``-1``: the newest committed one) into the live objects, resharded; with no
        step under ``folder``, ``initial_load_path`` when set. Returns whether anything was loaded."""
        steps = self.manager.steps()
        if step != -1 and step not in steps:
            raise CheckpointNotFoundError(
                f"checkpoint.load_step={step}: no committed step {step} under {self.folder!r} (found {steps}); "
                "pass a step that is there, or -1 for the newest"
            )
        if steps:
            found = steps[-1] if step == -1 else step
            uri, model_only = self.manager.saved_uri_of(found), found == 0
        elif self.config.initial_load_path:
            uri, model_only = self.config.initial_load_path, self.config.initial_load_model_only
        else:
            log.info("%s: no checkpoint to load; a fresh start", self.folder)
            return False
        model_sd = self.model.state_dict()
        state: dict[str, Any] = {MODEL: model_sd}
        if not model_only:
            state.update({k: v for k, v in self.states.items() if k not in self.config.exclude_from_loading})
        load(uri, state, allow_pickle=False)
        self.model.load_state_dict(model_sd)
        log.info("loaded %s (%s)", uri, ", ".join(state))
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Saves are synchronous: nothing is staged in the background."""

    def _wait_for_saving(self) -> None:
        """Saves are synchronous: ``save_future`` is never set."""
        self.save_future = None

    def _close(self) -> None:
        self.manager.wait()


class _DataloaderState:
    """The dataloader's state, refused by name on load at another data-parallel degree (torchtitan's
    dataloader keys its state by data-parallel rank and cannot reshard it)."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader

    def state_dict(self) -> dict[str, Any]:
        return self.dataloader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, now = state_dict.get("world_size"), getattr(self.dataloader, "dp_world_size", None)
        if saved is not None and now is not None and saved != now:
            raise CheckpointError(
                f"the checkpoint's dataloader state was saved by {saved} data-parallel ranks and this run has "
                f"{now}; torchtitan's dataloader cannot be resharded: add 'dataloader' to "
                "checkpoint.exclude_from_loading to resume the rest"
            )
        self.dataloader.load_state_dict(state_dict)


def _exported(value: Any, dtype: torch.dtype) -> Any:
    """A floating-point tensor in ``dtype`` (the last, model-only save's ``export_dtype``)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value
