"""tierckpt vs DCP (through fsspec/s3fs) on S3 (a local moto server), counted at the HTTP layer.

    python benchmarks/bench_s3.py [--gib 0.25] [--repeats 3] [--out docs/benchmarks.md]

moto's ``ThreadedMotoServer`` (127.0.0.1, in this process) sits behind a counting reverse proxy (aiohttp,
in its own process, on 127.0.0.1) that forwards every request unchanged and counts requests, request
body bytes and response body bytes per HTTP method, plus the size of every GET response. Both libraries
talk only to the proxy, so they are measured identically.

* save: ``Shard(0)`` on 2 gloo ranks; tierckpt to ``s3://bucket/tier``, DCP with ``FsspecWriter`` to
  ``s3://bucket/dcp`` (``sync_files=False``: fsspec streams have no ``fileno`` so DCP would fall back to
  ``os.sync()``; a finished S3 PUT is durable).
* load: resharded to ``Shard(1)`` on 3 gloo ranks (``FsspecReader`` for DCP), checked element by element.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

BUCKET = "bench"
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect",
       "proxy-authorization", "proxy-authenticate", "content-length"}


# -- counting reverse proxy (own process) ---------------------------------------------------------
def _proxy_main(port: int, upstream: str, ready: Any) -> None:
    import asyncio

    import aiohttp
    import yarl
    from aiohttp import web
    from multidict import CIMultiDict

    stats: dict[str, Any] = {}

    def record(method: str, req: int, resp: int) -> None:
        s = stats.setdefault(method, {"requests": 0, "request_bytes": 0, "response_bytes": 0, "sizes": []})
        s["requests"] += 1
        s["request_bytes"] += req
        s["response_bytes"] += resp
        if method == "GET":
            s["sizes"].append(resp)

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/__proxy__/stats":
            return web.json_response(stats)
        if request.path == "/__proxy__/reset":
            stats.clear()
            return web.json_response({})
        body = await request.read()
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in HOP)
        url = yarl.URL(upstream + request.raw_path, encoded=True)
        async with session.request(request.method, url, headers=headers, data=body or None,
                                   allow_redirects=False, skip_auto_headers=("Content-Type", "User-Agent",
                                                                             "Accept-Encoding", "Accept")) as up:
            data = await up.read()
            out = CIMultiDict((k, v) for k, v in up.headers.items() if k.lower() not in HOP)
            record(request.method, len(body), len(data))
            if request.method == "HEAD":
                if "Content-Length" in up.headers:  # the object's size, not a body: pass it through
                    out["Content-Length"] = up.headers["Content-Length"]
                return web.Response(status=up.status, headers=out)
            return web.Response(status=up.status, headers=out, body=data)

    async def main() -> None:
        nonlocal session
        session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=600),
                                        connector=aiohttp.TCPConnector(limit=64))
        app = web.Application(client_max_size=2**31)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()

    session: Any = None
    asyncio.run(main())


def _control(proxy: str, what: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{proxy}/__proxy__/{what}", timeout=60) as r:
        return json.loads(r.read())


class ProxyHook:
    """Called by rank 0 around each timed operation: reset the counts, then read them."""

    def __init__(self, proxy: str) -> None:
        self.proxy = proxy

    def __call__(self, when: str) -> Any:
        return _control(self.proxy, "reset" if when == "start" else "stats")


def _env(endpoint: str) -> None:
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent/aws-config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials", "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }.items():
        os.environ[k] = v
    os.environ.pop("TIERCKPT_S3_ENDPOINT_URL", None)


def _summary(recs: list[dict[str, Any]], method: str, field: str) -> list[float]:
    return [rec.get(method, {}).get(field, 0) for rec in recs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.25,
                    help="checkpoint size in GiB (default 0.25: moto on a 2-core machine is slow; see the doc)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement; medians reported (default 3)")
    ap.add_argument("--out", default=None, help="Markdown file to write the section into (default: print only)")
    args = ap.parse_args()

    import multiprocessing as mp

    import boto3
    from moto.server import ThreadedMotoServer

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    moto_port, proxy_port = C.free_port(), C.free_port()
    upstream, proxy = f"http://127.0.0.1:{moto_port}", f"http://127.0.0.1:{proxy_port}"
    _env(proxy)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=moto_port, verbose=False)
    server.start()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proxy_proc = ctx.Process(target=_proxy_main, args=(proxy_port, upstream, ready), daemon=True)
    proxy_proc.start()
    if not ready.wait(60):
        raise RuntimeError("counting proxy did not start")
    nbytes = C.state_bytes(args.gib)
    print(f"checkpoint: {C.N_TENSORS} x {C.shapes(args.gib)['w0']} fp32 = {C.fmt_bytes(nbytes)}; "
          f"moto {upstream} behind proxy {proxy}")
    try:
        boto3.client("s3", endpoint_url=proxy, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        opts = {"endpoint_url": proxy, "key": "testing", "secret": "testing"}
        uris = {"tierckpt": f"s3://{BUCKET}/tier", "dcp": f"s3://{BUCKET}/dcp"}
        hook = ProxyHook(proxy)
        t = time.perf_counter()
        saves = C.run_ranks(C.bench_ranks, 2, "save", args.gib, args.repeats, uris, opts, hook)
        print(f"saves done ({time.perf_counter() - t:.0f}s)")
        t = time.perf_counter()
        loads = C.run_ranks(C.bench_ranks, 3, "load", args.gib, args.repeats, uris, opts, hook)
        print(f"loads done ({time.perf_counter() - t:.0f}s)")
    finally:
        proxy_proc.kill()
        proxy_proc.join()
        server.stop()

    save_s, load_s = C.by_lib(saves, "seconds"), C.by_lib(loads, "seconds")
    save_http, load_http = C.by_lib(saves, "hook"), C.by_lib(loads, "hook")
    ms = {k: C.median(v) for k, v in save_s.items()}
    ml = {k: C.median(v) for k, v in load_s.items()}

    def gbps(s: float) -> str:
        return f"{nbytes / s / C.GiB:.3f}"

    time_rows = [
        ["save, 2 ranks, Shard(0)", f"{ms['tierckpt']:.2f}", f"{ms['dcp']:.2f}", f"**{ms['dcp'] / ms['tierckpt']:.2f}x**",
         f"{gbps(ms['tierckpt'])} / {gbps(ms['dcp'])}", f"{C.runs(save_s['tierckpt'])} — {C.runs(save_s['dcp'])}"],
        ["load 2 -> 3 ranks, Shard(0) -> Shard(1)", f"{ml['tierckpt']:.2f}", f"{ml['dcp']:.2f}",
         f"**{ml['dcp'] / ml['tierckpt']:.2f}x**", f"{gbps(ml['tierckpt'])} / {gbps(ml['dcp'])}",
         f"{C.runs(load_s['tierckpt'])} — {C.runs(load_s['dcp'])}"],
    ]
    times = C.md_table(["operation", "tierckpt s (median)", "DCP s (median)", "speedup (DCP s / tierckpt s)",
                        "GiB/s tierckpt / DCP", "all runs, s (tierckpt — DCP)"], time_rows)

    load_rows = []
    for lib in C.LIBS:
        recs = load_http[lib]
        gets = _summary(recs, "GET", "requests")
        got = _summary(recs, "GET", "response_bytes")
        sizes = [C.median(r["GET"]["sizes"]) if r.get("GET", {}).get("sizes") else 0 for r in recs]
        others = [sum(v["requests"] for m, v in r.items() if m != "GET") for r in recs]
        load_rows.append([
            lib, f"{ml[lib]:.2f}", f"{C.median(gets):.0f}", C.fmt_bytes(C.median(got)),
            f"**{C.median(got) / nbytes:.3f}**", C.fmt_bytes(C.median(sizes)), f"{C.median(others):.0f}",
        ])
    loads_md = C.md_table(["library", "load s", "GET requests", "bytes requested (GET bodies)",
                           "requested / needed", "median GET size", "other requests (HEAD, LIST...)"], load_rows)

    save_rows = []
    for lib in C.LIBS:
        recs = save_http[lib]
        methods = sorted({m for r in recs for m in r})
        per = ", ".join(f"{m} {C.median(_summary(recs, m, 'requests')):.0f}" for m in methods)
        sent = C.median([sum(v["request_bytes"] for v in r.values()) for r in recs])
        save_rows.append([lib, f"{ms[lib]:.2f}", per, C.fmt_bytes(sent), f"{sent / nbytes:.3f}"])
    saves_md = C.md_table(["library", "save s", "requests by method (median)", "bytes uploaded", "uploaded / tensor bytes"],
                          save_rows)

    tl, td = ml["tierckpt"], ml["dcp"]
    t_rec = load_http["tierckpt"]
    t_amp = C.median(_summary(t_rec, "GET", "response_bytes")) / nbytes
    t_med = C.median([C.median(r["GET"]["sizes"]) if r.get("GET", {}).get("sizes") else 0 for r in t_rec])
    checks = C.md_table(["target (tierckpt load)", "measured", "met?"], [
        [">= 2x DCP load throughput", f"{td / tl:.2f}x", "yes" if td / tl >= 2 else "**no**"],
        ["group bytes requested <= 1.05x needed", f"{t_amp:.3f}x", "yes" if t_amp <= 1.05 else "**no**"],
        ["median GET request >= 1 MiB", C.fmt_bytes(t_med), "yes" if t_med >= C.MiB else "**no**"],
    ])
    body = "\n\n".join([
        "## S3 (moto): tierckpt vs DCP via fsspec (`benchmarks/bench_s3.py`)",
        C.machine_info(os.getcwd()),
        f"State: {C.N_TENSORS} fp32 matrices of {C.shapes(args.gib)['w0']} = {C.fmt_bytes(nbytes)} (\"needed\" below: "
        f"every byte once, as the 3 loading ranks together need the whole checkpoint). Saved `Shard(0)` on 2 gloo "
        f"ranks, loaded `Shard(1)` on 3, {args.repeats} repeats (order alternates; untimed tiny warm-up first), "
        f"medians of rank 0's barrier-to-barrier seconds, every load checked element by element. S3 is moto "
        f"{__import__('moto').__version__} (in-memory, in the benchmark's main process) behind a counting aiohttp "
        f"reverse proxy (own process); all on 127.0.0.1 of a {os.cpu_count()}-core machine, so absolute throughput "
        f"is bounded by moto's and the proxy's Python CPU time, not by a network. DCP: "
        f"`FsspecWriter(sync_files=False)` / `FsspecReader` (s3fs {__import__('s3fs').__version__}, default options); "
        f"tierckpt: `storage_options` with the proxy's `endpoint_url`.",
        times,
        "Load, counted at the HTTP layer (median over repeats; whole group):",
        loads_md,
        "Save, counted at the HTTP layer:",
        saves_md,
        f"tierckpt phases (median, max over ranks): save: {C.phases(saves)}; load: {C.phases(loads)}. "
        f"tierckpt Monitor, load (sum over ranks): bytes_read {C.fmt_bytes(C.median(C.counter_sum(loads, 'bytes_read')))}, "
        f"requests {C.median(C.counter_sum(loads, 'requests')):.0f}, "
        f"bytes_exchanged {C.fmt_bytes(C.median(C.counter_sum(loads, 'bytes_exchanged')))}.",
        checks,
    ])
    C.publish(body, args.out, "bench_s3")


if __name__ == "__main__":
    main()
