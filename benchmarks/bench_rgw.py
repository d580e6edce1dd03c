"""tierckpt vs DCP (fsspec/s3fs) vs raw s3fs PUT/GET of the same bytes, on a real S3 server: Ceph radosgw.

    python benchmarks/bench_rgw.py [--gib 1] [--ranks 2 8] [--repeats 3] [--out docs/benchmarks.md]

Starts a one-monitor, one-OSD Ceph cluster with radosgw on 127.0.0.1 (``tests/radosgw.py``; Debian's
``radosgw ceph-mon ceph-osd``), then for each rank count, in one run:

* save: ``Shard(0)`` on N gloo ranks; tierckpt (``cache=False``: S3 itself) and DCP (``FsspecWriter``);
* load: the same checkpoint resharded to ``Shard(1)`` on N ranks, checked element by element;
* raw: every rank PUTs its share of the same bytes as one object with s3fs (``pipe_file``: multipart for
  large objects, its parts all in flight at once) and GETs it back (``cat_file``), barrier to barrier, at the
  same concurrency (one stream per rank): what the server gives a client that does nothing but move the bytes.

The three go in turn inside every repeat, in a rotating order, so a neighbour's load on a shared machine
falls on all of them alike. Before the timed loads every rank loads the full checkpoint once, untimed, with
each library: a job's first tierckpt load from a kind of store measures the store and the group (the
route costs, :mod:`tierckpt.loading.route_costs`: once per process); its seconds are reported on their own.

For every timed operation it also records, from outside the clients: the requests the server logged (by HTTP
method, radosgw's own log), the CPU seconds of the ranks and of the server's daemons, and how busy the
machine's cores were (``/proc/stat``, everything on the machine). Ratios are raw seconds / library seconds
(1.0: the library moves bytes as fast as a bare client).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import _common as C  # noqa: E402

BUCKET = "bench"
KINDS = ("tierckpt", "dcp", "raw")
REQUEST = re.compile(rb'"(GET|PUT|POST|HEAD|DELETE) ')
"""An access line of radosgw's log (beast frontend, ``debug rgw`` 1): one per request served."""


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) ticks of all cores so far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


class ServerWatch:
    """Rank 0's view of the server around one timed operation: requests logged, daemons' CPU, cores busy."""

    def __init__(self, log: str, daemons: dict[str, int]) -> None:
        self.log, self.daemons = log, daemons

    def start(self) -> None:
        self._offset = os.path.getsize(self.log)
        self._cpu = {name: _cpu_seconds(pid) for name, pid in self.daemons.items()}
        self._ticks = _machine_ticks()

    def stop(self) -> dict[str, Any]:
        ticks = _machine_ticks()
        cpu = {name: _cpu_seconds(pid) - self._cpu[name] for name, pid in self.daemons.items()}
        size, settled = os.path.getsize(self.log), time.monotonic() + 3
        while time.monotonic() < settled:  # radosgw writes its log from a thread of its own: wait till it is still
            time.sleep(0.3)
            size, before = os.path.getsize(self.log), size
            if size == before:
                break
        with open(self.log, "rb") as f:
            f.seek(self._offset)
            requests = collections.Counter(m.group(1).decode() for m in REQUEST.finditer(f.read()))
        busy = (ticks[0] - self._ticks[0]) / max(ticks[1] - self._ticks[1], 1)
        return {"requests": dict(requests), "daemon_cpu": cpu, "busy": busy}


