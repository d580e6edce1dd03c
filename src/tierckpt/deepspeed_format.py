"""Reading a DeepSpeed ZeRO checkpoint folder (stage 1, 2 or 3) in place, as a tierckpt checkpoint.

``engine.save_checkpoint(folder)`` writes ``folder/latest`` (the tag of the newest save) and
``folder/<tag>/`` holding ``mp_rank_00_model_states.pt`` (``param_shapes``: each param group's
parameter names and shapes, ``buffer_names``, the ``module`` state dict) and one
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank. Each param group's trainable
parameters are flattened into one fp32 buffer (padded at the end), split evenly across the ranks: rank
``r`` holds its partition as ``single_partition_of_fp32_groups[g]``, the optimizer's moments of the
same elements in ``base_optimizer_state["state"][g]`` (``exp_avg``, ``exp_avg_sq``, ``step``), and
``param_slice_mappings[g]``: for each parameter, how many of its elements the partition holds and where.
ZeRO-3 writes ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank instead and splits each
parameter on its own: rank ``r`` holds elements ``[r*k, (r+1)*k)`` of it (``k = ceil(numel / world)``),
its parts back to back in ``fp32_flat_groups[g]`` and ``optimizer_state_dict["state"][g]``.

Every such slice is a flat-range piece (:class:`~tierckpt.regions.FlatRange`) of its parameter, read in
place from the rank file (:mod:`tierckpt.torch_archive` finds the bytes; nothing is unpickled), so the
ordinary loader reshards it onto any layout. Names are tierckpt's (torch's flattened optimizer state
dict): ``model.<fqn>`` (the fp32 master weights; buffers and frozen parameters from ``module``),
``optim.state.<fqn>.<exp_avg|exp_avg_sq|step>`` and ``optim.param_groups.<fqn>.<setting>`` (each
parameter's group settings: lr, betas, eps, weight_decay...), so
``tierckpt.load(folder, {"model": model, "optim": adam})`` resumes a torch Adam/AdamW exactly.
A universal checkpoint (``ds_to_universal``) is read by :mod:`tierckpt.ucp_format`.

Group settings live inside ``data.pkl``: each is an object whose bytes are that ``data.pkl`` record
and whose codec (``deepspeed:<path>``) names where the value is in the unpickled structure
(:func:`decode_setting`; only plain values are accepted).

Not read in place, refused naming DeepSpeed's ``ds_to_universal`` command: tensor- or
pipeline-parallel folders (more than one ``mp_rank``), and ZeRO-3 folders with frozen parameters,
param groups split in sub-groups, or partitions over other groups than the data-parallel ranks. DeepSpeed writes no checksums: pieces carry ``crc32c=0`` and ``verify=True``
refuses the folder, as for a DCP directory.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from typing import Any

from .backends import Backend
from .errors import CheckpointError, CorruptCheckpointError
from .io.scheduler import get_scheduler
from .metadata import CheckpointMeta, FileMeta, ObjectMeta, PieceMeta, TensorMeta, dtype_name
from .regions import Box, FlatRange
from .store import without_node_cache
from .torch_archive import Archive, Opaque, StoredTensor, read_archives, unpickle

LATEST = "latest"
MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ZERO3_MODEL_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
"""ZeRO-3 writes one model states file per rank (rank 0's is read: ``param_shapes`` are the same on all)."""
FORMAT_TAG = "deepspeed"
STATES = ("exp_avg", "exp_avg_sq", "step")
CODEC_PREFIX = "deepspeed:"

DeepSpeedCheckpoint = tuple[CheckpointMeta, dict[str, TensorMeta], dict[str, list[PieceMeta]]]


def universal_command(uri: str, prefix: str) -> str:
    """DeepSpeed's command that makes a universal checkpoint (which tierckpt reads) of the save in tag
    folder ``prefix`` of the folder at ``uri``."""
    folder = f"{uri.rstrip('/')}/{prefix.rstrip('/')}" if prefix else uri
    return f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {folder} --output_folder OUT --inject_missing_state"


def _listing(backend: Backend) -> list[str]:
    return get_scheduler().run(backend.list(""))


def tag_prefix(backend: Backend, keys: Sequence[str]) -> str | None:
    """``"<tag>/"`` of the save a DeepSpeed folder's ``latest`` names, ``""`` when the root is a tag folder
    itself, ``None`` when the root is no DeepSpeed ZeRO folder."""
    names = set(keys)
    if MODEL_STATES in names or any(_OPTIM_FILE.match(k) for k in names):
        return ""
    if LATEST not in names:
        return None
    raw = get_scheduler().run(backend.get_capped(LATEST, 4096)).decode(errors="replace").strip()
    if not raw or "/" in raw or raw in (".", ".."):
        raise CorruptCheckpointError(f"{LATEST!r} of DeepSpeed folder {backend.root_uri!r} names {raw!r}, not a tag folder")
    if not any(k.startswith(f"{raw}/") for k in names):
        raise CorruptCheckpointError(
            f"{LATEST!r} of DeepSpeed folder {backend.root_uri!r} names tag {raw!r}, but there is no folder {raw}/; "
            "the save was interrupted or the folder was copied in part"
        )
    return f"{raw}/"


def is_deepspeed(backend: Backend, keys: Sequence[str] | None = None) -> bool:
    """Whether the root of ``backend`` is a DeepSpeed ZeRO checkpoint folder (or one of its tag folders):
    DeepSpeed's ``*_model_states.pt`` at the root, or in a folder beside ``latest``."""
    keys = _listing(without_node_cache(backend)) if keys is None else keys
    if any(k.endswith("_model_states.pt") and "/" not in k for k in keys):
        return True
    return LATEST in keys and any(k.endswith("_model_states.pt") and k.count("/") == 1 for k in keys)


def read_deepspeed(backend: Backend, keys: Sequence[str] | None = None) -> DeepSpeedCheckpoint:
    """Header, tensor table and pieces of the DeepSpeed ZeRO folder at the root of ``backend`` (listing ``keys``)."""
    backend = without_node_cache(backend)
    uri = backend.root_uri
    keys = _listing(backend) if keys is None else keys
    prefix = tag_prefix(backend, keys) or ""
    optim_files = {int(m[1]): k for k in keys if k.startswith(prefix) and "/" not in k[len(prefix):]
                   and (m := _OPTIM_FILE.match(k[len(prefix):]))}
    mp_ranks = {m[2] for k in keys if (m := _OPTIM_FILE.match(k[len(prefix):]))} | {
        k for k in keys if re.match(rf"^{re.escape(prefix)}mp_rank_(?!00_)\d+_model_states\.pt$", k)}
    model_file = prefix + MODEL_STATES
    if model_file not in keys:
        zero3 = sorted(k for k in keys if k.startswith(prefix) and ZERO3_MODEL_FILE.match(k[len(prefix):]))
        if not zero3:
            raise CorruptCheckpointError(f"DeepSpeed folder {uri!r} has no {model_file!r}: the save is incomplete")
        model_file = next((k for k in zero3 if ZERO3_MODEL_FILE.match(k[len(prefix):])[1] == "0"), zero3[0])
    if len(mp_ranks - {"00"}) > 0:
        raise CheckpointError(
            f"{uri!r} is a DeepSpeed checkpoint saved with tensor or pipeline parallelism (several mp_rank files), "
            f"which tierckpt does not read in place; make a universal checkpoint of it and load that: {universal_command(uri, prefix)}"
        )
    if not optim_files or sorted(optim_files) != list(range(len(optim_files))):
        raise CorruptCheckpointError(
            f"DeepSpeed folder {uri!r} holds optimizer files of ranks {sorted(optim_files)}, not ranks 0..N-1: "
            "a rank's zero_pp_rank_<r>_mp_rank_00_optim_states.pt is missing"
        )
    world = len(optim_files)
    files = [model_file] + [optim_files[r] for r in range(world)]
    archives = read_archives(backend, files)
    model = as_dict(archives[model_file].value, model_file, uri)
    shapes = param_shapes(model, model_file, uri)
    tensors: dict[str, TensorMeta] = {}
    pieces: dict[str, list[PieceMeta]] = {}
    for g, group in enumerate(shapes):
        for fqn, shape in group.items():
            tensors[f"model.{fqn}"] = TensorMeta(fqn=f"model.{fqn}", dtype="float32", shape=shape)
    for r in range(world):
        flats, slices = _layout(archives[optim_files[r]].value, optim_files[r], r, world, shapes, uri, prefix)
        _add_rank(flats, slices, optim_files[r], r, shapes, tensors, pieces, uri)
    _check_complete(shapes, pieces, uri)
    stage = _stage(archives[optim_files[0]].value)
    _add_module_tensors(model, model_file, shapes, tensors, pieces, uri, zero3=stage == 3)
    rank0 = optim_files[0]
    path = ("optimizer_state_dict", "optimizer_state_dict" if stage == 3 else "base_optimizer_state", "param_groups")
    objects = group_objects(backend, rank0, path, archives[rank0], shapes)
    sizes = {f: get_scheduler().run(backend.size(f)) for f in files}
    meta = CheckpointMeta(
        generation="", world_size=world, created_unix=0.0, frameworks=("deepspeed",),
        files=tuple(FileMeta(key=k, size=v) for k, v in sorted(sizes.items())), objects=tuple(objects),
        num_tensors=len(tensors), num_pieces=sum(len(p) for p in pieces.values()),
        tensor_bytes=sum(t.nbytes for t in tensors.values()),
        tags={FORMAT_TAG: f"zero{stage}", "deepspeed_tag": prefix.rstrip("/")},
    )
    return meta, tensors, pieces


def _not_in_place(uri: str, prefix: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{uri!r} is a DeepSpeed checkpoint {what}, which tierckpt does not read in place; make a universal "
        f"checkpoint of it and load or convert that: {universal_command(uri, prefix)}"
    )


def as_dict(value: Any, file: str, uri: str) -> dict[str, Any]:
    """``value`` (an unpickled file of the folder) when it is a dict, else :class:`CorruptCheckpointError` naming ``file``."""
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{file!r} of DeepSpeed folder {uri!r} holds a {type(value).__name__}, not a dict")
    return value


def param_shapes(model: dict[str, Any], file: str, uri: str) -> list[dict[str, tuple[int, ...]]]:
    """Each param group's parameter names and shapes, in the order of the flat buffers."""
    groups = model.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CorruptCheckpointError(f"{file!r} of DeepSpeed folder {uri!r} has no param_shapes list of groups")
    out = []
    for group in groups:
        shapes = {}
        for fqn, shape in group.items():
            if not isinstance(fqn, str) or not isinstance(shape, tuple) or not all(
                isinstance(n, int) and n >= 0 for n in shape
            ):
                raise CorruptCheckpointError(f"{file!r} of DeepSpeed folder {uri!r} gives {fqn!r} the shape {shape!r}")
            shapes[fqn] = tuple(shape)
        out.append(shapes)
    return out


def _stage(archive: Any) -> int:
    stage = archive.get("optimizer_state_dict", {}).get("zero_stage") if isinstance(archive, dict) else None
    if isinstance(stage, Opaque) and stage.args and isinstance(stage.args[0], int):
        return stage.args[0]
    return stage if isinstance(stage, int) else 0


Flats = list[dict[str, Any]]
"""Per param group: ``""`` (the fp32 weights) and each optimizer state name -> the rank's flat tensor."""
Slices = list[list[tuple[str, int, int]]]
"""Per param group: ``(fqn, numel, start)`` of each parameter slice in the rank's flat tensors."""


def _layout(
    archive: Any, file: str, rank: int, world: int, shapes: list[dict[str, tuple[int, ...]]], uri: str, prefix: str,
) -> tuple[Flats, Slices]:
    """A rank file's flat tensors and where each parameter's slice is in them (ZeRO-1/2 or ZeRO-3)."""
    bad = f"{file!r} of DeepSpeed folder {uri!r}"
    osd = as_dict(archive, file, uri).get("optimizer_state_dict")
    if isinstance(osd, dict) and "fp32_flat_groups" in osd:
        return _zero3_layout(osd, bad, rank, world, shapes, uri, prefix)
    try:
        fp32 = osd["single_partition_of_fp32_groups"]
        states = osd["base_optimizer_state"]["state"]
        mappings = osd["param_slice_mappings"]
        flats = [{"": fp32[g], **{s: states[g][s] for s in STATES if s in states[g]}} for g in range(len(shapes))]
        slices = [[(fqn, *_fragment(a)) for fqn, a in mappings[g].items()] for g in range(len(shapes))]
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"{bad} is not a ZeRO optimizer file (no single_partition_of_fp32_groups, base_optimizer_state or "
            f"param_slice_mappings for its {len(shapes)} param groups: {exc!r})"
        ) from None
    return flats, slices


