"""Save planner: replicas written once, full coverage, balance, pinning, agreement, layout, determinism."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tierckpt.errors import StateMismatchError
from tierckpt.planner.save_planner import offers_digest
from tierckpt.planner import LocalPiece, plan_save
from tierckpt.native.regions import Box, FlatRange, Region, flat_range_boxes


def full(fqn: str, shape: tuple[int, ...], dtype: str = "float32") -> LocalPiece:
    return LocalPiece(fqn=fqn, dtype=dtype, shape=shape, region=Box.full(shape))


def elements(region: Region, shape: tuple[int, ...]) -> list[int]:
    """Flat indices of the elements of a region of a tensor of ``shape``."""
    if isinstance(region, FlatRange):
        return list(range(region.start, region.stop))
    return torch.arange(math.prod(shape)).reshape(shape)[region.slices()].reshape(-1).tolist()


def coverage(plan, shapes: dict[str, tuple[int, ...]]) -> Counter:
    """How many times each (fqn, element) is written by the plan."""
    count: Counter = Counter()
    for ws in plan.writes:
        for w in ws:
            for e in elements(w.region, shapes[w.fqn]):
                count[(w.fqn, e)] += 1
    return count


def assert_covered_once(plan, shapes: dict[str, tuple[int, ...]]) -> None:
    count = coverage(plan, shapes)
    expected = {(f, e) for f, s in shapes.items() for e in range(math.prod(s))}
    assert set(count) == expected
    assert set(count.values()) == {1}


def test_replicas_are_written_once():
    """Three ranks offering the same full tensors (DDP) produce one write per tensor in total."""
    shapes = {"a": (4, 5), "b": (7,), "c": (2, 3, 2)}
    offers = [[full(f, s) for f, s in shapes.items()] for _ in range(3)]
    plan = plan_save(offers)
    assert sorted(w.fqn for ws in plan.writes for w in ws) == ["a", "b", "c"]
    assert_covered_once(plan, shapes)


def test_mixed_sharded_replicated_and_flat_cover_every_element_once():
    """Row shards, a replicated tensor (also on a subset of ranks) and FSDP1-like flat ranges: every
    element of every tensor is written exactly once across all ranks."""
    shapes = {"w": (6, 4), "r": (5, 3), "f": (3, 7), "half": (4,)}
    offers = []
    for rank in range(3):
        pieces = [
            LocalPiece(fqn="w", dtype="float32", shape=(6, 4), region=Box((2 * rank, 0), (2, 4))),
            full("r", (5, 3)),
            LocalPiece(fqn="f", dtype="float32", shape=(3, 7), region=FlatRange(7 * rank, 7 * rank + 7)),
        ]
        if rank < 2:
            pieces.append(full("half", (4,)))
        offers.append(pieces)
    plan = plan_save(offers)
    assert_covered_once(plan, shapes)
    writers_of_half = [r for r, ws in enumerate(plan.writes) if any(w.fqn == "half" for w in ws)]
    assert len(writers_of_half) == 1 and writers_of_half[0] in (0, 1)


def test_big_replicated_pieces_are_split_and_still_covered_once():
    """Replicated pieces above the split size are cut into parts spread over ranks, covering once."""
    shapes = {"big": (64, 32), "flat": (40, 10)}
    offers = []
    for _ in range(4):
        offers.append([
            full("big", (64, 32)),
            LocalPiece(fqn="flat", dtype="float32", shape=(40, 10), region=FlatRange(13, 400)),
        ])
    plan = plan_save(offers, min_split_bytes=1024)
    assert sum(1 for ws in plan.writes for w in ws if w.fqn == "big") > 1
    assert all(plan.writes[r] for r in range(4)), "split parts should reach every rank"
    count = coverage(plan, shapes)
    assert {e for (f, e) in count if f == "big"} == set(range(64 * 32))
    assert {e for (f, e) in count if f == "flat"} == set(range(13, 400))
    assert set(count.values()) == {1}


def transformer_like(layers: int = 12) -> dict[str, tuple[tuple[int, ...], str]]:
    """A GPT-ish tensor set: 1 KiB norms/biases up to 8 MiB matrices (float32 / bfloat16)."""
    d = 1024
    tensors: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((2048, d), "float32"),  # 8 MiB
        "final_norm.weight": ((256,), "float32"),  # 1 KiB
    }
    for i in range(layers):
        p = f"layers.{i}"
        tensors[f"{p}.attn.qkv.weight"] = ((3 * d, d), "bfloat16")  # 6 MiB
        tensors[f"{p}.attn.qkv.bias"] = ((3 * d,), "float32")
        tensors[f"{p}.attn.out.weight"] = ((d, d), "float32")  # 4 MiB
        tensors[f"{p}.mlp.up.weight"] = ((2 * d, d), "float32")  # 8 MiB
        tensors[f"{p}.mlp.down.weight"] = ((d, 2 * d), "bfloat16")  # 4 MiB
        tensors[f"{p}.norm1.weight"] = ((256,), "float32")  # 1 KiB
        tensors[f"{p}.norm2.weight"] = ((512,), "bfloat16")  # 1 KiB
    return tensors


def test_ddp_balance_is_within_ten_percent():
    """4 DDP ranks each offering the whole 12-layer model: max/mean bytes per rank <= 1.1, total = model."""
    tensors = transformer_like()
    offers = [[full(f, s, dt) for f, (s, dt) in tensors.items()] for _ in range(4)]
    plan = plan_save(offers)
    per_rank = plan.bytes_per_rank
    model_bytes = sum(t.nbytes for t in plan.tensors)
    assert sum(per_rank) == model_bytes
    mean = sum(per_rank) / len(per_rank)
    assert max(per_rank) / mean <= 1.1, per_rank


def test_pinned_pieces_stay_with_their_owner():
    """A piece only one rank holds is written by that rank, however unbalanced that makes the plan."""
    offers = [
        [LocalPiece(fqn="only0", dtype="float32", shape=(1000,), region=Box.full((1000,)))],
        [LocalPiece(fqn="s", dtype="float32", shape=(8, 4), region=Box((4, 0), (4, 4)))],
        [LocalPiece(fqn="s", dtype="float32", shape=(8, 4), region=Box((0, 0), (4, 4)))],
    ]
    plan = plan_save(offers)
    assert [(w.fqn, w.region) for w in plan.writes[0]] == [("only0", Box.full((1000,)))]
    assert [(w.fqn, w.region) for w in plan.writes[1]] == [("s", Box((4, 0), (4, 4)))]
    assert [(w.fqn, w.region) for w in plan.writes[2]] == [("s", Box((0, 0), (4, 4)))]


def test_replicas_go_only_to_holders():
    """A piece replicated on ranks 2 and 3 is never assigned to ranks 0 or 1, even when they are idle."""
    offers = [[], [], [full("x", (100,))], [full("x", (100,))]]
    plan = plan_save(offers, min_split_bytes=64)
    assert plan.writes[0] == () and plan.writes[1] == ()
    assert plan.bytes_per_rank[2] + plan.bytes_per_rank[3] == 400


@pytest.mark.parametrize(
    "other",
    [
        LocalPiece(fqn="layer.w", dtype="float16", shape=(4, 4), region=Box.full((4, 4))),
        LocalPiece(fqn="layer.w", dtype="float32", shape=(4, 5), region=Box.full((4, 5))),
    ],
    ids=["dtype", "shape"],
)
def test_disagreement_between_ranks_raises_naming_the_fqn(other):
    """Ranks describing one fqn with different dtype or global shape -> StateMismatchError naming it."""
    offers = [[full("layer.w", (4, 4))], [other]]
    with pytest.raises(StateMismatchError, match=r"layer\.w") as info:
        plan_save(offers)
    assert "rank 0" in str(info.value) and "rank 1" in str(info.value)


def test_offsets_aligned_and_non_overlapping():
    """Each rank's writes are in its own file, at aligned offsets, in order, not overlapping, and
    the file size is the end of the last write."""
    offers = []
    for rank in range(3):
        offers.append([
            LocalPiece(fqn=f"t{i}", dtype=dt, shape=(i + 3, 5), region=Box((0, 0), (i + 3, 5)))
            for i, dt in enumerate(["float32", "bfloat16", "int8", "bool", "float64"])
        ] + [LocalPiece(fqn=f"own{rank}", dtype="int8", shape=(13,), region=Box.full((13,)))])
    for align in (64, 4096):
        plan = plan_save(offers, align_bytes=align)
        for rank, ws in enumerate(plan.writes):
            assert len({w.file for w in ws}) <= 1
            end = 0
            for w in ws:
                assert w.byte_offset % align == 0
                assert w.byte_offset >= end
                end = w.byte_offset + w.byte_length
            assert plan.file_sizes[rank] == end
        files = [ws[0].file for ws in plan.writes if ws]
        assert len(files) == len(set(files))


def test_byte_lengths_match_regions():
    """Each write's byte_length is its region's element count times the dtype's item size."""
    offers = [[
        LocalPiece(fqn="a", dtype="bfloat16", shape=(3, 4), region=Box((1, 0), (2, 4))),
        LocalPiece(fqn="b", dtype="int64", shape=(10,), region=FlatRange(2, 9)),
        LocalPiece(fqn="c", dtype="bool", shape=(), region=Box((), ())),
    ]]
    plan = plan_save(offers)
    lengths = {w.fqn: w.byte_length for w in plan.writes[0]}
    assert lengths == {"a": 16, "b": 56, "c": 1}


