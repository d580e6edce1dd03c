"""Shared helpers of the benchmarks: rank spawning, sharded state, I/O counters, baselines, Markdown.

Both benchmarks build the same state (``N`` fp32 matrices, saved ``Shard(0)`` on 2 ranks, loaded
``Shard(1)`` on 3 ranks), fill it with a pattern that can be recomputed for any slice (so every load
is checked element by element without holding the full tensors), and time each library between two
barriers on rank 0.
"""

from __future__ import annotations

import datetime
import os
import platform
import queue
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks

import torch  # noqa: E402

MiB = 2**20
GiB = 2**30
COLS = 4096
BASE_ROWS = 8192  # 8 x (8192, 4096) fp32 = 1 GiB
N_TENSORS = 8


# -- processes ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=900),
        )
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 3600, daemon: bool = True) -> list[Any]:
    """Spawn ``world`` processes in one gloo group, run ``fn(rank, world, *args)``; per-rank results.

    ``daemon=False`` lets the ranks start processes of their own (ByteCheckpoint starts a server); they
    are killed here all the same if they do not finish."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, results), daemon=daemon) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(errors) < world:
            wait = 10 if errors else max(1.0, deadline - time.monotonic())
            try:
                rank, status, value = results.get(timeout=wait)
            except queue.Empty:
                break
            (out if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors or len(out) < world:
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RuntimeError(f"{fn.__name__} failed on {world} ranks (finished: {sorted(out)})\n{detail}")
    return [out[r] for r in range(world)]


# -- state ----------------------------------------------------------------------------------------
def shapes(gib: float) -> dict[str, tuple[int, int]]:
    """``N_TENSORS`` fp32 matrices of ``(rows, 4096)`` totalling about ``gib`` GiB."""
    rows = max(6, int(round(BASE_ROWS * gib)))
    return {f"w{i}": (rows, COLS) for i in range(N_TENSORS)}


def state_bytes(gib: float) -> int:
    return sum(r * c * 4 for r, c in shapes(gib).values())


def pattern(i: int, rows: slice, cols: slice) -> torch.Tensor:
    """Tensor ``i``'s values at ``[rows, cols]``: small integers, exact in fp32, unique per position mod 65521."""
    r = torch.arange(rows.start, rows.stop, dtype=torch.int64)[:, None] * 4099
    c = torch.arange(cols.start, cols.stop, dtype=torch.int64)[None, :] + i * 7919
    return ((r + c) % 65521).to(torch.float32)


def make_state(gib: float, shard_dim: int, fill: bool) -> dict[str, Any]:
    """This rank's DTensors, ``Shard(shard_dim)`` over all ranks of the default group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    placements = [Shard(shard_dim)]
    state = {}
    for i, (name, shape) in enumerate(shapes(gib).items()):
        local_shape, off = compute_local_shape_and_global_offset(shape, mesh, placements)
        rows, cols = slice(off[0], off[0] + local_shape[0]), slice(off[1], off[1] + local_shape[1])
        local = pattern(i, rows, cols) if fill else torch.full(tuple(local_shape), -1.0)
        stride = (shape[1], 1)
        state[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)
    return state


def check_state(state: dict[str, Any], gib: float) -> None:
    """Every element of this rank's loaded shards equals the saved pattern."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for i, (name, shape) in enumerate(shapes(gib).items()):
        dt = state[name]
        local_shape, off = compute_local_shape_and_global_offset(shape, dt.device_mesh, dt.placements)
        rows, cols = slice(off[0], off[0] + local_shape[0]), slice(off[1], off[1] + local_shape[1])
        if not torch.equal(dt.to_local(), pattern(i, rows, cols)):
            raise AssertionError(f"{name}: loaded values differ from the saved ones")


def reset_state(state: dict[str, Any]) -> None:
    for dt in state.values():
        dt.to_local().fill_(-1.0)


# -- one library operation ------------------------------------------------------------------------
LIBS = ("tierckpt", "dcp")


def order(r: int) -> tuple[str, ...]:
    """Alternate which library goes first in each repeat."""
    return LIBS if r % 2 == 0 else LIBS[::-1]


def _dcp_io(uri: str, opts: dict[str, Any] | None, write: bool) -> Any:
    import torch.distributed.checkpoint as dcp

    if opts is None:
        return dcp.FileSystemWriter(uri, sync_files=True) if write else dcp.FileSystemReader(uri)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    # sync_files would make DCP call os.sync() (fsspec streams have no fileno); a completed S3 PUT is durable
    return FsspecWriter(uri, sync_files=False, **opts) if write else FsspecReader(uri, **opts)


