"""The node memory tier: save stall, time to ``replicated``, recovery, training-loop overhead, memory.

    python benchmarks/bench_memory.py [--gib 0.5] [--repeats 3] [--steps 80] [--every 5] [--ranks-per-node 1]
                                      [--out docs/benchmarks.md]

Two simulated nodes (``TIERCKPT_NODE_ID`` and ``TIERCKPT_MEMORY_DIR`` per node, the memory directories under
``/dev/shm``), so each node's files are replicated to the other: one rank each, or ``--ranks-per-node`` in the
save and recovery parts (a lost node's ranks then receive their bytes over as many gloo pairs). The state is
``--gib`` GiB of fp32 DTensors (``Shard(0)``); the remote of tierckpt's saves is a directory on the local disk.

* **stall**: seconds from the call to its return, medians of ``--repeats`` after a warm-up, of a warm
  memcpy of the rank's state into preallocated memory (touched once before the first barrier, so no rank's
  page faults fall into another's timing), of ``tierckpt.async_save`` with the memory tier on,
  and of DCP's ``async_save`` to the local disk — each started by every rank at once after a barrier, in
  alternating order (the memcpy too: the ranks share the machine's memory bandwidth as their saves do); plus the seconds until tierckpt's save is committed in
  memory (``wait()``), ``replicated`` (``wait("replicated")``) and ``remote`` (written down; the next round
  starts after it), and until DCP's is saved.
* **recovery**: fresh processes load the checkpoint (every byte compared): after a crash, from node
  memory with the remote moved away; after a node loss (node 1's memory directory deleted; its rank comes
  back on an empty node), from node 0's memory and its replica of node 1's files, the remote still away; and,
  for comparison, the same checkpoint from the local disk (its files evicted from the page cache before
  each load) and from S3 (moto on loopback, node cache off); ``--repeats`` loads per case, each in fresh
  processes, their median and each one; the ``tierckpt.load`` call alone, and with the import its first use
  pays in a fresh process (the loader and the store clients), reported side by side.
* **training loop**: a small MLP + AdamW trained ``--steps`` steps on the 2 ranks (DDP), checkpointed every
  ``--every`` steps — no checkpoint, tierckpt ``async_save`` with the memory tier (every checkpoint
  written down, and only one in ``--persist-every``, the others ``persist=False``), DCP ``async_save`` —
  as the percentage by which the loop is slower than without checkpoints; and the CPU per checkpoint beyond
  the loop without checkpoints, counted until every save's background work is done (tierckpt's replica
  and write-down, DCP's write), each repeat's beside the median, and rank 0's by thread.
* **memory**: peak RSS above the state's and the bytes in the memory tier after the saves, per node.
* **bytes** (``--parts bytes``, not run by default): the node tiers' bytes per checkpoint byte, landed and
  read back per tier (:mod:`bench_node_bytes`, one process, ``--gib`` of state).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
from bench_async import _reset_peak, _rss_kib  # noqa: E402


def as_node(rank: int, memory_root: str, world: int = 2) -> None:
    """Place this process on its simulated node, memory tier on: 2 nodes, the first ``world // 2`` ranks on
    ``node0``, the others on ``node1``."""
    node = rank // max(1, world // 2)
    os.environ["TIERCKPT_NODE_ID"] = f"node{node}"
    os.environ["TIERCKPT_MEMORY_DIR"] = os.path.join(memory_root, f"node{node}")
    os.environ["TIERCKPT_MEMORY"] = "on"


def tier_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


# -- stall and time to replicated ----------------------------------------------------------------
def save_ranks(rank: int, world: int, gib: float, repeats: int, disk: str, memory_root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tierckpt

    as_node(rank, memory_root, world)
    state = C.make_state(gib, 0, fill=True)
    sources = [t.to_local() for t in state.values()]
    copies = [s.clone() for s in sources]  # the memcpy floor's destination, its pages touched before any timing
    base = _rss_kib("VmRSS")
    _reset_peak()
    out: dict[str, Any] = {"stall": {"tierckpt": [], "dcp": [], "memcpy": []}, "memory": [], "replicated": [],
                           "remote": [], "dcp_saved": []}
    for i in range(repeats + 1):  # the first round warms both libraries up
        for lib in ("memcpy", *C.order(i)) if i % 2 == 0 else (*C.order(i), "memcpy"):
            dist.barrier()
            start = time.perf_counter()
            if lib == "memcpy":
                for dst, src in zip(copies, sources):
                    dst.copy_(src)
                stall = time.perf_counter() - start
            elif lib == "tierckpt":
                handle = tierckpt.async_save(os.path.join(disk, "tierckpt"), state)
                stall = time.perf_counter() - start
                handle.wait()
                in_memory = time.perf_counter() - start
                handle.wait("replicated")
                replicated = time.perf_counter() - start
                handle.wait("remote")  # nothing of this save runs on into the next round's timing
                remote = time.perf_counter() - start
            else:
                future = dcp.async_save(state, checkpoint_id=os.path.join(disk, f"dcp-{i}"))
                stall = time.perf_counter() - start
                future.result()
                saved = time.perf_counter() - start
            if i == 0:
                continue
            out["stall"][lib].append(stall)
            if lib == "memcpy":
                continue
            if lib == "tierckpt":
                out["memory"].append(in_memory)
                out["replicated"].append(replicated)
                out["remote"].append(remote)
            else:
                out["dcp_saved"].append(saved)
    out["memcpy"] = C.median(out["stall"].pop("memcpy"))
    out["save_peak_kib"] = _rss_kib("VmHWM") - base
    out["tier_bytes"] = tier_bytes(os.environ["TIERCKPT_MEMORY_DIR"])
    out["state_bytes"] = sum(t.to_local().nbytes for t in state.values())
    dist.barrier()
    return out


# -- recovery ------------------------------------------------------------------------------------
def load_ranks(rank: int, world: int, gib: float, uri: str, opts: dict[str, Any] | None, memory_root: str | None) -> dict[str, Any]:
    import tierckpt

    if memory_root is not None:
        as_node(rank, memory_root, world)
    else:
        os.environ["TIERCKPT_MEMORY"] = "off"
    import torch.distributed as dist

    targets = C.make_state(gib, 0, fill=False)
    base = _rss_kib("VmRSS")
    _reset_peak()
    dist.barrier()  # the ranks start together: rank 0's time is the load's, not another rank's start-up
    # ``tierckpt.load`` is resolved lazily: its first use imports the loader and the store clients (pyarrow,
    # fsspec, aiohttp...). A restarted process pays that once, whatever it loads from; it is timed apart.
    start = time.perf_counter()
    load = tierckpt.load
    loaded = time.perf_counter()
    monitor = tierckpt.Monitor()
    cpu = time.process_time()  # every thread of this rank: the load's own, the I/O loop's, gloo's
    load(uri, targets, storage_options=opts, monitor=monitor)
    end = time.perf_counter()
    cpu = time.process_time() - cpu
    C.check_state(targets, gib)
    return {"seconds": end - loaded, "import_s": loaded - start, "peak_kib": _rss_kib("VmHWM") - base,
            "phases": {name: monitor.seconds.get(name, 0.0) for name in ("metadata", "read")}, "cpu_s": cpu}


def s3_save_ranks(rank: int, world: int, gib: float, uri: str, opts: dict[str, Any]) -> None:
    import tierckpt

    os.environ["TIERCKPT_MEMORY"] = "off"
    tierckpt.save(uri, C.make_state(gib, 0, fill=True), storage_options=opts)


def progress(what: str) -> None:
    print(f"bench_memory: {what} ...", file=sys.stderr, flush=True)


def recovery(gib: float, disk: str, memory_root: str, timeout_s: float, repeats: int = 1, world: int = 2) -> dict[str, Any]:
    """Seconds of each recovery (rank 0's wall time; the ranks start the load together), ``repeats`` loads
    per case in fresh processes: the median, and every load's time (one load spreads widely)."""
    uri = os.path.join(disk, "tierckpt")
    away = uri + ".away"
    result: dict[str, Any] = {}

    def repeated(name: str, before: Any, *args: Any) -> None:
        runs = []
        for _ in range(repeats):
            before()
            ranks = C.run_ranks(load_ranks, world, gib, *args, timeout_s=timeout_s)
            # CPU seconds of every rank of the load, over rank 0's wall time: how many cores the load kept busy
            runs.append({**ranks[0], "cores": sum(r["cpu_s"] for r in ranks) / ranks[0]["seconds"]})
        result[name] = {
            "seconds": statistics.median(r["seconds"] for r in runs), "samples": [r["seconds"] for r in runs],
            "cores": statistics.median(r["cores"] for r in runs),
            "import_s": statistics.median(r["import_s"] for r in runs), "peak_kib": max(r["peak_kib"] for r in runs),
            "phases": {name: statistics.median(r["phases"][name] for r in runs) for name in ("metadata", "read")},
        }

    os.rename(uri, away)  # the remote is down: only the memory tiers can serve the load
    try:
        repeated("memory (process crash)", lambda: None, uri, None, memory_root)
        # Node 1 is lost; its rank restarts on an empty node (its directory deleted again before each load).
        repeated("peer memory (node loss)", lambda: C.rmtree(os.path.join(memory_root, "node1")), uri, None, memory_root)
    finally:
        os.rename(away, uri)
    # Cold: the checkpoint's files evicted from the page cache before each load (not the whole cache: the
    # fresh processes would then start by reading torch's libraries from the disk).
    repeated("local disk (cold)", lambda: C.evict_files(uri), uri, None, None)
    if importlib.util.find_spec("moto") is None:
        progress("recovery from S3 skipped: moto is not installed (pip install 'moto[s3]' flask flask-cors)")
        return result
    from bench_matrix import BUCKET, MotoS3

    with MotoS3() as (_, s3_options):
        s3_uri, opts = f"s3://{BUCKET}/memory-bench", {**s3_options, "cache": False}
        C.run_ranks(s3_save_ranks, world, gib, s3_uri, opts, timeout_s=timeout_s)
        repeated("S3 (moto, node cache off)", lambda: None, s3_uri, opts, None)
    return result


# -- training-loop overhead ----------------------------------------------------------------------
MEMONLY = "memonly"
TRAIN_MODES = ["none", "tierckpt", MEMONLY, "dcp"]
EXITED = "(threads that exited)"


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process so far, summed by name (numbered pool threads as one
    name). A thread that exited is gone from here: :data:`EXITED` is what the process's total has beyond its
    live threads.

    Each thread's time is its CPU-time clock (``clock_gettime`` on the clock Linux derives from a thread id,
    nanoseconds), not ``/proc``'s ``stat``, whose clock ticks (10 ms) are truncated: for a dozen threads
    that made up to 0.1 s per reading, which the difference left in :data:`EXITED`."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            seconds = time.clock_gettime(_thread_clock(int(tid)))
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue  # exited meanwhile
        name = names.get(int(tid), comm).rstrip("0123456789_-")
        out[name] = out.get(name, 0.0) + seconds
    return out