def test_plan_is_deterministic():
    """The same offers give an identical plan and offers digest; different offers a different digest."""
    tensors = transformer_like(layers=3)

    def offers():
        return [[full(f, s, dt) for f, (s, dt) in tensors.items()] for _ in range(3)]

    a, b = plan_save(offers()), plan_save(offers())
    assert a == b and offers_digest(offers()) == offers_digest(offers())
    changed = offers()
    changed[1] = changed[1][:-1]
    assert offers_digest(changed) != offers_digest(offers())


def test_empty_regions_are_not_written():
    """A rank offering an empty piece (an FSDP1 parameter outside its shard) writes nothing for it."""
    offers = [
        [LocalPiece(fqn="p", dtype="float32", shape=(10,), region=FlatRange(0, 10))],
        [LocalPiece(fqn="p", dtype="float32", shape=(10,), region=FlatRange(0, 0))],
    ]
    plan = plan_save(offers)
    assert [w.region for ws in plan.writes for w in ws] == [FlatRange(0, 10)]
    assert plan.tensors[0].shape == (10,)


def test_flat_split_parts_are_flat_ranges_inside_the_original():
    """Splitting a replicated flat range yields consecutive sub-ranges (checked via flat_range_boxes)."""
    offers = [[LocalPiece(fqn="f", dtype="float32", shape=(50, 20), region=FlatRange(7, 993))] for _ in range(2)]
    plan = plan_save(offers, min_split_bytes=512)
    parts = sorted((w.region for ws in plan.writes for w in ws), key=lambda r: r.start)
    assert all(isinstance(p, FlatRange) for p in parts)
    assert parts[0].start == 7 and parts[-1].stop == 993
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    for p in parts:
        flat_range_boxes((50, 20), p.start, p.stop)  # valid range