def rgw_ranks(rank: int, world: int, mode: str, gib: float, repeats: int, uris: dict[str, str],
              opts: dict[str, Any], watch: ServerWatch) -> list[dict[str, Any]]:
    """Run on every rank: ``repeats`` rounds of the three kinds' saves (``mode`` "save") or loads, in turn."""
    import s3fs
    import torch.distributed as dist

    import tierckpt

    fs = s3fs.S3FileSystem(endpoint_url=opts["endpoint_url"], key=opts["key"], secret=opts["secret"],
                           skip_instance_cache=True)
    raw_path = f"{BUCKET}/raw-{world}/rank-{rank:05d}"
    state = C.make_state(gib, shard_dim=0 if mode == "save" else 1, fill=(mode == "save"))
    share = C.state_bytes(gib) // world
    data = os.urandom(share) if mode == "save" else b""

    def once(kind: str, monitor: Any = None) -> None:
        if kind == "raw":
            if mode == "save":
                fs.pipe_file(raw_path, data)
            elif len(fs.cat_file(raw_path)) != share:
                raise RuntimeError(f"rank {rank}: the raw GET returned another size than its PUT")
        elif mode == "save":
            C.do_save(kind, uris[kind], opts, state, monitor)
        else:
            C.do_load(kind, uris[kind], opts, state, monitor)

    out: list[dict[str, Any]] = []
    if mode == "save":
        warm = C.make_state(1e-4, shard_dim=0, fill=True)
        for lib in C.LIBS:  # each client's first requests (credentials, connections), untimed
            C.do_save(lib, uris[lib] + "-warmup", opts, warm, None)
        fs.pipe_file(raw_path + "-warmup", b"x")
    else:
        for kind in KINDS:  # the first load of each: tierckpt's includes the job's one-time route probe
            dist.barrier()
            t0 = time.perf_counter()
            once(kind)
            dist.barrier()
            out.append({"repeat": -1, "kind": kind, "seconds": time.perf_counter() - t0})
    for r in range(repeats):
        for i in range(len(KINDS)):
            kind = KINDS[(i + r) % len(KINDS)]
            if mode == "load":
                C.reset_state(state)
            elif kind != "raw" and rank == 0:
                C.remove_uri(uris[kind], opts)
            dist.barrier()
            if rank == 0:
                watch.start()
            monitor = tierckpt.Monitor()
            cpu0, t0 = os.times(), time.perf_counter()
            once(kind, monitor)
            cpu1 = os.times()
            dist.barrier()
            seconds = time.perf_counter() - t0
            server = watch.stop() if rank == 0 else None
            if mode == "load" and kind != "raw":
                C.check_state(state, gib)
            out.append({"repeat": r, "kind": kind, "seconds": seconds, "server": server, "lib": kind,
                        "cpu": cpu1.user - cpu0.user + cpu1.system - cpu0.system, "monitor": dict(monitor.seconds)})
    return out


