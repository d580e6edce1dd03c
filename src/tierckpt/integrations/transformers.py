"""Hugging Face ``transformers.Trainer`` checkpoints through tierckpt.

:class:`TierckptTrainer` is a drop-in ``Trainer`` whose checkpoints are tierckpt checkpoints:
each save writes ``<checkpoint_uri>/checkpoint-<global step>`` (``checkpoint_uri`` defaults to
``args.output_dir``; any tierckpt URI: a local directory, ``s3://``...) with one collective
:func:`tierckpt.save` of

=================  ===========================================================================
key                what
=================  ===========================================================================
``model``          the model's parameters and persistent buffers (sharded as trained)
``optimizer``      the optimizer, under its parameters' names (unwrapped from accelerate's wrapper)
``lr_scheduler``   the scheduler's ``state_dict``
``rng``            every rank's random generators (:class:`tierckpt.RNGState`)
``scaler``         the AMP gradient scaler, when there is one
``trainer_state``  ``TrainerState`` as the JSON ``trainer_state.json`` would hold (global step, logs,
                   stateful callbacks)
``hf_config``      ``model.config`` as JSON, so ``tierckpt convert --to safetensors`` writes config.json
=================  ===========================================================================

(``args.save_only_model``: model, trainer state and config only.) ``train(resume_from_checkpoint=True)``
resumes from the committed ``checkpoint-N`` with the highest N under ``checkpoint_uri``; a URI resumes
from that checkpoint; a local folder with ``trainer_state.json`` (a checkpoint the plain ``Trainer``
wrote) resumes as ``Trainer`` does. The resume restores exactly what the plain ``Trainer`` restores,
at the same points of training (model before the model is wrapped, optimizer and scheduler once they
exist, RNG when the data order needs it), so a resumed run ends bit-exact equal to an uninterrupted one.

``transformers`` calls these steps through private ``Trainer`` methods (``_save_checkpoint``,
``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``);
this module overrides them for the 5.x series it is tested with. ``save_total_limit`` deletes the
oldest ``checkpoint-N`` beyond the limit, counting the plain ``Trainer``'s checkpoint folders that a run
switched to ``TierckptTrainer`` mid-way left in its output directory with its own (as ``Trainer`` counts them),
the newest and ``state.best_model_checkpoint`` kept. Not supported (refused when the trainer is built):
``load_best_model_at_end`` (transformers reads the best checkpoint's files itself), DeepSpeed
(it saves and loads its engine itself).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any

import torch

try:
    from transformers import Trainer
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:
    raise ImportError(
        f'tierckpt.integrations.transformers needs transformers 5.x and accelerate ({exc}): pip install "tierckpt[transformers]"'
    ) from exc

from tierckpt.native import layout
from tierckpt.call_args import uri_text
from tierckpt.errors import CheckpointError, CheckpointNotFoundError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.loading.api import load, read_checkpoint
from tierckpt.saving.api import save
from tierckpt.store import open_store
from tierckpt.state.training import RNGState

__all__ = ["TierckptTrainer", "checkpoint_steps", "latest_checkpoint", "plain_checkpoints"]

log = logging.getLogger("tierckpt")

TRAINER_STATE_KEY = "trainer_state"
_CHECKPOINT_NAME = re.compile(rf"^{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)$")


def checkpoint_steps(root_uri: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> dict[int, str]:
    """Global step -> URI of each committed ``checkpoint-<step>`` directly under ``root_uri``."""
    root = uri_text("checkpoint_steps", root_uri).rstrip("/")
    listed = get_scheduler().run(open_store(root, dict(storage_options or {})).list(""))
    found = {}
    for name in layout.committed_children(listed):
        match = _CHECKPOINT_NAME.match(name)
        if match:
            found[int(match[1])] = f"{root}/{name}"
    return dict(sorted(found.items()))


def plain_checkpoints(run_dir: str) -> dict[int, str]:
    """Global step -> path of each checkpoint folder the plain ``Trainer`` wrote in the local directory
    ``run_dir``: ``checkpoint-<step>`` holding its ``trainer_state.json`` and no tierckpt ``COMMIT`` (nothing
    else is taken for one, so rotation never deletes a folder it does not know)."""
    if "://" in run_dir or not os.path.isdir(run_dir):
        return {}
    found = {}
    for name in os.listdir(run_dir):
        match = _CHECKPOINT_NAME.match(name)
        path = os.path.join(run_dir, name)
        if (match and not os.path.islink(path) and os.path.isfile(os.path.join(path, TRAINER_STATE_NAME))
                and not os.path.lexists(os.path.join(path, layout.COMMIT))):
            found[int(match[1])] = path
    return dict(sorted(found.items()))


def latest_checkpoint(root_uri: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The URI of the committed ``checkpoint-N`` with the highest N under ``root_uri``, or ``None``."""
    steps = checkpoint_steps(root_uri, storage_options)
    return steps[max(steps)] if steps else None


