"""Coalesced reads: a reader's back-to-back units of one object come in one ranged GET, each byte once.

The S3 loads run on the moto server and count the GETs it answered for data files (its request log),
against the units the plan read (one request each before coalescing).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import scenarios
import scenarios_routes
from test_load_planner import check_exact, reference, save_fake
from tierckpt.io.coalesce import Taken, coalesce
from tierckpt.loading.api import DEFAULT_ROUND_BYTES
from tierckpt.planner import TargetPiece, plan_load
from tierckpt.planner.routes import topology
from tierckpt.native.regions import Box

MiB = 1 << 20


# -- grouping ------------------------------------------------------------------------------------------
def test_coalesce_groups_only_exactly_adjacent_ranges_of_one_key():
    ranges = [("f", 100, 50), ("f", 0, 100), ("g", 150, 10), ("f", 152, 10), None, ("f", 150, 1)]
    assert coalesce(ranges, 1 << 20) == [[1, 0, 5], [3], [2], [4]]


def test_coalesce_reads_through_a_small_gap_only_where_no_read_covers_it():
    """Padding between pieces is read through; a byte another rank reads (the 8 at 108) is not."""
    taken = Taken([("f", [0, 64, 108, 130], 40)])
    ranges = [("f", 0, 40), ("f", 64, 40), ("f", 130, 40)]
    assert coalesce(ranges, 1 << 20, max_gap=32, taken=taken) == [[0, 1], [2]]
    assert coalesce(ranges, 1 << 20, max_gap=16, taken=taken) == [[0], [1], [2]]  # the gap is over the bound
    assert coalesce(ranges, 1 << 20) == [[0], [1], [2]]
    assert taken.free("f", 40, 64) and not taken.free("f", 104, 109) and taken.free("g", 0, 10)


def test_coalesce_caps_a_group_and_leaves_a_long_range_alone():
    ranges = [("f", 0, 40), ("f", 40, 40), ("f", 80, 40), ("f", 120, 200)]
    assert coalesce(ranges, 100) == [[0, 1], [2], [3]]


# -- plans: one reader's units lie back to back ----------------------------------------------------------
def _many_tensors(world: int, count: int = 24):
    """``count`` replicated (8, 16) fp32 tensors saved by 2 ranks (alternating files), needed whole by every rank."""
    refs = {f"t{i:02d}": reference((8, 16), "float32", seed=i) for i in range(count)}
    tensors, pieces, files = save_fake(refs, {n: [(i % 2, Box((0, 0), (8, 16)))] for i, n in enumerate(refs)}, pad=0)
    needs = [[TargetPiece(fqn=n, region=Box.full((8, 16))) for n in refs] for _ in range(world)]
    return refs, tensors, pieces, files, needs


def test_plan_from_an_object_store_gives_each_reader_runs_of_adjacent_units():
    refs, tensors, pieces, files, needs = _many_tensors(2)
    plan = plan_load(tensors, pieces, needs, chunk_bytes=1024, round_bytes=DEFAULT_ROUND_BYTES, topology=topology("object_store", "gloo", ["n", "n"]))
    check_exact(refs, plan, tensors, files, needs)
    assert plan.bytes_read == sum(r.numel() * 4 for r in refs.values())  # each byte once
    groups = [coalesce([(u.file, int(u.run_offsets[0]), u.nbytes) if u.reader == rank else None for u in plan.units], MiB)
              for rank in range(2)]
    requests = sum(len([g for g in rank_groups if plan.units[g[0]].reader == rank]) for rank, rank_groups in enumerate(groups))
    assert requests <= len(plan.units) // 4  # runs of 3 or more units of 512 bytes (before: 24 requests)
    assert abs(plan.bytes_read_per_rank[0] - plan.bytes_read_per_rank[1]) <= 2 * 1024  # balanced within chunk_bytes


# -- real loads from S3: GETs counted by the server ------------------------------------------------------
RANGE = re.compile(r"bytes=(\d+)-(\d+)")


def _data_gets(log: list[tuple[str, str, str | None]]) -> tuple[int, int]:
    """GET requests for data files in the server's log, and the bytes they asked for."""
    gets = [r for m, path, r in log if m == "GET" and "/data/rank-" in path]
    total = 0
    for header in gets:
        match = RANGE.fullmatch(header or "")
        assert match, f"data files are read by ranged GETs, got Range {header!r}"
        total += int(match[2]) - int(match[1]) + 1
    return len(gets), total


def _units(stats: list[dict]) -> int:
    return int(sum(s.get("units_direct", 0) + s.get("units_exchange", 0) for s in stats if s))


@pytest.mark.multiproc
def test_ddp_resume_from_s3_coalesces_gets_and_reads_each_byte_once(dist_pool, s3_bucket_uri, s3_server, s3_requests):
    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing", "region": "us-east-1", "cache": False}
    stats = dist_pool.run(scenarios_routes.ddp_resume, s3_bucket_uri, options, False)  # asserts bit-exact states
    gets, nbytes = _data_gets(s3_requests)
    first = next(s for s in stats if s)
    tensor_bytes, num_tensors = int(first["tensor_bytes"]), int(first["num_tensors"])
    assert sum(s.get("bytes_read", 0) for s in stats) == tensor_bytes  # each byte once for the group
    # what the GETs span beyond that is the padding (< 64 bytes) that aligns each saved piece
    assert tensor_bytes <= nbytes < tensor_bytes + 64 * num_tensors
    assert gets == sum(s.get("requests", 0) for s in stats if s)
    assert gets <= 4 < num_tensors <= _units(stats)  # before: one GET per unit (one per tensor or more)


@pytest.mark.multiproc
def test_resharded_load_from_s3_coalesces_gets_and_reads_each_byte_once(dist_pool, s3_bucket_uri, s3_server, s3_requests):
    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing", "region": "us-east-1", "cache": False}
    stats = dist_pool.run(scenarios.dtensor_reshard, s3_bucket_uri, (2,), "S0", (3,), "S0", options)  # asserts bit-exact
    needed = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in scenarios.SPECS.values())
    gets, nbytes = _data_gets(s3_requests)
    assert sum(s.get("bytes_read", 0) for s in stats) == needed
    assert needed <= nbytes < needed + 64 * 2 * len(scenarios.SPECS)  # plus the padding between pieces
    assert gets == sum(s.get("requests", 0) for s in stats if s)
    assert gets < _units(stats)
