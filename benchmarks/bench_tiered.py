"""Saving to S3 through the node cache: when training may resume, when the checkpoint is durable on
the remote, and loads from a warm node cache against cold S3 — beside DCP writing to S3 through fsspec.

    python benchmarks/bench_tiered.py [--gib 0.25] [--repeats 2] [--out docs/benchmarks.md]

Two gloo ranks save ``--gib`` GiB of fp32 DTensors (``Shard(0)``) to a moto S3 server on loopback:

* tierckpt ``async_save`` through the node cache: *resume* = the call returns (snapshot taken);
  *local* = ``handle.wait()`` (committed in the node cache; a synchronous ``save`` to S3 returns only
  once remote-durable);
  *remote-durable* = ``handle.wait_durable()`` (every object uploaded, ``COMMIT`` last);
* DCP ``async_save`` with fsspec's S3 writer: *resume* = the call returns; *remote-durable* = its future.

Then two ranks load it resharded (``Shard(1)``): tierckpt from the warm node cache, tierckpt straight
from S3 (``cache=False``), and DCP from S3. moto moves ~0.03 GiB/s on 2 cores, hence the small default.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

BUCKET = "tierckpt-bench-tiered"


def tiered_ranks(rank: int, world: int, gib: float, repeats: int, endpoint: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    import tierckpt

    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "region": "us-east-1"}
    fs_opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    state = C.make_state(gib, 0, fill=True)
    out: dict[str, list[float]] = {k: [] for k in ("t_resume", "t_local", "t_remote", "d_resume", "d_remote")}
    for i in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        handle = tierckpt.async_save(f"s3://{BUCKET}/tier-{i}", state, storage_options=opts)
        out["t_resume"].append(time.perf_counter() - start)
        handle.wait()
        out["t_local"].append(time.perf_counter() - start)
        handle.wait_durable()
        dist.barrier()
        out["t_remote"].append(time.perf_counter() - start)

        dist.barrier()
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=FsspecWriter(f"s3://{BUCKET}/dcp-{i}", sync_files=False, **fs_opts))
        out["d_resume"].append(time.perf_counter() - start)
        future.result()
        dist.barrier()
        out["d_remote"].append(time.perf_counter() - start)

    loads: dict[str, float] = {}
    for name, uri, options in (
        ("tierckpt, warm node cache", f"s3://{BUCKET}/tier-0", opts),
        ("tierckpt, S3 (cache=False)", f"s3://{BUCKET}/tier-0", {**opts, "cache": False}),
        ("dcp, S3", f"s3://{BUCKET}/dcp-0", fs_opts),
    ):
        targets = C.make_state(gib, 1, fill=False)
        dist.barrier()
        start = time.perf_counter()
        if name.startswith("dcp"):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            dcp.load(targets, storage_reader=FsspecReader(uri, **options))
        else:
            tierckpt.load(uri, targets, storage_options=options)
        dist.barrier()
        loads[name] = time.perf_counter() - start
        C.check_state(targets, gib)
    return {"saves": out, "loads": loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="Markdown file to write the section into (default: print only)")
    args = ap.parse_args()

    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = C.free_port()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ["TIERCKPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="tierckpt-bench-cache-")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        result = C.run_ranks(tiered_ranks, 2, args.gib, args.repeats, endpoint)[0]
    finally:
        server.stop()
        C.rmtree(os.environ["TIERCKPT_CACHE_DIR"])
    s, loads = result["saves"], result["loads"]
    med = {k: C.median(v) for k, v in s.items()}
    save_rows = [
        ["tierckpt async_save via node cache", f"{med['t_resume']:.2f}", f"{med['t_local']:.2f}", f"{med['t_remote']:.2f}"],
        ["DCP async_save, fsspec S3 writer", f"{med['d_resume']:.2f}", "-", f"{med['d_remote']:.2f}"],
    ]
    load_rows = [[name, f"{sec:.2f}", f"{loads['dcp, S3'] / sec:.2f}x"] for name, sec in loads.items()]
    text = (
        f"`python benchmarks/bench_tiered.py --gib {args.gib} --repeats {args.repeats}`; "
        f"{C.fmt_bytes(C.state_bytes(args.gib))} on 2 ranks, moto S3 on loopback; seconds on rank 0 (median).\n\n"
        + C.md_table(["save", "training may resume", "committed in node cache", "durable on S3"], save_rows)
        + "\n\nLoad, resharded to `Shard(1)` on 2 ranks:\n\n"
        + C.md_table(["load", "seconds", "speedup vs DCP from S3"], load_rows) + "\n"
    )
    print(text)
    if args.out:
        C.write_section(args.out, "bench_tiered", "## S3 through the node cache (`benchmarks/bench_tiered.py`)\n\n" + text)


if __name__ == "__main__":
    main()
