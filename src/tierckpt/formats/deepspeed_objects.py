"""The values of a DeepSpeed checkpoint that are no tensors: param group settings and Python-int steps.

They live inside a ``.pt`` file's ``data.pkl``: each is an object whose bytes are that ``data.pkl``
record and whose codec (``deepspeed:<path>``) names where the value is in the unpickled structure
(:func:`decode_value`; only plain values are accepted). ``deepspeed:`` alone names the whole file's
value (a universal checkpoint's ``step.pt`` holding a number).

* ``optim.param_groups.<fqn>.<setting>`` (lr, betas, eps, weight_decay...): :func:`group_objects`.
* ``optim.state.<fqn>.step`` where the optimizer keeps ``step`` as a Python number, not a tensor
  (DeepSpeed's CPU Adam, used with ``offload_optimizer``): :func:`step_objects`. A load into torch's
  Adam writes it into the state's step tensor, as torch's Adam does with such a step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from tierckpt.backends import Backend
from tierckpt.errors import CorruptCheckpointError
from tierckpt.native.metadata import ObjectMeta
from tierckpt.formats.torch_archive import Archive, unpickle

CODEC_PREFIX = "deepspeed:"


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
    out = []
    for g, (group, names) in enumerate(zip(groups, shapes)):
        for setting in group:
            if setting == "params" or not isinstance(setting, str):
                continue
            out += [value_object(f"optim.param_groups.{fqn}.{setting}", file, archive, (*path, str(g), setting))
                    for fqn in names]
    return out


def step_objects(
    file: str, archive: Archive, path: tuple[str, ...], shapes: list[dict[str, tuple[int, ...]]], steps: Sequence[Any],
) -> list[ObjectMeta]:
    """``optim.state.<fqn>.step`` of each parameter of each group ``g`` whose step (``steps[g]``, found at
    ``path + (g, "step")`` of ``archive``) is a Python number; a group whose step is a tensor has none here."""
    out = []
    for g, (step, names) in enumerate(zip(steps, shapes)):
        if not is_number(step):
            continue
        out += [value_object(f"optim.state.{fqn}.step", file, archive, (*path, str(g), "step")) for fqn in names]
    return out


def value_object(key: str, file: str, archive: Archive, path: Sequence[str]) -> ObjectMeta:
    """The object ``key``: the value at ``path`` of ``file``'s ``data.pkl`` (``archive``)."""
    return ObjectMeta(key=key, rank=None, file=file, byte_offset=archive.pickle_offset, byte_length=archive.pickle_length,
                      crc32c=archive.pickle_crc32c, codec=CODEC_PREFIX + "/".join(path))


def is_number(value: Any) -> bool:
    """A Python int or float (not a bool): a step counter kept outside a tensor."""
    return type(value) in (int, float)


def decode_value(data: bytes, codec: str, key: str) -> Any:
    """The plain value a ``deepspeed:<path>`` object names inside ``data`` (a ``data.pkl``)."""
    value: Any = _unpickled(data)
    path = codec[len(CODEC_PREFIX):]
    for part in path.split("/") if path else ():
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, dict) and part.isdigit() and int(part) in value:  # optimizer state: by group index
            value = value[int(part)]
        else:
            raise CorruptCheckpointError(f"object {key!r}: the DeepSpeed file has nothing at {codec!r}")
    if not _plain(value):
        raise CorruptCheckpointError(f"object {key!r} is a {type(value).__name__}, not a plain setting or number")
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
