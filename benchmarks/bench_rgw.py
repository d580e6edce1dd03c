"""tierckpt vs DCP (fsspec/s3fs) vs raw s3fs PUT/GET of the same bytes, on a real S3 server: Ceph radosgw.

    python benchmarks/bench_rgw.py [--gib 1] [--ranks 2 8] [--repeats 2] [--out docs/benchmarks.md]

Starts a one-monitor, one-OSD Ceph cluster with radosgw on 127.0.0.1 (``tests/radosgw.py``; Debian's
``radosgw ceph-mon ceph-osd``), then for each rank count, in one run:

* save: ``Shard(0)`` on N gloo ranks; tierckpt (``cache=False``: S3 itself) and DCP (``FsspecWriter``);
* load: the same checkpoint resharded to ``Shard(1)`` on N ranks, checked element by element;
* raw: every rank PUTs its share of the same bytes as one object with s3fs (``pipe_file``: multipart for
  large objects) and GETs it back (``cat_file``), barrier to barrier, at the same concurrency (one stream
  per rank): what the server gives a client that does nothing but move the bytes.

Ratios are raw seconds / library seconds (1.0: the library moves bytes as fast as a bare client).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import _common as C  # noqa: E402

BUCKET = "bench"


def raw_ranks(rank: int, world: int, gib: float, repeats: int, endpoint: str) -> list[dict[str, Any]]:
    """Run on every rank: ``repeats`` timed PUTs then GETs of this rank's share of ``gib`` GiB, one object each."""
    import s3fs
    import torch.distributed as dist

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing", skip_instance_cache=True)
    share = C.state_bytes(gib) // world
    data = os.urandom(share)
    path = f"{BUCKET}/raw/rank-{rank:05d}"
    fs.pipe_file(f"{path}-warmup", b"x" * 1024)  # the client's first request (credentials, connection)
    out = []
    for r in range(repeats):
        for op in ("put", "get"):
            dist.barrier()
            t0 = time.perf_counter()
            if op == "put":
                fs.pipe_file(path, data)
            else:
                got = fs.cat_file(path)
            dist.barrier()
            dt = time.perf_counter() - t0
            if op == "get" and got != data:
                raise RuntimeError(f"rank {rank}: the raw GET returned other bytes than its PUT")
            out.append({"repeat": r, "op": op, "seconds": dt})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (default 1)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8], help="rank counts (default: 2 8)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per measurement; medians reported (default 2)")
    ap.add_argument("--out", default=None, help="Markdown file to write the section into (default: print only)")
    args = ap.parse_args()

    import boto3
    from radosgw import RadosGateway

    nbytes = C.state_bytes(args.gib)
    rows = []
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
        for world in args.ranks:
            uris = {"tierckpt": f"s3://{BUCKET}/tier-{world}", "dcp": f"s3://{BUCKET}/dcp-{world}"}
            t = time.perf_counter()
            saves = C.run_ranks(C.bench_ranks, world, "save", args.gib, args.repeats, uris, opts)
            loads = C.run_ranks(C.bench_ranks, world, "load", args.gib, args.repeats, uris, opts)
            raw = C.run_ranks(raw_ranks, world, args.gib, args.repeats, endpoint)
            print(f"{world} ranks done ({time.perf_counter() - t:.0f}s)", flush=True)
            save_s, load_s = C.by_lib(saves, "seconds"), C.by_lib(loads, "seconds")
            for op, lib_s in (("put", save_s), ("get", load_s)):
                raw_s = C.median([rec["seconds"] for rec in raw[0] if rec["op"] == op])
                tier, dcp = C.median(lib_s["tierckpt"]), C.median(lib_s["dcp"])
                what = f"save, {world} ranks, Shard(0)" if op == "put" else f"load, {world} ranks, Shard(0) -> Shard(1)"
                rows.append([what, f"{tier:.2f}", f"{dcp:.2f}", f"{raw_s:.2f}",
                             f"{nbytes / tier / C.GiB:.3f} / {nbytes / dcp / C.GiB:.3f} / {nbytes / raw_s / C.GiB:.3f}",
                             f"**{raw_s / tier:.2f}**", f"{raw_s / dcp:.2f}", f"**{dcp / tier:.2f}x**"])
    table = C.md_table(["operation", "tierckpt s", "DCP s", "raw s3fs PUT/GET s",
                        "GiB/s tierckpt / DCP / raw", "tierckpt / raw (raw s / tierckpt s)", "DCP / raw",
                        "tierckpt vs DCP"], rows)
    import s3fs

    body = "\n\n".join([
        "## S3 on a real server (Ceph radosgw): tierckpt vs DCP vs raw s3fs (`benchmarks/bench_rgw.py`)",
        C.machine_info(os.getcwd()),
        f"State: {C.N_TENSORS} fp32 matrices of {C.shapes(args.gib)['w0']} = {C.fmt_bytes(nbytes)}, saved `Shard(0)` "
        f"and loaded `Shard(1)` on the same gloo ranks, {args.repeats} repeats, medians of rank 0's "
        f"barrier-to-barrier seconds; every load checked element by element. The server: Ceph 16.2 radosgw "
        f"(beast) over one OSD on BlueStore in a sparse file on this machine's disk, one monitor, all on "
        f"127.0.0.1 (tests/radosgw.py), so the server's own CPU shares the machine with the ranks. DCP: "
        f"`FsspecWriter(sync_files=False)` / `FsspecReader` (s3fs {s3fs.__version__}); tierckpt: `cache=False`; "
        f"raw: each rank one s3fs `pipe_file` / `cat_file` of its share of the same bytes.",
        table,
    ])
    C.publish(body, args.out, "bench_rgw")


if __name__ == "__main__":
    main()
