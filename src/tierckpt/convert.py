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
may be a tierckpt checkpoint or a foreign directory its reader reads in place (:mod:`tierckpt.readers`).

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
import json
import math
import os
import struct
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import layout, progress
from .backends import Backend
from .errors import CheckpointError, CheckpointNotFoundError
from .io.scheduler import ReadRequest, get_scheduler
from .loader import DEFAULT_CHUNK_BYTES, DEFAULT_ROUND_BYTES, Checkpoint, load, read_checkpoint, read_pieces
from .objects_read import read_objects
from .objects import decode_object
from .optim_groups import flat_to_indexed, indexed_to_flat, rename_legacy_optimizers
from .metadata import PieceMeta, TensorMeta
from .planner import TargetPiece, plan_load
from .regions import Box
from .safetensors_format import DTYPES, INDEX, SINGLE, tie as _tie
from .saver import save
from .readers import reader_of
from .store import open_store

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
DEFAULT_SLAB_BYTES = 256 << 20
SAFETENSORS_SINGLE = SINGLE
SAFETENSORS_INDEX = INDEX
HF_CONFIG_OBJECTS = {"hf_config": "config.json", "hf_generation_config": "generation_config.json"}
"""Checkpoint object (a JSON string) -> the Hugging Face file the export writes from it."""
NO_CONFIG_WARNING = (
    "no config.json written, and transformers' from_pretrained needs one: pass --config DIR (a folder with the "
    "model's config.json), or save the config with the model as {'hf_config': model.config.to_json_string()}"
)

SAFETENSORS_DTYPES = DTYPES


@dataclass(slots=True, kw_only=True)
class ConvertReport:
    """What a conversion wrote and what it left out."""

    source: str
    output: str
    to: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    tensor_bytes: int = 0
    objects: int = 0
    skipped_objects: list[str] = field(default_factory=list)
    skipped_tensors: int = 0
    """Tensors outside the prefix."""
    tied: dict[str, str] = field(default_factory=dict)
    """Tied copy -> its source: dropped by an export, restored by an import."""
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def render(self) -> str:
        lines = [
            f"converted {self.source} -> {self.output} ({self.to}): {self.tensors} tensors ({self.tensor_bytes} bytes), "
            f"{self.objects} objects, {len(self.files)} file(s)"
        ]
        if self.skipped_tensors:
            lines.append(f"  skipped {self.skipped_tensors} tensor(s) outside the prefix")
        if self.skipped_objects:
            lines.append(f"  skipped {len(self.skipped_objects)} object(s): {', '.join(self.skipped_objects)}")
        verb = "dropped" if self.to == "safetensors" else "restored"
        lines += [f"  tied: {verb} {copy} (the same tensor as {source})" for copy, source in self.tied.items()]
        return "\n".join(lines)


