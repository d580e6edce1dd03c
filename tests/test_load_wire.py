"""The compact form of the needs and asked keys a load all-gathers (load_wire.py): exact round trips,
and a fraction of the pickled objects' size."""

from __future__ import annotations

import logging
import pickle
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.load_wire import pack_asked, pack_needs, unpack, unpack_needs
from tierckpt.metadata import TensorMeta
from tierckpt.planner import TargetPiece
from tierckpt.regions import Box, FlatRange


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
@given(needs_of())
def test_needs_round_trip_exactly(case):
    shapes, needs = case
    ckpt = checkpoint(shapes)
    wire = pickle.loads(pickle.dumps(pack_needs(needs, ckpt)))
    assert unpack_needs(wire, ckpt, sorted(shapes)) == needs


def test_asked_keys_are_decoded_for_the_debug_log_only(caplog):
    ckpt = checkpoint({"a": (2,), "b": (3, 3), "c": ()}, objects=("step", "rng"))
    share = (pack_needs([TargetPiece(fqn="b", region=Box((1, 0), (2, 3)))], ckpt), [("missing", "z")],
             pack_asked(["b", "step", "z"], ckpt), None, "node", None, [], True, 2)
    with caplog.at_level(logging.DEBUG, logger="tierckpt"):
        (needs, findings, asked, empty, *rest), = unpack([share], ckpt)
    assert needs == [TargetPiece(fqn="b", region=Box((1, 0), (2, 3)))]
    assert findings == [("missing", "z")] and asked == ["b", "step"] and empty == [] and rest == ["node", None, [], True, 2]
    with caplog.at_level(logging.INFO, logger="tierckpt"):
        assert unpack([share], ckpt)[0][2] == []


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
    assert unpack_needs(pack_needs(needs, ckpt), ckpt, sorted(shapes)) == needs


