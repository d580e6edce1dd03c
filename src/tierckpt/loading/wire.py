"""The compact form of what each rank shares in a load's first collective (:mod:`tierckpt.loading.generation`).

Every rank all-gathers its needs (a :class:`~tierckpt.planner.TargetPiece` per tensor it loads) and
the keys its state asks for, so a group of N ranks receives N copies of the model's tensor names,
pickled objects each. Both sides hold the same checkpoint metadata (agreed before this collective), so
names travel as positions in it:

* needs: for each tensor, its position among the checkpoint's sorted tensor names and its class: the
  number of its region among the rank's distinct regions (``int32`` pairs); then each class's region:
  ``None`` for the whole tensor (a replicated parameter, whatever its shape), ``(offsets, lengths)`` for a
  box (a shard), a :class:`~tierckpt.native.regions.FlatRange` as it is (FSDP1 flat parameters). A rank sends
  each distinct region once (a model's layers share a few), and every rank's plan groups tensors needed
  alike on every rank by comparing one row of classes per tensor
  (:class:`~tierckpt.planner.group_needs.GroupNeeds`), not N needs;
* keys asked for: one bit per key of the checkpoint (tensors and objects; keys it lacks are reported
  as findings, which travel as they are), decoded only when the debug log that lists the keys nobody
  asked for is on.

:func:`unpack` returns every rank's needs grouped, for the planner, and the shares as
:func:`tierckpt.loading.match.report` reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tierckpt.formats.reader import Checkpoint
from tierckpt.planner import TargetPiece
from tierckpt.planner.group_needs import GroupNeeds, WireRegion, rank_needs
from tierckpt.native.regions import Box

logger = logging.getLogger("tierckpt")

WireNeeds = tuple[bytes, tuple[WireRegion, ...]]


def _names(ckpt: Checkpoint) -> list[str]:
    return sorted(ckpt.tensors)


def _keys(ckpt: Checkpoint) -> list[str]:
    return sorted(set(ckpt.tensors) | {o.key for o in ckpt.meta.objects})


def pack_needs(needs: Sequence[TargetPiece], ckpt: Checkpoint) -> WireNeeds:
    """``needs`` (tensors of ``ckpt``) as ``(position, class)`` pairs and each class's compact region."""
    position = {name: i for i, name in enumerate(_names(ckpt))}
    positions, classes, regions = rank_needs(needs, position, ckpt.tensors)
    pairs = np.stack([positions, classes], axis=1).astype(np.int32)
    return pairs.tobytes(), tuple(r if type(r) is not Box else (r.offsets, r.lengths) for r in regions)


def unpack_needs(wires: Sequence[WireNeeds], ckpt: Checkpoint, names: Sequence[str]) -> GroupNeeds:
    """Every rank's needs :func:`pack_needs` packed, in rank order (``names``: the checkpoint's sorted
    tensor names), grouped for the planner: the pairs of all ranks decoded as one array."""
    datas = [data for data, _ in wires]
    pairs = np.frombuffer(b"".join(datas), dtype=np.int32).reshape(-1, 2)
    return GroupNeeds(names, ckpt.tensors, pairs, [len(data) // 8 for data in datas], [classes for _, classes in wires])


def pack_asked(asked: Iterable[str], ckpt: Checkpoint) -> bytes:
    """One bit per key of ``ckpt`` (sorted): whether the state asks for it."""
    wanted = set(asked)
    return np.packbits(np.array([k in wanted for k in _keys(ckpt)], dtype=bool)).tobytes()


def unpack(gathered: Sequence[tuple[Any, ...]], ckpt: Checkpoint) -> tuple[GroupNeeds, list[tuple[Any, ...]]]:
    """Every rank's needs, grouped (:class:`~tierckpt.planner.group_needs.GroupNeeds`), and every rank's
    share with its asked keys as names (position 2; empty unless debug logging is on, the only reader of
    them; positions 0 and 3 are empty)."""
    names = _names(ckpt)
    keys = _keys(ckpt) if logger.isEnabledFor(logging.DEBUG) else None
    out = []
    for g in gathered:
        asked: list[str] = []
        if keys is not None:
            bits = np.unpackbits(np.frombuffer(g[2], dtype=np.uint8), count=len(keys))
            asked = [keys[i] for i in np.flatnonzero(bits).tolist()]
        out.append((None, g[1], asked, [], *g[4:]))
    return unpack_needs([g[0] for g in gathered], ckpt, names), out
