"""Cost of the read-path checksums: the same loads with and without ``check_crc``.

    python benchmarks/bench_load_crc.py [--gib 1.0] [--repeats 5] [--cold] [--out docs/benchmarks.md]

State: the benchmarks' 8 fp32 matrices (``_common.make_state``), saved ``Shard(0)`` on 2 ranks, on
local disk. Two loads, each timed with the default ``check_crc=True`` and with ``check_crc=False``
(the explicit switch that exists for this measurement), alternating which goes first per repeat:

* **same layout** — ``Shard(0)`` on 2 ranks: contiguous reads, every block checked whole;
* **reshard** — ``Shard(1)`` on 3 ranks: strided direct reads (each rank reads a third of every
  row), every block checked by combining the ranks' partial CRCs.

Reports the median seconds between two barriers on rank 0, the overhead (checked / unchecked - 1;
the budget is 10 %), and bytes read summed over ranks (Monitor ``bytes_read``; must equal the state's
bytes, amplification 1.00, both ways). The page cache is warm unless ``--cold`` (root): a warm cache
is the worst case for the relative cost, since storage then hides nothing.

Also reports the floor on this machine: one core's native CRC-32C throughput (the ``crc32c``
package, over 1 MiB blocks as a load checks them: from memory, and cache-resident as a local load's
block-by-block read and check sees them) beside its memory copy throughput (what a load from a warm
page cache mostly is), over a 256 MiB buffer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    check_state, drop_caches, machine_info, make_state, md_table, median, publish, reset_state, rmtree, run_ranks,
    runs, scratch_dir, state_bytes,
)


def _save(rank: int, world: int, path: str, gib: float) -> None:
    import tierckpt

    tierckpt.save(path, make_state(gib, 0, fill=True))


def _loads(rank: int, world: int, path: str, gib: float, shard_dim: int, repeats: int, cold: bool) -> list[dict[str, Any]]:
    import torch.distributed as dist

    import tierckpt

    state = make_state(gib, shard_dim, fill=False)
    out = []
    for r in range(repeats + 1):  # the first round is an untimed warm-up
        for check in ((True, False) if r % 2 == 0 else (False, True)):
            reset_state(state)
            if cold and rank == 0:
                drop_caches()
            monitor = tierckpt.Monitor()
            dist.barrier()
            started = time.perf_counter()
            tierckpt.load(path, state, monitor=monitor, check_crc=check)
            dist.barrier()
            seconds = time.perf_counter() - started
            check_state(state, gib)
            if r:
                out.append({"check_crc": check, "seconds": seconds, "bytes_read": monitor.counters.get("bytes_read", 0)})
    return out


def _loadavg(load: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def _floor() -> str:
    """One core's CRC-32C and copy throughput, GB/s (best of 5 over a 256 MiB buffer)."""
    import crc32c
    import torch

    nbytes, block = 256 << 20, 1 << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    view = memoryview(src.numpy())

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return nbytes / min(times) / 1e9

    crc = best(lambda: [crc32c.crc32c(view[i : i + block]) for i in range(0, nbytes, block)])
    resident = view[:block]
    cached = best(lambda: [crc32c.crc32c(resident) for _ in range(0, nbytes, block)])
    copy = best(lambda: dst.copy_(src))
    return (
        f"Floor on this machine (one core, 256 MiB): native CRC-32C {crc:.1f} GB/s from memory, {cached:.1f} GB/s "
        f"over a 1 MiB block in the CPU cache (what a local load's block-by-block read-and-check runs at) "
        f"(`crc32c` {crc32c.__version__}, hardware: {crc32c.hardware_based}); memory copy {copy:.1f} GB/s."
    )


def _summary(name: str, per_rank: list[list[dict[str, Any]]], nbytes: int) -> tuple[list[Any], float]:
    rows = per_rank[0]
    on = [x["seconds"] for x in rows if x["check_crc"]]
    off = [x["seconds"] for x in rows if not x["check_crc"]]
    read = {
        check: sum(rank_rows[i]["bytes_read"] for rank_rows in per_rank)
        for i, check in ((0, rows[0]["check_crc"]), (1, rows[1]["check_crc"]))
    }
    overhead = median(on) / median(off) - 1
    return [
        name, f"{median(off):.3f} ({runs(off)})", f"{median(on):.3f} ({runs(on)})", f"{overhead * 100:+.1f} %",
        f"{read[False] / nbytes:.2f} / {read[True] / nbytes:.2f}",
    ], overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each load (root)")
    parser.add_argument("--out", default=None, help="write the section into this Markdown file")
    args = parser.parse_args()
    load_before = os.getloadavg()
    workdir = scratch_dir("tierckpt-bench-crc-")
    path = str(Path(workdir) / "ckpt")
    try:
        run_ranks(_save, 2, path, args.gib)
        nbytes = state_bytes(args.gib)
        table, overheads = [], []
        for name, world, dim in (("same layout, Shard(0) on 2 ranks", 2, 0), ("reshard, Shard(1) on 3 ranks (strided)", 3, 1)):
            row, overhead = _summary(name, run_ranks(_loads, world, path, args.gib, dim, args.repeats, args.cold), nbytes)
            table.append(row)
            overheads.append(overhead)
        cache = "cold (dropped before each load)" if args.cold else "warm"
        body = "\n\n".join([
            "## Read-path checksum cost (`bench_load_crc.py`)",
            machine_info(workdir),
            f"State {args.gib} GiB (8 fp32 matrices) saved `Shard(0)` on 2 ranks; page cache {cache}; "
            f"median of {args.repeats} repeats, seconds between barriers on rank 0 (each run in parentheses).",
            md_table(["load", "check_crc=False s", "check_crc=True s", "overhead", "read amplification off / on"], table),
            f"Budget: at most +10 %. Worst measured: {max(overheads) * 100:+.1f} %.",
            _floor(),
            f"Load average (1/5/15 min) at the start {_loadavg(load_before)}, at the end {_loadavg(os.getloadavg())}: "
            "on a shared machine compare the two columns of one run, not runs with each other.",
        ])
        publish(body, args.out, "bench_load_crc")
    finally:
        rmtree(workdir)


if __name__ == "__main__":
    main()
