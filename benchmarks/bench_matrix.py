"""One benchmark matrix: tierckpt, torch DCP and ByteCheckpoint on the same states, in one run.

    python benchmarks/bench_matrix.py [--quick] [--repeats 3] [--out docs/benchmarks.md]

Cases (each library on the same state, the order of the libraries alternating per repeat, medians of
``--repeats``; the page cache is dropped before every load when the machine allows it):

* ``ddp``: a DDP MLP + AdamW (stepped, so the moments exist) on 2 ranks: save, then load on the same ranks.
* ``fsdp2``: the same model under FSDP2 (``fully_shard``) on 2 ranks: save and load.
* ``dtensor save``: 16 square fp32 DTensors ``Shard(0)`` on 2 ranks, saved until durable.
* ``reshard``: 8 fp32 matrices saved ``Shard(0)`` on 2 ranks, loaded ``Shard(1)`` on 3.
* ``async stall``: the DDP + AdamW state saved asynchronously: seconds until the call returns.
* ``s3``: the DDP + AdamW state (smaller) saved to and loaded from S3 (moto on loopback).
* ``node`` (only when named in ``--cases``): at each world size of ``--ranks`` (e.g. ``2,4,8``) on this
  node, a row -> column resharded load and a replicated (DDP-style) load of ``--gib`` GiB, with the bytes
  each library reads per group (``_node_scale.py``); its own table, between ``<!-- bench_node_scale -->``.
* ``nodes`` (only when named in ``--cases``): 2 simulated nodes x 4 ranks, one ``torchrun`` per node
  with its own node id: save and row -> column load of ``--gib`` GiB (default 0.125; with ``--quick`` 1/256),
  bytes read per node (``bench_nodes.py``); its own table, between ``<!-- bench_nodes -->``.

ByteCheckpoint runs where its API covers the case (DDP and FSDP2 models on a local disk) and when it
imports; otherwise its cells say why. Writes a table of ratios (peer seconds / tierckpt seconds: above
1.0 tierckpt is faster) between ``<!-- bench_matrix -->`` markers in ``--out`` and a chart beside it.
``--quick`` shrinks every state to a smoke test of a few MiB. The chart needs matplotlib (the ``bench``
extra); without it the table is written and the report says that the chart was not.

ByteCheckpoint 0.0.2 runs on torch 2.13 CPU installed without its pinned dependencies, in an
environment of its own so that its pins never reach the project's::

    python -m venv /work/venv-bench && /work/venv-bench/bin/pip install torch==2.13.0
    /work/venv-bench/bin/pip install -e '.[test,bench]'
    /work/venv-bench/bin/pip install --no-deps bytecheckpoint==0.0.2 mmh3 universal-pathlib cachetools \
        grpcio==1.69.0 protobuf==3.20.3
    /work/venv-bench/bin/python benchmarks/bench_matrix.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402

os.environ.setdefault("BYTECHECKPOINT_LOGGING_LEVEL", "WARNING")  # inherited by the ranks: one line per step otherwise
BUCKET = "matrix"


# -- libraries ------------------------------------------------------------------------------------
def bytecheckpoint_status() -> str | None:
    """``None`` when ByteCheckpoint imports, else why not."""
    try:
        import bytecheckpoint  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return f"does not import: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def libraries() -> tuple[list[str], str | None]:
    why = bytecheckpoint_status()
    return (["tierckpt", "dcp"] + ([] if why else ["bytecheckpoint"])), why


def alternate(libs: list[str], r: int) -> list[str]:
    return libs if r % 2 == 0 else libs[::-1]


class ModelOps:
    """Save, load and async-save of a model + optimizer for each library (same state, same ranks)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer, framework: str, opts: dict | None) -> None:
        self.model, self.optim, self.framework, self.opts = model, optim, framework, opts

    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def _dcp_io(self, uri: str, write: bool) -> Any:
        return C._dcp_io(uri, self.opts, write)

    def save(self, lib: str, uri: str) -> None:
        import torch.distributed.checkpoint as dcp

        import tierckpt

        if lib == "tierckpt":
            tierckpt.save(uri, {"model": self.model, "optim": self.optim}, storage_options=C._direct(self.opts))
        elif lib == "dcp":
            dcp.save(self._dcp_state(), storage_writer=self._dcp_io(uri, write=True))
        else:
            import bytecheckpoint

            bytecheckpoint.save(uri, {"model": self.model, "optimizer": self.optim}, framework=self.framework)

    def load(self, lib: str, uri: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        import tierckpt

        if lib == "tierckpt":
            tierckpt.load(uri, {"model": self.model, "optim": self.optim}, storage_options=C._direct(self.opts))
        elif lib == "dcp":
            state = self._dcp_state()
            dcp.load(state, storage_reader=self._dcp_io(uri, write=False))
            set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            import bytecheckpoint

            bytecheckpoint.load(uri, {"model": self.model, "optimizer": self.optim}, framework=self.framework)

    def async_save(self, lib: str, uri: str) -> tuple[float, Callable[[], Any]]:
        """Seconds until the call returned, and how to wait for the save to finish."""
        import torch.distributed.checkpoint as dcp

        import tierckpt

        t0 = time.perf_counter()
        if lib == "tierckpt":
            handle = tierckpt.async_save(uri, {"model": self.model, "optim": self.optim}, storage_options=C._direct(self.opts))
            return time.perf_counter() - t0, handle.wait
        future = dcp.async_save(self._dcp_state(), storage_writer=self._dcp_io(uri, write=True))
        return time.perf_counter() - t0, future.result

    def tensors(self) -> list[torch.Tensor]:
        """Every parameter and optimizer-state tensor of this rank (local shards of DTensors)."""
        out = [p.detach() for p in self.model.parameters()]
        for st in self.optim.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return [t.to_local() if hasattr(t, "to_local") else t for t in out]


def build_model(kind: str, hidden: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP of ``layers`` square ``hidden`` Linear layers, as DDP or FSDP2, with AdamW stepped once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, hidden)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _fresh(uri: str, opts: dict | None) -> None:
    """Rank 0 removes ``uri`` before a timed save (untimed; dirty pages written back first)."""
    C.remove_uri(uri, opts)


def _record(out: list, case: str, op: str, lib: str, r: int, seconds: float, **extra: Any) -> None:
    out.append({"case": case, "op": op, "lib": lib, "repeat": r, "seconds": seconds, **extra})


def model_ranks(
    rank: int, world: int, case: str, kind: str, hidden: int, layers: int, root: str, repeats: int,
    libs: list[str], opts: dict | None, endpoint: str | None, ops: tuple[str, ...],
) -> list[dict[str, Any]]:
    """Run on every rank: timed saves, loads and async saves of one model for every library."""
    import torch.distributed as dist

    if endpoint:
        from bench_s3 import _env

        _env(endpoint)
    model, optim = build_model(kind, hidden, layers)
    m = ModelOps(model, optim, kind, opts)
    reference = [t.clone() for t in m.tensors()]
    out: list[dict[str, Any]] = []
    uri = {lib: f"{root.rstrip('/')}/{case}-{lib}" for lib in libs}
    for lib in libs:  # untimed warm-up of each library in these processes (imports, first-call setup)
        if rank == 0:
            _fresh(uri[lib] + "-warmup", opts)
        dist.barrier()
        m.save(lib, uri[lib] + "-warmup")
        dist.barrier()
        if "async" not in ops:
            m.load(lib, uri[lib] + "-warmup")
        dist.barrier()
    if "save" in ops:
        for r in range(repeats):
            for lib in alternate(libs, r):
                if rank == 0:
                    _fresh(uri[lib], opts)
                dist.barrier()
                t0 = time.perf_counter()
                m.save(lib, uri[lib])
                dist.barrier()
                _record(out, case, "save", lib, r, time.perf_counter() - t0)
    if "load" in ops:
        for r in range(repeats):
            for lib in alternate(libs, r):
                for t in m.tensors():
                    t.zero_()
                dropped = C.drop_caches() if rank == 0 and opts is None else None
                dist.barrier()
                t0 = time.perf_counter()
                m.load(lib, uri[lib])
                dist.barrier()
                _record(out, case, "load", lib, r, time.perf_counter() - t0, dropped=dropped)
                if not all(torch.equal(a, b) for a, b in zip(m.tensors(), reference)):
                    raise AssertionError(f"{lib}: {case} load differs from the saved state on rank {rank}")
    if "async" in ops:
        for r in range(repeats):
            for lib in alternate([lib for lib in libs if lib != "bytecheckpoint"], r):
                if rank == 0:
                    _fresh(uri[lib] + "-async", opts)
                dist.barrier()
                stall, wait = m.async_save(lib, uri[lib] + "-async")
                wait()
                dist.barrier()
                _record(out, case, "async stall", lib, r, stall)
    return out


def warm_up(rank: int, root: str, libs: list[str]) -> None:
    """Untimed tiny save + load of each library in these processes (imports, first-call setup)."""
    import torch.distributed as dist

    state = C.make_state(1e-4, shard_dim=0, fill=True)
    for lib in libs:
        uri = os.path.join(root, f"warmup-{lib}-{dist.get_world_size()}")
        if rank == 0:
            _fresh(uri, None)
        dist.barrier()
        C.do_save(lib, uri, None, state, None)
        dist.barrier()
        C.do_load(lib, uri, None, state, None)
        dist.barrier()


def squares_ranks(rank: int, world: int, n: int, side: int, root: str, repeats: int, libs: list[str]) -> list[dict[str, Any]]:
    """Run on every rank: ``n`` square fp32 DTensors ``Shard(0)`` saved until durable, per library."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh("cpu", list(range(world)))
    state = {}
    for i in range(n):
        local = torch.randn(side // world, side, generator=torch.Generator().manual_seed(i * world + rank))
        state[f"t{i}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((side, side)), stride=(side, 1))
    warm_up(rank, root, libs)
    out: list[dict[str, Any]] = []
    for r in range(repeats):
        for lib in alternate(libs, r):
            uri = os.path.join(root, f"squares-{lib}")
            if rank == 0:
                _fresh(uri, None)
            dist.barrier()
            t0 = time.perf_counter()
            C.do_save(lib, uri, None, state, None)
            dist.barrier()
            _record(out, "dtensor save", "save", lib, r, time.perf_counter() - t0)
    return out


def reshard_save_ranks(rank: int, world: int, gib: float, root: str, libs: list[str]) -> bool:
    """Untimed: each library saves the ``Shard(0)`` state that the reshard case loads."""
    import torch.distributed as dist

    state = C.make_state(gib, shard_dim=0, fill=True)
    for lib in libs:
        uri = os.path.join(root, f"reshard-{lib}")
        if rank == 0:
            _fresh(uri, None)
        dist.barrier()
        C.do_save(lib, uri, None, state, None)
        dist.barrier()
    return True


def reshard_load_ranks(rank: int, world: int, gib: float, root: str, repeats: int, libs: list[str]) -> list[dict[str, Any]]:
    """Run on every rank of 3: timed ``Shard(1)`` loads of the 2-rank ``Shard(0)`` checkpoints."""
    import torch.distributed as dist

    warm_up(rank, root, libs)
    state = C.make_state(gib, shard_dim=1, fill=False)
    out: list[dict[str, Any]] = []
    for r in range(repeats):
        for lib in alternate(libs, r):
            C.reset_state(state)
            dropped = C.drop_caches() if rank == 0 else None
            dist.barrier()
            t0 = time.perf_counter()
            C.do_load(lib, os.path.join(root, f"reshard-{lib}"), None, state, None)
            dist.barrier()
            _record(out, "reshard 2 -> 3", "load", lib, r, time.perf_counter() - t0, dropped=dropped)
            C.check_state(state, gib)
    return out


# -- sizes ----------------------------------------------------------------------------------------
SIZES = {
    # (hidden, layers) of the MLP; 4 bytes x 3 (weights and two AdamW moments) per parameter
    "full": {"model": (4096, 2), "s3_model": (1024, 4), "squares": (16, 4096), "reshard_gib": 1.0},
    "quick": {"model": (256, 2), "s3_model": (128, 2), "squares": (16, 256), "reshard_gib": 1 / 256},
}


def model_bytes(hidden: int, layers: int) -> int:
    return 3 * 4 * layers * (hidden * hidden + hidden)


# -- S3 -------------------------------------------------------------------------------------------
class MotoS3:
    """moto's S3 server on 127.0.0.1 in this process, with one bucket."""

    def __enter__(self) -> tuple[str, dict[str, str]]:
        import logging

        import boto3
        from moto.server import ThreadedMotoServer

        from bench_s3 import _env

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        port = C.free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        _env(self.endpoint)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        return self.endpoint, {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    def __exit__(self, *exc: Any) -> None:
        self.server.stop()


# -- report ---------------------------------------------------------------------------------------
def medians(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """``(case, op)`` -> library -> seconds of every repeat (rank 0's records)."""
    out: dict[tuple[str, str], dict[str, list[float]]] = {}
    for rec in records:
        out.setdefault((rec["case"], rec["op"]), {}).setdefault(rec["lib"], []).append(rec["seconds"])
    return out


def ratio(peer: list[float] | None, mine: list[float]) -> str:
    if not peer:
        return "-"
    value = C.median(peer) / C.median(mine)
    return f"**{value:.2f}x**" if value >= 1.0 else f"**{value:.2f}x** (slower)"


MATPLOTLIB_MISSING = ("matplotlib is not installed, so no chart was written; install it (`pip install matplotlib`, "
                      "or the package's `bench` extra) and run again for the PNG")


def chart(rows: dict[tuple[str, str], dict[str, list[float]]], path: str) -> str | None:
    """Write a bar chart of the ratios to ``path``; return why not (matplotlib missing), else ``None``."""
    try:
        import matplotlib
    except ImportError:
        return MATPLOTLIB_MISSING

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{case}\n{op}" for case, op in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 4))
    width = 0.38
    for k, peer in enumerate(("dcp", "bytecheckpoint")):
        xs, ys = [], []
        for i, libs in enumerate(rows.values()):
            if libs.get(peer):
                xs.append(i + (k - 0.5) * width)
                ys.append(C.median(libs[peer]) / C.median(libs["tierckpt"]))
        if xs:  # a peer with no cell (ByteCheckpoint not installed) gets no legend entry
            ax.bar(xs, ys, width, color=("tab:blue", "tab:orange")[k],
                   label=f"{'DCP' if peer == 'dcp' else 'ByteCheckpoint'} s / tierckpt s")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("speedup of tierckpt (higher is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def report(records: list[dict[str, Any]], args: argparse.Namespace, size: dict, libs: list[str], bcp_why: str | None,
           dropped: bool, root: str) -> str:
    rows = medians(records)
    table = []
    for (case, op), by_lib in rows.items():
        mine = by_lib["tierckpt"]
        table.append([
            case, op, f"{C.median(mine):.3f}",
            f"{C.median(by_lib['dcp']):.3f}" if by_lib.get("dcp") else "-",
            f"{C.median(by_lib['bytecheckpoint']):.3f}" if by_lib.get("bytecheckpoint") else "-",
            ratio(by_lib.get("dcp"), mine), ratio(by_lib.get("bytecheckpoint"), mine),
            " / ".join(f"{lib}: {C.runs(v)}" for lib, v in by_lib.items()),
        ])
    hidden, layers = size["model"]
    s3_hidden, s3_layers = size["s3_model"]
    n, side = size["squares"]
    bcp_note = ("ByteCheckpoint 0.0.2 runs the DDP and FSDP2 model cases on a local disk; its API has no raw "
                "DTensor state, no S3 store and no async handle to wait on, so those cells are `-`."
                if not bcp_why else f"ByteCheckpoint is not in the table: it {bcp_why}.")
    drop_note = ("The page cache was dropped before every local load (`echo 3 > /proc/sys/vm/drop_caches`)."
                 if dropped else "Dropping the page cache was not permitted: local loads are page-cache-warm for every library.")
    body = "\n\n".join([
        "## Benchmark matrix: tierckpt, DCP and ByteCheckpoint (`benchmarks/bench_matrix.py`)",
        C.machine_info(root),
        f"States: DDP and FSDP2 models are {layers} x Linear({hidden}, {hidden}) + AdamW "
        f"({C.fmt_bytes(model_bytes(hidden, layers))} with the moments) on 2 gloo ranks; `dtensor save` is {n} x "
        f"({side}, {side}) fp32 `Shard(0)` on 2 ranks ({C.fmt_bytes(n * side * side * 4)}); `reshard` is "
        f"{C.N_TENSORS} x {C.shapes(size['reshard_gib'])['w0']} fp32 saved `Shard(0)` on 2 ranks, loaded `Shard(1)` "
        f"on 3 ({C.fmt_bytes(C.state_bytes(size['reshard_gib']))}); `s3` is {s3_layers} x Linear({s3_hidden}, {s3_hidden}) + "
        f"AdamW ({C.fmt_bytes(model_bytes(s3_hidden, s3_layers))}) on moto S3 over loopback (tierckpt with "
        f"`cache=False`, DCP through fsspec). Each library saves to its own fresh directory (removed and "
        f"synced before, untimed); saves return when durable (tierckpt: committed and fsynced; DCP: "
        f"`FileSystemWriter` defaults, which fsync; ByteCheckpoint: its default). {drop_note} "
        f"{args.repeats} repeats, order alternating; seconds are rank 0's barrier-to-barrier medians; every "
        f"load is checked element by element. Ratios are peer seconds / tierckpt seconds (above 1.0: tierckpt "
        f"is faster). {bcp_note}",
        C.md_table(["case", "operation", "tierckpt s", "DCP s", "ByteCheckpoint s", "DCP / tierckpt",
                    "ByteCheckpoint / tierckpt", "all runs, s"], table),
    ])
    if args.out:
        folder = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(folder, exist_ok=True)
        missing = chart(rows, os.path.join(folder, args.chart))
        if missing:
            print(f"bench_matrix: {missing}", file=sys.stderr, flush=True)
        body += f"\n\n{missing}." if missing else f"\n\n![matrix]({args.chart})"
    return body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny states: a smoke test of the whole matrix")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement; medians reported (default 3)")
    ap.add_argument("--out", default=None,
                    help="Markdown file to write the table into, the chart beside it (default: print only)")
    ap.add_argument("--chart", default="benchmarks-matrix.png", help="chart file name, written beside --out (when given)")
    ap.add_argument("--cases", default="ddp,fsdp2,squares,reshard,async,s3", help="comma-separated subset")
    ap.add_argument("--ranks", default="2,4,8", help="world sizes of the node case (comma-separated)")
    ap.add_argument("--gib", type=float, default=None,
                    help="state of the node case in GiB (default 1.0; with --quick 1/256); of the nodes case 0.125")
    ap.add_argument("--tmp", default=None, help="scratch directory (default: a new dir under $TMPDIR)")
    args = ap.parse_args()
    size = SIZES["quick" if args.quick else "full"]
    cases = set(args.cases.split(","))
    if "node" in cases:
        import _node_scale

        _node_scale.run(args, SIZES["quick"]["reshard_gib"])
        cases.discard("node")
    if "nodes" in cases:
        import bench_nodes

        gib = args.gib if args.gib is not None else (SIZES["quick"]["reshard_gib"] if args.quick else 0.125)
        bench_nodes.run(gib, 4, args.repeats, args.tmp, 3600, args.out)
        cases.discard("nodes")
    if not cases:
        return
    libs, bcp_why = libraries()
    model_libs = libs
    plain = [lib for lib in libs if lib != "bytecheckpoint"]
    root = C.scratch_dir("tierckpt-matrix-") if args.tmp is None else args.tmp
    os.makedirs(root, exist_ok=True)
    records: list[dict[str, Any]] = []
    dropped = C.drop_caches()
    started = time.perf_counter()

    def step(name: str, result: list[list[dict[str, Any]]]) -> None:
        records.extend(result[0])
        print(f"{name} done ({time.perf_counter() - started:.0f}s)", flush=True)

    try:
        hidden, layers = size["model"]
        if "ddp" in cases:
            step("ddp", C.run_ranks(model_ranks, 2, "ddp", "ddp", hidden, layers, root, args.repeats, model_libs,
                                    None, None, ("save", "load"), daemon=False))
        if "fsdp2" in cases:
            step("fsdp2", C.run_ranks(model_ranks, 2, "fsdp2", "fsdp2", hidden, layers, root, args.repeats,
                                      model_libs, None, None, ("save", "load"), daemon=False))
        if "squares" in cases:
            n, side = size["squares"]
            step("dtensor save", C.run_ranks(squares_ranks, 2, n, side, root, args.repeats, plain))
        if "reshard" in cases:
            C.run_ranks(reshard_save_ranks, 2, size["reshard_gib"], root, plain)
            step("reshard", C.run_ranks(reshard_load_ranks, 3, size["reshard_gib"], root, args.repeats, plain))
        if "async" in cases:
            step("async", C.run_ranks(model_ranks, 2, "async", "ddp", hidden, layers, root, args.repeats, plain,
                                      None, None, ("async",)))
        if "s3" in cases:
            s3_hidden, s3_layers = size["s3_model"]
            with MotoS3() as (endpoint, opts):
                step("s3", C.run_ranks(model_ranks, 2, "s3", "ddp", s3_hidden, s3_layers, f"s3://{BUCKET}",
                                       args.repeats, plain, opts, endpoint, ("save", "load")))
        body = report(records, args, size, libs, bcp_why, dropped, root)
        print(f"all cases done in {time.perf_counter() - started:.0f}s", flush=True)
    finally:
        if args.tmp is None:
            C.rmtree(root)
    C.publish(body, args.out, "bench_matrix")


if __name__ == "__main__":
    main()
