"""Blocking time of ``async_save`` into the node memory tier vs a memcpy of the state, side by side.

One process, a CPU state of ``--mib`` MiB (fp32 matrices). For each way, the best and median of
``--reps`` saves (after one warm-up save, which also prepares the memory tier's spare file):

* ``memcpy``: ``copy_`` of every tensor into a preallocated, warm buffer (the floor).
* ``tier (mapped)``: ``async_save`` with the memory tier on: the snapshot goes straight into the
  tier's file (its pages mapped and touched in the background after the previous save).
* ``staging -> path``: ``async_save`` to a local path without the memory tier (staging buffer copy).

The memory tier lives in a fresh directory under ``/dev/shm`` (removed at the end). Run:
``python benchmarks/bench_memory_stall.py --mib 256 --reps 5``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import tierckpt
from tierckpt.node.memory import MemoryConfig


def _state(mib: int) -> dict[str, torch.Tensor]:
    n = 8
    per = mib * 2**20 // 4 // n
    return {f"w{i}": torch.randn(per) for i in range(n)}


def _times(fn: Callable[[], None], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    state = _state(args.mib)
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="tierckpt-bench-")
    disk = tempfile.mkdtemp(prefix="tierckpt-bench-")
    try:
        buffers = {k: torch.empty_like(v) for k, v in state.items()}

        def memcpy() -> None:
            for k, v in state.items():
                buffers[k].copy_(v)

        config = MemoryConfig(directory=f"{shm}/tier", budget_bytes=8 * args.mib * 2**20, exit_wait_s=0)
        handles: list[tierckpt.SaveHandle] = []

        def save(uri: str, options: dict) -> Callable[[], None]:
            def run() -> None:
                handles.append(tierckpt.async_save(uri, state, storage_options=options))
            return run

        def settle() -> None:  # outside the timed part: the save commits and is written down, the spare is made
            while handles:
                handles.pop().wait_durable()
            time.sleep(0.5 + args.mib / 512)

        rows = []
        for name, fn in (("memcpy", memcpy), ("tier (mapped)", save(f"{disk}/tier", {"memory": config})),
                         ("staging -> path", save(f"{disk}/plain", {"memory": False}))):
            fn()
            settle()
            times = []
            for _ in range(args.reps):
                times += _times(fn, 1)
                settle()
            rows.append((name, min(times), statistics.median(times)))
        floor = rows[0][1]
        print(f"async_save blocking time, {args.mib} MiB CPU state, best / median of {args.reps}:")
        for name, best, median in rows:
            print(f"  {name:<16} {best * 1e3:8.1f} ms  {median * 1e3:8.1f} ms  {best / floor:5.2f}x memcpy")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