# -- tierckpt -> safetensors (streaming) ----------------------------------------------------------------
def to_safetensors(
    uri: str,
    out_dir: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    prefix: str = "",
    storage_options: Mapping[str, Any] | None = None,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
    config_dir: str | os.PathLike[str] | None = None,
) -> ConvertReport:
    """Write the tensors of the checkpoint at ``uri`` as a Hugging Face folder, streaming (see the module docstring).

    ``config_dir``: a folder with the model's ``config.json`` (and ``generation_config.json``) to write
    next to the weights; without it they come from the checkpoint's ``hf_config`` objects.
    """
    backend = open_store(uri, dict(storage_options or {}))
    ckpt = read_checkpoint(backend, accept_foreign=True)
    backend = reader_of(ckpt).source(backend)
    configs = _hf_configs(backend, ckpt, config_dir)
    names = _select(ckpt.tensors, prefix)
    if not names:
        raise CheckpointError(f"no tensor of {uri!r} starts with the prefix {prefix!r}")
    tie = _tie(names, configs.get("config.json"))
    tied = {}
    if tie is not None and tie[0] in names and ckpt.tensors[names[tie[0]]].shape == ckpt.tensors[names[tie[1]]].shape:
        del names[tie[0]]
        tied = {tie[0]: tie[1]}
    for fqn in names.values():
        _safetensors_dtype(ckpt.tensors[fqn])
    pieces = read_pieces(backend, ckpt)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(names, ckpt.tensors, max_shard_bytes)
    report = ConvertReport(source=uri, output=str(out), to="safetensors")
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, 1):
        filename = SAFETENSORS_SINGLE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(backend, ckpt, pieces, [(n, names[n]) for n in shard], out / filename, slab_bytes)
        weight_map.update({n: filename for n in shard})
        report.files.append(filename)
    total = sum(ckpt.tensors[f].nbytes for f in names.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_atomic(out / SAFETENSORS_INDEX, json.dumps(index, indent=2).encode())
        report.files.append(SAFETENSORS_INDEX)
    for filename, data in configs.items():
        _write_atomic(out / filename, json.dumps(data, indent=2).encode() + b"\n")
        report.files.append(filename)
    report.tensors, report.tensor_bytes = len(names), total
    report.skipped_tensors = len(ckpt.tensors) - len(names) - len(tied)
    report.tied = tied
    report.skipped_objects = sorted({o.key for o in ckpt.meta.objects} - (set(HF_CONFIG_OBJECTS) if config_dir is None else set()))
    if "config.json" not in configs:
        report.warnings.append(NO_CONFIG_WARNING)
        warnings.warn(NO_CONFIG_WARNING, stacklevel=2)
    return report


def _hf_configs(backend: Backend, ckpt: Checkpoint, config_dir: str | os.PathLike[str] | None) -> dict[str, dict[str, Any]]:
    """File name -> Hugging Face config to write: from ``config_dir``, else from the checkpoint's ``hf_config`` objects."""
    if config_dir is not None:
        folder = Path(config_dir)
        if not (folder / "config.json").is_file():
            raise CheckpointNotFoundError(f"--config {str(folder)!r} holds no config.json: pass the folder of the model's Hugging Face config")
        files = [f for f in HF_CONFIG_OBJECTS.values() if (folder / f).is_file()]
        return {f: _json_object((folder / f).read_bytes(), str(folder / f)) for f in files}
    configs = {}
    for key, filename in HF_CONFIG_OBJECTS.items():
        meta = min((o for o in ckpt.meta.objects if o.key == key), key=lambda o: -1 if o.rank is None else o.rank, default=None)
        if meta is None:
            if any(o.key.startswith(key + ".") for o in ckpt.meta.objects):
                raise CheckpointError(f"{backend.root_uri!r} holds {key!r} as a dict (one object per field); {_as_json(key)}")
            continue
        data = read_objects(backend, ckpt.meta.generation, {meta})[meta]
        value = decode_object(data, meta.codec, meta.key, allow_pickle=False)
        if not isinstance(value, str):
            raise CheckpointError(f"object {key!r} of {backend.root_uri!r} is of type {type(value).__name__}; {_as_json(key)}")
        configs[filename] = _json_object(value.encode(), f"object {key!r}")
    return configs


def _as_json(key: str) -> str:
    return f"save it as one JSON string ({{{key!r}: model.config.to_json_string()}}), or pass --config DIR"


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise CheckpointError(f"{what} is not a JSON object")
    return doc


def _select(tensors: Mapping[str, TensorMeta], prefix: str) -> dict[str, str]:
    """Output name -> fqn of the tensors under ``prefix`` (stripped), sorted by output name."""
    names = {fqn[len(prefix) :]: fqn for fqn in tensors if fqn.startswith(prefix) and len(fqn) > len(prefix)}
    return dict(sorted(names.items()))


def _safetensors_dtype(tensor: TensorMeta) -> str:
    try:
        return SAFETENSORS_DTYPES[tensor.dtype]
    except KeyError:
        raise CheckpointError(f"tensor {tensor.fqn!r} has dtype {tensor.dtype}, which safetensors cannot store") from None


def _shards(names: Mapping[str, str], tensors: Mapping[str, TensorMeta], max_shard_bytes: int) -> list[list[str]]:
    """Output names grouped in order into shards of at most ``max_shard_bytes`` (a larger tensor is alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, fqn in names.items():
        nbytes = tensors[fqn].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_safetensors(
    backend: Backend, ckpt: Checkpoint, pieces: Mapping[str, list[PieceMeta]], entries: list[tuple[str, str]],
    path: Path, slab_bytes: int,
) -> None:
    """One safetensors file: 8-byte header length, JSON header, then each tensor's bytes in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, fqn in entries:
        t = ckpt.tensors[fqn]
        header[name] = {"dtype": _safetensors_dtype(t), "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, fqn in entries:
            for slab in _tensor_slabs(backend, ckpt, pieces, ckpt.tensors[fqn], slab_bytes):
                f.write(slab.numpy().data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _tensor_slabs(
    backend: Backend, ckpt: Checkpoint, pieces: Mapping[str, list[PieceMeta]], tensor: TensorMeta, slab_bytes: int
) -> Iterator[torch.Tensor]:
    """The tensor's bytes in row-major order, as uint8 slabs of whole rows of about ``slab_bytes``."""
    for box in _row_slabs(tensor, slab_bytes):
        yield _read_box(backend, ckpt, pieces, tensor, box)


def _row_slabs(tensor: TensorMeta, slab_bytes: int) -> list[Box]:
    """Boxes of consecutive rows of dim 0 (the whole tensor for 0-d), contiguous in row-major order."""
    shape = tensor.shape
    if not shape:
        return [Box((), ())]
    if math.prod(shape) == 0:
        return []
    row = tensor.nbytes // shape[0]
    rows = max(1, slab_bytes // max(row, 1))
    rest = (0,) * (len(shape) - 1)
    return [Box((start,) + rest, (min(rows, shape[0] - start),) + tuple(shape[1:])) for start in range(0, shape[0], rows)]


def _read_box(
    backend: Backend, ckpt: Checkpoint, pieces: Mapping[str, list[PieceMeta]], tensor: TensorMeta, box: Box
) -> torch.Tensor:
    """One box of a tensor assembled from its saved pieces, as row-major bytes (a one-rank load plan)."""
    plan = plan_load(
        ckpt.tensors, {tensor.fqn: list(pieces.get(tensor.fqn, []))}, [[TargetPiece(fqn=tensor.fqn, region=box)]],
        chunk_bytes=DEFAULT_CHUNK_BYTES, round_bytes=DEFAULT_ROUND_BYTES,
    )
    dtype = tensor.torch_dtype
    target = torch.empty(box.lengths, dtype=dtype)
    gen = ckpt.meta.generation
    requests: list[ReadRequest] = []
    copies: list[tuple[torch.Tensor, Any]] = []
    for unit in plan.units:
        (delivery,) = unit.deliveries  # one rank, one target: each unit delivers once
        view = target[delivery.box.relative_to(box).slices()]
        direct = unit.box == delivery.box and view.is_contiguous()
        buffer = view.reshape(-1).view(torch.uint8) if direct else torch.empty(unit.nbytes, dtype=torch.uint8)
        memory = memoryview(buffer.numpy())
        key = layout.in_generation(gen, unit.file)
        for j, start in enumerate(unit.run_offsets.tolist()):
            requests.append(ReadRequest(key=key, start=start, out=memory[j * unit.run_bytes : (j + 1) * unit.run_bytes]))
        if not direct:
            copies.append((buffer, (unit, delivery, view)))
    if requests:
        sched = get_scheduler()
        sched.run(sched.read(backend, requests))
        bar = progress.current()
        if bar is not None:  # tierckpt convert's bar: the bytes read
            bar.add(sum(len(r.out) for r in requests))
    for buffer, (unit, delivery, view) in copies:
        source = buffer.view(dtype).view(unit.box.lengths)
        view.copy_(source[delivery.box.relative_to(unit.box).slices()])
    return target.reshape(-1).view(torch.uint8)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# -- safetensors -> tierckpt ------------------------------------------------------------------------------
def from_safetensors(
    src: str | os.PathLike[str], uri: str, *, prefix: str = "", storage_options: Mapping[str, Any] | None = None
) -> ConvertReport:
    """Save a safetensors file or Hugging Face folder as a tierckpt checkpoint (``prefix`` is prepended)."""
    try:
        from safetensors.torch import load_file
    except ImportError as exc:
        raise CheckpointError(
            'reading safetensors needs the "safetensors" package: pip install "tierckpt[hf]"'
        ) from exc

    tensors: dict[str, torch.Tensor] = {}
    report = ConvertReport(source=str(src), output=uri, to="tierckpt")
    files = _safetensors_files(Path(src))
    for path in files:
        tensors.update(load_file(str(path)))
    config = files[0].parent / "config.json"
    tie = _tie(tensors, _json_object(config.read_bytes(), str(config)) if config.is_file() else None)
    if tie is not None and tie[0] not in tensors:
        tensors[tie[0]] = tensors[tie[1]]
        report.tied = {prefix + tie[0]: prefix + tie[1]}
    state = {prefix + name: tensor for name, tensor in tensors.items()}
    save(uri, state, storage_options=storage_options)
    report.files = [uri]
    report.tensors, report.tensor_bytes = len(state), sum(t.nbytes for t in state.values())
    return report


def _safetensors_files(src: Path) -> list[Path]:
    """The files of a safetensors checkpoint: the file itself, the index's shards, or model.safetensors."""
    if src.is_file():
        return [src]
    index = src / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [src / name for name in sorted(set(weight_map.values()))]
    if (src / SAFETENSORS_SINGLE).is_file():
        return [src / SAFETENSORS_SINGLE]
    found = sorted(src.glob("*.safetensors"))
    if not found:
        raise CheckpointNotFoundError(f"no safetensors files in {str(src)!r}")
    return found


# -- DCP -------------------------------------------------------------------------------------------------
def from_dcp(src: str | os.PathLike[str], uri: str, *, storage_options: Mapping[str, Any] | None = None) -> ConvertReport:
    """Save a torch.distributed.checkpoint directory as a tierckpt checkpoint, in this process.

    Keys are kept, except that an optimizer state dict saved unflattened (settings by group number,
    ``optim.param_groups.0.lr``) is stored as tierckpt stores one: by parameter (see
    :func:`tierckpt.optim_groups.indexed_to_flat`). Unpickles the DCP metadata and byte entries: only for DCP
    checkpoints you trust.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _check_one_process("convert --from dcp")
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
    save(uri, state, storage_options=storage_options)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    report = ConvertReport(source=str(src), output=uri, to="tierckpt", files=[uri])
    report.tensors, report.tensor_bytes = len(tensors), sum(t.nbytes for t in tensors)
    report.objects = len(state) - len(tensors)
    return report


def to_dcp(
    uri: str,
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
    (``optim.param_groups.0.lr``, see :func:`tierckpt.optim_groups.flat_to_indexed`), so ``dcp.load``
    into that dict reads them; ``flatten_optimizer`` keeps them by parameter, for
    ``StateDictOptions(flatten_optimizer_state_dict=True)``. Also from a format 1.0 checkpoint.
    """
    import torch.distributed.checkpoint as dcp

    _check_one_process("convert --to dcp")
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
