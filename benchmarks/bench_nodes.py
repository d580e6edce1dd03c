"""Two simulated nodes on one machine: save, resharded load and replicated load, tierckpt beside torch DCP.

One ``torchrun --nnodes 2 --node_rank i --master_addr 127.0.0.1 --master_port P --nproc_per_node R``
per node, as on a cluster; each node has its own node id (``TIERCKPT_NODE_ID=simnode-i``) and its own
node-cache and memory-tier directories under the scratch root, so tierckpt plans as for two nodes (a
local path read by two nodes is a shared file system: each byte is read once per group and the
group exchanges, unless the costs the job measures say otherwise: :mod:`tierckpt.loading.route_costs`). The state
is ``_common.N_TENSORS`` fp32 matrices saved ``Shard(0)`` (rows) over all ranks, loaded ``Shard(1)``
(columns) over the same ranks; and the same matrices as plain tensors (a DDP model: saved once, loaded
whole by every rank). Every load is checked element by element. Rank 0 records tierckpt's load plan as
the loader logs it: the bytes of each route and the route inputs (``*``: measured on these processes).

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
import _node_scale as S  # noqa: E402

NODES = 2
SECTION = "bench_nodes"
CASES = ("reshard", "replicated")
ROUTES = ("direct", "node", "exchange")


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
    plans = C.plan_log() if rank == 0 else []
    try:
        # large enough that the loads measure the store here, untimed (tierckpt.loading.route_costs)
        warm = C.make_state(1 / 256, shard_dim=0, fill=True)
        for lib in C.LIBS:
            uri = os.path.join(root, f"warmup-{lib}")
            if rank == 0:
                C.remove_uri(uri, None)
            dist.barrier()
            C.do_save(lib, uri, None, warm, None)
            dist.barrier()
            C.do_load(lib, uri, None, warm, None)
            dist.barrier()
        states = {case: (S._states(case, gib, fill=True), S._states(case, gib, fill=False)) for case in CASES}
        expected = {case: S._expected(case, states[case][1], gib) for case in CASES}
        for r in range(repeats):
            for case in CASES:
                saved, state = states[case]
                for lib in C.order(r):
                    uri = os.path.join(root, f"ckpt-{lib}")
                    if rank == 0:
                        C.remove_uri(uri, None)
                    dist.barrier()
                    t0 = time.perf_counter()
                    C.do_save(lib, uri, None, saved, None)
                    dist.barrier()
                    save_s = time.perf_counter() - t0
                    S._reset(state)
                    dist.barrier()
                    mon = tierckpt.Monitor()
                    io0 = C.proc_io()["rchar"]
                    del plans[:]
                    t0 = time.perf_counter()
                    C.do_load(lib, uri, None, state, mon if lib == "tierckpt" else None)
                    dist.barrier()
                    load_s = time.perf_counter() - t0
                    rchar = C.proc_io()["rchar"] - io0
                    S._check(state, expected[case], lib)
                    read = max(rchar, int(mon.counters.get("bytes_read", 0))) if lib == "tierckpt" else rchar
                    records.append({"lib": lib, "case": case, "repeat": r, "save_s": save_s, "load_s": load_s,
                                    "bytes": read, "plan": plans[-1] if plans and lib == "tierckpt" else "",
                                    **{f"bytes_{route}": int(mon.counters.get(f"bytes_read_{route}", 0))
                                       for route in ROUTES}})
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
    rows = []
    for case, what in (("reshard", "row -> column"), ("replicated", "replicated (DDP-style)")):
        sec = {(lib, op): [x[f"{op}_s"] for x in rank0 if x["lib"] == lib and x["case"] == case]
               for lib in C.LIBS for op in ("save", "load")}
        for op in ("save", "load"):
            t, d = C.median(sec["tierckpt", op]), C.median(sec["dcp", op])
            rows.append([f"{op} {what}", f"{t:.3f}", f"{d:.3f}", f"**{d / t:.2f}x**",
                         " / ".join(f"{lib}: {C.runs(sec[lib, op])}" for lib in C.LIBS)])
    out = C.md_table(["operation", "tierckpt s", "DCP s", "DCP s / tierckpt s", "all runs, s"], rows)
    nodes = sorted({r["node"] for r in ranks})
    per_node = []
    for case in CASES:
        for lib in C.LIBS:
            cells = []
            for node in nodes:
                totals = [sum(x["bytes"] for r in ranks if r["node"] == node for x in r["records"]
                              if x["lib"] == lib and x["case"] == case and x["repeat"] == k)
                          for k in range(len(rank0) // (2 * len(CASES)))]
                cells.append(f"{C.fmt_bytes(C.median(totals))} ({C.median(totals) / need:.2f})")
            per_node.append([f"{case}: {lib}", *cells])
    out += "\n\n" + C.md_table(["bytes read in a load (/ state)", *nodes], per_node)
    routes = []
    for case in CASES:
        mine = [x for r in ranks for x in r["records"] if x["lib"] == "tierckpt" and x["case"] == case]
        total = max(sum(x["bytes"] for x in mine), 1)
        shares = ", ".join(f"{route} {sum(x[f'bytes_{route}'] for x in mine) / total:.2f}" for route in ROUTES)
        plans = [x["plan"] for x in rank0 if x["lib"] == "tierckpt" and x["case"] == case and x["plan"]]
        routes.append(f"- {case}: bytes read by route {shares}; rank 0's last plan: `{plans[-1] if plans else '?'}`")
    out += "\n\ntierckpt's routes (`*`: a cost measured by the job, the rest the defaults):\n\n" + "\n".join(routes)
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
            f"`Shard(0)` over all {NODES * per_node} ranks and loaded `Shard(1)` over the same ranks; replicated: "
            "the same matrices as plain tensors, saved once and loaded whole by every rank. One "
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
