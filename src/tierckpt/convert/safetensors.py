"""``tierckpt convert`` to and from safetensors: a Hugging Face folder streamed out of a checkpoint one
slab at a time (``to_safetensors``), and a safetensors file or folder saved as a checkpoint
(``from_safetensors``). The rules (shards, prefix, config.json, tied embeddings) are in
:mod:`tierckpt.convert.api`'s docstring.
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tierckpt import progress
from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.call_args import uri_text
from tierckpt.convert.report import ConvertReport
from tierckpt.native.coverage import check_exact_coverage
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from tierckpt.io.scheduler import ReadRequest, get_scheduler
from tierckpt.native.keys import validate_key
from tierckpt.loading.api import DEFAULT_CHUNK_BYTES, DEFAULT_ROUND_BYTES, Checkpoint, read_checkpoint, read_pieces
from tierckpt.loading.objects import read_objects
from tierckpt.formats.objects import decode_object
from tierckpt.native.metadata import PieceMeta, TensorMeta
from tierckpt.planner import TargetPiece, plan_load
from tierckpt.native.regions import Box
from tierckpt.formats.safetensors import DTYPES, INDEX, MAX_JSON_BYTES, SINGLE, parse_json, tie as _tie
from tierckpt.saving.api import save
from tierckpt.formats.select import reader_of
from tierckpt.store import open_store

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



def to_safetensors(
    uri: str | os.PathLike[str],
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
    uri = uri_text("convert.to_safetensors", uri)
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
    check_exact_coverage(ckpt.tensors, {f: pieces.get(f, []) for f in names.values()}, uri)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(names, ckpt.tensors, max_shard_bytes)
    report = ConvertReport(source=uri, output=str(out), to="safetensors")
    total = sum(ckpt.tensors[f].nbytes for f in names.values())
    bar = progress.current()
    if bar is not None:  # tierckpt convert's bar: the tensor bytes read (_read_box counts them)
        bar.expect(total)
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, 1):
        filename = SAFETENSORS_SINGLE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(backend, ckpt, pieces, [(n, names[n]) for n in shard], out / filename, slab_bytes)
        weight_map.update({n: filename for n in shard})
        report.files.append(filename)
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
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser recurses
        raise CheckpointError(f"{what} is not valid JSON (or nests too deep): {exc}") from exc
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
    src: str | os.PathLike[str], uri: str | os.PathLike[str], *, prefix: str = "", storage_options: Mapping[str, Any] | None = None
) -> ConvertReport:
    """Save a safetensors file or Hugging Face folder as a tierckpt checkpoint (``prefix`` is prepended)."""
    try:
        from safetensors.torch import load_file
    except ImportError as exc:
        raise CheckpointError(
            'reading safetensors needs the "safetensors" package: pip install "tierckpt[hf]"'
        ) from exc

    uri = uri_text("convert.from_safetensors", uri)
    tensors: dict[str, torch.Tensor] = {}
    report = ConvertReport(source=str(src), output=uri, to="tierckpt")
    files = _safetensors_files(Path(src))
    for path in files:
        tensors.update(load_file(str(path)))
    config = files[0].parent / "config.json"
    doc = parse_json(config.read_bytes(), repr(str(config))) if config.is_file() else None  # as the in-place reader
    if doc is not None and not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{str(config)!r} is not a JSON object")
    tie = _tie(tensors, doc)
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
        return [src / name for name in sorted(set(_index_files(index).values()))]
    if (src / SAFETENSORS_SINGLE).is_file():
        return [src / SAFETENSORS_SINGLE]
    found = sorted(src.glob("*.safetensors"))
    if not found:
        raise CheckpointNotFoundError(f"no safetensors files in {str(src)!r}")
    return found


def _index_files(index: Path) -> dict[str, str]:
    """Tensor name -> shard of ``model.safetensors.index.json``, each shard a key inside its folder (an
    absolute or ``..`` entry would convert another folder's tensors): read as the in-place reader does."""
    if index.stat().st_size > MAX_JSON_BYTES:
        raise CorruptCheckpointError(f"{str(index)!r} is larger than {MAX_JSON_BYTES} bytes; it is not read")
    doc = parse_json(index.read_bytes(), repr(str(index)))
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CorruptCheckpointError(f"{str(index)!r} has no weight_map of tensor names to files")
    try:
        return {name: validate_key(file) for name, file in weight_map.items()}
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{str(index)!r} lists a shard outside its folder: {exc}") from None


# -- DCP -------------------------------------------------------------------------------------------------