def _zero3_layout(
    osd: dict[str, Any], bad: str, rank: int, world: int, shapes: list[dict[str, tuple[int, ...]]], uri: str, prefix: str,
) -> tuple[Flats, Slices]:
    """ZeRO-3: each parameter is split evenly (``ceil(numel / world)`` per rank, the last padded), and a
    rank's flat group holds its part of each parameter of the group, in ``param_shapes`` order."""
    if osd.get("ds_zero_partition_groups") or osd.get("partition_count", world) != world:
        raise _not_in_place(uri, prefix, "partitioned over other groups than its data-parallel ranks (ZeRO++/MiCS)")
    try:
        fp32 = osd["fp32_flat_groups"]
        inner = osd["optimizer_state_dict"]
        states = inner["state"]
        if len(fp32) != len(shapes) or len(inner["param_groups"]) != len(shapes):
            raise _not_in_place(uri, prefix, "whose param groups are split in sub-groups (sub_group_size)")
        flats = [{"": fp32[g], **{s: states[g][s] for s in STATES if s in states[g]}} for g in range(len(shapes))]
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"{bad} is not a ZeRO-3 optimizer file (no fp32_flat_groups or optimizer state for its "
            f"{len(shapes)} param groups: {exc!r})"
        ) from None
    slices: Slices = []
    for group in shapes:
        start, group_slices = 0, []
        for fqn, shape in group.items():
            per_rank = -(-math.prod(shape) // world)
            group_slices.append((fqn, max(0, min(per_rank, math.prod(shape) - rank * per_rank)), start))
            start += per_rank
        slices.append(group_slices)
    return flats, slices


def _add_rank(
    flats: Flats, slices: Slices, file: str, rank: int, shapes: list[dict[str, tuple[int, ...]]],
    tensors: dict[str, TensorMeta], pieces: dict[str, list[PieceMeta]], uri: str,
) -> None:
    """The pieces one rank file holds: its slice of each parameter's fp32 weights and optimizer state."""
    bad = f"{file!r} of DeepSpeed folder {uri!r}"
    for g, (flat, group_slices) in enumerate(zip(flats, slices)):
        for name, t in flat.items():
            if not isinstance(t, StoredTensor) or (name != "step" and len(t.shape) != 1):
                raise CorruptCheckpointError(f"{bad}: {name or 'fp32'} of param group {g} is {t!r}, not a flat tensor")
        if rank == 0 and "step" in flat:  # one step per group, each of its parameters has it
            for fqn in shapes[g]:
                step = flat["step"]
                _add(tensors, pieces, f"optim.state.{fqn}.step", step, Box((), ()), step.byte_offset, step.nbytes)
        for fqn, numel, start in group_slices:
            if numel == 0:
                continue
            shape = shapes[g].get(fqn)
            if shape is None:
                raise CorruptCheckpointError(f"{bad} maps {fqn!r}, which param_shapes does not list in group {g}")
            done = sum(p.region.numel for p in pieces.get(f"model.{fqn}", ()))
            region = FlatRange(done, done + numel)
            if region.stop > math.prod(shape):
                raise CorruptCheckpointError(f"{bad} holds more elements of {fqn!r} than its shape {list(shape)} has")
            for name, t in flat.items():
                key = f"model.{fqn}" if not name else f"optim.state.{fqn}.{name}"
                if name == "step":
                    continue
                if start + numel > t.numel:
                    raise CorruptCheckpointError(
                        f"{bad}: {fqn!r} is mapped to elements {start}..{start + numel} of a partition of {t.numel}"
                    )
                item = t.nbytes // max(t.numel, 1)
                _add(tensors, pieces, key, t, region, t.byte_offset + start * item, numel * item, shape)


def _fragment(address: Any) -> tuple[int, int]:
    """``(numel, start)`` of a DeepSpeed ``fragment_address`` (a dataclass: its state holds both)."""
    state = address.state if isinstance(address, Opaque) else None
    numel, start = (state["numel"], state["start"]) if isinstance(state, dict) else address.args
    if not (isinstance(numel, int) and isinstance(start, int) and numel >= 0 and start >= 0):
        raise TypeError(f"fragment address {address!r}")
    return numel, start


def _add(
    tensors: dict[str, TensorMeta], pieces: dict[str, list[PieceMeta]], key: str, t: StoredTensor,
    region: Box | FlatRange, offset: int, length: int, shape: tuple[int, ...] | None = None,
) -> None:
    meta = TensorMeta(fqn=key, dtype=dtype_name(t.dtype), shape=t.shape if shape is None else shape)
    known = tensors.setdefault(key, meta)
    if known != meta:
        raise CorruptCheckpointError(f"DeepSpeed files disagree on {key!r}: {known} and {meta}")
    pieces.setdefault(key, []).append(
        PieceMeta(fqn=key, region=region, file=t.file, byte_offset=offset, byte_length=length, crc32c=0)
    )


def _check_complete(shapes: list[dict[str, tuple[int, ...]]], pieces: dict[str, list[PieceMeta]], uri: str) -> None:
    for group in shapes:
        for fqn, shape in group.items():
            held = sum(p.region.numel for p in pieces.get(f"model.{fqn}", ()))
            need = math.prod(shape)
            if held != need:
                raise CorruptCheckpointError(
                    f"DeepSpeed folder {uri!r}: the ranks' partitions hold {held} of the {need} elements of {fqn!r}"
                )


def _add_module_tensors(
    model: dict[str, Any], file: str, shapes: list[dict[str, tuple[int, ...]]], tensors: dict[str, TensorMeta],
    pieces: dict[str, list[PieceMeta]], uri: str, *, zero3: bool,
) -> None:
    """Buffers and frozen parameters, from the ``module`` state dict (trainable ones come from the
    partitions). ZeRO-3 keeps only buffers whole there (its frozen parameters are partitioned too)."""
    module = model.get("module")
    if not isinstance(module, dict):
        raise CorruptCheckpointError(f"{file!r} of DeepSpeed folder {uri!r} has no module state dict")
    if zero3 and model.get("frozen_param_shapes"):
        prefix = file.rsplit("/", 1)[0] + "/" if "/" in file else ""
        raise _not_in_place(uri, prefix, "with frozen parameters under ZeRO-3")
    trainable = {fqn for group in shapes for fqn in group}
    buffers = model.get("buffer_names")
    for fqn, t in module.items():
        if fqn in trainable or not isinstance(t, StoredTensor) or (zero3 and not (isinstance(buffers, list) and fqn in buffers)):
            continue
        _add(tensors, pieces, f"model.{fqn}", t, Box((0,) * len(t.shape), t.shape), t.byte_offset, t.nbytes)


# -- param group settings -------------------------------------------------------------------------------
def group_objects(
    backend: Backend, file: str, path: tuple[str, ...], archive: Archive, shapes: list[dict[str, tuple[int, ...]]],
) -> list[ObjectMeta]:
    """``optim.param_groups.<fqn>.<setting>`` for every parameter of every group found at ``path`` of
    ``archive`` (``file``): each points at the file's ``data.pkl`` bytes, its codec at the value."""
    groups: Any = archive.value
    for part in path:
        groups = groups.get(part) if isinstance(groups, dict) else None
    if groups is None:  # not saved (ZeRO-1/2's elastic checkpoints): a strict load names the settings missing
        return []
    if not isinstance(groups, list) or len(groups) != len(shapes) or not all(isinstance(g, dict) for g in groups):
        raise CorruptCheckpointError(
            f"{file!r} of DeepSpeed folder {backend.root_uri!r} has no list of {len(shapes)} param groups at {'/'.join(path)}"
        )
    start, length, crc = archive.pickle_offset, archive.pickle_length, archive.pickle_crc32c
    out = []
    for g, (group, names) in enumerate(zip(groups, shapes)):
        for setting in group:
            if setting == "params" or not isinstance(setting, str):
                continue
            codec = CODEC_PREFIX + "/".join((*path, str(g), setting))
            for fqn in names:
                out.append(ObjectMeta(key=f"optim.param_groups.{fqn}.{setting}", rank=None, file=file,
                                      byte_offset=start, byte_length=length, crc32c=crc, codec=codec))
    return out


def decode_setting(data: bytes, codec: str, key: str) -> Any:
    """The param group setting a ``deepspeed:<path>`` object names inside ``data`` (a ``data.pkl``)."""
    value: Any = _unpickled(data)
    for part in codec[len(CODEC_PREFIX):].split("/"):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise CorruptCheckpointError(f"object {key!r}: the DeepSpeed file has nothing at {codec!r}")
    if not _plain(value):
        raise CorruptCheckpointError(f"object {key!r} is a {type(value).__name__}, not a plain param group setting")
    return value


@functools.lru_cache(maxsize=8)
def _unpickled(data: bytes) -> Any:
    try:
        return unpickle(data)
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: any failure is corruption
        raise CorruptCheckpointError(f"a DeepSpeed data.pkl cannot be decoded: {exc!r}") from exc


def _plain(value: Any) -> bool:
    """Whether ``value`` is a number, string, ``None`` or a tuple or list of those (each container looked at
    once: a crafted file's DAG of shared tuples has 2^depth paths)."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        item = todo.pop()
        if item is None or type(item) in (bool, int, float, str) or id(item) in seen:
            continue
        if type(item) not in (tuple, list):
            return False
        seen.add(id(item))
        todo.extend(item)
    return True
