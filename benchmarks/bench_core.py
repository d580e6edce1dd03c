"""tierckpt vs torch.distributed.checkpoint (DCP) on a local disk, in the same run.

    python benchmarks/bench_core.py [--gib 1.0] [--repeats 3] [--out docs/benchmarks.md]

* save: ``--gib`` GiB of fp32 DTensors, ``Shard(0)`` over 2 gloo ranks, until durable (tierckpt: commit,
  data and directories fsynced; DCP: ``FileSystemWriter(sync_files=True)``, its default, fsyncs files).
* load: the same checkpoint resharded onto 3 ranks as ``Shard(1)`` (every saved shard cuts every target).
* bytes read per load: sum over ranks of ``/proc/self/io`` ``rchar`` (and ``read_bytes``) deltas around
  the load call, for both libraries; plus tierckpt's own ``Monitor`` counters.
* baselines in the same run: ``dd ... conv=fsync`` write and cold ``dd`` read of the same bytes, and a
  single-thread memcpy (``clone``) of one rank's share.

The page cache is dropped before every load when permitted (root); otherwise the output says that loads
are page-cache-warm for both libraries.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (default 1.0)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement; medians reported (default 3)")
    ap.add_argument("--out", default=None, help="Markdown file to write the section into (default: print only)")
    ap.add_argument("--tmp", default=None, help="scratch directory (default: a new dir under $TMPDIR)")
    args = ap.parse_args()

    load_before = os.getloadavg()[0]
    nbytes = C.state_bytes(args.gib)
    root = C.scratch_dir("tierckpt-bench-") if args.tmp is None else args.tmp
    os.makedirs(root, exist_ok=True)
    print(f"checkpoint: {C.N_TENSORS} x {C.shapes(args.gib)['w0']} fp32 = {C.fmt_bytes(nbytes)}; scratch {root}")
    try:
        # Baselines first (same disk, same run).
        dd_w, dd_r, mem = [], [], []
        dd_path = os.path.join(root, "dd.bin")
        for _ in range(args.repeats):
            C.rmtree(dd_path)
            dd_w.append(C.dd_write(dd_path, nbytes))
            cold = C.drop_caches()
            dd_r.append(C.dd_read(dd_path))
            mem.append(C.memcpy_seconds(args.gib))
        os.remove(dd_path)
        dd_bytes = max(1, nbytes // (4 * C.MiB)) * 4 * C.MiB
        print(f"dd write (fsync) {C.median(dd_w):.2f}s, dd read ({'cold' if cold else 'warm'}) {C.median(dd_r):.2f}s, "
              f"memcpy of one rank's half {C.median(mem):.3f}s")

        uris = {lib: os.path.join(root, lib) for lib in C.LIBS}
        t = time.perf_counter()
        saves = C.run_ranks(C.bench_ranks, 2, "save", args.gib, args.repeats, uris)
        print(f"saves done ({time.perf_counter() - t:.0f}s)")
        t = time.perf_counter()
        loads = C.run_ranks(C.bench_ranks, 3, "load", args.gib, args.repeats, uris, None, None, True)
        print(f"loads done ({time.perf_counter() - t:.0f}s)")
        ckpt_size = {lib: sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, lib))
                              for f in fs) for lib in C.LIBS}
    finally:
        if args.tmp is None:
            C.rmtree(root)

    dropped = all(rec["dropped"] for rec in loads[0])
    save_s = C.by_lib(saves, "seconds")
    load_s = C.by_lib(loads, "seconds")
    rchar = C.by_lib(loads, "rchar", "sum")
    rbytes = C.by_lib(loads, "read_bytes", "sum")
    mon_read = C.counter_sum(loads, "bytes_read")
    mon_xchg = C.counter_sum(loads, "bytes_exchanged")
    mon_reqs = C.counter_sum(loads, "requests")

    def gbps(seconds: list[float]) -> str:
        return f"{nbytes / C.median(seconds) / C.GiB:.2f}"

    ms, ml = {k: C.median(v) for k, v in save_s.items()}, {k: C.median(v) for k, v in load_s.items()}
    rows = [
        ["save, 2 ranks, Shard(0), until durable", f"{ms['tierckpt']:.2f}", f"{ms['dcp']:.2f}",
         f"**{ms['dcp'] / ms['tierckpt']:.2f}x**", f"{gbps(save_s['tierckpt'])} / {gbps(save_s['dcp'])}",
         f"{C.runs(save_s['tierckpt'])} — {C.runs(save_s['dcp'])}"],
        ["load 2 -> 3 ranks, Shard(0) -> Shard(1)", f"{ml['tierckpt']:.2f}", f"{ml['dcp']:.2f}",
         f"**{ml['dcp'] / ml['tierckpt']:.2f}x**", f"{gbps(load_s['tierckpt'])} / {gbps(load_s['dcp'])}",
         f"{C.runs(load_s['tierckpt'])} — {C.runs(load_s['dcp'])}"],
    ]
    table = C.md_table(["operation", "tierckpt s (median)", "DCP s (median)", "speedup (DCP s / tierckpt s)",
                        "GiB/s tierckpt / DCP", "all runs, s (tierckpt — DCP)"], rows)
    pairs = [d / t for t, d in zip(save_s["tierckpt"], save_s["dcp"])]
    spread = (f"Save, DCP s / tierckpt s per repeat (same repeat, adjacent runs): {' / '.join(f'{x:.2f}' for x in pairs)} "
              f"(min {min(pairs):.2f}, median {C.median(pairs):.2f}, max {max(pairs):.2f}). Load average (1 min) "
              f"{load_before:.2f} before the run, {os.getloadavg()[0]:.2f} after.")

    amp_rows = []
    for lib in C.LIBS:
        amp_rows.append([
            lib, C.fmt_bytes(C.median(rchar[lib])), f"**{C.median(rchar[lib]) / nbytes:.3f}**",
            C.fmt_bytes(C.median(rbytes[lib])), f"{C.median(rbytes[lib]) / nbytes:.3f}",
            C.fmt_bytes(ckpt_size[lib]),
        ])
    amp = C.md_table(["library", "rchar, sum over 3 ranks", "amplification (rchar / tensor bytes)",
                      "read_bytes (block layer), sum", "read_bytes / tensor bytes", "checkpoint size on disk"], amp_rows)
    mon_line = (f"tierckpt Monitor (sum over ranks, median): bytes_read {C.fmt_bytes(C.median(mon_read))} "
                f"({C.median(mon_read) / nbytes:.3f}x), requests {C.median(mon_reqs):.0f}, "
                f"bytes_exchanged {C.fmt_bytes(C.median(mon_xchg))}")
    base = C.md_table(["baseline (same bytes, same disk, same run)", "median s", "GiB/s"], [
        [f"`dd if=/dev/zero bs=4M count={dd_bytes // (4 * C.MiB)} conv=fsync`", f"{C.median(dd_w):.2f}",
         f"{dd_bytes / C.median(dd_w) / C.GiB:.2f}"],
        [f"`dd of=/dev/null bs=4M` ({'cold: page cache dropped' if cold else 'page-cache-warm'})",
         f"{C.median(dd_r):.2f}", f"{dd_bytes / C.median(dd_r) / C.GiB:.2f}"],
        ["memcpy (`clone`, 1 thread) of one rank's half", f"{C.median(mem):.3f}",
         f"{nbytes / 2 / C.median(mem) / C.GiB:.2f}"],
    ])
    cache_note = ("The page cache was dropped (`echo 3 > /proc/sys/vm/drop_caches`, as root) before every load "
                  "and before the cold `dd` read: loads read from the disk for both libraries."
                  if dropped else
                  "Dropping the page cache was not permitted: loads are page-cache-warm for both libraries equally.")
    body = "\n\n".join([
        "## Local disk: tierckpt vs DCP (`benchmarks/bench_core.py`)",
        C.machine_info(root if os.path.exists(root) else os.path.dirname(root)),
        f"State: {C.N_TENSORS} fp32 matrices of {C.shapes(args.gib)['w0']} = {C.fmt_bytes(nbytes)} of tensor data, "
        f"DTensors saved `Shard(0)` over 2 gloo ranks and loaded `Shard(1)` over 3 gloo ranks (a cross-cutting "
        f"reshard), in one run with {args.repeats} repeats (library order alternates per repeat, after an untimed tiny warm-up save+load of each library in the same processes); times are "
        f"rank 0's barrier-to-barrier seconds, medians. Each save goes to a fresh directory, removed and "
        f"`os.sync`-ed before (untimed). Every load is checked element by element. "
        f"DCP: `FileSystemWriter(path, sync_files=True)` (its default: fsyncs each data file) / "
        f"`FileSystemReader`; tierckpt returns after its commit (data files, metadata and directories fsynced). "
        f"{cache_note}",
        table,
        spread,
        "Bytes read per load (median over repeats; `/proc/self/io` deltas around the load call, summed over the "
        "3 loading ranks; `rchar` counts read()/pread() syscalls, not gloo socket traffic — checked: a 16 MiB "
        "gloo all_to_all adds ~100 B):",
        amp,
        mon_line + ".",
        f"tierckpt phases (median, max over ranks): save: {C.phases(saves)}; load: {C.phases(loads)}.",
        base,
    ])
    C.publish(body, args.out, "bench_core")


if __name__ == "__main__":
    main()
