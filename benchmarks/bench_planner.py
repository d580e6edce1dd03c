"""Planner at scale: a 175B GPT layout on 12,288 simulated ranks, tierckpt beside torch DCP.

Layout: 96 layers, hidden 12288, vocab 51200, TP 8 x PP 16 x DP 96. Parameters are TP-sharded
(column-parallel: dim 0; row-parallel: dim 1; vocab-parallel embedding) and replicated over DP; Adam
states (fp32 master, exp_avg, exp_avg_sq) are sharded ZeRO-style over DP: each DP rank holds a
contiguous range of the flattened TP-local parameters of its stage. Everything is planned in one
process — no tensors are allocated.

    python benchmarks/bench_planner.py [--layers 96] [--dp 96] [--out docs/benchmarks.md]

Measures: tierckpt's global save plan (dedup + balance + layout over all ranks' offers), the digest
check that lets an unchanged layout skip planning (plan cache), one rank's load plan against the
saved pieces, the metadata size; and DCP's dedup + default global save plan on the same items
(DCP cannot express flat ranges, so its items are the boxes those ranges decompose into).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tierckpt.loading.api import DEFAULT_CHUNK_BYTES, DEFAULT_ROUND_BYTES  # noqa: E402
from tierckpt.native.metadata import PieceMeta, encode_pieces, encode_tensors  # noqa: E402
from tierckpt.planner import LocalPiece, TargetPiece, plan_load, plan_save  # noqa: E402
from tierckpt.planner.save_planner import offers_digest  # noqa: E402
from tierckpt.native.regions import Box, FlatRange, flat_range_boxes  # noqa: E402

HIDDEN, VOCAB, TP, PP = 12288, 51200, 8, 16


def layer_tensors(layer: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """``(fqn, global shape, TP shard dim or None)`` of one transformer layer."""
    h = HIDDEN
    p = f"model.layers.{layer}."
    return [
        (p + "ln1.weight", (h,), None), (p + "ln1.bias", (h,), None),
        (p + "attn.qkv.weight", (3 * h, h), 0), (p + "attn.qkv.bias", (3 * h,), 0),
        (p + "attn.proj.weight", (h, h), 1), (p + "attn.proj.bias", (h,), None),
        (p + "ln2.weight", (h,), None), (p + "ln2.bias", (h,), None),
        (p + "mlp.fc1.weight", (4 * h, h), 0), (p + "mlp.fc1.bias", (4 * h,), 0),
        (p + "mlp.fc2.weight", (h, 4 * h), 1), (p + "mlp.fc2.bias", (h,), None),
    ]


def stage_tensors(stage: int, layers: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    per = layers // PP
    out = [t for layer in range(stage * per, (stage + 1) * per) for t in layer_tensors(layer)]
    if stage == 0:
        out.insert(0, ("model.embed.weight", (VOCAB, HIDDEN), 0))
    if stage == PP - 1:
        out += [("model.final_ln.weight", (HIDDEN,), None), ("model.final_ln.bias", (HIDDEN,), None)]
    return out


def tp_box(shape: tuple[int, ...], dim: int | None, tp: int) -> Box:
    if dim is None:
        return Box.full(shape)
    size = shape[dim] // TP
    offsets = [0] * len(shape)
    lengths = list(shape)
    offsets[dim], lengths[dim] = tp * size, size
    return Box(tuple(offsets), tuple(lengths))


def local_flat_to_regions(box: Box, start: int, stop: int) -> list[Box | FlatRange]:
    """A flat range of a TP-local box as global regions: one flat range when the box is contiguous
    in the global flattening (dim-0 shards, whole tensors), else the boxes it decomposes into."""
    regions = []
    for stored in flat_range_boxes(box.lengths, start, stop):
        regions.append(Box(tuple(o + b for o, b in zip(stored.box.offsets, box.offsets)), stored.box.lengths))
    return regions


def offers_of(tp: int, stage: int, dp: int, dp_size: int, layers: int) -> list[LocalPiece]:
    """What one rank holds: its TP shard of every parameter of its stage, and its DP slice of Adam states."""
    tensors = stage_tensors(stage, layers)
    offers = [
        LocalPiece(fqn=fqn, dtype="bfloat16", shape=shape, region=tp_box(shape, dim, tp)) for fqn, shape, dim in tensors
    ]
    sizes = [tp_box(shape, dim, tp).numel for _, shape, dim in tensors]
    total = sum(sizes)
    lo, hi = dp * total // dp_size, (dp + 1) * total // dp_size
    position = 0
    for (fqn, shape, dim), size in zip(tensors, sizes):
        a, b = max(lo, position), min(hi, position + size)
        if a < b:
            box = tp_box(shape, dim, tp)
            contiguous = dim in (0, None)
            for state in ("fp32_param", "exp_avg", "exp_avg_sq"):
                name = f"optim.state.{fqn}.{state}"
                if contiguous:
                    base = box.offsets[0] * math.prod(shape[1:]) if shape else 0
                    regions = [FlatRange(base + a - position, base + b - position)]
                else:
                    regions = local_flat_to_regions(box, a - position, b - position)
                offers += [LocalPiece(fqn=name, dtype="float32", shape=shape, region=r) for r in regions]
        position += size
    return offers


def all_offers(layers: int, dp_size: int) -> list[list[LocalPiece]]:
    offers = []
    for stage in range(PP):
        for dp in range(dp_size):
            for tp in range(TP):
                offers.append(offers_of(tp, stage, dp, dp_size, layers))
    return offers


def to_dcp_plans(offers: list[list[LocalPiece]]) -> list:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    plans = []
    for rank_offers in offers:
        items = []
        for p in rank_offers:
            boxes = [p.region] if isinstance(p.region, Box) else [s.box for s in flat_range_boxes(p.shape, p.region.start, p.region.stop)]
            for box in boxes:
                items.append(
                    WriteItem(
                        index=MetadataIndex(p.fqn, box.offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.lengths)),
                            properties=TensorProperties(dtype=getattr(torch, p.dtype)),
                            size=torch.Size(p.shape),
                        ),
                    )
                )
        plans.append(SavePlan(items))
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--dp", type=int, default=96)
    parser.add_argument("--skip-dcp", action="store_true")
    parser.add_argument("--out", default=None, help="Markdown file to update (between bench_planner markers)")
    args = parser.parse_args()
    world = TP * PP * args.dp
    rows: list[tuple[str, str]] = []

    t0 = time.perf_counter()
    offers = all_offers(args.layers, args.dp)
    build_s = time.perf_counter() - t0
    n_offers = sum(len(o) for o in offers)
    rows.append(("ranks (TP x PP x DP)", f"{world:,} ({TP} x {PP} x {args.dp})"))
    rows.append(("pieces offered by all ranks", f"{n_offers:,} (built in {build_s:.1f} s)"))

    t0 = time.perf_counter()
    plan = plan_save(offers)
    save_plan_s = time.perf_counter() - t0
    per_rank = plan.bytes_per_rank
    mean = sum(per_rank) / len(per_rank)
    rows.append(("tierckpt global save plan", f"{save_plan_s:.2f} s (target <= 5 s); max/mean bytes per rank {max(per_rank) / mean:.3f}"))

    t0 = time.perf_counter()
    offers_digest([offers[0]])
    digest_s = time.perf_counter() - t0
    rows.append(("tierckpt plan-cache check (one rank's digest)", f"{digest_s * 1e3:.2f} ms, then one all-gather of 64-byte digests"))

    pieces: dict[str, list[PieceMeta]] = {}
    for rank, writes in enumerate(plan.writes):
        for w in writes:
            pieces.setdefault(w.fqn, []).append(
                PieceMeta(fqn=w.fqn, region=w.region, file=w.file, byte_offset=w.byte_offset, byte_length=w.byte_length, crc32c=0)
            )
    tensors = {t.fqn: t for t in plan.tensors}
    meta_bytes = len(encode_pieces([p for ps in pieces.values() for p in ps])) + len(encode_tensors(plan.tensors))
    rows.append(("tierckpt metadata (pieces + tensors Parquet)", f"{meta_bytes / 2**20:.1f} MiB for {sum(len(p) for p in pieces.values()):,} pieces"))

    # One rank of a new job (TP 8 x PP 16, DP 1) loads its shard: rank (tp=3, stage=7).
    needs = [TargetPiece(fqn=p.fqn, region=p.region) for p in offers_of(3, 7, 0, 1, args.layers)]
    wanted = {n.fqn for n in needs}
    t0 = time.perf_counter()
    load = plan_load(
        tensors, {f: pieces[f] for f in wanted}, [needs], chunk_bytes=DEFAULT_CHUNK_BYTES, round_bytes=DEFAULT_ROUND_BYTES
    )
    load_plan_s = time.perf_counter() - t0
    rows.append(("tierckpt one rank's load plan (reshard to DP 1)", f"{load_plan_s:.3f} s (target <= 0.2 s); {len(load.units):,} read units, {load.bytes_read / 2**30:.2f} GiB"))

    if not args.skip_dcp:
        from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        t0 = time.perf_counter()
        dcp_plans = to_dcp_plans(offers)
        convert_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        deduped = dedup_save_plans(dcp_plans)
        _, dcp_meta = create_default_global_save_plan(deduped)
        dcp_s = time.perf_counter() - t0
        import pickle

        dcp_meta_bytes = len(pickle.dumps(dcp_meta))
        rows.append(("DCP dedup + default global save plan", f"{dcp_s:.2f} s (items built in {convert_s:.1f} s); tierckpt is {dcp_s / save_plan_s:.1f}x faster"))
        rows.append(("DCP metadata (pickled)", f"{dcp_meta_bytes / 2**20:.1f} MiB"))

    table = "\n".join(["| measure | result |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])
    print(table)
    if args.out:
        _write_section(Path(args.out), table, " ".join(sys.argv[1:]))


def _write_section(path: Path, table: str, argv: str) -> None:
    import platform

    body = (
        "<!-- bench_planner -->\n## Planner at scale (175B GPT, 12,288 simulated ranks)\n\n"
        f"`python benchmarks/bench_planner.py {argv}` on {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, one process.\n\n{table}\n<!-- /bench_planner -->"
    )
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start, end = text.find("<!-- bench_planner -->"), text.find("<!-- /bench_planner -->")
    if start >= 0 and end >= 0:
        text = text[:start] + body + text[end + len("<!-- /bench_planner -->") :]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