def _plain_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (which holds no state of its own)."""
    inner = getattr(optimizer, "optimizer", None)
    return _plain_optimizer(inner) if isinstance(inner, torch.optim.Optimizer) else optimizer


@dataclasses.dataclass(frozen=True)
class _Resume:
    """The tierckpt checkpoint a ``train`` call resumes from, and the top-level keys it holds."""

    uri: str
    keys: frozenset[str]


class TierckptTrainer(Trainer):
    """A ``transformers.Trainer`` that saves and resumes its checkpoints through tierckpt (module docstring).

    ``checkpoint_uri``: where the ``checkpoint-N`` checkpoints go (default ``args.output_dir``);
    ``storage_options``: passed to every :func:`tierckpt.save` and :func:`tierckpt.load` (credentials,
    node cache...). Every other argument is ``Trainer``'s.
    """

    def __init__(
        self, *args: Any, checkpoint_uri: str | os.PathLike[str] | None = None, storage_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.args.load_best_model_at_end:
            raise CheckpointError(
                "TierckptTrainer does not support load_best_model_at_end (transformers reads the best checkpoint's "
                "files itself); set load_best_model_at_end=False and load the best checkpoint with tierckpt.load"
            )
        if self.is_deepspeed_enabled:
            raise CheckpointError(
                "TierckptTrainer does not support DeepSpeed (its engine saves and loads its own checkpoints); "
                "use transformers.Trainer with DeepSpeed, or DDP/FSDP with TierckptTrainer"
            )
        if self.args.push_to_hub:
            warnings.warn(
                "TierckptTrainer does not push checkpoints to the Hub (their files are tierckpt's); "
                "push a save_pretrained folder (trainer.save_model(), then trainer.push_to_hub())",
                stacklevel=2,
            )
        self.checkpoint_uri = None if checkpoint_uri is None else uri_text("TierckptTrainer", checkpoint_uri)
        self.storage_options = dict(storage_options or {})
        self._resume: _Resume | None = None

    # -- where --------------------------------------------------------------------------------------------
    def checkpoint_root(self, trial: Any = None) -> str:
        """The URI under which this run's ``checkpoint-N`` go (a hyperparameter-search trial's run folder
        is appended to ``checkpoint_uri`` as transformers appends it to ``output_dir``)."""
        run_dir = self._get_output_dir(trial=trial)
        if self.checkpoint_uri is None:
            return run_dir.rstrip("/")
        relative = os.path.relpath(run_dir, self.args.output_dir)
        root = self.checkpoint_uri.rstrip("/")
        return root if relative == "." else f"{root}/{relative}"

    # -- save -----------------------------------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """One collective tierckpt save of ``checkpoint-<global step>`` (every rank calls it, as transformers does)."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        root = self.checkpoint_root(trial)
        self._export_callback_states()
        save(f"{root}/{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}", self._checkpoint_state(),
             storage_options=self.storage_options)
        if self.args.should_save and self.args.save_total_limit:
            self._rotate(root, self._get_output_dir(trial=trial), self.args.save_total_limit)

    def _export_callback_states(self) -> None:
        """Record the exportable callbacks' states in ``self.state``, as ``Trainer._save_checkpoint`` does."""
        for callback in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name = callback.__class__.__name__
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(callback.state())
            else:
                self.state.stateful_callbacks[name] = callback.state()

    def _checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds (module docstring)."""
        state: dict[str, Any] = {
            "model": self.model,
            TRAINER_STATE_KEY: json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n",
        }
        config = getattr(self.model, "config", None)
        if callable(getattr(config, "to_json_string", None)):
            state["hf_config"] = config.to_json_string()
        if not self.args.save_only_model:
            state["optimizer"] = _plain_optimizer(self.optimizer)
            if self.lr_scheduler is not None:
                state["lr_scheduler"] = self.lr_scheduler
            state["rng"] = RNGState()
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
        return state

    def _rotate(self, root: str, run_dir: str, limit: int) -> None:
        """Keep ``limit`` checkpoints (rank 0): the committed ``checkpoint-N`` under ``root`` and the plain
        ``Trainer``'s checkpoint folders in ``run_dir`` (:func:`plain_checkpoints`: left by this run before it
        switched to ``TierckptTrainer``) counted together by step, the oldest deleted first; the newest and
        ``state.best_model_checkpoint`` are never deleted (as ``Trainer``'s own rotation)."""
        ours = checkpoint_steps(root, self.storage_options)
        found = sorted([(step, uri, False) for step, uri in ours.items()]
                       + [(step, path, True) for step, path in plain_checkpoints(run_dir).items()])
        best = self.state.best_model_checkpoint
        protected = {found[-1][1], *([best.rstrip("/")] if best else [])} if found else set()
        excess = len(found) - max(limit, len(protected))
        backend = open_store(root, dict(self.storage_options))
        sched = get_scheduler()
        for step, where, plain in found:
            if excess <= 0:
                break
            if where in protected:
                continue
            if plain:
                shutil.rmtree(where)
            else:
                sched.run(backend.delete_prefix(f"{PREFIX_CHECKPOINT_DIR}-{step}/"))
            excess -= 1

    # -- resume ---------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` True or a tierckpt URI resumes through tierckpt."""
        if resume_from_checkpoint is None or resume_from_checkpoint is False or (
            isinstance(resume_from_checkpoint, str)
            and os.path.isfile(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME))
        ):  # no resume, or a checkpoint folder of the plain Trainer
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        uri = self._resolve(resume_from_checkpoint, trial)
        ckpt = read_checkpoint(open_store(uri, dict(self.storage_options)))
        keys = frozenset(name.split(".", 1)[0] for name in [*ckpt.tensors, *(o.key for o in ckpt.meta.objects)])
        if TRAINER_STATE_KEY not in keys:
            raise CheckpointError(
                f"{uri!r} holds no {TRAINER_STATE_KEY!r}: it was not saved by TierckptTrainer; load its "
                "weights with tierckpt.load(uri, {...}) and start training without resume_from_checkpoint"
            )
        holder: dict[str, Any] = {TRAINER_STATE_KEY: None}
        load(uri, holder, storage_options=self.storage_options)
        # transformers reads the trainer state from <checkpoint>/trainer_state.json: it reads a staged copy,
        # and every other step of the resume is read from ``uri`` by the methods below.
        with tempfile.TemporaryDirectory(prefix="tierckpt-resume-") as staged:
            with open(os.path.join(staged, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                f.write(holder[TRAINER_STATE_KEY])
            self._resume = _Resume(uri=uri, keys=keys)
            try:
                return super().train(resume_from_checkpoint=staged, trial=trial, **kwargs)
            finally:
                self._resume = None

    def _resolve(self, resume_from_checkpoint: str | bool, trial: Any) -> str:
        """The URI to resume from: the latest ``checkpoint-N`` for ``True``, else the URI given."""
        if resume_from_checkpoint is not True:
            return str(resume_from_checkpoint).rstrip("/")
        root = self.checkpoint_root(trial)
        uri = latest_checkpoint(root, self.storage_options)
        if uri is None:
            raise CheckpointNotFoundError(
                f"resume_from_checkpoint=True: no committed {PREFIX_CHECKPOINT_DIR}-N under {root!r}; "
                "train without resume_from_checkpoint to start a new run, or pass the checkpoint's URI"
            )
        return uri

    def _load(self, state: dict[str, Any]) -> None:
        assert self._resume is not None
        load(self._resume.uri, state, storage_options=self.storage_options)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        if self._resume is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if "optimizer" in self._resume.keys:
            return  # loaded with the optimizer, which names its state by the parameters of the model in the same load
        self._load({"model": model if model is not None else self.model})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._resume is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if "optimizer" not in self._resume.keys:
            return  # saved with save_only_model: the model was loaded alone
        state: dict[str, Any] = {"model": self.model, "optimizer": _plain_optimizer(self.optimizer)}
        if "lr_scheduler" in self._resume.keys and self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler
        self._load(state)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._resume is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and "scaler" in self._resume.keys:
            self._load({"scaler": scaler})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._resume is None:
            return super()._load_rng_state(checkpoint)
        if "rng" not in self._resume.keys:
            log.info("%s holds no RNG state (saved with save_only_model): the resumed run's randomness differs",
                     self._resume.uri)
            return
        self._load({"rng": RNGState()})
