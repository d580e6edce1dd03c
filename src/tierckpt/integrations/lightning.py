"""Lightning checkpoints through tierckpt: :class:`TierckptCheckpointIO`, a ``CheckpointIO`` plugin.

Switch a Lightning ``Trainer`` over with one argument::

    from tierckpt.integrations.lightning import TierckptCheckpointIO
    trainer = Trainer(..., plugins=[TierckptCheckpointIO()])
    trainer.fit(model, ckpt_path="last")  # resumes from ``last.ckpt`` when there is one

Each ``*.ckpt`` path Lightning names becomes a tierckpt checkpoint (a directory, or a prefix on a
remote store). Lightning's checkpoint dict is saved as it is: every tensor in it (model weights, optimizer
moments, tensors inside callback or loop states) is a tensor entry named by its path in the dict
(``state_dict.layer.weight``, ``optimizer_states.0.state.0.exp_avg``), and the rest of the dict, with
the tensors taken out, one object entry (:data:`STRUCTURE_KEY`). Loading needs no template: the
tensor table gives each tensor's shape and dtype, and the structure where it goes back.

Lightning saves and removes checkpoints on global rank 0 only (under DDP the weights are the same on
every rank), and every rank loads. So every call here is rank-local (``group="self"``): nothing waits
on the other ranks, and no save hangs a job whose other ranks are elsewhere.

:class:`TierckptModelParallelStrategy` does the same for FSDP2 and tensor parallel, whose strategy saves
sharded state itself: one collective save of every rank's shards, loaded back resharded.

This module imports ``lightning`` (``pip install 'tierckpt[lightning]'``); ``import tierckpt`` does not.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError as exc:
    raise ImportError(
        f"tierckpt.integrations.lightning needs Lightning ({exc}): pip install 'tierckpt[lightning]' "
        "(or pip install 'lightning>=2.6')"
    ) from exc

from tierckpt.comm import SELF, Group
from tierckpt.errors import CheckpointError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.loading.api import load
from tierckpt.formats.select import read_checkpoint
from tierckpt.loading.nested import template_of
from tierckpt.saving.api import save
from tierckpt.store import open_store

STRUCTURE_KEY = "lightning.structure"
"""The object entry holding the checkpoint dict without its tensors, and where each tensor goes back."""
STRUCTURE_VERSION = 1
SAVED_BY_IO = "tierckpt.integrations.lightning"
SAVED_BY_STRATEGY = "tierckpt.integrations.lightning.TierckptModelParallelStrategy"
"""The ``saved_by`` tag: a strategy's checkpoint holds its model and optimizers under tierckpt's names, which
only a load into the live (sharded) objects fills."""

STRATEGY_PICKLE_FIX = (
    "construct the strategy with TierckptModelParallelStrategy(..., weights_only=False) (Lightning does not pass "
    "trainer.fit(..., weights_only=) to a strategy that restores after setup, as this one does)"
)
"""The fix a strategy's load names for objects that only unpickling reads."""

Path = tuple[Any, ...]
"""Where a value sits in the checkpoint dict: the keys and list indices leading to it."""


class TierckptCheckpointIO(CheckpointIO):
    """Save, load and remove Lightning checkpoints through tierckpt, rank-locally (see the module doc).

    ``storage_options`` go to every :func:`tierckpt.save` / :func:`tierckpt.load` (e.g. S3 credentials,
    ``cache=``); ``Trainer.save_checkpoint(..., storage_options=...)`` adds to them for one save.
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` (Lightning's dict) to ``path`` as one tierckpt commit, from this rank alone."""
        options = _merged(self, self.storage_options, storage_options)
        tensors, structure = split_tensors(checkpoint)
        state: dict[str, Any] = dict(tensors)
        state[STRUCTURE_KEY] = (STRUCTURE_VERSION, structure)  # a tuple: one object entry (a dict would be recursed)
        save(_uri(path), state, group=SELF, storage_options=options, tags={"saved_by": SAVED_BY_IO}, allow_pickle=True)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict saved at ``path``, tensors on the CPU (or on ``map_location``: a device or a
        ``{"cpu": device}`` mapping). Objects that need unpickling load only with ``weights_only=False``,
        as with ``torch.load``."""
        uri = _uri(path)
        tensors, structure = read_state(uri, self.storage_options, allow_pickle=weights_only is False)
        device = _device_of(map_location)
        if device is not None:
            tensors = {key: tensor.to(device) for key, tensor in tensors.items()}
        return join_tensors(structure, tensors)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (every generation, and its copies in the node cache); a local
        symbolic link (``ModelCheckpoint(save_last="link")``) is removed, not the checkpoint it points to."""
        uri = _uri(path)
        if "://" not in uri and os.path.islink(uri):
            os.unlink(uri)
            return
        get_scheduler().run(open_store(uri, dict(self.storage_options)).delete_prefix(""))
        if "://" not in uri and os.path.isdir(uri):  # a local checkpoint's directory goes too
            shutil.rmtree(uri, ignore_errors=True)


