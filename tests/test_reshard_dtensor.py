"""Resharding across process counts and DTensor layouts, on real gloo process groups.

Every case checks each loaded element bit-exactly against the saved reference and that the group
read exactly the checkpoint's bytes (read amplification 1.00).
"""

import math

import pytest
import torch

import scenarios
import tierckpt

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


def _assert_exact_reads(stats: list[dict], local_files: bool = True) -> None:
    """Each byte read once by the group — except that from a local file on one node, the 0-d tensor
    (replicated on every loading rank) is read by each rank: a page-cache copy is cheaper than a message."""
    needed = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in scenarios.SPECS.values())
    loading = sum(1 for s in stats if s)
    if local_files:
        needed += (loading - 1) * scenarios.SPECS["scalar"][1].itemsize
    read = sum(s.get("bytes_read", 0) for s in stats)
    assert read == needed, f"group read {read} bytes for {needed} needed (amplification {read / needed:.3f})"


@pytest.mark.multiproc
@pytest.mark.parametrize("save_mesh,save_spec,load_mesh,load_spec", CASES)
def test_reshard(dist_pool, tmp_path, save_mesh, save_spec, load_mesh, load_spec):
    stats = dist_pool.run(scenarios.dtensor_reshard, str(tmp_path / "ckpt"), save_mesh, save_spec, load_mesh, load_spec)
    _assert_exact_reads(stats)


@pytest.mark.multiproc
@pytest.mark.s3_servers
@pytest.mark.parametrize("save_mesh,save_spec,load_mesh,load_spec", [CASES[1], CASES[4], CASES[6]])
def test_reshard_on_s3(dist_pool, s3_bucket_uri, s3_server, save_mesh, save_spec, load_mesh, load_spec):
    """The same reshards through S3 (moto, and radosgw, on loopback): every rank talks to the server itself."""
    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing", "region": "us-east-1"}
    stats = dist_pool.run(scenarios.dtensor_reshard, s3_bucket_uri, save_mesh, save_spec, load_mesh, load_spec, options)
    _assert_exact_reads(stats, local_files=False)


def test_single_process_on_memory_store(tmp_path):
    """memory:// is per process, so it serves single-process saves and loads."""
    uri = f"memory://reshard-{tmp_path.name}/ckpt"
    state = {n: scenarios.reference(n, shape, dtype) for n, (shape, dtype) in scenarios.SPECS.items()}
    tierckpt.save(uri, {"s": state})
    target = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in scenarios.SPECS.items()}
    tierckpt.load(uri, {"s": target})
    for name, value in state.items():
        assert torch.equal(target[name], value), name


@pytest.mark.multiproc
def test_row_to_column_reads_directly_on_local_files(dist_pool, tmp_path):
    """Runs of 2 KiB: on local files every rank reads its own columns itself — nothing is exchanged."""
    stats = dist_pool.run(scenarios.column_reshard, str(tmp_path / "ckpt"), None)
    assert sum(s.get("bytes_read", 0) for s in stats) == 64 * 1536 * 4
    assert sum(s.get("bytes_exchanged", 0) for s in stats) == 0


@pytest.mark.multiproc
@pytest.mark.s3_servers
def test_row_to_column_on_s3_reads_large_ranges_and_exchanges(dist_pool, s3_bucket_uri, s3_server):
    """On S3 the same 2 KiB runs would be 2 KiB GETs: one reader per slab fetches it whole, then an all-to-all."""
    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing", "region": "us-east-1"}
    stats = dist_pool.run(scenarios.column_reshard, s3_bucket_uri, options)
    assert sum(s.get("bytes_read", 0) for s in stats) == 64 * 1536 * 4
    assert sum(s.get("bytes_exchanged", 0) for s in stats) > 0
    assert sum(s.get("requests", 0) for s in stats) <= 4  # a few large ranged reads, not 64 rows x 3 ranks
