"""Load planning time against the group size: N simulated ranks, one process, no I/O.

A load plans per rank (:mod:`tierckpt.planner.rank_plan`: :func:`plan_rank`, then :func:`agree_rounds`
with every rank's share); the group plan (:func:`tierckpt.planner.plan_load`, every rank's units: what
each rank computed before, and still computes where node memory tiers relocate readers) is timed
beside it, for N = 2 ... 64:

* ``row->col``: 16 fp32 matrices (4096 x 4096, 1 GiB) saved as N row shards, loaded as N column shards
  (every rank touches every saved piece: N^2 pieces touched by the group, inherent);
* ``col->col``: saved and loaded as the same N column shards (each rank touches one piece per matrix);
* ``flat->row``: FSDP1-style flat ranges (each rank holds an uneven slice of the flattening) loaded as
  row shards;
* ``2d->2d``: a 2-D mesh ``(N/2, 2)`` with ``Shard(0), Shard(1)`` loaded on the mesh ``(2, N/2)``.

``--memory``: a load from the node memory tiers after a node loss, ranks in nodes of 8 (shared file system
costs): each node holds its own ranks' files and its ring neighbour's replicas, node 1 is a fresh
replacement holding nothing, so its ranks' units go to the holders. Before, such a load computed the
group plan on every rank and then moved its readers by a greedy over every unit (timed: the group plan
alone, a lower bound of that); now each rank plans its own units and those of the files its node holds.

Reported: CPU milliseconds per plan (``time.process_time``, best of ``--repeat``: the planner is one
thread of pure Python, and CPU time stays meaningful on a shared, loaded machine; with the cyclic
garbage collector paused, as :func:`tierckpt.load` runs it): the group plan, and a rank's plan
(:func:`plan_rank` and :func:`agree_rounds`, the slowest of ranks 0, N/2 and N-1); pieces touched (saved piece, target pairs that share an element) by
the group and by the slowest rank's targets, and microseconds per piece touched; the units that rank's plan
holds (those it reads or receives from: a flat range's pieces are up to three boxes each, so a rank
touching more of them holds more units per piece); and decoding every rank's needs from the form the
needs all-gather carries (:func:`tierckpt.loading.wire.unpack_needs`, once per load on every rank, before
its plan: microseconds in all).

    PYTHONPATH=src python benchmarks/bench_plan_scale.py [--ranks 2 4 8 16 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from collections.abc import Callable
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tierckpt.gc_pause import gc_paused  # noqa: E402
from tierckpt.loading.wire import pack_needs, unpack_needs  # noqa: E402
from tierckpt.loading.api import DEFAULT_CHUNK_BYTES, DEFAULT_ROUND_BYTES  # noqa: E402
from tierckpt.native.metadata import PieceMeta, TensorMeta  # noqa: E402
from tierckpt.planner import TargetPiece, plan_load, topology  # noqa: E402
from tierckpt.planner.rank_plan import agree_rounds, plan_rank  # noqa: E402
from tierckpt.native.regions import Box, FlatRange, Region, stored_boxes  # noqa: E402

SHAPE = (4096, 4096)
MATRICES = 16


def even(n: int, parts: int, i: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``i`` of ``n`` split into ``parts`` near-equal parts."""
    return n * i // parts, n * (i + 1) // parts


def rows(n: int, i: int) -> Box:
    lo, hi = even(SHAPE[0], n, i)
    return Box((lo, 0), (hi - lo, SHAPE[1]))


def cols(n: int, i: int) -> Box:
    lo, hi = even(SHAPE[1], n, i)
    return Box((0, lo), (SHAPE[0], hi - lo))


def flat(n: int, i: int) -> FlatRange:
    # Uneven: a rank's share grows with its index, so the cuts fall mid-row.
    total = math.prod(SHAPE)
    weights = [k + 1 for k in range(n)]
    lo = total * sum(weights[:i]) // sum(weights)
    hi = total * sum(weights[: i + 1]) // sum(weights)
    return FlatRange(lo, hi)


