"""The node-scale benchmark's table (``bench_matrix.py --cases node``): ratios and bytes read per group.
(Its measuring part spawns 2, 4 and 8 ranks and is smoke-run by hand or by ``device_node_scale.sh``.)"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _common as C  # noqa: E402
import _node_scale  # noqa: E402


def test_node_scale_table_has_ratios_and_bytes_read_per_group():
    """Per case and world size: DCP s / tierckpt s from rank 0's medians, bytes summed over the ranks and
    over the state's bytes, and the share tierckpt read directly."""
    gib = 1 / 256
    need = C.state_bytes(gib)

    def rank(r: int) -> list[dict]:
        out = []
        for rep in range(3):
            out.append({"case": "reshard 2", "lib": "tierckpt", "repeat": rep, "seconds": 0.5 + rep * 0.01,
                        "bytes": need // 2, "counters": {"bytes_read_direct": need // 2}})
            out.append({"case": "reshard 2", "lib": "dcp", "repeat": rep, "seconds": 1.0 + rep * 0.01,
                        "bytes": need, "counters": {}})
        return out

    table = _node_scale.table([[rank(0), rank(1)]], gib)
    row = next(line for line in table.splitlines() if line.startswith("| reshard 2 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["0.510", "1.010", "**1.98x**"]
    assert cells[4].endswith("(1.00)") and cells[5].endswith("(2.00)") and cells[6] == "1.00"
