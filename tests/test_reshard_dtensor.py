"""Resharding across process counts and DTensor layouts, on real gloo process groups."""

import math

import pytest
import torch

import scenarios

pytestmark = pytest.mark.multiproc

CASES = [
    # (save mesh, save placements, load mesh, load placements)
    pytest.param(None, None, (2,), "S0", id="1->2"),
    pytest.param((2,), "S0", (3,), "S0", id="2->3"),
    pytest.param((4,), "S0", (2,), "S1", id="4->2-shard1"),
    pytest.param((3,), "S1", None, None, id="3->1"),
    pytest.param((2,), "S0", (3,), "S1", id="row->column"),
    pytest.param((2, 2), "S0,S1", (1, 4), "S0,S1", id="2x2->1x4"),
    pytest.param((2, 2), "R,S0", (4, 1), "S0,S1", id="2x2-replicated->4x1"),
    pytest.param((2,), "R", (3,), "S0", id="replicate->shard"),
]


@pytest.mark.parametrize("save_mesh,save_spec,load_mesh,load_spec", CASES)
def test_reshard(dist_pool, tmp_path, save_mesh, save_spec, load_mesh, load_spec):
    stats = dist_pool.run(scenarios.dtensor_reshard, str(tmp_path / "ckpt"), save_mesh, save_spec, load_mesh, load_spec)
    needed = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in scenarios.SPECS.values())
    read = sum(s.get("bytes_read", 0) for s in stats)
    assert read == needed, f"group read {read} bytes for {needed} needed (amplification {read / needed:.3f})"