def mesh(a: int, b: int) -> Callable[[int, int], Box]:
    """Shard(0) over a mesh dimension of ``a``, Shard(1) over one of ``b``; rank ``i`` at ``(i // b, i % b)``."""

    def region(n: int, i: int) -> Box:
        r0, r1 = even(SHAPE[0], a, i // b)
        c0, c1 = even(SHAPE[1], b, i % b)
        return Box((r0, c0), (r1 - r0, c1 - c0))

    return region


def layouts(n: int) -> dict[str, tuple[Callable[[int, int], Region], Callable[[int, int], Region]]]:
    return {
        "row->col": (rows, cols),
        "col->col": (cols, cols),
        "flat->row": (flat, rows),
        "2d->2d": (mesh(max(n // 2, 1), min(n, 2)), mesh(min(n, 2), max(n // 2, 1))),
    }


def case(n: int, save: Callable[[int, int], Region], load: Callable[[int, int], Region]):
    """The planner's inputs for ``n`` ranks saving by ``save`` and loading by ``load``."""
    tensors, pieces = {}, {}
    item = 4
    saved = [save(n, i) for i in range(n)]  # equal regions are one object, as the pieces table's decoding gives them
    for m in range(MATRICES):
        fqn = f"layer{m}.weight"
        tensors[fqn] = TensorMeta(fqn=fqn, dtype="float32", shape=SHAPE)
        pieces[fqn] = []
        for i in range(n):
            region = saved[i]
            nbytes = sum(s.box.numel for s in stored_boxes(region, SHAPE)) * item
            pieces[fqn].append(PieceMeta(fqn=fqn, region=region, file=f"data_{i}", byte_offset=m * SHAPE[0] * SHAPE[1] * item // n,
                                         byte_length=nbytes, crc32c=0))
    needs = [[TargetPiece(fqn=f"layer{m}.weight", region=load(n, i)) for m in range(MATRICES)] for i in range(n)]
    return tensors, pieces, needs


def touched(tensors, pieces, needs, ranks=None) -> int:
    """Saved piece, target pairs that share an element, over the group or ``ranks`` (brute force)."""
    count = 0
    for rank_needs in (needs if ranks is None else [needs[r] for r in ranks]):
        for need in rank_needs:
            shape = tensors[need.fqn].shape
            boxes = [s.box for s in stored_boxes(need.region, shape)]
            for p in pieces[need.fqn]:
                saved = [s.box for s in stored_boxes(p.region, shape)]
                count += any(a.intersect(b) is not None for a in boxes for b in saved)
    return count


@gc_paused
def timed_plan(tensors, pieces, needs, topo) -> float:
    """CPU seconds of one plan, the collector paused as in a load."""
    t0 = time.process_time()
    plan_load(tensors, pieces, needs, chunk_bytes=DEFAULT_CHUNK_BYTES, round_bytes=DEFAULT_ROUND_BYTES, topology=topo)
    return time.process_time() - t0


SIZES = dict(chunk_bytes=DEFAULT_CHUNK_BYTES, round_bytes=DEFAULT_ROUND_BYTES, p2p_min_bytes=1 << 20)


def wired(tensors, needs):
    """A stand-in checkpoint and every rank's needs as the needs all-gather carries them (:func:`pack_needs`)."""
    ckpt = SimpleNamespace(tensors=tensors, meta=SimpleNamespace(objects=[]))
    return ckpt, [pack_needs(n, ckpt) for n in needs]


@gc_paused
def timed_decode(ckpt, wires) -> float:
    """CPU seconds of decoding every rank's needs (as :func:`tierckpt.loading.wire.unpack` does)."""
    t0 = time.process_time()
    unpack_needs(wires, ckpt, sorted(ckpt.tensors))
    return time.process_time() - t0


@gc_paused
def timed_rank_plan(tensors, pieces, group, topo, rank, shares, held=None) -> float:
    """CPU seconds of one rank's plan: its units, then the rounds from every rank's share."""
    t0 = time.process_time()
    draft = plan_rank(tensors, pieces, group, rank, topology=topo, held=held, **SIZES)
    agree_rounds(draft, shares, tensors)
    return time.process_time() - t0


def memory_holdings(pieces, nodes: tuple[str, ...]) -> dict[str, tuple[tuple[int, ...], int]]:
    """What the node memory tiers hold after node 1's loss: each node its own ranks' files and its ring
    neighbour's (its replicas), node 1 nothing; one node alone holds its own files."""
    names = sorted(set(nodes), key=lambda x: int(x.removeprefix("node")))
    size = {p.file: 0 for plist in pieces.values() for p in plist}
    for plist in pieces.values():
        for p in plist:
            size[p.file] = max(size[p.file], p.byte_offset + p.byte_length)
    held = {}
    for file in size:
        owner = nodes[int(file.removeprefix("data_"))]
        k = names.index(owner)
        holders = {owner, names[(k - 1) % len(names)]} - ({"node1"} if len(names) > 1 else set())
        held[file] = (tuple(r for r, node in enumerate(nodes) if node in holders), size[file])
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 64])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="loads from node memory tiers after a node loss")
    args = parser.parse_args()
    print(f"{platform.machine()}, Python {platform.python_version()}, one process")
    print("| layout | N | group plan CPU ms | pairs (group) | µs per pair | rank plan CPU ms | pairs (rank) | µs per pair "
          "| units (rank) | needs decode µs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in layouts(2):
        for n in args.ranks:
            save, load = layouts(n)[name]
            tensors, pieces, needs = case(n, save, load)
            nodes = tuple(f"node{r // 8}" for r in range(n))
            topo = (topology("shared_fs", "gloo", nodes) if args.memory and len(set(nodes)) > 1
                    else topology("node_local", "gloo", ("node",) * n, cores=n))
            held = memory_holdings(pieces, nodes) if args.memory else None
            best = math.inf
            for _ in range(args.repeat):
                best = min(best, timed_plan(tensors, pieces, needs, topo))
            pairs = touched(tensors, pieces, needs)
            slowest, rank = 0.0, 0
            ckpt, wires = wired(tensors, needs)
            group = unpack_needs(wires, ckpt, sorted(tensors))
            shares = [plan_rank(tensors, pieces, group, r, topology=topo, held=held, **SIZES).share for r in range(n)]
            decode = min(timed_decode(ckpt, wires) for _ in range(args.repeat))
            for r in sorted({0, n // 2, n - 1}):
                t = min(timed_rank_plan(tensors, pieces, group, topo, r, shares, held) for _ in range(args.repeat))
                if t >= slowest:
                    slowest, rank = t, r
            mine = touched(tensors, pieces, needs, [rank])
            units = len(plan_rank(tensors, pieces, group, rank, topology=topo, held=held, **SIZES).drafts)
            print(f"| {name} | {n} | {best * 1e3:.1f} | {pairs} | {best * 1e6 / pairs:.0f} | {slowest * 1e3:.1f} | {mine} "
                  f"| {slowest * 1e6 / mine:.0f} | {units} | {decode * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
