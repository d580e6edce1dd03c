"""Framework-free sharded tensors (tierckpt.sharded): validation, Megatron helpers, and a TP x PP
checkpoint resharded to another TP x PP layout and to one process, compared bit-exactly."""

import re
from types import SimpleNamespace

import pytest
import torch

import scenarios_state
import tierckpt
from tierckpt import CheckpointError
from tierckpt.errors import StateMismatchError
from tierckpt.native.coverage import check_offered_coverage
from tierckpt.native.metadata import TensorMeta
from tierckpt.native.regions import Box, FlatRange
from tierckpt.sharded import (
    FlatShardedTensor, ShardedTensor, column_parallel, from_megatron, row_parallel, stage_layers, vocab_parallel,
)


def test_sharded_tensor_entry_and_prepended_axes():
    local = torch.arange(12.0).reshape(3, 4)
    entry = ShardedTensor(local, (2, 6, 4), (1, 3, 0)).__tierckpt_entry__("w")
    assert entry.shape == (2, 6, 4) and entry.region == Box((1, 3, 0), (1, 3, 4))
    entry.tensor.zero_()  # a view: loading fills the caller's tensor in place
    assert local.abs().sum() == 0


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: ShardedTensor(torch.zeros(3, 4), (5, 4), (3, 0)), "reaches past the global shape [5, 4] in dim 0"),
        (lambda: ShardedTensor(torch.zeros(3, 4), (12,), (0,)), "has 2 dims but global_shape"),
        (lambda: ShardedTensor(torch.zeros(3, 4), (6, 4), (0,)), "different lengths"),
        (lambda: ShardedTensor(torch.zeros(3, 4), (6, 4), (-1, 0)), "must not be negative"),
        (lambda: ShardedTensor([1, 2], (2,), (0,)), "must be a torch.Tensor"),
        (lambda: FlatShardedTensor(torch.zeros(2, 2), (4,), 0), "must be 1-D"),
        (lambda: FlatShardedTensor(torch.zeros(5), (2, 3), 2), "outside a tensor of shape"),
        (lambda: column_parallel(torch.zeros(5, 2), 0, 2, full=True), "does not split evenly"),
        (lambda: column_parallel(torch.zeros(5, 2), 2, 2), "tp_rank 2 is not in 0..1"),
        (lambda: vocab_parallel(torch.zeros(4, 2), 0, 2, vocab_size=9), "larger than the padded vocabulary"),
    ],
)
def test_validation_errors(make, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        make()


def test_megatron_helpers():
    full = torch.arange(24.0).reshape(4, 6)
    col = column_parallel(full, 1, 2, full=True).__tierckpt_entry__("c")
    assert col.region == Box((2, 0), (2, 6)) and torch.equal(col.tensor, full[2:])
    row = row_parallel(torch.zeros(4, 3), 1, 2).__tierckpt_entry__("r")
    assert row.shape == (4, 6) and row.region == Box((0, 3), (4, 3))
    # Vocab 13 padded to 16 over TP 4: rank 3 holds rows 12..15, of which only row 12 is real.
    emb = vocab_parallel(torch.zeros(4, 5), 3, 4, vocab_size=13).__tierckpt_entry__("e")
    assert emb.shape == (13, 5) and emb.region == Box((12, 0), (1, 5))
    assert list(stage_layers(5, 0, 2)) == [0, 1, 2] and list(stage_layers(5, 1, 2)) == [3, 4]


def test_flat_saved_loads_into_boxes_single_process(tmp_path):
    """A whole flat buffer saved as one FlatShardedTensor loads into row boxes and a plain tensor."""
    ref = torch.randn(5, 7)
    tierckpt.save(str(tmp_path / "x"), {"m": {"w": FlatShardedTensor(ref.reshape(-1).clone(), (5, 7), 0)}})
    rows = ShardedTensor(torch.zeros(2, 7), (5, 7), (2, 0))
    tierckpt.load(str(tmp_path / "x"), {"m": {"w": rows}})
    assert torch.equal(rows.local, ref[2:4])
    plain = torch.zeros(5, 7)
    tierckpt.load(str(tmp_path / "x"), {"m": {"w": plain}})
    assert torch.equal(plain, ref)


def test_a_tensor_the_ranks_hold_in_part_is_refused_by_save(tmp_path):
    """One layer under a name whose global shape is the whole stack: the save is refused, nothing committed
    (every load refuses a tensor whose pieces miss elements); the layer under a shape of its own saves."""
    layer = torch.arange(48.0).reshape(8, 6)
    with pytest.raises(StateMismatchError, match=re.escape("hold 48 of its 192 elements, 144 are on no rank")):
        tierckpt.save(str(tmp_path / "x"), {"stack.0": ShardedTensor(layer, (4, 8, 6), (0, 0, 0))})
    assert not (tmp_path / "x" / "COMMIT").exists()
    tierckpt.save(str(tmp_path / "x"), {"stack.0": ShardedTensor(layer, (1, 8, 6), (0, 0, 0))})
    back = torch.zeros(1, 8, 6)
    tierckpt.load(str(tmp_path / "x"), {"stack.0": back})
    assert torch.equal(back[0], layer)


def test_offered_regions_that_miss_or_share_elements_are_refused():
    """The regions of two ranks: a row no rank holds, and two different pieces holding the same row."""
    tensors = {"w": TensorMeta(fqn="w", dtype="float32", shape=(4, 6))}
    check_offered_coverage(tensors, {"w": [Box((0, 0), (2, 6)), Box((2, 0), (2, 6))]})
    check_offered_coverage(tensors, {"w": [FlatRange(0, 10), FlatRange(10, 24)]})
    with pytest.raises(StateMismatchError, match=re.escape("hold 18 of its 24 elements, 6 are on no rank")):
        check_offered_coverage(tensors, {"w": [Box((0, 0), (2, 6)), Box((3, 0), (1, 6))]})
    with pytest.raises(StateMismatchError, match=re.escape("[0:3, 0:6] and [2:4, 0:6]")):
        check_offered_coverage(tensors, {"w": [Box((0, 0), (3, 6)), Box((2, 0), (2, 6))]})
    with pytest.raises(StateMismatchError, match=re.escape("flat [0:10] and flat [8:24]")):
        check_offered_coverage(tensors, {"w": [FlatRange(0, 10), FlatRange(8, 24)]})
    with pytest.raises(StateMismatchError, match=re.escape("hold 0 of its 24 elements")):
        check_offered_coverage(tensors, {})


def test_from_megatron_duck_typed():
    data = torch.zeros(2, 6)
    st = SimpleNamespace(key="w", data=data, global_shape=(8, 6), global_offset=(4, 0), replica_id=(0, 0, 1),
                         prepend_axis_num=0, flattened_range=None, local_shape=(2, 6))
    entry = from_megatron(st).__tierckpt_entry__("w")
    assert entry.region == Box((4, 0), (2, 6)) and entry.shape == (8, 6)
    flat = SimpleNamespace(**{**vars(st), "data": torch.zeros(5), "flattened_range": slice(3, 8)})
    assert from_megatron(flat).__tierckpt_entry__("w").region == FlatRange(27, 32)
    cols = SimpleNamespace(**{**vars(flat), "global_shape": (2, 12), "global_offset": (0, 6)})
    with pytest.raises(CheckpointError, match="not one flat range"):
        from_megatron(cols)


@pytest.mark.multiproc
def test_megatron_tp2_pp2_to_tp4_and_one_process(dist_pool, tmp_path):
    results = dist_pool.run(scenarios_state.megatron_reshard, str(tmp_path / "ckpt"))
    assert all(r["tp4"] == len(scenarios_state.megatron_state(r_i, 4, 0, 1, fill=False)) + 1 for r_i, r in enumerate(results))
    assert results[0]["one"] == 4 * 5 + 4
