"""The wire of peer recovery: tierckpt's lanes (``tierckpt.loading.peer_lanes``) against one connection per pair.

    python benchmarks/bench_wire.py [--mib 256] [--repeats 5] [--lanes 1,2,4] [--chunk-mib 8,32]
                                    [--out docs/benchmarks.md]

Peer recovery streams a lost node's bytes from its peer's memory tier in chunks (``tierckpt.loading.peer_stream``),
so a load from peer memory is never faster than the wire between the two ranks. Two processes move
``--mib`` MiB from rank 0's memory into rank 1's (touched beforehand, as a restarted model's initialised
weights are) ``--repeats`` times for each count of ``--lanes`` and each chunk size: 1 lane is the load's
own gloo group (one connection), more are the lanes of the side group tierckpt makes
(``tierckpt.node.memory.sidegroup``, its ``LANES`` set to the count; one device, connection and I/O thread per
lane). Rank 1's medians, barrier to barrier, after one
untimed round that connects the lanes. It measures the transport alone; on a 2-core machine the transfer is
CPU-bound and every count moves about the same.
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

TAG = 0x5EED
"""The tag chunks take on the group itself (one lane), as peer recovery's do."""


def wire_ranks(rank: int, world: int, nbytes: int, lanes: list[int], chunk_bytes: list[int], repeats: int) -> dict[tuple[int, int], list[float]]:
    """Rank 0 sends ``nbytes`` to rank 1 over each count of lanes with each chunk size; rank 1's seconds per
    repeat, per ``(lanes, chunk bytes)``."""
    import torch.distributed as dist

    from tierckpt.loading import peer_lanes
    from tierckpt.comm import Comm
    from tierckpt.node.memory import sidegroup

    buffer = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    out: dict[tuple[int, int], list[float]] = {}
    for count in lanes:
        # a side group of ``count`` lanes (and the replicators' device after them)
        peer_lanes.LANES = sidegroup.LANES = sidegroup.REPLICA_DEVICE = count
        sidegroup.DEVICES = count + 1
        sidegroup._made.clear()
        for chunk in chunk_bytes:
            seconds = []
            for _ in range(repeats + 1):
                way = peer_lanes.lanes_of(Comm(), TAG) if count > 1 else peer_lanes.Lanes(Comm(), None, 1, TAG)
                dist.barrier()
                start = time.perf_counter()
                parts = [buffer[at : at + chunk] for at in range(0, nbytes, chunk)]
                works = [way.send(part, 1) if rank == 0 else way.recv(part, 0) for part in parts]
                for work in works:
                    work.wait()
                way.close()
                dist.barrier()
                seconds.append(time.perf_counter() - start)
            if rank == 1:
                if not bool((buffer == 1).all()):
                    raise AssertionError(f"the received bytes differ from the sent ones ({count} lanes, {chunk} B chunks)")
                buffer.zero_()
            out[count, chunk] = seconds[1:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lanes", default="1,2,4", help="connections per pair, comma-separated (1: the group itself)")
    ap.add_argument("--chunk-mib", default="8,32", help="chunk sizes in MiB, comma-separated")
    ap.add_argument("--out", default=None, help="Markdown file to write the section into (default: print only)")
    args = ap.parse_args()
    nbytes = args.mib << 20
    lanes = [int(n) for n in args.lanes.split(",")]
    chunks = [int(n) << 20 for n in args.chunk_mib.split(",")]
    seconds = C.run_ranks(wire_ranks, 2, nbytes, lanes, chunks, args.repeats)[1]
    rows: list[list[Any]] = []
    for (count, chunk), runs in seconds.items():
        median = C.median(runs)
        rows.append([count, chunk >> 20, f"{median * 1e3:.0f}", f"{nbytes / median / 1e9:.2f}", C.runs(runs)])
    body = "\n\n".join([
        "## The wire of peer recovery: lanes per pair (`benchmarks/bench_wire.py`)",
        C.machine_info(os.getcwd()),
        f"{args.mib} MiB from rank 0 to rank 1 on loopback over 1 lane (the group's own connection) or tierckpt's "
        f"side group's lanes (`tierckpt.loading.peer_lanes`); rank 1's medians of {args.repeats} after one untimed round.",
        C.md_table(["lanes (connections per pair)", "chunk MiB", "ms", "GB/s", "all runs, s"], rows),
    ])
    C.publish(body, args.out, "bench_wire")


if __name__ == "__main__":
    main()
