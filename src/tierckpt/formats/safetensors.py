"""Reading a Hugging Face ``save_pretrained`` folder in place, as a tierckpt checkpoint.

A folder holding ``model.safetensors``, or shards listed by ``model.safetensors.index.json``, loads
with ``tierckpt.load(folder, {"model": model})``: its tensors appear under the key ``model``
(:data:`MODEL_KEY`), so ``transformer.wte.weight`` of the file is ``model.transformer.wte.weight``.
A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and ``data_offsets``) and the tensors' row-major bytes: each tensor is one piece of its file
(:class:`~tierckpt.native.metadata.PieceMeta`), and the ordinary loader reads it with its own planner
(byte-range reads, any resharding: a DTensor or FSDP2 model reads only its shard).

When the folder's ``config.json`` ties input and output embeddings (``tie_word_embeddings``, true
when absent, as in ``transformers``) and the files hold no ``lm_head.weight`` (``save_pretrained``
drops it), ``model.lm_head.weight`` reads the input embedding's bytes, so a strict load into the tied
model finds both keys.

safetensors records no checksums: pieces carry ``crc32c=0``, and ``load(verify=True)`` refuses such a
folder (:func:`refusal`). Its reader (:data:`tierckpt.formats.select.SAFETENSORS`) reads it past the node
cache (``save_pretrained`` rewrites files in place).
Headers and the index are checked (JSON shape, dtypes, offsets inside the file, sizes that match the
shape) and a bad one raises :class:`~tierckpt.errors.CorruptCheckpointError` naming the file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import struct
from collections.abc import Collection, Mapping
from typing import Any

from tierckpt.backends import Backend
from tierckpt.formats.reader import Root
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native.keys import validate_key
from tierckpt.native.metadata import CheckpointMeta, FileMeta, PieceMeta, TensorMeta, dtype_from_name, itemsize
from tierckpt.native.regions import Box

__all__ = ["CONFIG", "DTYPES", "INDEX", "MODEL_KEY", "SINGLE", "holds", "read_safetensors", "refusal", "tie"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
MODEL_KEY = "model"
"""The state key under which a folder's tensors load: ``tierckpt.load(folder, {"model": model})``."""
FORMAT = "safetensors"
"""The reader's name (:attr:`tierckpt.formats.reader.CheckpointReader.format`)."""
FORMAT_TAG = "safetensors"
"""Header tag of a checkpoint read from a safetensors folder."""
MAX_HEADER_BYTES = 100 << 20
"""The largest safetensors header read (the safetensors library's own limit)."""
MAX_JSON_BYTES = 64 << 20
"""The largest ``model.safetensors.index.json`` or ``config.json`` read."""

#: tierckpt dtype name -> safetensors dtype name.
DTYPES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
_FROM_SAFETENSORS = {v: k for k, v in DTYPES.items()}
TIED_OUTPUT = "lm_head.weight"
TIED_INPUT_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "shared.weight")

SafetensorsCheckpoint = tuple[CheckpointMeta, dict[str, TensorMeta], dict[str, list[PieceMeta]]]


