"""The compact form of the needs and asked keys a load all-gathers (load_wire.py): exact round trips, a
fraction of the pickled objects' size, and grouped needs (planner/group_needs.py) that lose nothing a
rank's plan reads: random reshards through the wire give the group plan and the plans of the plain lists."""

from __future__ import annotations

import logging
import pickle
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from test_load_planner import check_exact, save_fake, scenario
from test_load_planner_index import mesh_or_flat_case
from test_rank_plan import P2P, check_union

from tierckpt.loading.wire import pack_asked, pack_needs, unpack, unpack_needs
from tierckpt.native.metadata import TensorMeta
from tierckpt.planner import TargetPiece, plan_load, topology
from tierckpt.planner.group_needs import GroupNeeds
from tierckpt.planner.rank_plan import agree_rounds, plan_rank
from tierckpt.native.regions import Box, FlatRange


def checkpoint(shapes: dict[str, tuple[int, ...]], objects: tuple[str, ...] = ()) -> SimpleNamespace:
    tensors = {k: TensorMeta(fqn=k, dtype="float32", shape=s) for k, s in shapes.items()}
    metas = [SimpleNamespace(key=k) for k in objects]
    return SimpleNamespace(tensors=tensors, meta=SimpleNamespace(objects=metas))


@st.composite
def needs_of(draw):
    shapes = {f"layer{i}.w": tuple(draw(st.lists(st.integers(1, 9), max_size=3))) for i in range(draw(st.integers(1, 8)))}
    needs = []
    for fqn in draw(st.permutations(sorted(shapes))):
        shape = shapes[fqn]
        kind = draw(st.sampled_from(["whole", "box", "flat"]))
        if kind == "whole" or not shape:
            region = Box.full(shape)
        elif kind == "box":
            offsets = tuple(draw(st.integers(0, n - 1)) for n in shape)
            region = Box(offsets, tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offsets)))
        else:
            numel = 1
            for n in shape:
                numel *= n
            lo = draw(st.integers(0, numel - 1))
            region = FlatRange(lo, draw(st.integers(lo + 1, numel)))
        needs.append(TargetPiece(fqn=fqn, region=region))
    return shapes, needs


@settings(max_examples=200, deadline=None)
@given(st.lists(needs_of(), min_size=1, max_size=4))
def test_needs_round_trip_exactly(cases):
    """Each rank's needs of its own tensors (a shared checkpoint of all of them), through pickle."""
    shapes = {k: v for c in cases for k, v in c[0].items()}
    needs = [[n for n in c[1] if shapes[n.fqn] == c[0][n.fqn]] for c in cases]
    ckpt = checkpoint(shapes)
    wires = [pickle.loads(pickle.dumps(pack_needs(n, ckpt))) for n in needs]
    group = unpack_needs(wires, ckpt, sorted(shapes))
    assert [group.of_rank(r) for r in range(len(needs))] == needs
    assert group.needed() == sorted({sorted(shapes).index(n.fqn) for rank_needs in needs for n in rank_needs})


@settings(max_examples=200, deadline=None)
@given(st.lists(needs_of(), min_size=1, max_size=4))
def test_two_tensors_share_a_digest_exactly_when_every_rank_needs_the_same_region(cases):
    """The digest a rank's plan groups tensors by (with their shape): equal exactly when each rank needs
    the same region of both tensors, or neither."""
    shapes = {k: v for c in cases for k, v in c[0].items()}
    needs = [[n for n in c[1] if shapes[n.fqn] == c[0][n.fqn]] for c in cases]
    ckpt = checkpoint(shapes)
    group = unpack_needs([pack_needs(n, ckpt) for n in needs], ckpt, sorted(shapes))
    names = sorted(shapes)
    regions = [{n.fqn: n.region for n in rank_needs} for rank_needs in needs]
    for a, x in enumerate(names):
        for b, y in enumerate(names):
            if shapes[x] == shapes[y]:
                alike = all(r.get(x) == r.get(y) for r in regions)
                assert (group.digest(a) == group.digest(b)) == alike, (x, y)


def wired(tensors, needs) -> GroupNeeds:
    """Every rank's needs packed, pickled as the all-gather sends them, and unpacked."""
    ckpt = SimpleNamespace(tensors=tensors, meta=SimpleNamespace(objects=[]))
    return unpack_needs([pickle.loads(pickle.dumps(pack_needs(n, ckpt))) for n in needs], ckpt, sorted(tensors))


