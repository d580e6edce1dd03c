"""Reading a DeepSpeed universal checkpoint (UCP, made by ``ds_to_universal``) in place, as a tierckpt checkpoint.

A universal folder (``<out>/<tag>/``, named by ``<out>/latest_universal``) holds, per parameter,
``zero/<fqn>/fp32.pt`` (``{"param": tensor, ...}``, the whole fp32 weights), ``exp_avg.pt``,
``exp_avg_sq.pt`` (the same form) and ``step.pt`` (a tensor, or the Python int of DeepSpeed's CPU Adam:
an object, :mod:`tierckpt.formats.deepspeed_objects`); buffers have only ``fp32.pt``. Made from a ZeRO-3
folder, the files hold bare flat tensors (read with the parameter's shape), there is no ``step.pt`` (a
strict load into Adam names ``step`` missing) and no buffer: buffers come from the ``module`` of the
copied model states file. Frozen parameters have no ``zero/`` folder: ZeRO-1/2's come whole from that
``module``, ZeRO-3's from the ``frozen_param_fragments`` of every rank's copied model states file
(:func:`~tierckpt.formats.deepspeed.add_frozen_fragments`; a rank's file that is not there is named).
``zero/optimizer_state.pt`` holds the param groups (``param_groups``, parameters numbered by group)
and the copied ``mp_rank_00_model_states.pt`` says which parameters each group holds (``param_shapes``).

Each tensor is one piece, read in place from its file (:mod:`tierckpt.formats.torch_archive`), under the
names :mod:`tierckpt.formats.deepspeed` gives a ZeRO folder's: ``model.<fqn>``,
``optim.state.<fqn>.<exp_avg|exp_avg_sq|step>``, ``optim.param_groups.<fqn>.<setting>``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tierckpt.backends import Backend
from tierckpt.errors import CorruptCheckpointError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native.metadata import CheckpointMeta, FileMeta, ObjectMeta, PieceMeta, TensorMeta, dtype_name
from tierckpt.native.regions import Box
from tierckpt.store import without_node_cache
from tierckpt.formats.torch_archive import StoredTensor, read_archives
from tierckpt.formats import deepspeed as deepspeed_format
from tierckpt.formats.deepspeed_objects import group_objects, is_number, value_object

LATEST = "latest_universal"
OPTIMIZER_STATE = "zero/optimizer_state.pt"
FORMAT_TAG = "deepspeed"
FILES = {"fp32": "model.{fqn}", "exp_avg": "optim.state.{fqn}.exp_avg", "exp_avg_sq": "optim.state.{fqn}.exp_avg_sq",
         "step": "optim.state.{fqn}.step"}
"""File stem in ``zero/<fqn>/`` -> the key its tensor loads under."""

UcpCheckpoint = tuple[CheckpointMeta, dict[str, TensorMeta], dict[str, list[PieceMeta]]]


def tag_prefix(backend: Backend, keys: list[str]) -> str | None:
    """``"<tag>/"`` that ``latest_universal`` names, ``""`` when the root is a universal tag folder, else ``None``."""
    if OPTIMIZER_STATE in keys:
        return ""
    if LATEST not in keys:
        return None
    raw = get_scheduler().run(backend.get_capped(LATEST, 4096)).decode(errors="replace").strip()
    if not raw or "/" in raw or f"{raw}/{OPTIMIZER_STATE}" not in keys:
        raise CorruptCheckpointError(
            f"{LATEST!r} of universal checkpoint {backend.root_uri!r} names {raw!r}, which holds no {OPTIMIZER_STATE}"
        )
    return f"{raw}/"


def is_ucp(backend: Backend, keys: list[str]) -> bool:
    """Whether ``keys`` (the listing of ``backend``'s root) are a universal checkpoint (or its parent with ``latest_universal``)."""
    return OPTIMIZER_STATE in keys or LATEST in keys


def read_ucp(backend: Backend, keys: list[str]) -> UcpCheckpoint:
    """Header, tensor table and pieces of the universal checkpoint at the root of ``backend`` (listing ``keys``)."""
    backend = without_node_cache(backend)
    uri = backend.root_uri
    prefix = tag_prefix(backend, keys) or ""
    model_file = prefix + deepspeed_format.MODEL_STATES
    rank_models = deepspeed_format.zero3_model_files(keys, prefix)
    if model_file not in keys:  # from ZeRO-3: ds_to_universal copies its per-rank files
        model_file = rank_models.get(0, prefix + "zero_pp_rank_0_mp_rank_00_model_states.pt")
    if model_file not in keys:
        raise CorruptCheckpointError(
            f"universal checkpoint {uri!r} has no {model_file!r} (ds_to_universal copies it there; it says which "
            "parameters each param group holds)"
        )
    zero = f"{prefix}zero/"
    tensor_files = [k for k in keys if k.startswith(zero) and k.count("/") == zero.count("/") + 1
                    and k.rsplit("/", 1)[1].removesuffix(".pt") in FILES]
    optim_file = prefix + OPTIMIZER_STATE
    archives = read_archives(backend, [model_file, optim_file, *tensor_files])
    model = deepspeed_format.as_dict(archives[model_file].value, model_file, uri)
    shapes = deepspeed_format.param_shapes(model, model_file, uri)
    tensors: dict[str, TensorMeta] = {}
    pieces: dict[str, list[PieceMeta]] = {}
    objects: list[ObjectMeta] = []
    for file in tensor_files:
        fqn, stem = file[len(zero):-len(".pt")].rsplit("/", 1)
        key = FILES[stem].format(fqn=fqn)
        if stem == "step" and is_number(archives[file].value):  # CPU Adam's step: a number, not a tensor
            objects.append(value_object(key, file, archives[file], ()))
            continue
        _add_whole(key, _tensor(archives[file].value, file, uri), file, tensors, pieces)
    for group in shapes:
        for fqn, shape in group.items():
            _reshape_flat(fqn, shape, tensors, pieces)
            found = tensors.get(f"model.{fqn}")
            if found is None or found.shape != shape:
                raise CorruptCheckpointError(
                    f"universal checkpoint {uri!r}: parameter {fqn!r} of shape {list(shape)} has "
                    f"{'no ' + zero + fqn + '/fp32.pt' if found is None else 'fp32 weights of shape ' + str(list(found.shape))}"
                )
    _add_buffers(model, model_file, tensors, pieces)
    files = [*archives, *_add_frozen(backend, model, model_file, rank_models, tensors, pieces)]
    objects += group_objects(backend, optim_file, ("param_groups",), archives[optim_file], shapes)
    sizes = {f: get_scheduler().run(backend.size(f)) for f in set(files)}
    meta = CheckpointMeta(
        generation="", world_size=1, created_unix=0.0, frameworks=("deepspeed universal",),
        files=tuple(FileMeta(key=k, size=v) for k, v in sorted(sizes.items())), objects=tuple(objects),
        num_tensors=len(tensors), num_pieces=sum(len(p) for p in pieces.values()), tensor_bytes=sum(t.nbytes for t in tensors.values()),
        tags={FORMAT_TAG: "universal", "deepspeed_tag": prefix.rstrip("/")},
    )
    return meta, tensors, pieces


def _reshape_flat(fqn: str, shape: tuple[int, ...], tensors: dict[str, TensorMeta], pieces: dict[str, list[PieceMeta]]) -> None:
    """ZeRO-3's universal files hold each parameter's tensors flat: the same row-major bytes, given the parameter's shape."""
    for key in [k.format(fqn=fqn) for k in FILES.values()]:
        t = tensors.get(key)
        if t is None or t.shape == shape or len(t.shape) != 1 or t.shape[0] != math.prod(shape):
            continue
        tensors[key] = TensorMeta(fqn=key, dtype=t.dtype, shape=shape)
        pieces[key] = [dataclasses.replace(p, region=Box((0,) * len(shape), shape)) for p in pieces[key]]


def _add_buffers(model: dict[str, Any], file: str, tensors: dict[str, TensorMeta], pieces: dict[str, list[PieceMeta]]) -> None:
    """Buffers ``ds_to_universal`` left out (ZeRO-3's), from the ``module`` of the copied model states file."""
    module, names = model.get("module"), model.get("buffer_names")
    if not isinstance(module, dict) or not isinstance(names, list):
        return
    for name in names:
        t = module.get(name)
        key = f"model.{name}"
        if key not in tensors and isinstance(t, StoredTensor):
            _add_whole(key, t, file, tensors, pieces)


def _add_whole(key: str, t: StoredTensor, file: str, tensors: dict[str, TensorMeta], pieces: dict[str, list[PieceMeta]]) -> None:
    """``key``: the whole tensor ``t`` of ``file``, one piece."""
    tensors[key] = TensorMeta(fqn=key, dtype=dtype_name(t.dtype), shape=t.shape)
    pieces[key] = [PieceMeta(fqn=key, region=Box((0,) * len(t.shape), t.shape), file=file,
                             byte_offset=t.byte_offset, byte_length=t.nbytes, crc32c=0)]


def _add_frozen(
    backend: Backend, model: dict[str, Any], model_file: str, rank_models: dict[int, str],
    tensors: dict[str, TensorMeta], pieces: dict[str, list[PieceMeta]],
) -> list[str]:
    """Frozen parameters, which ``ds_to_universal`` does not convert, from the copied model states: whole
    from ``module`` (ZeRO-1/2), or ZeRO-3's parts from every rank's file; the files read for them."""
    frozen = model.get("frozen_param_shapes")
    if not frozen or all(f"model.{fqn}" in tensors for fqn in frozen):
        return []
    if model_file not in rank_models.values():
        module = model.get("module")
        lost = [f for f in frozen if not isinstance(module, dict) or not isinstance(module.get(f), StoredTensor)]
        if lost:
            raise CorruptCheckpointError(
                f"universal checkpoint {backend.root_uri!r}: {model_file!r} lists frozen parameters {lost} its module does not hold"
            )
        for fqn in frozen:
            _add_whole(f"model.{fqn}", module[fqn], model_file, tensors, pieces)
        return []
    world = model.get("dp_world_size")
    world = world if type(world) is int and world > 0 else max(rank_models) + 1
    return deepspeed_format.add_frozen_fragments(backend, model, model_file, rank_models, world, tensors, pieces,
                                                 "universal checkpoint")


def _tensor(value: Any, file: str, uri: str) -> StoredTensor:
    """The tensor of a universal file: ``{"param": tensor, ...}`` or a bare tensor (``step.pt``, ZeRO-3's files)."""
    if isinstance(value, dict):
        value = value.get("param")
    if not isinstance(value, StoredTensor):
        raise CorruptCheckpointError(f"{file!r} of universal checkpoint {uri!r} holds no tensor (nor a dict with 'param')")
    return value
