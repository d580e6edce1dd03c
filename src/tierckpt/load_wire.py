"""The compact form of what each rank shares in a load's first collective (:mod:`tierckpt.load_generation`).

Every rank all-gathers its needs (a :class:`~tierckpt.planner.TargetPiece` per tensor it loads) and
the keys its state asks for, so a group of N ranks receives N copies of the model's tensor names,
pickled objects each. Both sides hold the same checkpoint metadata (agreed before this collective), so
names travel as positions in it:

* needs: the position of each tensor among the checkpoint's sorted tensor names (an ``int32`` array)
  and its region: ``None`` for the whole tensor (a replicated parameter), ``(offsets, lengths)`` for a
  box (a shard), a :class:`~tierckpt.regions.FlatRange` as it is (FSDP1 flat parameters);
* keys asked for: one bit per key of the checkpoint (tensors and objects; keys it lacks are reported
  as findings, which travel as they are), decoded only when the debug log that lists the keys nobody
  asked for is on.

:func:`unpack` restores the layout :func:`tierckpt.load_match.report` and the planner read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .checkpoint_reader import Checkpoint
from .planner import TargetPiece
from .regions import Box, Region

logger = logging.getLogger("tierckpt")

WireRegion = tuple[tuple[int, ...], tuple[int, ...]] | Region | None
WireNeeds = tuple[bytes, tuple[WireRegion, ...]]


def _names(ckpt: Checkpoint) -> list[str]:
    return sorted(ckpt.tensors)


def _keys(ckpt: Checkpoint) -> list[str]:
    return sorted(set(ckpt.tensors) | {o.key for o in ckpt.meta.objects})


def pack_needs(needs: Sequence[TargetPiece], ckpt: Checkpoint) -> WireNeeds:
    """``needs`` (tensors of ``ckpt``) as positions and compact regions."""
    position = {name: i for i, name in enumerate(_names(ckpt))}
    indices = np.array([position[n.fqn] for n in needs], dtype=np.int32)
    regions: list[WireRegion] = []
    for n in needs:
        region = n.region
        if isinstance(region, Box):
            whole = region == Box.full(ckpt.tensors[n.fqn].shape)
            regions.append(None if whole else (region.offsets, region.lengths))
        else:
            regions.append(region)
    return indices.tobytes(), tuple(regions)


def unpack_needs(wire: WireNeeds, ckpt: Checkpoint, names: Sequence[str]) -> list[TargetPiece]:
    """The needs :func:`pack_needs` packed (``names``: the checkpoint's sorted tensor names)."""
    data, regions = wire
    out = []
    for i, region in zip(np.frombuffer(data, dtype=np.int32).tolist(), regions):
        fqn = names[i]
        if region is None:
            region = Box.full(ckpt.tensors[fqn].shape)
        elif isinstance(region, tuple):
            region = Box(*region)
        out.append(TargetPiece(fqn=fqn, region=region))
    return out


def pack_asked(asked: Iterable[str], ckpt: Checkpoint) -> bytes:
    """One bit per key of ``ckpt`` (sorted): whether the state asks for it."""
    wanted = set(asked)
    return np.packbits(np.array([k in wanted for k in _keys(ckpt)], dtype=bool)).tobytes()


def unpack(gathered: Sequence[tuple[Any, ...]], ckpt: Checkpoint) -> list[tuple[Any, ...]]:
    """Every rank's share with its needs as :class:`TargetPiece` lists and its asked keys as names
    (position 2; empty unless debug logging is on, the only reader of them; position 3 is empty)."""
    names = _names(ckpt)
    keys = _keys(ckpt) if logger.isEnabledFor(logging.DEBUG) else None
    out = []
    for g in gathered:
        asked: list[str] = []
        if keys is not None:
            bits = np.unpackbits(np.frombuffer(g[2], dtype=np.uint8), count=len(keys))
            asked = [keys[i] for i in np.flatnonzero(bits).tolist()]
        out.append((unpack_needs(g[0], ckpt, names), g[1], asked, [], *g[4:]))
    return out
