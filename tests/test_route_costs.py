"""Load routes chosen from measured costs: the route flips with what the machine measures, the per-node
route reads each byte once per node, the override is checked, and real loads measure and agree."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest
import torch

import scenarios_route_costs
from test_load_planner import check_exact
from test_load_routes import ddp_case
from tierckpt.errors import RouteCostsError
from tierckpt.loading.api import DEFAULT_ROUND_BYTES
from tierckpt.planner import plan_load
from tierckpt.planner.routes import (
    DIRECT, EXCHANGE, NODE, RankRead, choose_route, direct_seconds, exchange_seconds, node_seconds,
    topology, with_costs,
)
from tierckpt.loading.generation import _log_routes
from tierckpt.loading.route_costs import ROUTE_COSTS_ENV, parse_override
from tierckpt.monitor import Monitor
from tierckpt.native.metadata import TensorMeta
from tierckpt.native.regions import Box
from tierckpt.planner import TargetPiece
from tierckpt.planner.group_needs import GroupNeeds

MiB = 1 << 20
TWO_BY_FOUR = ["a"] * 4 + ["b"] * 4


def replicated(world: int, nbytes: int = 64 * MiB) -> list[RankRead]:
    return [RankRead(r, nbytes, 1, nbytes) for r in range(world)]


# What the 2-core test VM measured with 2 simulated nodes of 4 ranks on a page-cached disk: gloo over loopback
# with 8 processes on 2 cores is slow next to the page cache.
SLOW_EXCHANGE = {"local_byte_s": 3e-9, "remote_byte_s": 3e-9, "message_s": 1e-3,
                 "byte_s": 0.2e-9, "group_byte_s": 0.1e-9, "cached_byte_s": 0.2e-9}
# A real shared file system behind a fast network: the store is the bottleneck.
SLOW_STORE = {"local_byte_s": 0.1e-9, "remote_byte_s": 0.1e-9, "message_s": 10e-6,
              "byte_s": 2e-9, "group_byte_s": 2e-9, "cached_byte_s": 0.1e-9}


def test_the_route_flips_with_the_measured_exchange_and_back():
    """A DDP resume on 2 nodes x 4 ranks from a local path (a "shared file system" to the planner)."""
    prior = topology("shared_fs", "gloo", TWO_BY_FOUR, cores=2)
    reads, n = replicated(8), 64 * MiB
    assert choose_route(reads, n, 1, prior) == EXCHANGE  # the constants' guess
    slow = with_costs(prior, SLOW_EXCHANGE, tuple(SLOW_EXCHANGE))
    assert direct_seconds(reads, n, slow) < exchange_seconds(reads, n, 1, slow)
    assert choose_route(reads, n, 1, slow) == DIRECT
    fast = with_costs(slow, SLOW_STORE, tuple(SLOW_STORE))  # measured again on another machine: flips back
    assert choose_route(reads, n, 1, fast) == EXCHANGE
    assert choose_route(reads, n, 1, with_costs(fast, SLOW_EXCHANGE, ())) == DIRECT


def test_the_plan_follows_the_measured_costs():
    refs, tensors, pieces, files, needs = ddp_case(8)
    prior = topology("shared_fs", "gloo", TWO_BY_FOUR, cores=2)
    plans = {}
    for name, costs in (("slow exchange", SLOW_EXCHANGE), ("slow store", SLOW_STORE)):
        topo = with_costs(prior, costs, tuple(costs))
        plans[name] = plan = plan_load(tensors, pieces, needs, chunk_bytes=1024, round_bytes=DEFAULT_ROUND_BYTES,
                                       topology=topo)
        check_exact(refs, plan, tensors, files, needs)
    assert plans["slow exchange"].bytes_read == 8 * 64 * 16 * 4 and not any(plans["slow exchange"].exchanges)
    assert plans["slow store"].bytes_read == 64 * 16 * 4 and all(plans["slow store"].exchanges)


def test_each_node_reads_once_and_shares_where_only_the_network_between_nodes_is_slow():
    """An object store (no page cache: direct repeats are GETs again) and a slow link between nodes: each node
    reads the bytes once and delivers them to its own ranks only."""
    refs, tensors, pieces, files, needs = ddp_case(8)
    costs = {"remote_byte_s": 5e-9, "local_byte_s": 0.1e-9, "request_s": 1e-6, "message_s": 2e-6}
    topo = with_costs(topology("object_store", "gloo", TWO_BY_FOUR, cores=16), costs, tuple(costs))
    n = 64 * MiB
    reads = replicated(8)
    assert node_seconds(reads, n, 1, topo) < min(direct_seconds(reads, n, topo), exchange_seconds(reads, n, 1, topo))
    assert choose_route(reads, n, 1, topo) == NODE
    plan = plan_load(tensors, pieces, needs, chunk_bytes=4096, round_bytes=DEFAULT_ROUND_BYTES, topology=topo)
    check_exact(refs, plan, tensors, files, needs)
    assert plan.bytes_read == 2 * 64 * 16 * 4  # once per node
    for unit in plan.units:
        assert {TWO_BY_FOUR[d.rank] for d in unit.deliveries} == {TWO_BY_FOUR[unit.reader]}
        assert len(unit.deliveries) == 4
    assert plan.bytes_by_route(TWO_BY_FOUR) == {DIRECT: 0, NODE: 2 * 64 * 16 * 4, EXCHANGE: 0}
    # with one rank per node it is no route of its own (that is the direct route)
    assert choose_route(replicated(2), n, 1, replace(topo, nodes=("a", "b"))) != NODE


def test_the_override_is_checked_and_names_the_fix():
    assert parse_override("") == (False, {})
    assert parse_override(" constants , local_byte_s=2e-9,message_s=0.0001") == (
        True, {"local_byte_s": 2e-9, "message_s": 1e-4})
    for bad in ("local_byte=1e-9", "byte_s", "byte_s=fast", "byte_s=-1", "byte_s=inf", "byte_s=nan"):
        with pytest.raises(RouteCostsError, match=ROUTE_COSTS_ENV) as info:
            parse_override(bad)
        assert "name=seconds" in str(info.value) and "constants" in str(info.value)


def test_the_measured_costs_are_named_in_the_inputs():
    topo = with_costs(topology("shared_fs", "gloo", TWO_BY_FOUR), {"byte_s": 1e-9}, ("byte_s",))
    text = topo.describe()
    assert "byte_s=1e-09*" in text and "local_byte_s=5e-10," in text and "2 node(s)" in text


# -- real loads: the group measures, agrees and routes by it -----------------------------------------
def _ranks(stats: list[dict]) -> list[dict]:
    ranks = [s for s in stats if s]
    assert len(ranks) == 2
    return ranks


@pytest.mark.multiproc
def test_a_load_measures_the_store_and_the_exchange_once_and_every_rank_agrees(dist_pool, tmp_path):
    ranks = _ranks(dist_pool.run(scenarios_route_costs.measured_load, str(tmp_path / "ckpt"), ""))
    costs = [r["costs"] for r in ranks]
    assert costs[0] == costs[1]  # the same inputs on every rank
    names = set(costs[0])
    # one rank per node: no rank of the same node to exchange with, so local_byte_s keeps its prior
    assert names == {"request_s", "byte_s", "group_byte_s", "cached_byte_s", "message_s", "remote_byte_s"}
    assert all(math.isfinite(v) and v >= 0 for v in costs[0].values()) and costs[0]["byte_s"] > 0
    assert all(r["probes"] == 1 for r in ranks)  # the second load reused what the first measured


@pytest.mark.multiproc
@pytest.mark.parametrize("override,route", [
    ("local_byte_s=1e-6,remote_byte_s=1e-6", "direct"),  # exchanging is slow: each rank reads
    ("byte_s=1e-6,group_byte_s=1e-6,request_s=1e-3", "exchange"),  # the store is slow: read once, exchange
])
def test_a_real_load_flips_route_with_the_costs(dist_pool, tmp_path, override, route):
    ranks = _ranks(dist_pool.run(scenarios_route_costs.measured_load, str(tmp_path / "ckpt"), override))
    other = "exchange" if route == "direct" else "direct"
    assert sum(r.get(f"units_{route}", 0) for r in ranks) > 0 and all(r.get(f"units_{other}", 0) == 0 for r in ranks)
    tensor_bytes = ranks[0]["tensor_bytes"]
    assert sum(r.get("bytes_read", 0) for r in ranks) == (2 if route == "direct" else 1) * tensor_bytes


# -- what a load counts and logs of its plan's routes ------------------------------------------------------
UNIT_BYTES = 64 * 16 * 4
"""The bytes of ``ddp_case``'s tensor: what each read of it holds."""


