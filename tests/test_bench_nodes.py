"""The two-simulated-node benchmark's table (``benchmarks/bench_nodes.py``): ratios from rank 0's medians,
bytes read summed per node. (Its measuring part starts two torchruns of 4 ranks and is run by hand.)"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _common as C  # noqa: E402
import bench_nodes  # noqa: E402


def test_nodes_table_has_ratios_from_rank0_and_bytes_per_node():
    """DCP s / tierckpt s from rank 0's medians only (the other ranks' seconds differ), bytes read summed
    over each node's ranks, and tierckpt's direct share over the group."""
    gib = 1 / 256
    need = C.state_bytes(gib)

    def rank(r: int) -> dict:
        node = f"simnode-{r // 2}"
        records = []
        for rep in range(3):
            slow = 10.0 if r else 1.0  # only rank 0's seconds count
            records.append({"lib": "tierckpt", "repeat": rep, "save_s": slow * (0.2 + rep * 0.01),
                            "load_s": slow * (0.5 + rep * 0.01), "bytes": need // 4, "direct": need // 8})
            records.append({"lib": "dcp", "repeat": rep, "save_s": slow * 0.4, "load_s": slow * (1.0 + rep * 0.01),
                            "bytes": need * (1 + r)})
        return {"rank": r, "node": node, "records": records}

    table = bench_nodes.table([rank(r) for r in range(4)], gib)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| operation") and not line.startswith("| bytes")}
    assert rows["save (Shard(0))"][1:4] == ["0.210", "0.400", "**1.90x**"]
    assert rows["load row -> column"][1:4] == ["0.510", "1.010", "**1.98x**"]
    assert rows["tierckpt"][1:] == [f"{C.fmt_bytes(need // 2)} (0.50)", f"{C.fmt_bytes(need // 2)} (0.50)"]
    assert rows["dcp"][1:] == [f"{C.fmt_bytes(3 * need)} (3.00)", f"{C.fmt_bytes(7 * need)} (7.00)"]
    assert table.endswith("read by the direct route (the rest read once and exchanged): 0.50")
