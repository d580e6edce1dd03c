"""Where the time of a local save goes: tierckpt vs ``dcp.save``, phase by phase, on a shared machine.

    python benchmarks/profile_save.py [--n 16] [--side 4096] [--cols SIDE] [--repeats 5] [--profile] [--floor]

The state of the comparison: ``--n`` fp32 DTensors of ``--side`` rows and ``--cols`` columns (default
``--side``: squares; 16 x 4096^2, 64 MiB
each, 1 GiB in all), ``Shard(0)`` on 2 gloo ranks; both saves are durable (tierckpt: commit, data,
metadata and directories fsynced; DCP: ``FileSystemWriter(sync_files=True)``, its default). Each save
goes to a fresh directory, removed and ``os.sync``-ed before (untimed) — or with ``--between nosync``
removed without the sync (the previous save's writeback may still run), or with ``--between reuse``
saved over the previous checkpoint in place (DCP truncates and rewrites its files; tierckpt writes a
new generation and removes the previous one in the background after the call returns — the script
waits for that removal and ``os.sync``-s, untimed, and reports its seconds; versions that removed it
inside the call pay it in the timed save). The order of the libraries alternates per repeat. With
``--floor``, the device's floor for the same bytes is timed
in the same processes too: each rank writes its shards' bytes to one file with plain ``os.write`` calls,
``fsync``-s it and its directory (``floor``: what any buffered writer pays, with no format, no checksum,
no metadata), and the same through an 8 MiB page-aligned buffer with ``O_DIRECT`` (``floor-direct``:
the page cache bypassed, for reference).

Wall-clock ratios on a machine shared with other work swing from run to run, so beside the seconds it
reports what depends less on the neighbours: each rank's CPU seconds (all threads, ``os.times``),
tierckpt's ``Monitor`` phases (wall seconds of each step, max over ranks), and with ``--profile`` the
top functions of a ``cProfile`` of rank 0's calling thread (DCP writes in the calling thread; tierckpt
writes on its I/O loop, which the phases cover). Prints a Markdown report; writes nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

LIBS = ("tierckpt", "dcp")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _sys() -> float:
    return os.times().system


def _discards(path: str) -> tuple[int, int]:
    """``(bytes discarded, ms spent discarding)`` so far by the block device holding ``path``
    (``/proc/diskstats``; the whole device, so other jobs' discards count too; ``(0, 0)`` if unknown)."""
    dev = os.stat(path).st_dev
    want = {(os.major(dev), os.minor(dev))}
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/../dev") as f:  # a partition: its disk
            major, minor = f.read().split(":")
            want.add((int(major), int(minor)))
    except OSError:
        pass
    try:
        with open("/proc/diskstats") as f:
            rows = [line.split() for line in f]
    except OSError:
        return 0, 0
    for row in rows:
        if (int(row[0]), int(row[1])) in want and len(row) >= 18:
            return int(row[16]) * 512, int(row[17])
    return 0, 0


def _state(rank: int, world: int, n: int, side: int, cols: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh("cpu", list(range(world)))
    state = {}
    for i in range(n):
        local = torch.randn(side // world, cols, generator=torch.Generator().manual_seed(i * world + rank))
        state[f"t{i}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((side, cols)),
                                            stride=(cols, 1))
    return state


def _top(profile: cProfile.Profile, limit: int = 12) -> list[tuple[str, float, float]]:
    """``(function, own seconds, cumulative seconds)`` of the functions with the most own time."""
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = []
    for (file, line, name), (_, _, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append((f"{os.path.basename(file)}:{line} {name}", own, cum))
    return sorted(rows, key=lambda r: -r[1])[:limit]


def _after_save(lib: str, between: str) -> float | None:
    """Rank 0, untimed, after a save: wait for tierckpt's background removal of the superseded
    generations (``--between reuse``; its seconds since the save returned, ``None`` when this
    version of tierckpt removes them inside the call), then ``os.sync`` so that neither library's next
    save pays for the other's freed blocks."""
    if lib != "tierckpt" or between != "reuse":
        return None
    try:
        from tierckpt.saving import cleanup
    except ImportError:
        return None
    started = time.perf_counter()
    cleanup.wait_pending()
    os.sync()
    return time.perf_counter() - started


FLOOR_DIRECT_BUFFER = 8 << 20


def _save_floor(lib: str, directory: str, rank: int, state: dict[str, Any]) -> None:
    """The device floor: this rank's shard bytes written to one file, then ``fsync`` of it and of
    ``directory`` (buffered for ``floor``; ``O_DIRECT`` through a page-aligned buffer for ``floor-direct``)."""
    import mmap

    import torch

    direct = lib == "floor-direct"
    path = os.path.join(directory, f"rank{rank}")
    os.makedirs(directory, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    bounce = mmap.mmap(-1, FLOOR_DIRECT_BUFFER) if direct else None
    try:
        for value in state.values():
            data = memoryview(value.to_local().contiguous().reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(data), FLOOR_DIRECT_BUFFER if direct else len(data)):
                piece = data[start : start + (FLOOR_DIRECT_BUFFER if direct else len(data))]
                if bounce is not None:  # the shard sizes here are multiples of the block size
                    bounce[: len(piece)] = piece
                    piece = memoryview(bounce)[: len(piece)]
                while piece:
                    piece = piece[os.write(fd, piece) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def ranks(
    rank: int, world: int, n: int, side: int, cols: int, root: str, repeats: int, profile: bool, between: str,
    warmup: bool, libs: tuple[str, ...] = LIBS,
) -> list[dict[str, Any]]:
    """Run on every rank: warm-up, then ``repeats`` timed saves per library (order alternating)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tierckpt

    state = _state(rank, world, n, side, cols)
    small = {k: v for k, v in list(state.items())[:1]}
    for lib in LIBS if warmup else ():  # untimed: imports and first-call setup of each library
        uri = os.path.join(root, f"warmup-{lib}")
        if rank == 0:
            C.remove_uri(uri, None)
        dist.barrier()
        C.do_save(lib, uri, None, small, None)
        dist.barrier()
    out = []
    for r in range(repeats):
        for lib in libs if r % 2 == 0 else libs[::-1]:
            uri = os.path.join(root, lib)
            if rank == 0 and between == "fresh":
                C.remove_uri(uri, None)
            elif rank == 0 and between == "nosync":
                C.rmtree(uri)
            dist.barrier()
            monitor = tierckpt.Monitor()
            prof = cProfile.Profile() if profile and rank == 0 and r == repeats - 1 else None
            disc0 = _discards(root)
            cpu0, sys0, t0 = _cpu(), _sys(), time.perf_counter()
            if prof is not None:
                prof.enable()
            if lib == "tierckpt":
                tierckpt.save(uri, state, monitor=monitor)
            elif lib.startswith("floor"):
                _save_floor(lib, uri, rank, state)
            else:
                dcp.save(state, storage_writer=dcp.FileSystemWriter(uri, sync_files=True))
            if prof is not None:
                prof.disable()
            own = time.perf_counter() - t0
            dist.barrier()
            seconds = time.perf_counter() - t0
            cpu, system = _cpu() - cpu0, _sys() - sys0
            disc = [b - a for a, b in zip(disc0, _discards(root))]
            sweep = _after_save(lib, between) if rank == 0 else None
            dist.barrier()
            out.append({"repeat": r, "lib": lib, "seconds": seconds, "own_seconds": own, "cpu": cpu, "sys": system,
                        "phases": dict(monitor.seconds), "sweep": sweep, "discard": disc,
                        "top": _top(prof) if prof is not None else None})
    return out


def report(per_rank: list[list[dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = [f"State: {args.n} x ({args.side}, {args.cols}) fp32 `Shard(0)` on 2 ranks "
             f"({C.fmt_bytes(args.n * args.side * args.cols * 4)}); {args.repeats} repeats; between saves: "
             f"{args.between}; {'no ' if args.no_warmup else ''}warm-up; load average before: "
             f"{args.load_before}, after: {os.getloadavg()[0]:.2f} (1 min)."]
    rows = []
    for lib in args.libs:
        recs = [(i, rec) for i, rec in enumerate(per_rank[0]) if rec["lib"] == lib]
        wall = [rec["seconds"] for _, rec in recs]
        cpu = [sum(rr[i]["cpu"] for rr in per_rank) for i, _ in recs]
        rows.append([lib, f"{C.median(wall):.3f}", C.runs(wall), f"{C.median(cpu):.3f}", C.runs(cpu)])
        rows[-1].append(C.runs([sum(rr[i]["sys"] for rr in per_rank) for i, _ in recs]))
    lines.append(C.md_table(["library", "wall s (median)", "wall s, all runs", "CPU s, both ranks (median)", "CPU s, all runs",
                             "of which system (kernel) s, all runs"], rows))
    lines.append("Device discards during each timed save (whole disk, rank 0's view; other jobs' count too), "
                 "GiB / ms: " + "; ".join(f"r{rec['repeat']} {rec['lib']} {rec['discard'][0] / C.GiB:.2f} / "
                                          f"{rec['discard'][1]}" for rec in per_rank[0]))
    for lib in args.libs[:-1]:
        ratios = [d["seconds"] / t["seconds"] for d, t in zip(
            [rec for rec in per_rank[0] if rec["lib"] == "dcp"], [rec for rec in per_rank[0] if rec["lib"] == lib])]
        lines.append(f"DCP s / {lib} s per repeat: {' / '.join(f'{x:.2f}' for x in ratios)} "
                     f"(median {C.median(ratios):.2f}, min {min(ratios):.2f}, max {max(ratios):.2f})")
    phases: dict[str, list[float]] = {}
    for i, rec in enumerate(per_rank[0]):
        if rec["lib"] == "tierckpt":
            for name in set().union(*(rr[i]["phases"] for rr in per_rank)):
                phases.setdefault(name, []).append(max(rr[i]["phases"].get(name, 0.0) for rr in per_rank))
    sweeps = [rec["sweep"] for rec in per_rank[0] if rec["sweep"] is not None]
    if sweeps:
        lines.append(f"tierckpt's background removal of the previous generation, after the save returned, "
                     f"untimed (wait + `os.sync`): {C.runs(sweeps)} s")
    lines.append("tierckpt phases (max over ranks; median over repeats): " + ", ".join(
        f"{k} {C.median(v):.3f}s" for k, v in sorted(phases.items(), key=lambda kv: -C.median(kv[1]))))
    for rec in per_rank[0]:
        if rec["top"]:
            lines.append(f"cProfile, rank 0's calling thread, {rec['lib']} (own s / cumulative s):")
            lines.append(C.md_table(["function", "own s", "cum s"], [[f, f"{o:.3f}", f"{c:.3f}"] for f, o, c in rec["top"]]))
    return "\n\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16, help="number of square tensors (default 16)")
    ap.add_argument("--side", type=int, default=4096, help="rows of each fp32 tensor (default 4096)")
    ap.add_argument("--cols", type=int, default=None, help="columns of each tensor (default: --side, squares)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile rank 0's calling thread in the last repeat")
    ap.add_argument("--between", choices=("fresh", "nosync", "reuse"), default="fresh",
                    help="before each save: remove and sync (fresh), remove only (nosync), or nothing (reuse)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="time the first save of each library in the processes too (lazy imports, first plan)")
    ap.add_argument("--floor", action="store_true",
                    help="also time the device floor for the same bytes: plain writes + fsync, and with O_DIRECT")
    ap.add_argument("--tmp", default=None, help="scratch directory (default: a new dir under $TMPDIR)")
    args = ap.parse_args()
    args.cols = args.cols or args.side
    args.libs = ("tierckpt", *(("floor", "floor-direct") if args.floor else ()), "dcp")
    args.load_before = f"{os.getloadavg()[0]:.2f}"
    root = C.scratch_dir("tierckpt-profile-") if args.tmp is None else args.tmp
    os.makedirs(root, exist_ok=True)
    try:
        per_rank = C.run_ranks(ranks, 2, args.n, args.side, args.cols, root, args.repeats, args.profile, args.between,
                               not args.no_warmup, args.libs)
    finally:
        if args.tmp is None:
            C.rmtree(root)
    print(report(per_rank, args))


if __name__ == "__main__":
    main()
