"""Asynchronous save of CUDA state: the stall against the pinned device-to-host bandwidth, beside DCP.

    python benchmarks/bench_gpu.py [--gib 4] [--repeats 3] [--out FILE]

One process, one GPU. The state is ``--gib`` GiB of CUDA tensors (16 bf16 matrices and as many fp32
ones). In the same run:

* pinned D2H: one warm ``copy_(non_blocking=True)`` of the whole state into preallocated pinned host
  memory, then a synchronize: the physical floor of any snapshot from the GPU;
* pageable D2H: the same into ordinary host memory (what a plain ``.cpu()`` costs);
* tierckpt ``async_save``: stall (call to return: training may go on) and committed (``wait()``),
  median of ``--repeats`` after one warm-up that allocates the pinned staging buffer;
* DCP ``async_save`` with its pinned ``DefaultStager`` (the stager's default options): its call returns
  before the copy is done, so its stall is measured until ``staging_completion`` (when training may
  change the state), committed at ``upload_completion``.

Bytes are checked after a load back. Writes go to ``--dir`` (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch


def make_state(gib: float) -> dict[str, torch.Tensor]:
    per = int(gib * (1 << 30)) // 32
    side_bf16 = int((per // 2) ** 0.5)
    side_fp32 = int((per // 4) ** 0.5)
    gen = torch.Generator(device="cuda").manual_seed(0)
    state = {}
    for i in range(16):
        state[f"bf16.{i}"] = torch.randn(side_bf16, side_bf16, device="cuda", generator=gen).to(torch.bfloat16)
        state[f"fp32.{i}"] = torch.randn(side_fp32, side_fp32, device="cuda", generator=gen)
    return state


def d2h_seconds(state: dict[str, torch.Tensor], pinned: bool) -> float:
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in state.items()}
    for k, v in state.items():
        host[k].copy_(v, non_blocking=pinned)  # first touch
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for k, v in state.items():
            host[k].copy_(v, non_blocking=pinned)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tierckpt_saves(state: dict[str, torch.Tensor], root: str, repeats: int) -> tuple[list[float], list[float]]:
    import tierckpt

    tierckpt.async_save(os.path.join(root, "t-warm"), state).wait()
    stalls, totals = [], []
    for i in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        handle = tierckpt.async_save(os.path.join(root, f"t-{i}"), state)
        stalls.append(time.perf_counter() - start)
        handle.wait()
        totals.append(time.perf_counter() - start)
    return stalls, totals


def dcp_saves(
    state: dict[str, torch.Tensor], root: str, repeats: int
) -> tuple[list[float], list[float], list[float]]:
    """DCP's call returns before its background staging copy is done; the state may be changed only
    after ``staging_completion``: that is the stall comparable to tierckpt's (which returns after its copy)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager

    def once(path: str) -> tuple[float, float, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        response = dcp.async_save(state, checkpoint_id=path, async_stager=DefaultStager())
        returned = time.perf_counter() - start
        response.staging_completion.result()  # only now may training change the state
        staged = time.perf_counter() - start
        response.upload_completion.result()
        return returned, staged, time.perf_counter() - start

    once(os.path.join(root, "d-warm"))
    runs = [once(os.path.join(root, f"d-{i}")) for i in range(repeats)]
    return [r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]


def check_roundtrip(state: dict[str, torch.Tensor], root: str) -> None:
    import tierckpt

    target = {k: torch.empty_like(v) for k, v in state.items()}
    tierckpt.load(os.path.join(root, "t-0"), target)
    bad = [k for k in state if not torch.equal(state[k], target[k])]
    if bad:
        raise SystemExit(f"tierckpt load of the GPU save differs in {bad}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None, help="write the markdown table here (default: stdout only)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device")
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    root = tempfile.mkdtemp(prefix="tierckpt-bench-gpu-", dir=args.dir)
    try:
        state = make_state(args.gib)
        nbytes = sum(t.nbytes for t in state.values())
        pinned, pageable = d2h_seconds(state, True), d2h_seconds(state, False)
        t_stall, t_total = tierckpt_saves(state, root, args.repeats)
        check_roundtrip(state, root)
        d_return, d_stall, d_total = dcp_saves(state, root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    med = statistics.median
    gib = nbytes / (1 << 30)
    rows = [
        ("pinned D2H copy (floor)", pinned, "", ""),
        ("pageable D2H copy", pageable, "", ""),
        ("tierckpt async_save", med(t_stall), med(t_total), f"{med(t_stall) / pinned:.2f}x"),
        ("DCP async_save, pinned DefaultStager: until staged", med(d_stall), med(d_total), f"{med(d_stall) / pinned:.2f}x"),
    ]
    lines = [
        f"Device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; state {gib:.2f} GiB "
        f"({len(state)} tensors, bf16 and fp32); medians of {args.repeats} after a warm-up.",
        "",
        "| | stall (s) | committed (s) | stall / pinned D2H |",
        "|---|---|---|---|",
    ]
    for name, stall, total, ratio in rows:
        total_s = f"{total:.3f}" if total != "" else ""
        lines.append(f"| {name} | {stall:.3f} ({gib / stall:.1f} GiB/s) | {total_s} | {ratio} |")
    lines.append("")
    lines.append(f"DCP's call itself returned after {med(d_return):.3f} s, before its staging copy was done "
                 "(the state may not be changed until `staging_completion`).")
    lines.append(f"tierckpt stall / DCP stall: {med(t_stall) / med(d_stall):.2f}x "
                 f"(runs: tierckpt {', '.join(f'{s:.3f}' for s in t_stall)}; DCP {', '.join(f'{s:.3f}' for s in d_stall)})")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