def plans_through_the_wire(tensors, pieces, needs, chunk, round_bytes, topo):
    group = wired(tensors, needs)
    drafts = [plan_rank(tensors, pieces, group, r, chunk_bytes=chunk, round_bytes=round_bytes, p2p_min_bytes=P2P,
                        topology=topo) for r in range(len(needs))]
    plain = [plan_rank(tensors, pieces, needs, r, chunk_bytes=chunk, round_bytes=round_bytes, p2p_min_bytes=P2P,
                       topology=topo) for r in range(len(needs))]
    for d, p in zip(drafts, plain):
        assert d.keys == p.keys and d.checkers == p.checkers and d.share == p.share
        assert [{**u, "run_offsets": u["run_offsets"].tolist()} for u in d.drafts] == \
               [{**u, "run_offsets": u["run_offsets"].tolist()} for u in p.drafts]
    return [agree_rounds(d, [x.share for x in drafts], tensors) for d in drafts]


@settings(max_examples=100, deadline=None)
@given(scenario(), st.sampled_from(["node_local", "shared_fs", "object_store"]), st.booleans())
def test_random_reshards_through_the_wire_plan_as_the_plain_needs(case, store, two_nodes):
    """Every rank's needs through the wire (a copy of each tensor laid out alike, some ranks needing
    several regions of one tensor): each rank's draft is the one its plain needs give, and the union of
    the rank plans is the group plan of the plain needs, delivering the reference bits exactly."""
    refs, layout, needs, kinds, chunk, round_bytes = case
    refs = {**refs, **{f"{k}.copy": v + 1 for k, v in refs.items()}}
    layout = {**layout, **{f"{k}.copy": v for k, v in layout.items()}}
    needs = [[*n, *[TargetPiece(fqn=f"{x.fqn}.copy", region=x.region) for x in reversed(n)]] for n in needs]
    tensors, pieces, files = save_fake(refs, layout)
    topo = topology(store, "gloo", [f"n{r % 2 if two_nodes else 0}" for r in range(len(needs))])
    group = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=round_bytes, topology=topo)
    plans = plans_through_the_wire(tensors, pieces, needs, chunk, round_bytes, topo)
    check_exact(refs, check_union(plans, group, tensors, round_bytes), tensors, files, needs)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_meshes_and_flat_ranges_through_the_wire_plan_as_the_plain_needs(data):
    """Up to 16 ranks, 1-D/2-D meshes or FSDP1 flat ranges: the same through the wire as plain."""
    world, tensors, pieces, needs = mesh_or_flat_case(data, 4096)
    topo = topology("node_local", "gloo", [f"n{r * 2 // world}" for r in range(world)])
    group = plan_load(tensors, pieces, needs, chunk_bytes=256, round_bytes=1 << 20, topology=topo)
    check_union(plans_through_the_wire(tensors, pieces, needs, 256, 1 << 20, topo), group, tensors, 1 << 20)


def test_asked_keys_are_decoded_for_the_debug_log_only(caplog):
    ckpt = checkpoint({"a": (2,), "b": (3, 3), "c": ()}, objects=("step", "rng"))
    share = (pack_needs([TargetPiece(fqn="b", region=Box((1, 0), (2, 3)))], ckpt), [("missing", "z")],
             pack_asked(["b", "step", "z"], ckpt), None, "node", None, [], True, 2)
    with caplog.at_level(logging.DEBUG, logger="tierckpt"):
        group, ((empty_needs, findings, asked, empty, *rest),) = unpack([share], ckpt)
    assert group.of_rank(0) == [TargetPiece(fqn="b", region=Box((1, 0), (2, 3)))] and empty_needs is None
    assert findings == [("missing", "z")] and asked == ["b", "step"] and empty == [] and rest == ["node", None, [], True, 2]
    with caplog.at_level(logging.INFO, logger="tierckpt"):
        assert unpack([share], ckpt)[1][0][2] == []


def test_a_sharded_model_share_is_under_a_quarter_of_the_objects():
    """873 tensors (a 7B model with AdamW states), each a row shard of 8 ranks or replicated."""
    shapes = {}
    for layer in range(97):
        for name, shape in (("q.weight", (4096, 4096)), ("mlp.weight", (11008, 4096)), ("norm.weight", (4096,))):
            for prefix in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
                shapes[f"{prefix}.layers.{layer}.{name}"] = shape
    ckpt = checkpoint(shapes)
    needs = [TargetPiece(fqn=k, region=Box.full(s) if len(s) == 1 else Box((3 * s[0] // 8, 0), (s[0] // 8, s[1])))
             for k, s in shapes.items()]
    old = pickle.dumps((needs, sorted(shapes)), protocol=pickle.HIGHEST_PROTOCOL)
    new = pickle.dumps((pack_needs(needs, ckpt), pack_asked(shapes, ckpt)), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(new) * 4 < len(old)
    assert unpack_needs([pack_needs(needs, ckpt)], ckpt, sorted(shapes)).of_rank(0) == needs


