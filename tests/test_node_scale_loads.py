"""Load routes at node scale: 8 gloo ranks on one simulated node and on 2 x 4, each route's bytes counted.

What each rank reads, exchanges and checks is exact: a row -> column resharded load reads every byte
once per group by either route (direct: each rank its own column window; exchange: one reader per
saved piece, the others' windows sent); a replicated (DDP-style) load reads the file on every rank of
one node (page cache) but once per group across nodes.
"""

from __future__ import annotations

import pytest

import scenarios_node_scale as S
from distributed import WorkerPool

pytestmark = [pytest.mark.multiproc, pytest.mark.node_scale]
WORLD = 8


@pytest.fixture(scope="module")
def pool8():
    pool = WorkerPool(WORLD)
    yield pool
    pool.close()


def _sum(stats: list[dict], key: str) -> int:
    return sum(int(s.get(key, 0)) for s in stats)


def _padded(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def test_rows_to_columns_on_one_node_reads_each_window_directly(pool8, tmp_path):
    stats = pool8.run(S.rows_to_columns, str(tmp_path / "ckpt"), "direct", 1)
    total = stats[0]["tensor_bytes"]
    assert _sum(stats, "bytes_read") == total  # read amplification 1.00: each rank reads its columns only
    assert all(s["bytes_read_direct"] == total // WORLD and s.get("units_exchange", 0) == 0 for s in stats)
    assert _sum(stats, "bytes_exchanged") == 0
    assert _sum(stats, "bytes_checked") == total  # every byte checked once (partial blocks combined)


def test_rows_to_columns_read_once_and_exchanged(pool8, tmp_path):
    stats = pool8.run(S.rows_to_columns, str(tmp_path / "ckpt"), "exchange", 1)
    total = stats[0]["tensor_bytes"]
    assert _sum(stats, "bytes_read") == total
    assert all(s["bytes_read_exchange"] == total // WORLD and s.get("units_direct", 0) == 0 for s in stats)
    # each reader keeps its own window and sends the 7 others theirs: one delivery per (piece, other rank)
    window = S.SHAPE[0] // WORLD * S.SHAPE[1] // WORLD * 4
    assert _sum(stats, "bytes_exchanged") == 2 * WORLD * (WORLD - 1) * _padded(window)
    assert _sum(stats, "bytes_checked") == total


def test_replicated_on_one_node_reads_the_file_on_every_rank(pool8, tmp_path):
    stats = pool8.run(S.replicated, str(tmp_path / "ckpt"), "auto", 1)
    total = stats[0]["tensor_bytes"]
    assert all(s["bytes_read_direct"] == total for s in stats)
    assert _sum(stats, "bytes_exchanged") == 0
    assert _sum(stats, "bytes_checked") == total  # the page cache's bytes checked once on the node


def test_replicated_on_two_nodes_reads_each_byte_once(pool8, tmp_path):
    stats = pool8.run(S.replicated, str(tmp_path / "ckpt"), "auto", 2)
    total = stats[0]["tensor_bytes"]
    assert _sum(stats, "bytes_read") == total and _sum(stats, "units_direct") == 0
    assert _sum(stats, "bytes_checked") == total
    # every byte reaches the 7 ranks that did not read it
    assert (WORLD - 1) * total <= _sum(stats, "bytes_exchanged") < (WORLD - 1) * total + 16 * WORLD * WORLD


def test_rows_to_columns_by_the_loaders_own_costs_reads_each_byte_once(pool8, tmp_path):
    """Whichever route the loader's costs pick on this machine (its cores decide), each byte is read and
    checked once per group, and every rank's window arrives whole."""
    stats = pool8.run(S.rows_to_columns, str(tmp_path / "ckpt"), "auto", 1)
    total = stats[0]["tensor_bytes"]
    assert _sum(stats, "bytes_read") == total and _sum(stats, "bytes_checked") == total
    assert _sum(stats, "bytes_read_direct") + _sum(stats, "bytes_read_exchange") == total