def read_state(uri: str, storage_options: Mapping[str, Any] | None = None, *, allow_pickle: bool = False,
               group: Group = SELF, live: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors (by entry key, on the CPU) and the structure object of a checkpoint saved by
    :class:`TierckptCheckpointIO` or :class:`TierckptModelParallelStrategy`: the template is built from the saved
    tensor table, so none is needed. ``live`` entries (a sharded model, its optimizers) are loaded in place, in
    the same load, and the tensors under their keys left out of what is returned. ``group``: who loads
    together (default: this process alone)."""
    options = dict(storage_options or {})
    live = dict(live or {})
    under_live = tuple(f"{key}." for key in live)
    ckpt = read_checkpoint(open_store(uri, options))
    codecs = {obj.codec for obj in ckpt.meta.objects if obj.key == STRUCTURE_KEY}
    if not codecs:
        raise CheckpointError(
            f"{uri!r} is a tierckpt checkpoint but not one saved by TierckptCheckpointIO (it has no {STRUCTURE_KEY!r} "
            "object); load it with tierckpt.load(uri, state) and a state to fill"
        )
    if not live and ckpt.meta.tags.get("saved_by") == SAVED_BY_STRATEGY:
        raise CheckpointError(
            f"{uri!r} was saved by TierckptModelParallelStrategy: its model and optimizer states load only into a "
            "model and optimizers; resume through that strategy, or read the weights with "
            "tierckpt.load(uri, {'state_dict': model})"
        )
    if "pickle" in codecs and not allow_pickle:
        fix = (STRATEGY_PICKLE_FIX if live else "pass weights_only=False (trainer.fit(..., weights_only=False))")
        raise CheckpointError(
            f"the Lightning checkpoint {uri!r} holds objects (hyperparameters, callback state) that only unpickling "
            f"reads, and unpickling can run code; if you trust this checkpoint, {fix}"
        )
    template = {key: value for key, value in template_of(ckpt).items() if not key.startswith(under_live)}
    template.update(live)
    load(uri, template, group=group, storage_options=options, allow_pickle=allow_pickle)
    for key in live:
        del template[key]
    version, structure = template.pop(STRUCTURE_KEY)
    if version != STRUCTURE_VERSION:
        raise CheckpointError(
            f"{uri!r}: its Lightning structure object is of version {version!r} and this tierckpt reads version "
            f"{STRUCTURE_VERSION}; load it with the tierckpt release that saved it"
        )
    return template, structure


class TierckptModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel) checkpointing through tierckpt instead of
    torch DCP, which that strategy calls itself (it passes nothing to a ``CheckpointIO``).

    Every rank saves its shards of the model and optimizer states in one collective :func:`tierckpt.save`
    (the strategy calls ``save_checkpoint`` on every rank); the rest of Lightning's dict goes as with
    :class:`TierckptCheckpointIO`. A load fills the model and optimizers in place, resharded onto this run's
    layout, and returns the rest. ``storage_options`` go to every save and load; the other arguments are
    ``ModelParallelStrategy``'s.

    ``weights_only=False`` lets a resume read the objects that only unpickling reads (hyperparameters of your
    own classes, callback state), from checkpoints you trust. It is the strategy's own argument because
    Lightning restores a checkpoint after this strategy's setup without the ``weights_only`` given to
    ``trainer.fit``; a ``weights_only`` that Lightning does pass to :meth:`load_checkpoint` wins.
    """

    def __init__(self, *args: Any, storage_options: Mapping[str, Any] | None = None, weights_only: bool | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tierckpt_io = TierckptCheckpointIO(storage_options)
        self._weights_only = weights_only

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        options = _merged(self, self._tierckpt_io.storage_options, storage_options)
        uri = _uri(self.broadcast(filepath))
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        tensors, structure = split_tensors(rest)
        live = self._live(optimizers="optimizer_states" in checkpoint)  # not in a weights-only checkpoint
        state: dict[str, Any] = {**tensors, **live, STRUCTURE_KEY: (STRUCTURE_VERSION, structure)}
        save(uri, state, storage_options=options, tags={"saved_by": SAVED_BY_STRATEGY}, allow_pickle=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        uri = _uri(self.broadcast(checkpoint_path))
        weights_only = self._weights_only if weights_only is None else weights_only
        tensors, structure = read_state(uri, self._tierckpt_io.storage_options, allow_pickle=weights_only is False,
                                        group=None, live=self._live())
        return join_tensors(structure, tensors)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self._tierckpt_io.remove_checkpoint(filepath)

    def _live(self, optimizers: bool = True) -> dict[str, Any]:
        """The sharded model and (with ``optimizers``) its optimizers, saved and loaded in place under
        Lightning's key names."""
        live: dict[str, Any] = {"state_dict": self.model}
        if optimizers:
            live.update({f"optimizer_{i}": opt for i, opt in enumerate(self.optimizers)})
        return live


def split_tensors(checkpoint: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, structure)``: every tensor of ``checkpoint`` by a unique dotted key of its path, and
    ``{"tree": checkpoint without them, "tensors": [(path, key), ...]}``; :func:`join_tensors` undoes it."""
    tensors: dict[str, torch.Tensor] = {}
    places: list[tuple[Path, str]] = []

    def take(value: Any, path: Path) -> Any:
        if isinstance(value, torch.Tensor):
            key = _unique(".".join(map(str, path)), tensors)
            tensors[key] = value
            places.append((path, key))
            return None
        if isinstance(value, dict):
            out = copy.copy(value)  # keeps the dict's class (OrderedDict, Lightning's AttributeDict) and attributes
            for k, v in value.items():
                out[k] = take(v, (*path, k))
            return out
        if isinstance(value, list):
            return [take(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            items = [take(v, (*path, i)) for i, v in enumerate(value)]
            return type(value)._make(items) if hasattr(value, "_make") else type(value)(items)
        return value

    tree = take(dict(checkpoint), ())
    return tensors, {"tree": tree, "tensors": places}


def join_tensors(structure: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The checkpoint dict that :func:`split_tensors` split into ``structure`` and ``tensors``."""
    by_path = {tuple(path): key for path, key in structure["tensors"]}
    missing = sorted(key for key in by_path.values() if key not in tensors)
    if missing:
        raise CheckpointError(f"the Lightning structure names tensors the checkpoint lacks: {missing[:8]}")

    def put(value: Any, path: Path) -> Any:
        key = by_path.get(path)
        if key is not None:
            return tensors[key]
        if isinstance(value, dict):
            out = copy.copy(value)
            for k, v in value.items():
                out[k] = put(v, (*path, k))
            return out
        if isinstance(value, list):
            return [put(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            items = [put(v, (*path, i)) for i, v in enumerate(value)]
            return type(value)._make(items) if hasattr(value, "_make") else type(value)(items)
        return value

    return put(structure["tree"], ())


def _unique(key: str, taken: Mapping[str, Any]) -> str:
    """``key``, or ``key~N`` when two paths spell the same dotted key (a dict key holding a dot)."""
    if key not in taken and key != STRUCTURE_KEY:
        return key
    n = 1
    while f"{key}~{n}" in taken:
        n += 1
    return f"{key}~{n}"


def _merged(owner: object, base: Mapping[str, Any], extra: Any) -> dict[str, Any]:
    """``base`` storage options updated by one save's ``storage_options`` (``Trainer.save_checkpoint``)."""
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"{type(owner).__name__}.save_checkpoint: storage_options must be a dict of tierckpt storage "
                        f"options, got {type(extra).__name__}")
    return {**base, **(extra or {})}


def _uri(path: Any) -> str:
    uri = os.fspath(path)
    if not isinstance(uri, str):
        raise TypeError(f"a checkpoint path must be a string or path-like, got {type(path).__name__}")
    return uri


def _device_of(map_location: Any) -> torch.device | None:
    """The device to move the loaded tensors to (they are read onto the CPU); ``None``: leave them."""
    if map_location is None:
        return None
    if isinstance(map_location, Mapping):
        target = map_location.get("cpu")
        return None if target is None else torch.device(target)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise TypeError(
        f"TierckptCheckpointIO.load_checkpoint: map_location must be a device, a device name or a "
        f"{{'cpu': device}} mapping (tensors are read onto the CPU), got {type(map_location).__name__}"
    )


__all__ = ["STRUCTURE_KEY", "TierckptCheckpointIO", "TierckptModelParallelStrategy", "join_tensors", "read_state",
           "split_tensors"]
