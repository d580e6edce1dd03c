"""``tierckpt bench``: a quick save/load measurement on this machine's storage, beside torch DCP.

One process saves ``--gib`` GiB of fp32 tensors to ``--dir`` with tierckpt and with DCP, loads them
back, and prints seconds, throughput and the ratio. For the multi-process, resharding and S3
comparisons, run the scripts in ``benchmarks/`` (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from typing import Any

import torch

from tierckpt.loading import api as loader
from tierckpt.saving import api as saver


def _add_bench(subparsers: Any) -> None:
    """Register ``bench``."""
    p = subparsers.add_parser(
        "bench", help="time a save and a load on this machine, beside torch DCP",
        description="Save --gib GiB of fp32 tensors with tierckpt and with torch DCP in this process, to the same "
        "directory, load both back (checking every element), and print seconds, throughput and the ratio. "
        "For multi-process, resharding, async and S3 comparisons run the scripts in benchmarks/.",
    )
    p.add_argument("--gib", type=float, default=0.25, help="state size in GiB (default 0.25)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(handler=cmd_bench)


def _state(gib: float) -> dict[str, torch.Tensor]:
    rows = max(1, int(gib * (1 << 30) / (8 * 4096 * 4)))
    return {f"w{i}": torch.randn(rows, 4096) for i in range(8)}


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(gib: float, directory: str) -> dict[str, Any]:
    """Seconds to save and load the same state with tierckpt and with DCP (one process, same disk)."""
    import torch.distributed.checkpoint as dcp

    state = _state(gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    target = {k: torch.empty_like(v) for k, v in state.items()}
    results = {
        "tierckpt_save_s": _timed(lambda: saver.save(f"{directory}/tierckpt", state)),
        "tierckpt_load_s": _timed(lambda: loader.load(f"{directory}/tierckpt", target)),
        "dcp_save_s": _timed(lambda: dcp.save(state, checkpoint_id=f"{directory}/dcp", no_dist=True)),
        "dcp_load_s": _timed(lambda: dcp.load(target, checkpoint_id=f"{directory}/dcp", no_dist=True)),
    }
    if not all(torch.equal(target[k], state[k]) for k in state):
        raise AssertionError("bench: loaded tensors differ from the saved ones")
    return {"bytes": nbytes, **results}


def cmd_bench(args: argparse.Namespace) -> int:
    directory = args.dir or tempfile.mkdtemp(prefix="tierckpt-bench-")
    try:
        doc = measure(args.gib, directory)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    gib = doc["bytes"] / (1 << 30)
    for op in ("save", "load"):
        ours, theirs = doc[f"tierckpt_{op}_s"], doc[f"dcp_{op}_s"]
        print(f"{op}: tierckpt {ours:.3f} s ({gib / ours:.2f} GiB/s), DCP {theirs:.3f} s ({gib / theirs:.2f} GiB/s), "
              f"{theirs / ours:.2f}x")
    return 0


COMMANDS = (_add_bench,)
