"""Loads of states made of many small tensors: tierckpt (checksums on and off) vs DCP, in the same run.

    python benchmarks/bench_small_tensors.py [--mib 256] [--repeats 7] [--out docs/benchmarks.md]

A model's state is hundreds of tensors of a few MiB or less (biases, norms, the optimizer's moments of
each), not a few large matrices: what a load costs per tensor (planning, one read per unit, one check per
block) shows there, not in the other benchmarks' 8 matrices. One process, no process group; the same
``--mib`` MiB of fp32 as 1,024 x 1/4 MiB, 256 x 1 MiB, 64 x 4 MiB and 8 x 32 MiB tensors, saved once by
each library on the local disk, then loaded into preallocated tensors with a warm page cache (so the
per-tensor cost is not hidden behind the disk), the three loads alternating in order per repeat; every
load is compared with the state. Reports medians (each run in parentheses) and tierckpt's ratio to DCP.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, md_table, median, publish, rmtree, runs, scratch_dir  # noqa: E402

LAYOUTS = ((1024, 0.25), (256, 1.0), (64, 4.0), (8, 32.0))
"""(tensors, MiB each) at the default ``--mib 256``; scaled to ``--mib``."""


def _state(count: int, mib: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(count)
    return {f"layers.{i}.weight": torch.randn(int(mib * (1 << 20)) // 4, generator=g) for i in range(count)}


def _loads(root: Path, count: int, mib: float, repeats: int) -> dict[str, list[float]]:
    import torch.distributed.checkpoint as dcp

    import tierckpt

    state = _state(count, mib)
    ours, theirs = str(root / f"tierckpt-{count}"), str(root / f"dcp-{count}")
    tierckpt.save(ours, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when it runs without a process group
        dcp.save(state, checkpoint_id=theirs)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    loads = {
        "tierckpt": lambda: tierckpt.load(ours, target),
        "tierckpt, check_crc=False": lambda: tierckpt.load(ours, target, check_crc=False),
        "DCP": lambda: dcp.load(target, checkpoint_id=theirs),
    }
    out: dict[str, list[float]] = {name: [] for name in loads}
    names = list(loads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(repeats + 1):  # the first round warms the page cache and each library's imports
            for name in names if r % 2 else names[::-1]:
                for t in target.values():
                    t.zero_()
                start = time.perf_counter()
                loads[name]()
                seconds = time.perf_counter() - start
                if not all(torch.equal(target[k], v) for k, v in state.items()):
                    raise AssertionError(f"{name}: the loaded state differs from the saved one")
                if r:
                    out[name].append(seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=256, help="state size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the section into this Markdown file")
    args = parser.parse_args()
    workdir = scratch_dir("tierckpt-bench-small-")
    try:
        rows = []
        for count, each in LAYOUTS:
            mib = each * args.mib / 256
            got = _loads(Path(workdir), count, mib, args.repeats)
            dcp = median(got["DCP"])
            rows.append([f"{count} x {mib:g} MiB"] + [
                f"{median(s):.3f} ({runs(s)})" + ("" if name == "DCP" else f", {median(s) / dcp:.2f}x DCP")
                for name, s in got.items()
            ])
            print(rows[-1], flush=True)
        body = "\n\n".join([
            "## Many small tensors: load vs DCP (`bench_small_tensors.py`)",
            machine_info(workdir),
            f"One process, {args.mib:g} MiB of fp32 per state, page cache warm; seconds per load, median of "
            f"{args.repeats} (each run in parentheses), the loads alternating in order.",
            md_table(["state", "tierckpt (checksums on, the default)", "tierckpt, check_crc=False", "DCP"], rows),
            f"Load average at the end: {os.getloadavg()[0]:.2f} (2 cores): compare the columns of one run.",
        ])
        publish(body, args.out, "bench_small_tensors")
    finally:
        rmtree(workdir)


if __name__ == "__main__":
    main()
