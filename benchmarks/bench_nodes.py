"""Two simulated nodes on one machine: save and resharded load, tierckpt beside torch DCP.

One ``torchrun --nnodes 2 --node_rank i --master_addr 127.0.0.1 --master_port P --nproc_per_node R``
per node, as on a cluster; each node has its own node id (``TIERCKPT_NODE_ID=simnode-i``) and its own
node-cache and memory-tier directories under the scratch root, so tierckpt plans as for two nodes (a
local path read by two nodes is a shared file system: each byte is read once per group and the
group exchanges). The state is ``_common.N_TENSORS`` fp32 matrices saved ``Shard(0)`` (rows) over all
ranks, loaded ``Shard(1)`` (columns) over the same ranks; every load is checked element by element.

Per repeat (library order alternating): each library saves into a fresh directory, then loads it
resharded. Reported: rank 0's barrier-to-barrier seconds (medians), the ratio DCP s / tierckpt s
(above 1: tierckpt is faster), and the bytes each node's ranks read in a load (``/proc/self/io``
``rchar``, and for tierckpt its mapped reads, which ``rchar`` does not see), over the state's bytes.

    PYTHONPATH=src python benchmarks/bench_nodes.py [--gib 0.125] [--ranks-per-node 4] [--repeats 3] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

NODES = 2
SECTION = "bench_nodes"


# -- one rank (run by torchrun) ---------------------------------------------------------------------
def worker(root: str, gib: float, repeats: int) -> None:
    """Every rank: warm-up, then per repeat each library's save and resharded load; records to a JSON file."""
    import torch
    import torch.distributed as dist

    import tierckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank = dist.get_rank()
    records: list[dict[str, Any]] = []
    try:
        warm = C.make_state(1e-4, shard_dim=0, fill=True)
        for lib in C.LIBS:
            uri = os.path.join(root, f"warmup-{lib}")
            if rank == 0:
                C.remove_uri(uri, None)
            dist.barrier()
            C.do_save(lib, uri, None, warm, None)
            dist.barrier()
            C.do_load(lib, uri, None, warm, None)
            dist.barrier()
        saved = C.make_state(gib, shard_dim=0, fill=True)
        state = C.make_state(gib, shard_dim=1, fill=False)
        for r in range(repeats):
            for lib in C.order(r):
                uri = os.path.join(root, f"ckpt-{lib}")
                if rank == 0:
                    C.remove_uri(uri, None)
                dist.barrier()
                t0 = time.perf_counter()
                C.do_save(lib, uri, None, saved, None)
                dist.barrier()
                save_s = time.perf_counter() - t0
                C.reset_state(state)
                dist.barrier()
                mon = tierckpt.Monitor()
                io0 = C.proc_io()["rchar"]
                t0 = time.perf_counter()
                C.do_load(lib, uri, None, state, mon if lib == "tierckpt" else None)
                dist.barrier()
                load_s = time.perf_counter() - t0
                rchar = C.proc_io()["rchar"] - io0
                C.check_state(state, gib)
                read = max(rchar, int(mon.counters.get("bytes_read", 0))) if lib == "tierckpt" else rchar
                records.append({"lib": lib, "repeat": r, "save_s": save_s, "load_s": load_s, "bytes": read,
                                "direct": int(mon.counters.get("bytes_read_direct", 0))})
    finally:
        dist.destroy_process_group()
    out = {"rank": rank, "node": os.environ.get("TIERCKPT_NODE_ID", ""), "records": records}
    Path(root, "results", f"rank-{rank:03d}.json").write_text(json.dumps(out))