@pytest.mark.parametrize("case,nodes,costs,kind,expected", [
    ("direct", ["n"] * 3, {}, "node_local", {DIRECT: 3 * UNIT_BYTES, NODE: 0, EXCHANGE: 0}),
    ("exchange", TWO_BY_FOUR, SLOW_STORE, "shared_fs", {DIRECT: 0, NODE: 0, EXCHANGE: UNIT_BYTES}),
    ("node", TWO_BY_FOUR, {"remote_byte_s": 5e-9, "local_byte_s": 0.1e-9, "request_s": 1e-6, "message_s": 2e-6},
     "object_store", {DIRECT: 0, NODE: 2 * UNIT_BYTES, EXCHANGE: 0}),
])
def test_a_load_counts_and_logs_each_route_of_its_plan(caplog, case, nodes, costs, kind, expected):
    """Each rank's monitor counts the units it reads and their bytes per route; rank 0 logs the group's plan
    (or its own) with the bytes of each route, in one line."""
    _, tensors, pieces, _, needs = ddp_case(len(nodes))
    topo = with_costs(topology(kind, "gloo", nodes, cores=2), costs, tuple(costs))
    plan = plan_load(tensors, pieces, needs, chunk_bytes=1024, round_bytes=DEFAULT_ROUND_BYTES, topology=topo)
    counted: dict[str, float] = {}
    for rank in range(len(nodes)):
        monitor = Monitor()
        with caplog.at_level(logging.INFO, logger="tierckpt"):
            _log_routes(plan, topo, rank, monitor)
        for name, value in monitor.counters.items():
            counted[name] = counted.get(name, 0) + value
        mine = [u for u in plan.units if u.reader == rank]
        assert sum(v for k, v in monitor.counters.items() if k.startswith("units_")) == len(mine)
        assert sum(v for k, v in monitor.counters.items() if k.startswith("bytes_read_")) == sum(u.nbytes for u in mine)
    assert counted == {f"units_{case}": len(plan.units), f"bytes_read_{case}": expected[case]}  # every unit one route
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("load plan")]
    assert lines == [f"load plan: {len(plan.units)} units; {expected[DIRECT]} bytes read directly, {expected[NODE]} read "
                     f"once per node and shared there, {expected[EXCHANGE]} read once and exchanged ({topo.describe()})"]
    caplog.clear()
    own = replace(plan, units=tuple(u for u in plan.units if u.reader == 0), rank=0)
    with caplog.at_level(logging.INFO, logger="tierckpt"):
        _log_routes(own, topo, 0, Monitor())
    theirs = {r: sum(u.nbytes for u in own.units if u.route_in(nodes) == r) for r in expected}
    assert [r.getMessage() for r in caplog.records] == [
        f"load plan of rank 0: {len(own.units)} units; {theirs[DIRECT]} bytes read directly, {theirs[NODE]} read once "
        f"per node and shared there, {theirs[EXCHANGE]} read once and exchanged ({topo.describe()})"]


