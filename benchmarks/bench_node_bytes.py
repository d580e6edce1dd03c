"""The node tiers' bytes per checkpoint: what lands on the node, and what is read back on its way down.

    python benchmarks/bench_node_bytes.py [--mib 256] [--out FILE]
    (or: python benchmarks/bench_memory.py --parts bytes)

One process saves ``--mib`` MiB of fp32 tensors synchronously (``tierckpt.save``, which returns once the
checkpoint is where its URI points) to a remote directory reached through fsspec (``local://``, so the
node tiers apply), in three chains: memory tier + node disk cache, memory tier alone, node disk cache
alone; and to a plain path (the local backend) with the memory tier. For each, per byte of the
checkpoint's data files:

* **write syscalls** and **read syscalls**: the process's ``wchar`` / ``rchar`` deltas (``/proc/self/io``):
  every byte passed to ``write``/``read`` (tmpfs, disk cache, the remote directory), whatever the code.
  Copies through ``mmap`` do not show here; kernel-side copies (``copy_file_range``: the write-down
  into a local file or the node disk cache) count once as read and once as written.
* **CPU ms**: the process's CPU time (every thread) for the save, per 256 MiB of data.
* **per tier** (when the engine counts them: ``tierckpt.node.ledger``): bytes landed in the memory
  tier and in the node disk cache, and bytes read back out of each to go down.

The memory tier's directory is under ``/dev/shm`` (tmpfs); the node cache and the remote on local disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

import torch

CHAINS = (("memory + node disk", True, True, "local://"), ("memory tier only", True, False, "local://"),
          ("node disk only", False, True, "local://"), ("memory tier only, plain path", True, False, ""))
"""(name, memory tier, node cache, scheme): a plain path is the local backend (the node cache never applies)."""


def proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def ledger() -> dict[str, int] | None:
    try:
        from tierckpt.node import ledger as led
    except ImportError:  # a tree without the engine's ledger
        return None
    return led.snapshot()


def cpu_s() -> float:
    """CPU seconds of this process so far, every thread."""
    t = os.times()
    return t.user + t.system


def measure(mib: int, memory: bool, cache: bool, scheme: str, base: str) -> dict[str, Any]:
    import tierckpt

    remote = os.path.join(base, "remote")
    os.environ["TIERCKPT_MEMORY_DIR"] = os.path.join(f"/dev/shm/tierckpt-bench-bytes-{os.getpid()}", "mem")
    os.environ["TIERCKPT_CACHE_DIR"] = os.path.join(base, "cache")
    n = mib * 2**20 // 4 // 8
    state = {f"w{i}": torch.arange(n, dtype=torch.float32) + i for i in range(8)}
    uri = f"{scheme}{remote}/step-1"
    io0, led0, cpu0 = proc_io(), ledger(), cpu_s()
    tierckpt.save(uri, state, storage_options={"memory": memory, "cache": cache})
    io1, led1, cpu1 = proc_io(), ledger(), cpu_s()
    data = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(remote) for f in fs if "/data" in d + "/")
    out: dict[str, Any] = {"data_bytes": data, "wchar": io1["wchar"] - io0["wchar"], "rchar": io1["rchar"] - io0["rchar"],
                           "cpu_s": cpu1 - cpu0}
    if led0 is not None and led1 is not None:
        out.update({k: led1[k] - led0[k] for k in led1})
    return out


def run(mib: int) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    for name, memory, cache, scheme in CHAINS:
        base = tempfile.mkdtemp(prefix="tierckpt-bench-bytes-")
        try:
            rows.append((name, measure(mib, memory, cache, scheme, base)))
        finally:
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(f"/dev/shm/tierckpt-bench-bytes-{os.getpid()}", ignore_errors=True)
    return rows


def table(mib: int, rows: list[tuple[str, dict[str, Any]]]) -> str:
    def per(r: dict[str, Any], k: str) -> str:
        return f"{r[k] / r['data_bytes']:.2f}×" if k in r and r["data_bytes"] else "n/a"

    lines = [
        f"Node bytes per checkpoint byte (`tierckpt.save` of {mib} MiB, synchronous, to `local://` or a plain path; "
        "CPU: the process's CPU milliseconds, every thread, per 256 MiB of data):",
        "",
        "| chain | write syscalls | read syscalls | memory tier landed | memory tier read back | node disk landed "
        "| node disk read back | CPU ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(f"| {name} | {per(r, 'wchar')} | {per(r, 'rchar')} | {per(r, 'memory.landed')} | "
                     f"{per(r, 'memory.read_back')} | {per(r, 'node-disk.landed')} | {per(r, 'node-disk.read_back')} | "
                     f"{r['cpu_s'] * 1000 * (256 << 20) / max(r['data_bytes'], 1):.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    body = table(args.mib, run(args.mib))
    if args.out:
        with open(args.out, "a") as f:
            f.write(body + "\n")
    print(body)


if __name__ == "__main__":
    sys.exit(main())
