"""Node-scale cases of ``bench_matrix.py --cases node --ranks 2,4,8``: N ranks on one node, both libraries.

* ``reshard N``: ``C.N_TENSORS`` fp32 matrices saved ``Shard(0)`` (rows) on N ranks, loaded ``Shard(1)``
  (columns) on the same N ranks: every saved piece meets every loaded one.
* ``replicated N``: the same matrices as plain tensors, replicated on every rank (a DDP model and its
  optimizer): saved once per group, loaded whole by every rank.

Each library saves untimed, then loads ``repeats`` times, the order of the libraries alternating, each
load checked element by element. Recorded per load: rank 0's barrier-to-barrier seconds and, summed over
ranks, the bytes read — ``/proc/self/io`` ``rchar`` (read calls) plus, for tierckpt, the bytes its
mapped reads copied out of the page cache (which ``rchar`` does not see): the Monitor's ``bytes_read``
counts every byte a unit reads, by either path, so tierckpt's figure is ``max(rchar, bytes_read)``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import _common as C
import torch

LIBS = ["tierckpt", "dcp"]


def replicated_state(gib: float, fill: bool) -> dict[str, torch.Tensor]:
    """The matrices of :func:`_common.shapes` as plain (replicated) tensors, the same on every rank."""
    out = {}
    for i, (name, (rows, cols)) in enumerate(C.shapes(gib).items()):
        out[name] = C.pattern(i, slice(0, rows), slice(0, cols)) if fill else torch.full((rows, cols), -1.0)
    return out


def _states(case: str, gib: float, fill: bool) -> dict[str, Any]:
    if case == "reshard":
        return C.make_state(gib, shard_dim=0 if fill else 1, fill=fill)
    return replicated_state(gib, fill)


def _expected(case: str, state: dict[str, Any], gib: float) -> dict[str, torch.Tensor]:
    """What each local tensor of ``state`` (the load's targets) must hold: the saved pattern, computed once."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for i, (name, shape) in enumerate(C.shapes(gib).items()):
        t = state[name]
        if case == "reshard":
            local_shape, off = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
            out[name] = C.pattern(i, slice(off[0], off[0] + local_shape[0]), slice(off[1], off[1] + local_shape[1]))
        else:
            out[name] = C.pattern(i, slice(0, shape[0]), slice(0, shape[1]))
    return out


def _check(state: dict[str, Any], expected: dict[str, torch.Tensor], lib: str) -> None:
    for name, want in expected.items():
        t = state[name]
        if not torch.equal(t.to_local() if hasattr(t, "to_local") else t, want):
            raise AssertionError(f"{lib}: {name} loaded values differ from the saved ones")


def _reset(state: dict[str, Any]) -> None:
    for t in state.values():
        (t.to_local() if hasattr(t, "to_local") else t).fill_(-1.0)


def node_ranks(rank: int, world: int, cases: list[str], gib: float, root: str, repeats: int) -> list[dict[str, Any]]:
    """Run on every rank of N: for each case, untimed saves by both libraries, then timed loads."""
    import torch.distributed as dist

    import tierckpt

    for lib in LIBS:  # untimed warm-up of each library in these processes (imports, first-call setup)
        uri = os.path.join(root, f"warmup-{lib}-{world}")
        if rank == 0:
            C.remove_uri(uri, None)
        dist.barrier()
        warm = C.make_state(1 / 256, shard_dim=0, fill=True)  # the loads measure the store here (route_costs)
        C.do_save(lib, uri, None, warm, None)
        dist.barrier()
        C.do_load(lib, uri, None, warm, None)
        dist.barrier()
    out: list[dict[str, Any]] = []
    plans = C.plan_log() if rank == 0 else []
    for case in cases:
        saved = _states(case, gib, fill=True)
        uris = {lib: os.path.join(root, f"{case}-{world}-{lib}") for lib in LIBS}
        for lib in LIBS:
            if rank == 0:
                C.remove_uri(uris[lib], None)
            dist.barrier()
            C.do_save(lib, uris[lib], None, saved, None)
            dist.barrier()
        del saved
        state = _states(case, gib, fill=False)
        expected = _expected(case, state, gib)
        for r in range(repeats):
            for lib in (LIBS if r % 2 == 0 else LIBS[::-1]):
                _reset(state)
                dist.barrier()
                mon = tierckpt.Monitor()
                io0 = C.proc_io()
                del plans[:]
                t0 = time.perf_counter()
                C.do_load(lib, uris[lib], None, state, mon if lib == "tierckpt" else None)
                dist.barrier()
                seconds = time.perf_counter() - t0
                rchar = C.proc_io()["rchar"] - io0["rchar"]
                _check(state, expected, lib)
                read = max(rchar, int(mon.counters.get("bytes_read", 0))) if lib == "tierckpt" else rchar
                out.append({"case": f"{case} {world}", "lib": lib, "repeat": r, "seconds": seconds, "bytes": read,
                            "counters": dict(mon.counters) if lib == "tierckpt" else {},
                            "plan": plans[-1] if plans and lib == "tierckpt" else ""})
        del state, expected
    return out


def node_scale(
    ranks: list[int], cases: list[str], gib: float, root: str, repeats: int,
    done: Callable[[list[list[list[dict[str, Any]]]]], None] | None = None,
) -> list[list[list[dict[str, Any]]]]:
    """Every case at every world size in ``ranks``; per world size, the records of every rank.
    ``done``: called with the results so far after each world size."""
    out = []
    for world in ranks:
        t0 = time.perf_counter()
        out.append(C.run_ranks(node_ranks, world, cases, gib, root, repeats))
        print(f"node scale: {world} ranks done ({time.perf_counter() - t0:.0f}s)", flush=True)
        for name in os.listdir(root):  # each world size's checkpoints: the next needs the disk
            if name.endswith(tuple(f"-{world}-{lib}" for lib in LIBS)):
                C.rmtree(os.path.join(root, name))
        if done is not None:
            done(out)
    return out


def table(per_world: list[list[list[dict[str, Any]]]], gib: float) -> str:
    """One row per case and world size: medians, the ratio DCP s / tierckpt s, bytes read per group."""
    need = C.state_bytes(gib)
    rows = []
    for per_rank in per_world:
        groups: dict[str, dict[str, list[int]]] = {}
        for i, rec in enumerate(per_rank[0]):
            g = groups.setdefault(rec["case"], {lib: [] for lib in LIBS})
            g[rec["lib"]].append(i)
        for case, idx in groups.items():
            sec = {lib: [per_rank[0][i]["seconds"] for i in idx[lib]] for lib in LIBS}
            byt = {lib: C.median([sum(rr[i]["bytes"] for rr in per_rank) for i in idx[lib]]) for lib in LIBS}
            direct = C.median([sum(rr[i]["counters"].get("bytes_read_direct", 0) for rr in per_rank) for i in idx["tierckpt"]])
            ratio = C.median(sec["dcp"]) / C.median(sec["tierckpt"])
            rows.append([
                case, f"{C.median(sec['tierckpt']):.3f}", f"{C.median(sec['dcp']):.3f}",
                f"**{ratio:.2f}x**" + ("" if ratio >= 1.0 else " (slower)"),
                f"{C.fmt_bytes(byt['tierckpt'])} ({byt['tierckpt'] / need:.2f})",
                f"{C.fmt_bytes(byt['dcp'])} ({byt['dcp'] / need:.2f})",
                f"{direct / max(byt['tierckpt'], 1):.2f}",
                " / ".join(f"{lib}: {C.runs(v)}" for lib, v in sec.items()),
            ])
    out = C.md_table(["case (ranks)", "tierckpt s", "DCP s", "DCP / tierckpt", "tierckpt bytes read (/ state)",
                      "DCP bytes read (/ state)", "tierckpt direct share", "all runs, s"], rows)
    plans = [f"- {rec['case']}: `{rec['plan']}`" for per_rank in per_world for rec in per_rank[0] if rec.get("plan")
             and rec["repeat"] == 0]
    return out + ("\n\ntierckpt's load plans (rank 0, first repeat; `*`: a route cost measured by the job):\n\n"
                  + "\n".join(plans) if plans else "")


def run(args: argparse.Namespace, quick_gib: float) -> None:
    """The node case: its own section (``bench_node_scale``) in ``--out``, written again after each world
    size (a run cut short keeps the sizes it finished)."""
    gib = args.gib if args.gib is not None else (quick_gib if args.quick else 1.0)
    ranks = [int(r) for r in args.ranks.split(",")]
    root = C.scratch_dir("tierckpt-node-") if args.tmp is None else args.tmp
    os.makedirs(root, exist_ok=True)

    def body(per_world: list) -> str:
        return "\n\n".join([
            f"## Node scale: resharded and replicated loads at {', '.join(map(str, ranks))} ranks "
            "(`benchmarks/bench_matrix.py --cases node`)",
            C.machine_info(root),
            f"State: {C.N_TENSORS} x {C.shapes(gib)['w0']} fp32 ({C.fmt_bytes(C.state_bytes(gib))}). `reshard N`: "
            f"saved `Shard(0)` on N ranks, loaded `Shard(1)` on the same N; `replicated N`: plain tensors (a "
            f"DDP-style state) saved once per group, loaded whole by each of N ranks. Loads are page-cache warm "
            f"(a restart on the node that saved). {args.repeats} repeats, order alternating; seconds are rank 0's "
            f"barrier-to-barrier medians; every load is checked element by element. Bytes read are summed over "
            f"ranks (`rchar`, and tierckpt's mapped reads); `/ state` is that over the state's bytes.",
            table(per_world, gib),
        ])

    def done(per_world: list) -> None:
        if args.out and len(per_world) < len(ranks):
            C.write_section(args.out, "bench_node_scale", body(per_world))

    try:
        per_world = node_scale(ranks, ["reshard", "replicated"], gib, root, args.repeats, done)
    finally:
        if args.tmp is None:
            C.rmtree(root)
    C.publish(body(per_world), args.out, "bench_node_scale")
