"""The plan phase of a real resharded load at N ranks on this node (one ``torchrun`` per step).

16 fp32 matrices of ``--size`` x ``--size`` saved ``Shard(0)`` over the ranks, loaded ``Shard(1)`` three
times; rank 0 prints, per load, the barrier-to-barrier seconds and the slowest rank's ``plan`` and
``metadata`` phase seconds (:class:`tierckpt.Monitor`). Run it with the tree to measure on ``PYTHONPATH``::

    PYTHONPATH=src torchrun --standalone --nproc_per_node 8 benchmarks/bench_plan_load.py /tmp/ckpt save
    PYTHONPATH=src torchrun --standalone --nproc_per_node 8 benchmarks/bench_plan_load.py /tmp/ckpt load
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402

import tierckpt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("step", choices=["save", "load"])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full = {f"layer{m}.weight": torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(m))
            for m in range(16)}
    if args.step == "save":
        tierckpt.save(args.path, {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()})
    else:
        mine = []
        for _ in range(args.repeats):
            targets = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}
            monitor = tierckpt.Monitor()
            dist.barrier()
            start = time.perf_counter()
            tierckpt.load(args.path, targets, monitor=monitor)
            dist.barrier()
            mine.append((time.perf_counter() - start, monitor.seconds.get("plan", 0.0), monitor.seconds.get("metadata", 0.0)))
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        if dist.get_rank() == 0:
            for k in range(args.repeats):
                print(json.dumps({"load_s": round(every[0][k][0], 3), "plan_s_max": round(max(r[k][1] for r in every), 4),
                                  "metadata_s_max": round(max(r[k][2] for r in every), 4)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