def tie(names: Collection[str], config: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """``(lm_head.weight, input embedding)`` when ``config`` ties them and one input embedding is among ``names``."""
    if config is None or not config.get("tie_word_embeddings", True):
        return None
    sources = [n for n in names if any(n == s or n.endswith("." + s) for s in TIED_INPUT_SUFFIXES)]
    return (TIED_OUTPUT, sources[0]) if len(sources) == 1 else None


def holds(root: Root) -> bool:
    """Whether ``root`` is a Hugging Face folder (``model.safetensors`` or its sharded index)."""
    return root.has(INDEX) or root.has(SINGLE)


def refusal(uri: str) -> str:
    """The message for an operation that needs a tierckpt checkpoint but found a safetensors folder."""
    return (
        f"{uri!r} is a Hugging Face safetensors folder (no COMMIT record), not a tierckpt checkpoint. "
        "tierckpt.load reads it in place, its tensors under the key 'model', without verify=True (safetensors "
        f"records no checksums); for anything else convert it: tierckpt convert --from safetensors --to tierckpt {uri} OUT"
    )


def read_safetensors(backend: Backend) -> SafetensorsCheckpoint:
    """Header, tensor table and pieces of the safetensors folder at the root of ``backend`` (a chain
    below the node cache)."""
    uri = backend.root_uri
    sched = get_scheduler()
    weight_map = _weight_map(backend) if sched.run(backend.exists(INDEX)) else None
    files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
    sizes = _sizes(backend, files)
    tensors: dict[str, TensorMeta] = {}
    pieces: dict[str, list[PieceMeta]] = {}
    for file in files:
        for name, tensor, piece in _file_entries(backend, file, sizes[file]):
            if name in tensors:
                raise CorruptCheckpointError(f"safetensors folder {uri!r}: tensor {name!r} is in more than one file")
            if weight_map is not None and weight_map.get(name, file) != file:
                raise CorruptCheckpointError(
                    f"safetensors folder {uri!r}: {INDEX} places {name!r} in {weight_map[name]!r}, but {file!r} holds it"
                )
            tensors[name], pieces[name] = tensor, [piece]
    if weight_map is not None and (lost := sorted(set(weight_map) - set(tensors))):
        raise CorruptCheckpointError(
            f"safetensors folder {uri!r}: {INDEX} lists {len(lost)} tensor(s) its files do not hold, e.g. {lost[0]!r}"
        )
    tied = tie(tensors, _config(backend))
    if tied is not None and tied[0] not in tensors:
        output, source = tied
        tensors[output] = dataclasses.replace(tensors[source], fqn=output)
        pieces[output] = [dataclasses.replace(p, fqn=output) for p in pieces[source]]
    tensors = {f"{MODEL_KEY}.{n}": dataclasses.replace(t, fqn=f"{MODEL_KEY}.{n}") for n, t in tensors.items()}
    pieces = {f"{MODEL_KEY}.{n}": [dataclasses.replace(p, fqn=f"{MODEL_KEY}.{n}") for p in ps] for n, ps in pieces.items()}
    meta = CheckpointMeta(
        generation="", world_size=1, created_unix=0.0, frameworks=("safetensors",),
        files=tuple(FileMeta(key=k, size=v) for k, v in sorted(sizes.items())),
        num_tensors=len(tensors), num_pieces=sum(len(p) for p in pieces.values()),
        tensor_bytes=sum(t.nbytes for t in tensors.values()), tags={FORMAT_TAG: "huggingface"},
    )
    return meta, tensors, pieces


def parse_json(data: bytes, what: str) -> Any:
    """The JSON document ``data`` (``what``: the file it is, for the message); malformed or nested deeper
    than the parser recurses (an index or header a thousand levels deep) raises
    :class:`~tierckpt.errors.CorruptCheckpointError` naming ``what``."""
    try:
        return json.loads(data)
    except RecursionError:
        raise CorruptCheckpointError(f"{what} nests JSON arrays or objects too deep to be read; it is not a "
                                     "safetensors index, config or header") from None
    except ValueError as exc:
        raise CorruptCheckpointError(f"{what} is not valid JSON: {exc}") from exc


def _json(backend: Backend, key: str) -> Any:
    """A small JSON document of the folder, refused when larger than :data:`MAX_JSON_BYTES` or malformed."""
    sched = get_scheduler()
    if sched.run(backend.size(key)) > MAX_JSON_BYTES:
        raise CorruptCheckpointError(f"{key!r} of {backend.root_uri!r} is larger than {MAX_JSON_BYTES} bytes; it is not read")
    return parse_json(sched.run(backend.get(key)), f"{key!r} of {backend.root_uri!r}")


def _weight_map(backend: Backend) -> dict[str, str]:
    """Tensor name -> shard file, from ``model.safetensors.index.json``."""
    doc = _json(backend, INDEX)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CorruptCheckpointError(f"{INDEX} of {backend.root_uri!r} has no weight_map of tensor names to files")
    return {name: validate_key(file) for name, file in weight_map.items()}


def _config(backend: Backend) -> dict[str, Any] | None:
    if not get_scheduler().run(backend.exists(CONFIG)):
        return None
    doc = _json(backend, CONFIG)
    return doc if isinstance(doc, dict) else None


def _sizes(backend: Backend, files: list[str]) -> dict[str, int]:
    async def sizes() -> list[int]:
        return list(await asyncio.gather(*(backend.size(f) for f in files)))

    try:
        return dict(zip(files, get_scheduler().run(sizes())))
    except CheckpointNotFoundError as exc:
        raise CorruptCheckpointError(f"a file of safetensors folder {backend.root_uri!r} is missing: {exc}") from exc


def _file_entries(backend: Backend, file: str, size: int) -> list[tuple[str, TensorMeta, PieceMeta]]:
    """Each tensor of one safetensors file: its name, description and the piece holding its bytes."""
    bad = f"safetensors file {file!r} of {backend.root_uri!r}"
    sched = get_scheduler()
    if size < 8:
        raise CorruptCheckpointError(f"{bad} has {size} bytes, fewer than its header length")
    (length,) = struct.unpack("<Q", sched.run(backend.get_range(file, 0, 8)))
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise CorruptCheckpointError(f"{bad} claims a header of {length} bytes (the file has {size})")
    header = parse_json(sched.run(backend.get_range(file, 8, 8 + length)), f"the header of {bad}")
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{bad} has a header that is not a JSON object")
    start = 8 + length
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _FROM_SAFETENSORS[entry["dtype"]]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (*shape, begin, end)):
                raise ValueError("a size or offset is not a non-negative integer")
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"{bad} describes {name!r} as {entry!r}, which is not a tensor tierckpt reads ({exc!r}; dtypes: "
                f"{sorted(_FROM_SAFETENSORS)})"
            ) from None
        nbytes = math.prod(shape) * itemsize(dtype_from_name(dtype))
        if end - begin != nbytes or start + end > size:
            raise CorruptCheckpointError(
                f"{bad}: {name!r} ({dtype} {list(shape)}, {nbytes} bytes) has data_offsets [{begin}, {end}] "
                f"(data starts at byte {start}, the file has {size})"
            )
        tensor = TensorMeta(fqn=name, dtype=dtype, shape=shape)
        piece = PieceMeta(fqn=name, region=Box((0,) * len(shape), shape), file=file, byte_offset=start + begin,
                          byte_length=nbytes, crc32c=0)
        out.append((name, tensor, piece))
    return out