def _thread_clock(tid: int) -> int:
    """The CPU-time clock of thread ``tid`` of this process (the kernel's ``MAKE_THREAD_CPUCLOCK(tid,
    CPUCLOCK_SCHED)``: what ``pthread_getcpuclockid`` returns, from a kernel thread id)."""
    return (~tid << 3) | 6


def train_ranks(rank: int, world: int, mode: str, steps: int, every: int, hidden: int, disk: str, memory_root: str,
                persist_every: int) -> dict[str, Any]:
    """Seconds for ``steps`` training steps, checkpointing every ``every`` steps as ``mode`` says (``memonly``:
    tierckpt writing down only every ``persist_every``-th checkpoint, the others ``persist=False``); and of
    them, the seconds inside the checkpoint calls (``stall``) and waiting for the previous save (``wait``);
    and the CPU seconds the rank's process spent, all its threads (``cpu``), from the loop's start until every
    checkpoint's background work is done (the last save waited for to its final level, then a barrier, so
    the peer's replica of it is in too): every checkpoint's whole cost, whichever library leaves more of it
    to after its call. On cores that training keeps busy, that work costs the loop about what it costs in CPU."""
    import resource
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tierckpt

    as_node(rank, memory_root)
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU()) for _ in range(4)]
    model = DDP(torch.nn.Sequential(*layers))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(32, hidden)
    pending: Any = None

    def step() -> None:
        optim.zero_grad()
        model(data).square().mean().backward()
        optim.step()

    ckpt_group = dist.new_group(backend="gloo")  # DCP's async collectives must not race DDP's on the default group

    def persisted(i: int) -> bool:
        return mode != MEMONLY or (i // every) % persist_every == 0

    def checkpoint(i: int) -> Any:
        state = {"model": model, "optim": optim}
        if mode in ("tierckpt", MEMONLY):
            persist = persisted(i)
            return tierckpt.async_save(os.path.join(disk, f"train-{mode}"), state, persist=persist)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optim)
        return dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(disk, f"train-dcp-{i}"),
                              process_group=ckpt_group)

    def finish(handle: Any) -> None:
        handle.wait() if mode != "dcp" else handle.result()

    def settle(handle: Any, persisted: bool) -> None:
        """Wait for all of a save's background work: DCP's write, tierckpt's replica and (persisted) write-down."""
        handle.result() if mode == "dcp" else handle.wait("remote" if persisted else "replicated")

    for _ in range(3):  # warm-up: allocator, autograd, optimizer state, and one checkpoint
        step()
    if mode != "none":
        finish(checkpoint(0))
    dist.barrier()
    stall = wait = 0.0
    usage, threads = resource.getrusage(resource.RUSAGE_SELF), thread_cpu()
    start = time.perf_counter()
    for i in range(1, steps + 1):
        step()
        if mode == "none" or i % every:
            continue
        t0 = time.perf_counter()
        if pending is not None:  # one save in flight at a time, as a training loop does
            finish(pending)
        t1 = time.perf_counter()
        pending = checkpoint(i)
        t2 = time.perf_counter()
        wait, stall = wait + t1 - t0, stall + t2 - t1
    seconds = time.perf_counter() - start
    if pending is not None:
        settle(pending, persisted(steps - steps % every))
    dist.barrier()
    end, threads_end = resource.getrusage(resource.RUSAGE_SELF), thread_cpu()
    cpu = end.ru_utime + end.ru_stime - usage.ru_utime - usage.ru_stime
    per_thread = {name: t - threads.get(name, 0.0) for name, t in threads_end.items()}
    per_thread[EXITED] = cpu - sum(per_thread.values())
    return {"seconds": seconds, "stall": stall, "wait": wait, "cpu": cpu, "threads": per_thread}