# -- the launcher -----------------------------------------------------------------------------------
def launch(root: str, gib: float, per_node: int, repeats: int, timeout_s: float) -> list[dict[str, Any]]:
    """Start one torchrun per simulated node and wait for both; each rank's record."""
    os.makedirs(os.path.join(root, "results"), exist_ok=True)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        raise SystemExit("torchrun not found beside this Python or on PATH: install torch's launcher")
    port = C.free_port()
    procs = []
    for node in range(NODES):
        env = dict(os.environ, TIERCKPT_NODE_ID=f"simnode-{node}", OMP_NUM_THREADS="1",
                   TIERCKPT_CACHE_DIR=os.path.join(root, f"node-{node}", "cache"),
                   TIERCKPT_MEMORY_DIR=os.path.join(root, f"node-{node}", "memory"))
        cmd = [torchrun, "--nnodes", str(NODES), "--node_rank", str(node), "--master_addr", "127.0.0.1",
               "--master_port", str(port), "--nproc_per_node", str(per_node), __file__, "--worker",
               "--root", root, "--gib", str(gib), "--repeats", str(repeats)]
        log = open(os.path.join(root, f"node-{node}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    failed = []
    for node, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
        if code != 0:
            failed.append(node)
    if failed:
        tails = "\n".join(f"--- node {n} ---\n{Path(root, f'node-{n}.log').read_text()[-3000:]}" for n in failed)
        raise SystemExit(f"simulated node(s) {failed} failed\n{tails}")
    return [json.loads(p.read_text()) for p in sorted(Path(root, "results").glob("rank-*.json"))]


def table(ranks: list[dict[str, Any]], gib: float) -> str:
    need = C.state_bytes(gib)
    rank0 = next(r for r in ranks if r["rank"] == 0)["records"]
    sec = {(lib, op): [x[f"{op}_s"] for x in rank0 if x["lib"] == lib] for lib in C.LIBS for op in ("save", "load")}
    rows = []
    for op, what in (("save", "save (Shard(0))"), ("load", "load row -> column")):
        t, d = C.median(sec["tierckpt", op]), C.median(sec["dcp", op])
        rows.append([what, f"{t:.3f}", f"{d:.3f}", f"**{d / t:.2f}x**",
                     " / ".join(f"{lib}: {C.runs(sec[lib, op])}" for lib in C.LIBS)])
    out = C.md_table(["operation", "tierckpt s", "DCP s", "DCP s / tierckpt s", "all runs, s"], rows)
    nodes = sorted({r["node"] for r in ranks})
    per_node = []
    for lib in C.LIBS:
        cells = []
        for node in nodes:
            totals = [sum(x["bytes"] for r in ranks if r["node"] == node for x in r["records"]
                          if x["lib"] == lib and x["repeat"] == k) for k in range(len(sec[lib, "load"]))]
            cells.append(f"{C.fmt_bytes(C.median(totals))} ({C.median(totals) / need:.2f})")
        per_node.append([lib, *cells])
    out += "\n\n" + C.md_table(["bytes read in a load (/ state)", *nodes], per_node)
    loads = len(sec["tierckpt", "load"])
    direct = C.median([sum(x.get("direct", 0) for r in ranks for x in r["records"] if x["lib"] == "tierckpt"
                           and x["repeat"] == k) for k in range(loads)])
    read = C.median([sum(x["bytes"] for r in ranks for x in r["records"] if x["lib"] == "tierckpt" and x["repeat"] == k)
                     for k in range(loads)])
    out += f"\n\ntierckpt's share of its bytes read by the direct route (the rest read once and exchanged): {direct / max(read, 1):.2f}"
    return out


def run(gib: float, per_node: int, repeats: int, tmp: str | None, timeout_s: float, out: str | None) -> None:
    """The whole benchmark: launch both nodes, print the section and write it into ``out`` (when given)."""
    root = C.scratch_dir("tierckpt-nodes-") if tmp is None else tmp
    os.makedirs(root, exist_ok=True)
    try:
        ranks = launch(root, gib, per_node, repeats, timeout_s)
        body = "\n\n".join([
            f"## Two simulated nodes: {NODES} x {per_node} ranks (`benchmarks/bench_nodes.py`)",
            C.machine_info(root),
            f"State: {C.N_TENSORS} x {C.shapes(gib)['w0']} fp32 ({C.fmt_bytes(C.state_bytes(gib))}), saved "
            f"`Shard(0)` over all {NODES * per_node} ranks and loaded `Shard(1)` over the same ranks. One "
            f"`torchrun --nnodes {NODES} --node_rank i --master_addr 127.0.0.1` per node, each with its own "
            "`TIERCKPT_NODE_ID` and node-cache / memory-tier directories; the checkpoint directory is shared by "
            f"both (a shared file system to tierckpt's planner). {repeats} repeats, library order alternating; "
            "seconds are rank 0's barrier-to-barrier medians; every load is checked element by element.",
            table(ranks, gib),
        ])
    finally:
        if tmp is None:
            C.rmtree(root)
    C.publish(body, out, SECTION)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=0.125, help="state size in GiB (default 0.125: 128 MiB)")
    parser.add_argument("--ranks-per-node", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tmp", default=None, help="scratch root (default: a fresh temp dir, removed after)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    parser.add_argument("--out", default=None, help="Markdown file to update (between bench_nodes markers)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.root, args.gib, args.repeats)
    else:
        run(args.gib, args.ranks_per_node, args.repeats, args.tmp, args.timeout, args.out)


if __name__ == "__main__":
    main()
