"""The two-simulated-node benchmark's table (``benchmarks/bench_nodes.py``): per case, ratios from rank 0's
medians, bytes read summed per node, the bytes of each load route. (Its measuring part starts two torchruns
of 4 ranks and is run by hand.)"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _common as C  # noqa: E402
import bench_nodes  # noqa: E402


def test_nodes_table_has_ratios_from_rank0_and_bytes_per_node():
    """Per case (resharded, replicated): DCP s / tierckpt s from rank 0's medians only (the other ranks'
    seconds differ), bytes read summed over each node's ranks, and tierckpt's share of its bytes read by each
    route over the group, with rank 0's last plan."""
    gib = 1 / 256
    need = C.state_bytes(gib)
    # case -> (tierckpt save, load, DCP save, load) seconds of repeat 0 on rank 0; bytes and routes per rank
    seconds = {"reshard": (0.2, 0.5, 0.4, 1.0), "replicated": (0.3, 0.6, 0.45, 1.5)}
    routes = {"reshard": {"bytes_direct": need // 8, "bytes_node": 0, "bytes_exchange": need // 8},
              "replicated": {"bytes_direct": 0, "bytes_node": need // 2, "bytes_exchange": 0}}
    tier_bytes = {"reshard": need // 4, "replicated": need // 2}
    dcp_bytes = {"reshard": 1, "replicated": 2}  # DCP reads need * (this + rank)

    def rank(r: int) -> dict:
        node = f"simnode-{r // 2}"
        records = []
        for rep in range(3):
            slow = 10.0 if r else 1.0  # only rank 0's seconds count
            for case in bench_nodes.CASES:
                ts, tl, ds, dl = seconds[case]
                records.append({"lib": "tierckpt", "case": case, "repeat": rep, "save_s": slow * (ts + rep * 0.01),
                                "load_s": slow * (tl + rep * 0.01), "bytes": tier_bytes[case],
                                "plan": f"{case} plan {rep}" if r == 0 else "", **routes[case]})
                records.append({"lib": "dcp", "case": case, "repeat": rep, "save_s": slow * ds,
                                "load_s": slow * (dl + rep * 0.01), "bytes": need * (dcp_bytes[case] + r), "plan": "",
                                **{f"bytes_{route}": 0 for route in bench_nodes.ROUTES}})
        return {"rank": r, "node": node, "records": records}

    table = bench_nodes.table([rank(r) for r in range(4)], gib)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| operation") and not line.startswith("| bytes")}
    assert rows["save row -> column"][1:4] == ["0.210", "0.400", "**1.90x**"]
    assert rows["load row -> column"][1:4] == ["0.510", "1.010", "**1.98x**"]
    assert rows["save replicated (DDP-style)"][1:4] == ["0.310", "0.450", "**1.45x**"]
    assert rows["load replicated (DDP-style)"][1:4] == ["0.610", "1.510", "**2.48x**"]
    assert rows["reshard: tierckpt"][1:] == [f"{C.fmt_bytes(need // 2)} (0.50)", f"{C.fmt_bytes(need // 2)} (0.50)"]
    assert rows["reshard: dcp"][1:] == [f"{C.fmt_bytes(3 * need)} (3.00)", f"{C.fmt_bytes(7 * need)} (7.00)"]
    assert rows["replicated: tierckpt"][1:] == [f"{C.fmt_bytes(need)} (1.00)", f"{C.fmt_bytes(need)} (1.00)"]
    assert rows["replicated: dcp"][1:] == [f"{C.fmt_bytes(5 * need)} (5.00)", f"{C.fmt_bytes(9 * need)} (9.00)"]
    assert ("- reshard: bytes read by route direct 0.50, node 0.00, exchange 0.50; "
            "rank 0's last plan: `reshard plan 2`") in table
    assert table.endswith("- replicated: bytes read by route direct 0.00, node 1.00, exchange 0.00; "
                          "rank 0's last plan: `replicated plan 2`")
