"""The wire of peer recovery: one gloo pair's throughput, and what several connections per pair would give.

    python benchmarks/bench_wire.py [--mib 256] [--repeats 5] [--lanes 1,2,4] [--out docs/benchmarks.md]

Peer recovery streams a lost node's bytes from its peer's memory tier over the group's gloo pair (8 MiB
chunks, ``isend``/``irecv``), so a load from peer memory is never faster than that pair. Torch's gloo group
runs a send tagged ``t`` on its context ``t mod devices`` (``GLOO_SOCKET_IFNAME=lo,lo`` makes two devices on
loopback), each device with its own I/O thread: a group with several devices and chunks posted on alternating
tags moves them over several connections at once. Two processes move ``--mib`` MiB from rank 0's memory into
rank 1's (touched beforehand, as a restarted model's initialised weights are) ``--repeats`` times for each
count of ``--lanes``; rank 1's medians, barrier to barrier. It measures the transport alone, not tierckpt:
whether lanes are worth building into peer recovery is what it is for (on a 2-core machine the transfer is
CPU-bound and every count moves about the same).
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

CHUNK_BYTES = 8 << 20
"""The chunk peer recovery streams (``tierckpt.peer_stream``)."""


def wire_ranks(rank: int, world: int, nbytes: int, lanes: int, repeats: int) -> list[float]:
    """Rank 0 sends ``nbytes`` to rank 1 in chunks posted on ``lanes`` tags; rank 1's seconds per repeat."""
    import torch.distributed as dist

    buffer = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    seconds = []
    for _ in range(repeats + 1):  # the first round connects the lanes' pairs
        dist.barrier()
        start = time.perf_counter()
        works = []
        for i, at in enumerate(range(0, nbytes, CHUNK_BYTES)):
            chunk = buffer[at : at + CHUNK_BYTES]
            works.append(dist.isend(chunk, 1, tag=i % lanes) if rank == 0 else dist.irecv(chunk, 0, tag=i % lanes))
        for work in works:
            work.wait()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    if rank == 1 and not bool((buffer == 1).all()):
        raise AssertionError("the received bytes differ from the sent ones")
    return seconds[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lanes", default="1,2,4", help="devices of the group (connections per pair), comma-separated")
    ap.add_argument("--out", default=None, help="Markdown file to write the section into (default: print only)")
    args = ap.parse_args()
    nbytes = args.mib << 20
    rows: list[list[Any]] = []
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        for lanes in (int(n) for n in args.lanes.split(",")):
            os.environ["GLOO_SOCKET_IFNAME"] = ",".join(["lo"] * lanes)  # the spawned ranks inherit it
            seconds = C.run_ranks(wire_ranks, 2, nbytes, lanes, args.repeats)[1]
            median = C.median(seconds)
            rows.append([lanes, f"{median * 1e3:.0f}", f"{nbytes / median / 1e9:.2f}", C.runs(seconds)])
    finally:
        if before is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = before
    body = "\n\n".join([
        "## The wire of peer recovery: gloo connections per pair (`benchmarks/bench_wire.py`)",
        C.machine_info(os.getcwd()),
        f"{args.mib} MiB from rank 0 to rank 1 in {CHUNK_BYTES >> 20} MiB chunks on loopback, the chunks' tags "
        f"alternating over the group's devices; rank 1's medians of {args.repeats} after one untimed round.",
        C.md_table(["devices (connections per pair)", "ms", "GB/s", "all runs, s"], rows),
    ])
    C.publish(body, args.out, "bench_wire")


if __name__ == "__main__":
    main()
