"""Reading a DeepSpeed ZeRO checkpoint folder (stage 1, 2 or 3) in place, as a tierckpt checkpoint.

``engine.save_checkpoint(folder)`` writes ``folder/latest`` (the tag of the newest save) and
``folder/<tag>/`` holding ``mp_rank_00_model_states.pt`` (``param_shapes``: each param group's
parameter names and shapes, ``buffer_names``, the ``module`` state dict) and one
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank. Each param group's trainable
parameters are flattened into one fp32 buffer (padded at the end), split evenly across the ranks: rank
``r`` holds its partition as ``single_partition_of_fp32_groups[g]``, the optimizer's moments of the
same elements in ``base_optimizer_state["state"][g]`` (``exp_avg``, ``exp_avg_sq``, ``step``: a tensor, or a
Python int with DeepSpeed's CPU Adam of ``offload_optimizer``), and
``param_slice_mappings[g]``: for each parameter, how many of its elements the partition holds and where.
ZeRO-3 writes ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank instead and splits each
parameter on its own: rank ``r`` holds elements ``[r*k, (r+1)*k)`` of it (``k = ceil(numel / world)``),
its parts back to back in ``fp32_flat_groups[g]`` and ``optimizer_state_dict["state"][g]``; its frozen
parameters (``frozen_param_shapes``) are split the same way, rank ``r``'s part in the
``frozen_param_fragments`` of its model states file (:func:`add_frozen_fragments`).

Every such slice is a flat-range piece (:class:`~tierckpt.native.regions.FlatRange`) of its parameter, read in
place from the rank file (:mod:`tierckpt.formats.torch_archive` finds the bytes; nothing is unpickled), so the
ordinary loader reshards it onto any layout. Names are tierckpt's (torch's flattened optimizer state
dict): ``model.<fqn>`` (the fp32 master weights; buffers and ZeRO-1/2's frozen parameters from ``module``),
``optim.state.<fqn>.<exp_avg|exp_avg_sq|step>`` and ``optim.param_groups.<fqn>.<setting>`` (each
parameter's group settings: lr, betas, eps, weight_decay...), so
``tierckpt.load(folder, {"model": model, "optim": adam})`` resumes a torch Adam/AdamW exactly.
A universal checkpoint (``ds_to_universal``) is read by :mod:`tierckpt.formats.ucp`.
Group settings and Python-int steps are objects inside a file's ``data.pkl``
(:mod:`tierckpt.formats.deepspeed_objects`).

Not read in place, refused naming DeepSpeed's ``ds_to_universal`` command: tensor- or
pipeline-parallel folders (more than one ``mp_rank``), and ZeRO-3 folders with param groups split in
sub-groups or partitions over other groups than the data-parallel ranks. DeepSpeed writes no checksums: pieces carry ``crc32c=0`` and ``verify=True``
refuses the folder, as for a DCP directory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from tierckpt.backends import Backend
from tierckpt.formats.deepspeed_objects import group_objects, is_number, step_objects
from tierckpt.errors import CheckpointError, CorruptCheckpointError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native.metadata import CheckpointMeta, FileMeta, PieceMeta, TensorMeta, dtype_name
from tierckpt.native.regions import Box, FlatRange
from tierckpt.store import without_node_cache
from tierckpt.formats.torch_archive import Opaque, StoredTensor, read_archives

LATEST = "latest"
MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ZERO3_MODEL_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
"""ZeRO-3 writes one model states file per rank (rank 0's is read: ``param_shapes`` are the same on all)."""
FORMAT_TAG = "deepspeed"
STATES = ("exp_avg", "exp_avg_sq", "step")

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
    zero3_models = zero3_model_files(keys, prefix)
    if model_file not in keys:
        if not zero3_models:
            raise CorruptCheckpointError(f"DeepSpeed folder {uri!r} has no {model_file!r}: the save is incomplete")
        model_file = zero3_models.get(0, zero3_models[min(zero3_models)])
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
    steps: list[list[Any]] = []
    for r in range(world):
        flats, slices = _layout(archives[optim_files[r]].value, optim_files[r], r, world, shapes, uri, prefix)
        _add_rank(flats, slices, optim_files[r], r, shapes, tensors, pieces, uri)
        steps.append([flat.get("step") for flat in flats])
    _check_complete(shapes, pieces, uri)
    _check_steps_agree(steps, optim_files, uri)
    stage = _stage(archives[optim_files[0]].value)
    _add_module_tensors(model, model_file, shapes, tensors, pieces, uri, zero3=stage == 3)
    if stage == 3:
        files += add_frozen_fragments(backend, model, model_file, zero3_models, world, tensors, pieces, "DeepSpeed folder")
    rank0 = optim_files[0]
    path = ("optimizer_state_dict", "optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    objects = group_objects(backend, rank0, (*path, "param_groups"), archives[rank0], shapes)
    objects += step_objects(rank0, archives[rank0], (*path, "state"), shapes, steps[0])
    sizes = {f: get_scheduler().run(backend.size(f)) for f in set(files)}
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
    return [_shape_table(group, file, uri) for group in groups]


def _shape_table(group: dict[Any, Any], file: str, uri: str) -> dict[str, tuple[int, ...]]:
    """``{fqn: shape}`` of a ``param_shapes`` group or of ``frozen_param_shapes``, each entry checked."""
    shapes = {}
    for fqn, shape in group.items():
        if not isinstance(fqn, str) or not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise CorruptCheckpointError(f"{file!r} of DeepSpeed folder {uri!r} gives {fqn!r} the shape {shape!r}")
        shapes[fqn] = tuple(shape)
    return shapes


def zero3_model_files(keys: Sequence[str], prefix: str) -> dict[int, str]:
    """Rank -> ZeRO-3 model states file (``zero_pp_rank_<r>_mp_rank_00_model_states.pt``) in folder ``prefix``."""
    return {int(m[1]): k for k in keys if k.startswith(prefix) and (m := ZERO3_MODEL_FILE.match(k[len(prefix):]))}


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
            if name == "step" and is_number(t):  # CPU Adam's: an object (deepspeed_objects.step_objects)
                continue
            if not isinstance(t, StoredTensor) or (name != "step" and len(t.shape) != 1):
                raise CorruptCheckpointError(f"{bad}: {name or 'fp32'} of param group {g} is {t!r}, not a flat tensor or step number")
        step = flat.get("step")
        if rank == 0 and isinstance(step, StoredTensor):  # one step per group, each of its parameters has it
            for fqn in shapes[g]:
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


def _check_steps_agree(steps: list[list[Any]], files: dict[int, str], uri: str) -> None:
    """Every rank saved the same Python-int step of each group (rank 0's is read), as ``ds_to_universal`` requires."""
    for rank, rank_steps in enumerate(steps):
        for g, (first, mine) in enumerate(zip(steps[0], rank_steps)):
            if is_number(first) and mine != first:
                raise CorruptCheckpointError(
                    f"DeepSpeed folder {uri!r}: {files[rank]!r} holds step {mine!r} for param group {g}, "
                    f"{files[0]!r} step {first!r}; the rank files are of different saves"
                )


def _add_module_tensors(
    model: dict[str, Any], file: str, shapes: list[dict[str, tuple[int, ...]]], tensors: dict[str, TensorMeta],
    pieces: dict[str, list[PieceMeta]], uri: str, *, zero3: bool,
) -> None:
    """Buffers and (ZeRO-1/2) frozen parameters, from the ``module`` state dict (trainable ones come from
    the partitions). ZeRO-3 keeps only buffers whole there (its frozen parameters are partitioned too:
    :func:`add_frozen_fragments`)."""
    module = model.get("module")
    if not isinstance(module, dict):
        raise CorruptCheckpointError(f"{file!r} of DeepSpeed folder {uri!r} has no module state dict")
    frozen = model.get("frozen_param_shapes")
    lost = [] if zero3 or not isinstance(frozen, dict) else [f for f in frozen if not isinstance(module.get(f), StoredTensor)]
    if lost:
        raise CorruptCheckpointError(f"{file!r} of DeepSpeed folder {uri!r} lists frozen parameters {lost} its module does not hold")
    trainable = {fqn for group in shapes for fqn in group}
    buffers = model.get("buffer_names")
    for fqn, t in module.items():
        if fqn in trainable or not isinstance(t, StoredTensor) or (zero3 and not (isinstance(buffers, list) and fqn in buffers)):
            continue
        _add(tensors, pieces, f"model.{fqn}", t, Box((0,) * len(t.shape), t.shape), t.byte_offset, t.nbytes)


def add_frozen_fragments(
    backend: Backend, model: dict[str, Any], model_file: str, rank_files: dict[int, str], world: int,
    tensors: dict[str, TensorMeta], pieces: dict[str, list[PieceMeta]], what: str,
) -> list[str]:
    """ZeRO-3's frozen parameters (``frozen_param_shapes`` of ``model``, rank 0's model states), and the
    files read for them: rank ``r``'s model states file (``rank_files[r]``) holds elements
    ``[r*k, (r+1)*k)`` of each (``k = ceil(numel / world)``, the last rank's padded) in its
    ``frozen_param_fragments``, as DeepSpeed's ``zero_to_fp32`` joins them. A rank's file that is not
    there is named (``what`` says which kind of folder lacks it): nothing is dropped."""
    uri = backend.root_uri
    frozen = model.get("frozen_param_shapes")
    if not frozen:
        return []
    if not isinstance(frozen, dict):
        raise CorruptCheckpointError(f"{model_file!r} of {what} {uri!r} holds frozen_param_shapes {frozen!r}, not a dict")
    shapes = _shape_table(frozen, model_file, uri)
    missing = [r for r in range(world) if r not in rank_files]
    if missing:
        raise CorruptCheckpointError(
            f"{what} {uri!r} has ZeRO-3 frozen parameters ({', '.join(shapes)}), which each rank's model states file "
            f"holds a part of, but not the files of rank(s) {missing} (zero_pp_rank_<r>_mp_rank_00_model_states.pt of "
            f"{world} ranks): copy them in from the ZeRO folder it was saved or made from"
        )
    files = [rank_files[r] for r in range(world)]
    archives = read_archives(backend, files)
    for rank, file in enumerate(files):
        fragments = as_dict(archives[file].value, file, uri).get("frozen_param_fragments")
        for fqn, shape in shapes.items():
            numel = math.prod(shape)
            per_rank = -(-numel // world)
            start, stop = min(numel, rank * per_rank), min(numel, (rank + 1) * per_rank)
            t = fragments.get(fqn) if isinstance(fragments, dict) else None
            if not isinstance(t, StoredTensor) or len(t.shape) != 1 or t.numel != per_rank:
                raise CorruptCheckpointError(
                    f"{file!r} of {what} {uri!r} holds {t!r} as its part of frozen parameter {fqn!r}, not a flat "
                    f"tensor of {per_rank} elements (its share of {numel} at {world} ranks)"
                )
            if stop > start:
                item = t.nbytes // t.numel
                _add(tensors, pieces, f"model.{fqn}", t, FlatRange(start, stop), t.byte_offset, (stop - start) * item, shape)
    return files
