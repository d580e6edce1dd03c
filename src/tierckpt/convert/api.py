"""Conversions between tierckpt checkpoints and other formats (``tierckpt convert``).

=====================  ===========================================================================
conversion             memory
=====================  ===========================================================================
tierckpt -> safetensors streams: one slab of at most ``slab_bytes`` (default 256 MiB) of one tensor
                       at a time, assembled from the saved pieces; a model larger than RAM converts.
safetensors -> tierckpt holds every tensor in memory (``tierckpt.save`` takes one state).
dcp -> tierckpt        holds every tensor in memory (DCP loads into full CPU tensors, one process).
tierckpt -> dcp        holds every tensor in memory (full CPU tensors, one process).
=====================  ===========================================================================

safetensors output is a Hugging Face-style folder: ``model.safetensors``, or shards
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json`` when the tensors exceed
``max_shard_bytes``. A ``prefix`` selects tensors by fqn and strips it (``model.embed.weight`` ->
``embed.weight``); objects cannot be stored in safetensors and are skipped (and reported). The source
may be a tierckpt checkpoint or a foreign directory its reader reads in place (:mod:`tierckpt.formats.select`).

**Hugging Face config.** ``transformers``' ``from_pretrained`` needs ``config.json`` next to the
weights. The export writes it (and ``generation_config.json``) from ``config_dir`` (a folder holding the
model's config), else from the checkpoint's objects ``hf_config`` / ``hf_generation_config``: JSON
strings, saved as ``{"hf_config": model.config.to_json_string()}`` next to the model. Without either it
warns (one line) and writes the weights only.

**Tied embeddings.** When the config ties input and output embeddings (``tie_word_embeddings``, true
when absent as in ``transformers``), the export drops ``lm_head.weight`` as ``save_pretrained`` does,
and the import of a folder whose ``config.json`` says so restores it from the input embedding (the one
tensor named ``*embed_tokens.weight``, ``*wte.weight``, ``*word_embeddings.weight`` or ``*shared.weight``),
so a strict load into the tied model finds both keys.

**Trust.** A DCP checkpoint's ``.metadata`` is a pickle and its non-tensor entries are ``torch.save``
bytes: importing one (``--from dcp``) unpickles them, which can run code. Import only DCP checkpoints
you trust. tierckpt objects that need full unpickling are skipped on export unless ``allow_pickle``.
"""


from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from tierckpt.call_args import uri_text
from tierckpt.convert.report import ConvertReport
from tierckpt.convert.safetensors import DEFAULT_MAX_SHARD_BYTES, from_safetensors, to_safetensors
from tierckpt.errors import CheckpointError, CheckpointNotFoundError
from tierckpt.loading.api import load, read_checkpoint
from tierckpt.state.optim_groups import flat_to_indexed, indexed_to_flat, rename_legacy_optimizers
from tierckpt.saving.api import save
from tierckpt.store import open_store

__all__ = ["ConvertReport", "DEFAULT_MAX_SHARD_BYTES", "from_dcp", "from_safetensors", "to_dcp", "to_safetensors"]


def from_dcp(src: str | os.PathLike[str], uri: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> ConvertReport:
    """Save a torch.distributed.checkpoint directory as a tierckpt checkpoint, in this process.

    Keys are kept, except that an optimizer state dict saved unflattened (settings by group number,
    ``optim.param_groups.0.lr``) is stored as tierckpt stores one: by parameter (see
    :func:`tierckpt.state.optim_groups.indexed_to_flat`). Unpickles the DCP metadata and byte entries: only for DCP
    checkpoints you trust. A byte entry that only unpickling reads back (a custom class) is kept as a pickle,
    with a warning (``save(allow_pickle="warn")``): loading it then needs ``allow_pickle=True``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _check_one_process("convert --from dcp")
    uri = uri_text("convert.from_dcp", uri)
    try:
        metadata = dcp.FileSystemReader(str(src)).read_metadata()
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"no DCP checkpoint at {str(src)!r}: {exc}") from exc
    state: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            state[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        else:
            state[key] = None  # a bytes entry: DCP replaces the placeholder with the loaded object
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=str(src), no_dist=True)
    indexed_to_flat(state)
    save(uri, state, storage_options=storage_options, allow_pickle="warn")
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    report = ConvertReport(source=str(src), output=uri, to="tierckpt", files=[uri])
    report.tensors, report.tensor_bytes = len(tensors), sum(t.nbytes for t in tensors)
    report.objects = len(state) - len(tensors)
    return report


def to_dcp(
    uri: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    flatten_optimizer: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> ConvertReport:
    """Load the checkpoint at ``uri`` into full CPU tensors (one process) and save it with DCP.

    Objects are included by key (a per-rank object takes rank 0's value, as a one-process load does);
    objects that need full unpickling are skipped unless ``allow_pickle``. Optimizer param groups come
    out as torch's default ``get_state_dict(model, optim)`` names them, by group number
    (``optim.param_groups.0.lr``, see :func:`tierckpt.state.optim_groups.flat_to_indexed`), so ``dcp.load``
    into that dict reads them; ``flatten_optimizer`` keeps them by parameter, for
    ``StateDictOptions(flatten_optimizer_state_dict=True)``. Also from a format 1.0 checkpoint.
    """
    import torch.distributed.checkpoint as dcp

    _check_one_process("convert --to dcp")
    uri = uri_text("convert.to_dcp", uri)
    ckpt = read_checkpoint(open_store(uri, dict(storage_options or {})))
    state: dict[str, Any] = {fqn: torch.empty(t.shape, dtype=t.torch_dtype) for fqn, t in ckpt.tensors.items()}
    skipped = sorted({o.key for o in ckpt.meta.objects if o.codec == "pickle" and not allow_pickle})
    state.update({o.key: None for o in ckpt.meta.objects if o.key not in skipped})
    load(uri, state, strict=not skipped, allow_pickle=allow_pickle, storage_options=storage_options)
    if ckpt.meta.format_minor < 1:
        rename_legacy_optimizers(state)
    if not flatten_optimizer:
        flat_to_indexed(state, [k for k in state if k not in ckpt.tensors])
    with _quiet_dcp():
        dcp.save(state, checkpoint_id=str(out_dir), no_dist=True)
    report = ConvertReport(source=uri, output=str(out_dir), to="dcp", files=sorted(os.listdir(out_dir)))
    report.tensors, report.tensor_bytes = len(ckpt.tensors), sum(t.nbytes for t in ckpt.tensors.values())
    report.objects = sum(not isinstance(v, torch.Tensor) for v in state.values())
    report.skipped_objects = skipped
    return report


def _check_one_process(what: str) -> None:
    """DCP conversions load or save with tierckpt in this process alone: inside a process group of
    several ranks that would wait for the other ranks, so refuse at once."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise CheckpointError(
            f"{what} runs in one process, but this one is rank {dist.get_rank()} of a process group of "
            f"{dist.get_world_size()}; run the `tierckpt {what}` command in a process of its own"
        )


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group (that is the intent here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
