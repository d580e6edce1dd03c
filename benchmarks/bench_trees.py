"""This tree against another tree of tierckpt, in one run: node-scale loads and memory-tier saves, no regression?

    python benchmarks/bench_trees.py --baseline OTHER/src [--cases node,memory] [--ranks 2,4,8] [--gib 0.25]
                                     [--rounds 2] [--repeats 3] [--out docs/benchmarks.md]

* ``node``: the node case of ``bench_matrix.py`` (``_node_scale.node_scale``: a row -> column resharded load
  and a replicated load at each world size of ``--ranks``, tierckpt and torch DCP alternating, every load
  checked);
* ``memory``: the save part of ``bench_memory.py`` (``save_ranks``: 2 simulated nodes, the memory tier with
  peer replicas, ``--gib`` of DTensors): the async-save stall beside DCP's, and the seconds until the save is
  committed in memory, ``replicated`` and written down (``remote``).

Each case runs once per tree per round, each tree in a child process of its own (``PYTHONPATH`` = its ``src``; the
benchmark code is this tree's, and it calls only the public API), the two trees alternating per round.
DCP is the same library in both children, so its seconds tell how loaded the machine was during each
child; the report gives, per case, each tree's tierckpt median, its DCP median, and this tree's speed
relative to the baseline both raw (baseline s / this s) and normalised by DCP (this tree's DCP / tierckpt
over the baseline's): above 1.0 this tree is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as C

HERE = Path(__file__).resolve().parent
THIS_SRC = HERE.parent / "src"


def _child(cases: list[str], ranks: list[int], gib: float, repeats: int, root: str) -> None:
    """In the child: every case, rank 0's records ``{case, lib, seconds}`` as one JSON line."""
    records: list[dict[str, Any]] = []
    if "node" in cases:
        import _node_scale

        per_world = _node_scale.node_scale(ranks, ["reshard", "replicated"], gib, root, repeats)
        records += [{k: rec[k] for k in ("case", "lib", "seconds")} for per_rank in per_world for rec in per_rank[0]]
    if "memory" in cases:
        import bench_memory

        memory_root = f"/dev/shm/tierckpt-trees-{os.getpid()}"
        try:
            out = C.run_ranks(bench_memory.save_ranks, 2, gib, repeats, root, memory_root)[0]
        finally:
            C.rmtree(memory_root)
        for lib in ("tierckpt", "dcp"):
            records += [{"case": "memory tier: async-save stall", "lib": lib, "seconds": s} for s in out["stall"][lib]]
        for level in ("memory", "replicated", "remote"):
            records += [{"case": f"memory tier: until {level}", "lib": "tierckpt", "seconds": s} for s in out[level]]
        records += [{"case": "memory tier: until remote", "lib": "dcp", "seconds": s} for s in out["dcp_saved"]]
    print("RESULT " + json.dumps(records), flush=True)


def _run_tree(src: str, args: argparse.Namespace, root: str) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(HERE)])}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--cases", args.cases, "--ranks", args.ranks,
           "--gib", str(args.gib),
           "--repeats", str(args.repeats), "--root", root]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"the tree at {src} failed (rc {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, baseline: str) -> str:
    cases = list(dict.fromkeys(rec["case"] for rec in results["this"]))
    rows = []
    for case in cases:
        sec = {(tree, lib): [r["seconds"] for r in results[tree] if r["case"] == case and r["lib"] == lib]
               for tree in results for lib in ("tierckpt", "dcp")}
        med = {key: C.median(v) if v else float("nan") for key, v in sec.items()}
        raw = med[("baseline", "tierckpt")] / med[("this", "tierckpt")]
        normalised = (med[("this", "dcp")] / med[("this", "tierckpt")]) / (med[("baseline", "dcp")] / med[("baseline", "tierckpt")])
        rows.append([
            case, f"{med[('baseline', 'tierckpt')]:.3f}", f"{med[('this', 'tierckpt')]:.3f}",
            "-" if not sec[("this", "dcp")] else f"{med[('baseline', 'dcp')]:.3f} / {med[('this', 'dcp')]:.3f}",
            f"**{raw:.2f}x**",
            f"{normalised:.2f}x" if normalised == normalised else "-",
            f"baseline {C.runs(sec[('baseline', 'tierckpt')])}; this {C.runs(sec[('this', 'tierckpt')])}",
        ])
    table = C.md_table(["case (ranks)", "baseline tierckpt s", "this tree s", "DCP s (baseline child / this child)",
                        "baseline s / this s", "normalised by DCP", "all runs, s"], rows)
    text = "\n\n".join([
        "## No regression: this tree against the tree before (`benchmarks/bench_trees.py`)",
        C.machine_info(args.root or "/tmp"),
        f"State: {C.fmt_bytes(C.state_bytes(args.gib))} of fp32 matrices; cases `{args.cases}` (node: loads at "
        f"{args.ranks} ranks; memory tier: saves on 2 simulated nodes of one rank, DCP's `until remote` is its "
        "saved). Each tree in its own child process per round "
        f"({args.rounds} rounds, trees alternating), {args.repeats} measurements per library per round; seconds are rank 0's "
        "barrier-to-barrier medians over every round. Above 1.0x this tree is faster.",
        table,
    ])
    return text.replace(os.path.abspath(baseline), "BASE/src").replace(baseline, "BASE/src")  # no machine paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="the other tree's src directory")
    ap.add_argument("--cases", default="node,memory", help="node, memory or both (default)")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--gib", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=2, help="child runs per tree, alternating (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="loads per library in each child (default 3)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one child may take")
    ap.add_argument("--out", default=None, help="write the Markdown section into this file (docs/benchmarks.md)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    if args.child:
        _child(args.cases.split(","), ranks, args.gib, args.repeats, args.root)
        return
    if not args.baseline:
        ap.error("--baseline OTHER/src is required")
    results: dict[str, list[dict[str, Any]]] = {"this": [], "baseline": []}
    trees = {"this": str(THIS_SRC), "baseline": os.path.abspath(args.baseline)}
    root = C.scratch_dir("tierckpt-trees-")
    try:
        for round_ in range(args.rounds):
            for tree in (("this", "baseline") if round_ % 2 == 0 else ("baseline", "this")):
                t0 = time.perf_counter()
                results[tree] += _run_tree(trees[tree], args, os.path.join(root, f"{tree}-{round_}"))
                print(f"round {round_ + 1}: {tree} done ({time.perf_counter() - t0:.0f}s)", flush=True)
    finally:
        C.rmtree(root)
    text = _report(results, args, args.baseline)
    print(text)
    if args.out:
        C.write_section(args.out, "bench_trees", text)


if __name__ == "__main__":
    main()