def _spread(xs: list[float]) -> str:
    return f"{C.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def _rows(world: int, mode: str, per_rank: list[list[dict[str, Any]]], nbytes: int) -> tuple[list[Any], list[Any]]:
    """One row of the timing table and one per kind of the server table, for one rank count and mode."""
    timed = [i for i, rec in enumerate(per_rank[0]) if rec["repeat"] >= 0]
    secs = {k: [per_rank[0][i]["seconds"] for i in timed if per_rank[0][i]["kind"] == k] for k in KINDS}
    med = {k: C.median(v) for k, v in secs.items()}
    what = f"save, {world} ranks, Shard(0)" if mode == "save" else f"load, {world} ranks, Shard(0) -> Shard(1)"
    first = {rec["kind"]: rec["seconds"] for rec in per_rank[0] if rec["repeat"] < 0}
    row = [what, *(_spread(secs[k]) for k in KINDS),
           " / ".join(f"{nbytes / med[k] / C.GiB:.3f}" for k in KINDS),
           f"**{med['raw'] / med['tierckpt']:.2f}**", f"{med['raw'] / med['dcp']:.2f}",
           f"**{med['dcp'] / med['tierckpt']:.2f}x**",
           " / ".join(f"{first[k]:.2f}" for k in KINDS) if first else "-"]
    server_rows = []
    for kind in KINDS:
        idx = [i for i in timed if per_rank[0][i]["kind"] == kind]
        watched = [per_rank[0][i]["server"] for i in idx]
        methods = sorted({m for w in watched for m in w["requests"]})
        counts = {m: C.median([w["requests"].get(m, 0) for w in watched]) for m in methods}
        requests = ", ".join(f"{m} {n:.0f}" for m, n in counts.items() if n)
        ranks_cpu = C.median([sum(rr[i]["cpu"] for rr in per_rank) for i in idx])
        daemons = C.median([sum(w["daemon_cpu"].values()) for w in watched])
        rgw = C.median([w["daemon_cpu"]["radosgw"] for w in watched])
        busy = C.median([w["busy"] for w in watched])
        server_rows.append([what, kind, requests, f"{ranks_cpu:.2f}", f"{daemons:.2f} ({rgw:.2f})",
                            f"{C.median(secs[kind]):.2f}", f"{busy:.0%}"])
    phases = C.phases([[rec for rec in rr if rec["repeat"] >= 0] for rr in per_rank])
    return row, server_rows, f"{what}: {phases}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (default 1)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8], help="rank counts (default: 2 8)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per measurement; medians reported (default 3)")
    ap.add_argument("--out", default=None, help="Markdown file to write the section into (default: print only)")
    args = ap.parse_args()

    import boto3
    import s3fs
    from radosgw import RadosGateway

    nbytes = C.state_bytes(args.gib)
    rows, server_rows, phases = [], [], []
    started = time.perf_counter()
    with RadosGateway() as gateway:
        endpoint = gateway.endpoint
        print(f"radosgw at {endpoint} after {time.perf_counter() - started:.0f}s; checkpoint "
              f"{C.fmt_bytes(nbytes)}", flush=True)
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}.items():
            os.environ[name] = value
        os.environ.pop("AWS_SESSION_TOKEN", None)
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        watch = ServerWatch(str(Path(gateway.folder) / "log" / "client.rgw.log"),
                            {Path(p.args[0]).name: p.pid for p in gateway._processes})
        for world in args.ranks:
            uris = {"tierckpt": f"s3://{BUCKET}/tier-{world}", "dcp": f"s3://{BUCKET}/dcp-{world}"}
            t = time.perf_counter()
            for mode in ("save", "load"):
                per_rank = C.run_ranks(rgw_ranks, world, mode, args.gib, args.repeats, uris, opts, watch)
                row, more, phase = _rows(world, mode, per_rank, nbytes)
                rows.append(row)
                phases.append(phase)
                server_rows += more
                print(C.md_table(["", "kind", "requests", "ranks CPU s", "daemons CPU s (radosgw)", "s", "busy"],
                                 more), phase, sep="\n", flush=True)
            print(f"{world} ranks done ({time.perf_counter() - t:.0f}s)", flush=True)
    table = C.md_table(["operation", "tierckpt s", "DCP s", "raw s3fs PUT/GET s", "GiB/s tierckpt / DCP / raw",
                        "tierckpt / raw (raw s / tierckpt s)", "DCP / raw", "tierckpt vs DCP",
                        "first load in the processes, tierckpt / DCP / raw s"], rows)
    server = C.md_table(["operation", "client", "requests logged by radosgw (median)", "CPU s, all ranks",
                         "CPU s, Ceph daemons (radosgw)", "seconds", "machine's cores busy"], server_rows)
    body = "\n\n".join([
        "## S3 on a real server (Ceph radosgw): tierckpt vs DCP vs raw s3fs (`benchmarks/bench_rgw.py`)",
        C.machine_info(tempfile.gettempdir()),  # the OSD's file is in the cluster's temporary folder
        f"State: {C.N_TENSORS} fp32 matrices of {C.shapes(args.gib)['w0']} = {C.fmt_bytes(nbytes)}, saved `Shard(0)` "
        f"and loaded `Shard(1)` on the same gloo ranks; {args.repeats} rounds, each timing tierckpt, DCP and the raw "
        f"client in turn (rotating order); seconds are rank 0's barrier to barrier: median (min-max); every library "
        f"load checked element by element. Before the timed loads each kind loads once, untimed (last column): "
        f"tierckpt's first load in a process measures the store and the group (its route probe, once per process). "
        f"The server: Ceph 16.2 radosgw (beast) over one OSD on BlueStore in a sparse file on this machine's disk, "
        f"one monitor, all on 127.0.0.1 (tests/radosgw.py), so the server's own CPU shares the machine with the "
        f"ranks. DCP: `FsspecWriter(sync_files=False)` / `FsspecReader` (s3fs {s3fs.__version__}); tierckpt: "
        f"`cache=False`; raw: each rank one s3fs `pipe_file` / `cat_file` of its share of the bytes.",
        table,
        "Per timed operation (medians over the rounds): the requests radosgw logged, the CPU seconds of the ranks "
        "and of the Ceph daemons, and the share of the machine's cores busy meanwhile (everything running on it).",
        server,
        "tierckpt's phases (`Monitor`; median over the rounds of the slowest rank): "
        + "; ".join(f"{p}" for p in phases) + ".",
    ])
    C.publish(body, args.out, "bench_rgw")


if __name__ == "__main__":
    main()