def _direct(opts: dict[str, Any] | None) -> dict[str, Any] | None:
    """Remote stores straight, without tierckpt's node cache, so both libraries meet S3 itself."""
    return None if opts is None else {**opts, "cache": False}


def do_save(lib: str, uri: str, opts: dict[str, Any] | None, state: dict[str, Any], monitor: Any) -> None:
    import torch.distributed.checkpoint as dcp

    import tierckpt

    if lib == "tierckpt":
        tierckpt.save(uri, state, monitor=monitor, storage_options=_direct(opts))
    else:
        dcp.save(state, storage_writer=_dcp_io(uri, opts, write=True))


def do_load(lib: str, uri: str, opts: dict[str, Any] | None, state: dict[str, Any], monitor: Any) -> None:
    import torch.distributed.checkpoint as dcp

    import tierckpt

    if lib == "tierckpt":
        tierckpt.load(uri, state, monitor=monitor, storage_options=_direct(opts))
    else:
        dcp.load(state, storage_reader=_dcp_io(uri, opts, write=False))


def remove_uri(uri: str, opts: dict[str, Any] | None) -> None:
    if opts is None:
        rmtree(uri)
        os.makedirs(uri)
        os.sync()  # earlier dirty pages are not charged to the next save
    else:
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri, skip_instance_cache=True, **opts)
        if fs.exists(path):
            fs.rm(path, recursive=True)


def bench_ranks(
    rank: int, world: int, mode: str, gib: float, repeats: int, uris: dict[str, str],
    opts: dict[str, Any] | None = None, hook: Callable[[str], Any] | None = None, drop: bool = False,
) -> list[dict[str, Any]]:
    """Run on every rank: a tiny untimed warm-up of both libraries, then ``repeats`` timed saves
    (``Shard(0)``) or loads (``Shard(1)``) per library into/from ``uris[lib]``, alternating the order.

    Each record: rank 0's barrier-to-barrier seconds, this rank's ``/proc/self/io`` deltas, tierckpt's
    Monitor, and (rank 0) ``hook("start")`` / ``hook("stop")`` results around the timed region.
    """
    import torch.distributed as dist

    import tierckpt

    warm = make_state(1e-4, shard_dim=0 if mode == "save" else 1, fill=True)
    for lib in LIBS:
        uri = uris[lib].rstrip("/") + "-warmup"
        if rank == 0:
            remove_uri(uri, opts)
        dist.barrier()
        do_save(lib, uri, opts, warm, None)
        dist.barrier()
        do_load(lib, uri, opts, warm, None)
        dist.barrier()
    state = make_state(gib, shard_dim=0 if mode == "save" else 1, fill=(mode == "save"))
    out = []
    for r in range(repeats):
        for lib in order(r):
            uri = uris[lib]
            dropped = None
            if mode == "save":
                if rank == 0:
                    remove_uri(uri, opts)
            else:
                reset_state(state)
                if rank == 0 and drop:
                    dropped = drop_caches()
            if rank == 0 and hook:
                hook("start")
            dist.barrier()
            mon = tierckpt.Monitor()
            io0 = proc_io()
            t0 = time.perf_counter()
            (do_save if mode == "save" else do_load)(lib, uri, opts, state, mon)
            dist.barrier()
            dt = time.perf_counter() - t0
            io1 = proc_io()
            hooked = hook("stop") if rank == 0 and hook else None
            if mode == "load":
                check_state(state, gib)
            out.append({"repeat": r, "lib": lib, "seconds": dt, "dropped": dropped, "hook": hooked,
                        **{k: io1[k] - io0[k] for k in ("rchar", "wchar", "read_bytes", "write_bytes")},
                        "monitor": dict(mon.seconds), "counters": dict(mon.counters)})
    return out


def by_lib(per_rank: list[list[dict[str, Any]]], key: str, reduce: str = "rank0") -> dict[str, list[Any]]:
    """Per library, one value per repeat: rank 0's (timings, hooks) or the sum over ranks (bytes)."""
    out: dict[str, list[Any]] = {lib: [] for lib in LIBS}
    for i, rec in enumerate(per_rank[0]):
        value = sum(rr[i][key] for rr in per_rank) if reduce == "sum" else rec[key]
        out[rec["lib"]].append(value)
    return out


