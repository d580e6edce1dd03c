"""Asynchronous save: how long training is blocked, against a memcpy and DCP ``async_save``, plus memory.

    python benchmarks/bench_async.py [--gib 1.0] [--repeats 3] [--ranks 2] [--memory] [--out docs/benchmarks.md]

Each library runs in its own gloo group of ``--ranks`` ranks on one node (so peak memory is its own), on
the same ``--gib`` GiB of fp32 DTensors (``Shard(0)``) written to the same disk; ``--memory``: tierckpt
saves through the node memory tier (in ``/dev/shm``; the snapshot lands in the tier's spare file):

* stall: seconds from the call to its return (training may continue; tierckpt has copied the state
  into its reusable staging buffer, DCP into its CPU copy), median of ``--repeats`` after one warm-up;
* committed: seconds from the call until the checkpoint is committed (``handle.wait()`` / ``future.result()``);
* memcpy: in the same processes, a warm copy of the rank's state into preallocated memory, every rank at
  once after a barrier as the saves start (ranks copying together share the memory bandwidth), median of
  one per repeat;
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


def _memcpy_seconds(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    """A warm copy of the rank's state, started by every rank at once."""
    import torch.distributed as dist

    dist.barrier()
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


def async_ranks(rank: int, world: int, lib: str, gib: float, repeats: int, root: str, memory: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import tierckpt

    if memory:
        os.environ["TIERCKPT_MEMORY"] = "on"
        os.environ["TIERCKPT_MEMORY_DIR"] = os.path.join(root, "memory-tier")
    state = C.make_state(gib, 0, fill=True)
    sources = [t.to_local() for t in state.values()]
    copies = [s.clone() for s in sources]  # the memcpy's destination, its pages touched before any timing
    base = _rss_kib("VmRSS")  # before the warm-up: the staging memory a library keeps counts as its cost
    _reset_peak()
    first = tierckpt.Monitor()
    # Through the memory tier, every save goes to one URI, as a training job's do (each a new generation of
    # it): the tier's spare file for the next snapshot is made per URI.
    uri = (lambda i: os.path.join(root, lib)) if memory else (lambda i: os.path.join(root, f"{lib}-{i}"))
    warm = _save(lib, uri("warmup"), state, first)
    _wait(lib, warm)
    if memory:
        warm.wait("remote")
    stalls, totals, phases, hits, into_tier, aside = [], [], [], 0, 0, 0
    memcpys = []
    for i in range(repeats):
        memcpys.append(_memcpy_seconds(sources, copies))
        dist.barrier()
        monitor = tierckpt.Monitor()
        start = time.perf_counter()
        handle = _save(lib, uri(i), state, monitor)
        stalls.append(time.perf_counter() - start)
        _wait(lib, handle)
        totals.append(time.perf_counter() - start)
        if memory:  # written down too (untimed), so no save's background work runs into the next one's stall
            handle.wait("remote")
        phases.append(dict(monitor.seconds))
        hits += monitor.counters.get("plan_cache_hits", 0)
        into_tier += monitor.counters.get("snapshots_into_tier", 0)
        aside += monitor.counters.get("snapshots_while_agreeing", 0)
    save_peak = _rss_kib("VmHWM") - base
    dist.barrier()
    targets = C.make_state(gib, 1, fill=False)
    base = _rss_kib("VmRSS")
    _reset_peak()
    C.do_load(lib, uri(0), None, targets, tierckpt.Monitor())
    load_peak = _rss_kib("VmHWM") - base
    C.check_state(targets, gib)
    return {"stall": stalls, "total": totals, "memcpy": C.median(memcpys), "phases": phases,
            "first_plan": first.seconds.get("plan", 0.0), "plan_cache_hits": hits, "into_tier": into_tier,
            "while_agreeing": aside,
            "save_peak_kib": save_peak, "load_peak_kib": load_peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2, help="ranks of each library's group, on this one node")
    ap.add_argument("--memory", action="store_true", help="tierckpt saves through the node memory tier (/dev/shm)")
    ap.add_argument("--out", default=None, help="Markdown file to write the section into (default: print only)")
    args = ap.parse_args()
    root = C.scratch_dir("tierckpt-bench-async-")
    memory_root = C.scratch_dir("tierckpt-bench-async-tier-", "/dev/shm") if args.memory else root
    try:
        results = {lib: C.run_ranks(async_ranks, args.ranks, lib, args.gib, args.repeats, root if lib == "dcp" else memory_root,
                                    args.memory and lib == "tierckpt") for lib in C.LIBS}
    finally:
        C.rmtree(root)
        if args.memory:
            C.rmtree(memory_root)
    machine = C.machine_info(os.path.dirname(root))
    per_rank = C.state_bytes(args.gib) / args.ranks
    rows = []
    med = {lib: {k: C.median(r[0][k]) for k in ("stall", "total")} for lib, r in results.items()}
    memcpy = C.median([r["memcpy"] for rs in results.values() for r in rs[:1]])  # rank 0's, as the stalls
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
        f"`python benchmarks/bench_async.py --gib {args.gib} --repeats {args.repeats} --ranks {args.ranks}"
        f"{' --memory' if args.memory else ''}`; "
        f"{C.fmt_bytes(C.state_bytes(args.gib))} of fp32 DTensors on {args.ranks} ranks ({C.fmt_bytes(per_rank)} per rank)"
        f"{', tierckpt through the node memory tier' if args.memory else ''}; "
        f"warm memcpy of a rank's state, every rank at once, in the same processes: {memcpy:.3f} s.\n\n{machine}\n\n{table}\n\n"
        f"tierckpt stall = {ratio:.2f}x DCP's (target <= 0.5x) and {med['tierckpt']['stall'] / memcpy:.2f}x a memcpy "
        f"(target <= 1.1x)."
        + (f" Snapshots straight into the tier's spare file: {results['tierckpt'][0]['into_tier']} of {args.repeats} "
           "(counted on rank 0; a save that finds no spare copies through the staging buffer)." if args.memory else "")
        + f"\n\n{phase_table}\n\n"
        "`flatten` and `stage` (the snapshot copy) block training, and so does `plan` (check-in, one all-gather, "
        "rank 0 naming the generation) where it outlasts the copy: a rank whose offers match its previous save "
        f"copies while the group agrees ({results['tierckpt'][0]['while_agreeing']} of the {args.repeats} timed saves "
        "on rank 0), else it agrees first. `checksum` and `file_write` are busy times in "
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


PHASES = ("flatten", "plan", "stage", "checksum", "file_write", "gather", "commit")
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
    blocking = {"flatten", "stage"}
    phases_ax.barh(names, [phase_seconds[n] for n in names],
                   color=["#c0392b" if n in blocking else "#95a5a6" for n in names])
    phases_ax.set_xlabel("tierckpt seconds per phase (rank 0, median)")
    phases_ax.set_title("red: blocks training (plan: only where it outlasts the copy)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