# -- no route to choose, nothing measured ----------------------------------------------------------------
def test_a_load_where_each_tensor_has_one_needing_rank_measures_nothing(tmp_path, monkeypatch):
    """One rank reads every slab itself whatever the costs: a one-rank load of a checkpoint large enough to
    measure the store with takes no probe and keeps nothing, and still loads every value."""
    import tierckpt
    from tierckpt.loading import route_costs

    state = {"w": torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024)}  # a 1 MiB data file
    tierckpt.save(str(tmp_path / "ckpt"), state)
    assert max(p.stat().st_size for p in (tmp_path / "ckpt").rglob("*") if p.is_file()) >= route_costs.PROBE_MIN_FILE_BYTES
    probes: list[int] = []
    probe = route_costs._probe
    monkeypatch.setattr(route_costs, "_probe", lambda *args: probes.append(1) or probe(*args))
    monkeypatch.setattr(route_costs, "_kept", {})
    monkeypatch.setenv(ROUTE_COSTS_ENV, "")  # the tests' default skips every probe: measure as a job does
    target = {"w": torch.zeros(256, 1024)}
    tierckpt.load(str(tmp_path / "ckpt"), target)
    assert torch.equal(target["w"], state["w"])
    assert probes == [] and route_costs._kept == {}


def test_whether_some_tensor_is_needed_by_several_ranks():
    tensors = {name: TensorMeta(fqn=name, dtype="float32", shape=(4, 4)) for name in ("a", "b")}
    whole = Box.full((4, 4))
    own = [[TargetPiece(fqn="a", region=whole)], [TargetPiece(fqn="b", region=whole)], []]
    assert GroupNeeds.of(own, tensors).one_rank_per_tensor()
    halves = [[TargetPiece(fqn="a", region=Box((0, 0), (2, 4)))], [TargetPiece(fqn="a", region=Box((2, 0), (2, 4)))]]
    assert not GroupNeeds.of(halves, tensors).one_rank_per_tensor()  # its slabs may be read once and exchanged
    assert GroupNeeds.of([[], []], tensors).one_rank_per_tensor()