def counter_sum(per_rank: list[list[dict[str, Any]]], name: str) -> list[float]:
    """tierckpt Monitor counter ``name`` summed over ranks, one value per repeat."""
    return [sum(rr[i]["counters"].get(name, 0) for rr in per_rank)
            for i, rec in enumerate(per_rank[0]) if rec["lib"] == "tierckpt"]


def phases(per_rank: list[list[dict[str, Any]]]) -> str:
    """tierckpt Monitor phases: median over repeats of the max over ranks."""
    acc: dict[str, list[float]] = {}
    for i, rec in enumerate(per_rank[0]):
        if rec["lib"] != "tierckpt":
            continue
        for name in set().union(*(rr[i]["monitor"] for rr in per_rank)):
            acc.setdefault(name, []).append(max(rr[i]["monitor"].get(name, 0.0) for rr in per_rank))
    return ", ".join(f"{k} {median(v):.2f}s" for k, v in sorted(acc.items(), key=lambda kv: -median(kv[1])))


def runs(seconds: Sequence[float]) -> str:
    return " / ".join(f"{s:.2f}" for s in seconds)


# -- measurements ---------------------------------------------------------------------------------
def proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (all threads, including finished ones)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def drop_caches() -> bool:
    """Write back and drop the page cache; False when not permitted (not root, read-only /proc/sys)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict_files(root: str) -> None:
    """Write back the files under ``root`` and evict their pages from the page cache
    (``posix_fadvise(DONTNEED)``): a cold read of a checkpoint without :func:`drop_caches`' side effect,
    every other file (the interpreter's, torch's libraries) cold too, which makes fresh processes slow to start."""
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def dd_write(path: str, nbytes: int) -> float:
    """Seconds for ``dd if=/dev/zero of=path bs=4M count=N conv=fsync``."""
    count = max(1, nbytes // (4 * MiB))
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    return time.perf_counter() - t0


def dd_read(path: str) -> float:
    """Seconds for ``dd if=path of=/dev/null bs=4M`` (cold when the cache was dropped before)."""
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M"], check=True, capture_output=True)
    return time.perf_counter() - t0


def memcpy_seconds(gib: float, ranks: int = 2) -> float:
    """Seconds to ``clone()`` one rank's share of the state (single thread)."""
    per_rank = [torch.empty(r // ranks, c).fill_(1.0) for r, c in shapes(gib).values()]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    copies = [t.clone() for t in per_rank]
    dt = time.perf_counter() - t0
    del copies
    return dt


# -- reporting ------------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n:.0f} B"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_info(path_for_df: str) -> str:
    mem_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    while not os.path.exists(path_for_df) and os.path.dirname(path_for_df) != path_for_df:
        path_for_df = os.path.dirname(path_for_df)  # a scratch directory already removed: the disk it was on
    df = subprocess.run(["df", "-h", path_for_df], capture_output=True, text=True).stdout.strip().splitlines()
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    return "\n".join([
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- nproc: {os.cpu_count()} ({cpu}); RAM: {mem_kib / 2**20:.1f} GiB; "
        f"Python {platform.python_version()}, torch {torch.__version__}",
        f"- disk (`df -h {path_for_df}`): `{df[-1] if df else '?'}`",
    ])


DOC_TITLE = "# tierckpt benchmarks\n\nProduced by the scripts in `benchmarks/` (see `benchmarks/README.md`).\n"


def write_section(path: str, name: str, body: str) -> None:
    """Replace the text between ``<!-- name -->`` and ``<!-- /name -->`` in ``path`` (append if absent)."""
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    block = f"{start}\n{body.rstrip()}\n{end}\n"
    text = open(path).read() if os.path.exists(path) else DOC_TITLE
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + block.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def publish(body: str, out: str | None, section: str) -> None:
    """Print a benchmark's Markdown and write it between its markers in ``out`` (when given)."""
    print()
    print(body)
    if out:
        write_section(out, section, body)
        print(f"\nwritten to {out}")


def scratch_dir(prefix: str, under: str | None = None) -> str:
    """A fresh temp dir (under ``under``, else on the disk holding ``$TMPDIR``); removed by the caller."""
    return tempfile.mkdtemp(prefix=prefix, dir=under)


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def plan_log() -> list[str]:
    """The load plans the loader logs in this process, as they come (its INFO line per load)."""
    import logging

    plans: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("load plan"):
                plans.append(message)

    log = logging.getLogger("tierckpt")
    log.addHandler(Keep(logging.INFO))
    log.setLevel(logging.INFO)
    return plans
