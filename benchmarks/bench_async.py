"""Asynchronous save: how long training is blocked, against a memcpy and DCP ``async_save``, plus memory.

    python benchmarks/bench_async.py [--gib 1.0] [--repeats 3] [--out docs/benchmarks.md]

Each library runs in its own 2-rank gloo group (so peak memory is its own), on the same ``--gib`` GiB of
fp32 DTensors (``Shard(0)``) written to the same disk:

* stall: seconds from the call to its return (training may continue; tierckpt has copied the state
  into its reusable staging buffer, DCP into its CPU copy), median of ``--repeats`` after one warm-up;
* committed: seconds from the call until the checkpoint is committed (``handle.wait()`` / ``future.result()``);
* memcpy: in the same processes, one warm copy of the rank's state into preallocated memory;
* memory: peak RSS above the RSS with the state loaded, per rank, over the saves (the warm-up included,
  so staging memory a library keeps between saves counts), and during a
  load resharded to ``Shard(1)`` (above the RSS with the target tensors allocated). The peak is reset
  through ``/proc/self/clear_refs`` before each measurement.

A bar chart of the phases is written next to ``--out`` as ``benchmarks-async.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _warm_memcpy(state: dict[str, Any]) -> float:
    sources = [t.to_local() for t in state.values()]
    targets = [torch.empty_like(s) for s in sources]
    for dst, src in zip(targets, sources):
        dst.copy_(src)  # first touch of the destination pages
    start = time.perf_counter()
    for dst, src in zip(targets, sources):
        dst.copy_(src)
    return time.perf_counter() - start


def _save(lib: str, uri: str, state: dict[str, Any], monitor: Any) -> Any:
    if lib == "tierckpt":
        import tierckpt

        return tierckpt.async_save(uri, state, monitor=monitor)
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(state, checkpoint_id=uri)


def _wait(lib: str, handle: Any) -> None:
    handle.wait() if lib == "tierckpt" else handle.result()


def async_ranks(rank: int, world: int, lib: str, gib: float, repeats: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    import tierckpt

    state = C.make_state(gib, 0, fill=True)
    memcpy = _warm_memcpy(state)
    base = _rss_kib("VmRSS")  # before the warm-up: the staging memory a library keeps counts as its cost
    _reset_peak()
    first = tierckpt.Monitor()
    warm = _save(lib, os.path.join(root, f"{lib}-warmup"), state, first)
    _wait(lib, warm)
    stalls, totals, phases, hits = [], [], [], 0
    for i in range(repeats):
        dist.barrier()
        monitor = tierckpt.Monitor()
        start = time.perf_counter()
        handle = _save(lib, os.path.join(root, f"{lib}-{i}"), state, monitor)
        stalls.append(time.perf_counter() - start)
        _wait(lib, handle)
        totals.append(time.perf_counter() - start)
        phases.append(dict(monitor.seconds))
        hits += monitor.counters.get("plan_cache_hits", 0)
    save_peak = _rss_kib("VmHWM") - base
    dist.barrier()
    targets = C.make_state(gib, 1, fill=False)
    base = _rss_kib("VmRSS")
    _reset_peak()
    C.do_load(lib, os.path.join(root, f"{lib}-0"), None, targets, tierckpt.Monitor())
    load_peak = _rss_kib("VmHWM") - base
    C.check_state(targets, gib)
    return {"stall": stalls, "total": totals, "memcpy": memcpy, "phases": phases,
            "first_plan": first.seconds.get("plan", 0.0), "plan_cache_hits": hits,
            "save_peak_kib": save_peak, "load_peak_kib": load_peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="Markdown file to write the section into (default: print only)")
    args = ap.parse_args()
    root = C.scratch_dir("tierckpt-bench-async-")
    try:
        results = {lib: C.run_ranks(async_ranks, 2, lib, args.gib, args.repeats, root) for lib in C.LIBS}
    finally:
        C.rmtree(root)
    per_rank = C.state_bytes(args.gib) / 2
    rows = []
    med = {lib: {k: C.median(r[0][k]) for k in ("stall", "total")} for lib, r in results.items()}
    memcpy = C.median([r["memcpy"] for rs in results.values() for r in rs])
    for lib, rs in results.items():
        rows.append([
            lib, f"{med[lib]['stall']:.3f}", f"{med[lib]['stall'] / memcpy:.2f}x", f"{med[lib]['total']:.2f}",
            C.fmt_bytes(max(r["save_peak_kib"] for r in rs) * 1024), C.fmt_bytes(max(r["load_peak_kib"] for r in rs) * 1024),
        ])
    table = C.md_table(
        ["library", "stall s (median, rank 0)", "stall / memcpy", "until committed s", "save: peak RSS above state (max rank)",
         "resharded load (Shard(1)): peak RSS above targets (max rank)"], rows)
    ratio = med["tierckpt"]["stall"] / med["dcp"]["stall"]
    phase_seconds = _phase_medians(results["tierckpt"][0]["phases"])
    phase_table = C.md_table(
        ["tierckpt phase (rank 0, median)", *PHASES],
        [["seconds", *(f"{phase_seconds[name]:.3f}" for name in PHASES)]],
    )
    text = (
        f"`python benchmarks/bench_async.py --gib {args.gib} --repeats {args.repeats}`; "
        f"{C.fmt_bytes(C.state_bytes(args.gib))} of fp32 DTensors on 2 ranks ({C.fmt_bytes(per_rank)} per rank); "
        f"warm memcpy of a rank's state in the same processes: {memcpy:.3f} s.\n\n{table}\n\n"
        f"tierckpt stall = {ratio:.2f}x DCP's (target <= 0.75x) and {med['tierckpt']['stall'] / memcpy:.2f}x a memcpy "
        f"(target <= 1.25x).\n\n{phase_table}\n\n"
        "`plan` and `stage` (the snapshot copy) block training; `checksum` and `file_write` are busy times in "
        "the background that overlap each other (a chunk is checksummed while the previous one is written) and "
        "the copy when the state streams through the ping-pong halves; `gather` and `commit` follow. Plan cache: the first save of the layout (the warm-up) planned in "
        f"{results['tierckpt'][0]['first_plan'] * 1e3:.1f} ms; the {args.repeats} timed saves hit the cache "
        f"{results['tierckpt'][0]['plan_cache_hits']} times and their `plan` phase (digest, one all-gather, "
        f"rank 0 naming the generation) took {phase_seconds['plan'] * 1e3:.1f} ms.\n\n![phases](benchmarks-async.png)\n"
    )
    print(text)
    if args.out:
        _plot(results, memcpy, phase_seconds, os.path.join(os.path.dirname(args.out) or ".", "benchmarks-async.png"))
        C.write_section(args.out, "bench_async", "## Async save: stall, commit and memory (`benchmarks/bench_async.py`)\n\n" + text)


PHASES = ("plan", "stage", "checksum", "file_write", "gather", "commit")
"""tierckpt's save phases, in pipeline order (see the Monitor's phases in docs/user-guide.md)."""


def _phase_medians(phases: list[dict[str, float]]) -> dict[str, float]:
    return {name: C.median([p.get(name, 0.0) for p in phases]) for name in PHASES}


def _plot(results: dict[str, list[dict[str, Any]]], memcpy: float, phase_seconds: dict[str, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, phases_ax) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": [3, 2]})
    labels, stalls, rests = [], [], []
    for lib, rs in results.items():
        stall, total = C.median(rs[0]["stall"]), C.median(rs[0]["total"])
        labels.append(lib)
        stalls.append(stall)
        rests.append(total - stall)
    ax.barh(labels, stalls, color="#c0392b", label="training blocked (stall)")
    ax.barh(labels, rests, left=stalls, color="#95a5a6", label="background until committed")
    ax.axvline(memcpy, color="k", ls="--", lw=1, label=f"memcpy of a rank's state ({memcpy:.2f} s)")
    ax.set_xlabel("seconds (rank 0, median)")
    ax.legend(loc="lower right", fontsize=8)
    names = list(reversed(PHASES))
    blocking = {"plan", "stage"}
    phases_ax.barh(names, [phase_seconds[n] for n in names],
                   color=["#c0392b" if n in blocking else "#95a5a6" for n in names])
    phases_ax.set_xlabel("tierckpt seconds per phase (rank 0, median)")
    phases_ax.set_title("red: blocks training", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