def training(args: argparse.Namespace, disk: str, memory_root: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {mode: [] for mode in TRAIN_MODES}
    for r in range(args.repeats):
        for mode in TRAIN_MODES if r % 2 == 0 else TRAIN_MODES[::-1]:
            out[mode].append(C.run_ranks(train_ranks, 2, mode, args.steps, args.every, args.hidden, disk, memory_root,
                                          args.persist_every, timeout_s=args.timeout)[0])
    return out


# -- report --------------------------------------------------------------------------------------
def save_section(saves: list[dict[str, Any]]) -> list[str]:
    """The save table and the memory-per-node table (empty when the save part did not run)."""
    if not saves:
        return []
    r0 = saves[0]
    med = C.median
    stall_t, stall_d = med(r0["stall"]["tierckpt"]), med(r0["stall"]["dcp"])
    rows = [
        ["memcpy of the rank's state (warm; every rank at once, as the saves)", f"{r0['memcpy']:.3f}", ""],
        ["tierckpt `async_save`, memory tier: stall", f"{stall_t:.3f}",
         f"{stall_t / r0['memcpy']:.2f}x memcpy (target <= 1.1x), {stall_t / stall_d:.2f}x DCP (target <= 0.5x)"],
        ["DCP `async_save` to local disk: stall", f"{stall_d:.3f}", ""],
        ["tierckpt: committed in node memory", f"{med(r0['memory']):.3f}", ""],
        ["tierckpt: `replicated` (peer node's memory)", f"{med(r0['replicated']):.3f}", ""],
        ["tierckpt: `remote` (written down to the local disk)", f"{med(r0['remote']):.3f}", ""],
        ["DCP: saved to local disk", f"{med(r0['dcp_saved']):.3f}", ""],
    ]
    per_node = max(1, len(saves) // 2)
    mem_rows = [[f"node{i // per_node}, rank {i}", C.fmt_bytes(s["state_bytes"]), C.fmt_bytes(s["save_peak_kib"] * 1024),
                 C.fmt_bytes(s["tier_bytes"])] for i, s in enumerate(saves)]
    return ["Save (seconds, rank 0):\n\n" + C.md_table(["what", "seconds", "ratio"], rows),
            "Memory per rank after the saves (the tier's bytes are its node's):\n\n"
            + C.md_table(["node, rank", "state", "peak RSS above the state", "memory tier"], mem_rows)]


def recovery_section(rec: dict[str, Any]) -> list[str]:
    """The recovery table (empty when the recovery part did not run): the load call alone, and with the
    imports of tierckpt's loader that a fresh process pays before its first load."""
    if not rec:
        return []
    mem = next(v["seconds"] for k, v in rec.items() if k.startswith("memory"))
    peer = next(v["seconds"] for k, v in rec.items() if k.startswith("peer"))
    rec_rows = []
    for name, value in rec.items():
        ratio = "" if name.startswith(("memory", "peer")) else (
            f"{value['seconds'] / mem:.1f}x the memory recovery, {value['seconds'] / peer:.1f}x the peer recovery")
        phases = value["phases"]
        rec_rows.append([name, f"{value['seconds']:.3f}", " / ".join(f"{x:.3f}" for x in value["samples"]),
                         f"{phases['metadata'] * 1e3:.0f} / {phases['read'] * 1e3:.0f}",
                         f"{value['cores']:.2f}", f"{value['import_s'] + value['seconds']:.3f}",
                         C.fmt_bytes(value["peak_kib"] * 1024), ratio])
    return ["Recovery in fresh processes, remote away for the memory cases (seconds, rank 0; \"load call\": "
            "`tierckpt.load` alone, the median of the loads listed beside it, ratios of these medians; \"with "
            "imports\": plus its first use's import of the loader and the store clients; the load's `metadata` and "
            "`read` phases, medians; \"cores busy\": the CPU seconds of every rank during the load call over its wall "
            "time, the median (at the machine's core count, the cores are the limit); peak RSS above the targets, "
            "the largest):\n\n"
            + C.md_table(["from", "load call", "each load", "metadata / read ms", "cores busy", "with imports", "peak RSS",
                          "ratio (load calls)"], rec_rows)]


def training_section(args: argparse.Namespace, train: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The training-loop table (empty when the training part did not run)."""
    if not train:
        return []
    med = C.median
    base = med([r["seconds"] for r in train["none"]])
    saves = args.steps // args.every
    base_cpu = med([r["cpu"] for r in train["none"]])
    names = {MEMONLY: f"tierckpt, 1 in {args.persist_every} written down"}

    def cpu_ms(mode: str) -> str:
        """The median CPU milliseconds per checkpoint, and each repeat's (against the median loop without)."""
        each = [1000 * (r["cpu"] - base_cpu) / saves for r in train[mode]]
        return f"{med(each):.0f} ({' / '.join(f'{x:.0f}' for x in each)})"

    rows = [[names.get(mode, mode), C.runs([r["seconds"] for r in train[mode]]), f"{100 * (med([r['seconds'] for r in train[mode]]) / base - 1):+.1f} %",
             f"{1000 * med([r['stall'] for r in train[mode]]) / saves:.1f}", f"{1000 * med([r['wait'] for r in train[mode]]) / saves:.1f}",
             cpu_ms(mode)]
            for mode in TRAIN_MODES]
    return [f"Training loop, {args.steps} steps, a checkpoint every {args.every} (seconds, all repeats; overhead against "
            "no checkpoint; per checkpoint, rank 0's milliseconds inside the checkpoint call and waiting for the "
            "previous save, and the CPU milliseconds its process spent beyond the loop without checkpoints, all "
            "threads, until every checkpoint's background work was done: the median, then each repeat's):\n\n" + C.md_table(["mode", "seconds", "overhead", "stall ms", "wait ms", "CPU ms"], rows),
            paired_section(train, saves), thread_section(train, saves)]


def paired_section(train: dict[str, list[dict[str, Any]]], saves: int) -> str:
    """tierckpt against DCP within each repeat: a repeat runs every mode back to back, so what drifts between
    repeats on a shared machine (the loop without checkpoints moved by +-40 ms per checkpoint between repeats
    on the 2-core VM) cancels in the difference, which the columns above, medians against another median,
    keep."""
    med = C.median
    rows = []
    for mode in ("tierckpt", MEMONLY):
        cpu = [1000 * (t["cpu"] - d["cpu"]) / saves for t, d in zip(train[mode], train["dcp"])]
        time_ratio = [t["seconds"] / d["seconds"] for t, d in zip(train[mode], train["dcp"])]
        rows.append([mode if mode != MEMONLY else "tierckpt, some written down",
                     f"{med(cpu):+.0f} ({' / '.join(f'{x:+.0f}' for x in cpu)})",
                     f"{med(time_ratio):.2f} ({' / '.join(f'{x:.2f}' for x in time_ratio)})",
                     f"{sum(x <= 0 for x in cpu)} of {len(cpu)}"])
    return ("Paired by repeat (each repeat runs every mode back to back): CPU milliseconds per checkpoint minus "
            "DCP's in the same repeat, and the loop's seconds over DCP's (the median, then each repeat's; "
            "below 0 and below 1.00, tierckpt costs less):\n\n"
            + C.md_table(["mode", "CPU ms - DCP's", "seconds / DCP's", "repeats at or below DCP's CPU"], rows))


def thread_section(train: dict[str, list[dict[str, Any]]], saves: int) -> str:
    """Rank 0's CPU milliseconds per checkpoint by thread, beyond the loop without checkpoints (medians over
    the repeats; the clock ticks of ``/proc`` are 10 ms, so a cell under about 10 / checkpoints is noise)."""
    med = C.median
    names = sorted({n for runs in train.values() for r in runs for n in r["threads"]} - {EXITED}) + [EXITED]

    def cell(mode: str, name: str) -> float:
        base = med([r["threads"].get(name, 0.0) for r in train["none"]])
        return 1000 * (med([r["threads"].get(name, 0.0) for r in train[mode]]) - base) / saves

    modes = [m for m in TRAIN_MODES if m != "none"]
    rows = [[name, *(f"{cell(m, name):.0f}" for m in modes)] for name in names
            if any(abs(cell(m, name)) >= 0.5 for m in modes)]
    headers = {MEMONLY: "tierckpt, some written down"}
    return ("Where that CPU went: rank 0's CPU milliseconds per checkpoint by thread, beyond the same thread in the "
            "loop without checkpoints (medians; threads of a pool summed; a thread that exited before the end is "
            f"only in \"{EXITED}\"):\n\n" + C.md_table(["thread", *(headers.get(m, m) for m in modes)], rows))


def report(args: argparse.Namespace, saves: list[dict[str, Any]], rec: dict[str, Any], train: dict[str, list[dict[str, Any]]],
           disk: str) -> str:
    save_table, *memory_table = save_section(saves) or [None]
    sections = [
        f"`python benchmarks/bench_memory.py --gib {args.gib} --repeats {args.repeats} --steps {args.steps} "
        f"--every {args.every} --hidden {args.hidden} --persist-every {args.persist_every} --ranks-per-node "
        f"{args.ranks_per_node}` (2 simulated nodes of {args.ranks_per_node} rank(s) for the save and recovery, 2 "
        f"ranks each its own node for the training loop; medians of {args.repeats}).\n\n{C.machine_info(disk)}",
        save_table, *recovery_section(rec), *training_section(args, train), *memory_table,
    ]
    return "\n\n".join(s for s in sections if s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=80, help="training steps per loop (16 checkpoints at --every 5)")
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--persist-every", type=int, default=4,
                    help="the training loop's memory-only mode writes down every N-th checkpoint (persist=False between)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds any one group of ranks may take")
    ap.add_argument("--ranks-per-node", type=int, default=1,
                    help="ranks on each of the 2 simulated nodes in the save and recovery parts (a node's ranks move "
                         "their bytes over their own pairs in a peer recovery)")
    ap.add_argument("--parts", default="save,recovery,training",
                    help="comma-separated parts to run (save, recovery, training, bytes); recovery needs save")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"save", "recovery", "training", "bytes"} or ("recovery" in parts and "save" not in parts):
        ap.error(f"--parts {args.parts!r}: name some of save, recovery, training, bytes (recovery needs save)")
    if "bytes" in parts:
        import bench_node_bytes

        mib = int(args.gib * 1024)
        C.publish(bench_node_bytes.table(mib, bench_node_bytes.run(mib)), args.out, "bench_node_bytes")
        if parts == {"bytes"}:
            return
    disk = C.scratch_dir("tierckpt-bench-memory-")
    memory_root = f"/dev/shm/tierckpt-bench-{os.getpid()}"
    try:
        saves: list[dict[str, Any]] = []
        rec: dict[str, Any] = {}
        train: dict[str, list[dict[str, Any]]] = {}
        if "save" in parts:
            progress("saves")
            saves = C.run_ranks(save_ranks, 2 * args.ranks_per_node, args.gib, args.repeats, disk, memory_root,
                                timeout_s=args.timeout)
        if "recovery" in parts:
            progress("recovery")
            rec = recovery(args.gib, disk, memory_root, args.timeout, args.repeats, 2 * args.ranks_per_node)
        shutil.rmtree(memory_root, ignore_errors=True)
        if "training" in parts:
            progress("training loop")
            train = training(args, disk, memory_root)
        body = report(args, saves, rec, train, disk)
    finally:
        shutil.rmtree(memory_root, ignore_errors=True)
        C.rmtree(disk)
    C.publish(body, args.out, "bench_memory")


if __name__ == "__main__":
    main()
