"""Load planning: which bytes each rank reads, and who gets which elements.

Inputs are the saved pieces of each tensor, what every rank of the loading group needs
(:class:`TargetPiece`: the region its local tensor holds) and the :class:`~.routes.Topology` the
routes are costed with (the store, the exchange, each rank's node). :func:`plan_load` plans the whole
group (every rank's units) and returns a :class:`LoadPlan`; a load plans each rank's own share with
:mod:`.rank_plan` (same slabs, routes and units; readers by a stripe rule, moved to a rank whose node's
memory tier holds the file where one does), and conversions use this group plan:

1. Every saved piece and every target becomes *stored boxes* (a flat range is a few boxes), so all
   meetings are box ∩ box. For each tensor the saved boxes are indexed (:class:`~.box_index.BoxIndex`)
   and each target visits only those that meet it along its most selective dimension, so a rank's
   targets cost the pieces they touch, not every piece of the tensor.
2. Each saved box is cut into row slabs of about ``chunk_bytes``; a slab is contiguous in its file.
   Within a slab :func:`~.routes.choose_route` picks a route from what each costs:
   ``direct`` — every rank reads its own parts (one unit per rank and part, no exchange), or
   ``exchange`` — the union of the needs becomes *read units* (one box read into one packed buffer
   when the needs tile it or overlap, else one per need), each read once.
3. Units are ordered by file and offset. An exchanged unit has one reader: the rank that needs most
   of it, ties to the least-loaded rank — or to the reader of the unit it continues in its file (up to
   :data:`COALESCE_GAP_BYTES` of padding between them) while
   that rank is at most ``chunk_bytes`` ahead, so a reader's units lie back to back and the loader can
   fetch them in one request (:mod:`tierckpt.io.coalesce`). Its :class:`Delivery` parts for the
   others are sent by an all-to-all. Exchanged bytes are read exactly once (read amplification 1.00 whenever the needs tile each slab); direct units read a byte
   once per rank that needs it, which the cost model allows only where the repeats are cheap (the
   same node's page cache).
4. Units are grouped into rounds so that no rank holds more than about ``round_bytes`` of read,
   sent and received buffers at once; memory stays bounded whatever the checkpoint's size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from tierckpt.native.metadata import PieceMeta, TensorMeta, itemsize
from tierckpt.native.regions import StoredBox, stored_boxes
from tierckpt.planner.load_order import COALESCE_GAP_BYTES, READER_SHARE, assign_rounds, choose_readers
from tierckpt.planner.plan_types import Delivery, LoadPlan, ReadUnit, TargetPiece, whole_to_other
from tierckpt.planner.routes import Topology, topology_for
from tierckpt.planner.slab_units import plan_tensor

__all__ = [
    "COALESCE_GAP_BYTES", "READER_SHARE", "Delivery", "LoadPlan", "ReadUnit", "TargetPiece", "plan_load", "whole_to_other",
]


def plan_load(
    tensors: dict[str, TensorMeta],
    pieces: dict[str, list[PieceMeta]],
    needs: Sequence[Sequence[TargetPiece]],
    *,
    chunk_bytes: int,
    round_bytes: int,
    topology: Topology | None = None,
) -> LoadPlan:
    """Plan a load for a group whose rank ``r`` needs ``needs[r]``. Pure and deterministic.

    ``chunk_bytes`` and ``round_bytes`` (steps 2 and 4 above) have no default here: the entry point
    passes its own (:data:`tierckpt.loading.api.DEFAULT_CHUNK_BYTES`, :data:`tierckpt.loading.api.DEFAULT_ROUND_BYTES`).

    ``topology``: the costs the route of each slab is chosen by (see :mod:`.routes`); default
    :func:`~.routes.default_topology`, which reads each byte once per group.
    """
    world = len(needs)
    topo = topology_for(topology, world)
    targets: dict[str, list[tuple[int, int, StoredBox]]] = defaultdict(list)
    for rank, rank_needs in enumerate(needs):
        for index, need in enumerate(rank_needs):
            shape = tensors[need.fqn].shape
            for sb in stored_boxes(need.region, shape):
                targets[need.fqn].append((rank, index, sb))

    drafts: list[dict] = []
    for fqn in sorted(targets):
        meta = tensors[fqn]
        plan_tensor(meta, pieces.get(fqn, []), targets[fqn], chunk_bytes, topo, drafts)
    # In file order, so that one reader's units lie back to back and a round reads files sequentially.
    drafts.sort(key=lambda d: (d["file"], int(d["run_offsets"][0]) if len(d["run_offsets"]) else 0))
    choose_readers(drafts, world, chunk_bytes)

    units, rounds, exchanges = assign_rounds(drafts, world, round_bytes)
    per_rank = [0] * world
    for u in units:
        per_rank[u.reader] += u.nbytes
    return LoadPlan(
        units=units,
        rounds=rounds,
        exchanges=exchanges,
        world_size=world,
        bytes_read=sum(per_rank),
        bytes_delivered=sum(d.numel * itemsize(tensors[u.fqn].torch_dtype) for u in units for d in u.deliveries),
        bytes_read_per_rank=tuple(per_rank),
    )
