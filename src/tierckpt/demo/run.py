"""The ``tierckpt demo`` job: train with FSDP2 on 2 ranks, checkpoint, resume on 3 ranks and on 1.

Phases (every distributed phase spawns fresh gloo processes on 127.0.0.1):

* **A** — 2 ranks, FSDP2 on a 2-rank mesh, AdamW: train ``steps`` steps, save
  ``{"model", "optim", "step"}`` to ``<root>/step-<steps>``, then train ``steps`` more steps without
  stopping; those losses are the reference continuation.
* **B** — 3 ranks, FSDP2 on a 3-rank mesh: load the checkpoint (resharded 2 -> 3), train the same
  next ``steps`` steps.
* **C** — this process, a plain module without a process group: load (resharded 2 -> 1), train the
  same next ``steps`` steps.

The global batch of each step does not depend on the world size: it is the union of
``batch(step, r)`` for the two logical data shards ``r = 0, 1``, split among however many ranks
there are, and the logged loss is the mean over the whole global batch. So the resumed losses match
the reference up to float summation order (compared with a relative tolerance, not bit-exactly).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

import tierckpt
from tierckpt.backends.files import write_error
from tierckpt.demo.model import TinyTransformer, batch
from tierckpt.monitor import format_bytes

LOGICAL_SHARDS = 2
"""Data shards per step, independent of the world size (the saving run's world size)."""
TOLERANCE = 1e-4
"""Largest relative difference allowed between a resumed loss and the reference loss."""
VOCAB = 61
LR = 1e-2
DEFAULT_ROOT_ENV = "TIERCKPT_DEMO_DIR"
DEFAULT_ROOT = "./tierckpt-demo"


@dataclass
class IOStats:
    """One save or load: wall seconds, per-phase seconds (slowest rank) and byte counters (all ranks)."""

    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class DemoReport:
    """What the demo measured; :meth:`render` formats it for people."""

    checkpoint: str
    reference: list[float]
    resumed_3: list[float]
    resumed_1: list[float]
    first_step: int
    max_rel_diff: float
    tolerance: float
    save: IOStats
    load_3: IOStats
    load_1: IOStats
    checkpoint_meta: dict[str, Any]
    wall_seconds: float

    @property
    def ok(self) -> bool:
        """Whether both resumes reproduced the uninterrupted losses within :attr:`tolerance`."""
        return self.max_rel_diff <= self.tolerance

    def render(self) -> str:
        """The losses side by side, then the save/load timings and bytes."""
        lines = [f"checkpoint: {self.checkpoint}", "", "losses after the checkpoint (global-batch mean):"]
        lines.append(f"  {'step':>4}  {'2 ranks, no stop':>16}  {'resumed on 3':>14}  {'resumed on 1':>14}")
        for i, (ref, r3, r1) in enumerate(zip(self.reference, self.resumed_3, self.resumed_1)):
            lines.append(f"  {self.first_step + i + 1:>4}  {ref:>16.6f}  {r3:>14.6f}  {r1:>14.6f}")
        verdict = "OK" if self.ok else "DIVERGED"
        lines.append(f"  max relative difference: {self.max_rel_diff:.2e} (tolerance {self.tolerance:.0e}): {verdict}")
        lines += ["", f"  {'operation':<22} {'seconds':>8}  {'phases (s, slowest rank)':<40} bytes"]
        for name, stats in (("save (2 ranks)", self.save), ("load 2->3 ranks", self.load_3), ("load 2->1 rank", self.load_1)):
            phases = " ".join(f"{k}={v:.3f}" for k, v in stats.phases.items())
            counted = " ".join(f"{k}={format_bytes(v)}" for k, v in stats.bytes.items())
            lines.append(f"  {name:<22} {stats.seconds:>8.3f}  {phases:<40} {counted}")
        meta = self.checkpoint_meta
        lines.append(
            f"  checkpoint: {meta['num_tensors']} tensors in {meta['num_pieces']} pieces, "
            f"{format_bytes(meta['tensor_bytes'])} of tensors, {format_bytes(meta['file_bytes'])} in {meta['files']} files, "
            f"saved by {meta['world_size']} ranks ({', '.join(meta['frameworks'])})"
        )
        lines.append(f"  demo wall time: {self.wall_seconds:.1f} s")
        return "\n".join(lines)


def default_root() -> str:
    """``$TIERCKPT_DEMO_DIR``, or ``./tierckpt-demo``."""
    return os.environ.get(DEFAULT_ROOT_ENV, DEFAULT_ROOT)


# -- training --------------------------------------------------------------------------------------
def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of step ``step``: the union of the logical data shards."""
    parts = [batch(step, r) for r in range(LOGICAL_SHARDS)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def build(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """TinyTransformer (FSDP2 on a ``world``-rank CPU mesh when ``world > 1``) and its AdamW."""
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=VOCAB)
    if world > 1:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh("cpu", torch.arange(world))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    """One step on this rank's share of the global batch; returns the global-batch mean loss.

    Each rank backpropagates ``world * local_sum / global_tokens`` because FSDP2 averages gradients
    over the ranks, so the update equals that of the global mean loss on any world size.
    """
    x, y = global_batch(step)
    local_x, local_y = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
    local_sum = torch.nn.functional.cross_entropy(model(local_x).reshape(-1, VOCAB), local_y.reshape(-1), reduction="sum")
    optim.zero_grad()
    (local_sum * (world / y.numel())).backward()
    optim.step()
    total = local_sum.detach().clone()
    if world > 1:
        dist.all_reduce(total)
    return total.item() / y.numel()


def _io_stats(seconds: float, monitor: tierckpt.Monitor) -> dict[str, Any]:
    return {"seconds": seconds, "phases": dict(monitor.seconds), "bytes": {k: v for k, v in monitor.counters.items() if "bytes" in k}}


def _timed_start(world: int) -> float:
    """Line the ranks up, so a save or load is timed from when every rank has arrived."""
    if world > 1:
        dist.barrier()
    return time.perf_counter()


def _merge(per_rank: list[dict[str, Any]]) -> IOStats:
    """Slowest rank's seconds per phase, byte counters summed over ranks."""
    phases: dict[str, float] = {}
    counters: dict[str, int] = {}
    for r in per_rank:
        for k, v in r["phases"].items():
            phases[k] = max(phases.get(k, 0.0), v)
        for k, v in r["bytes"].items():
            counters[k] = counters.get(k, 0) + v
    return IOStats(seconds=max(r["seconds"] for r in per_rank), phases=phases, bytes=counters)


def _meta_summary(meta: Any) -> dict[str, Any]:
    return {
        "world_size": meta.world_size, "frameworks": list(meta.frameworks), "num_tensors": meta.num_tensors,
        "num_pieces": meta.num_pieces, "tensor_bytes": meta.tensor_bytes,
        "file_bytes": sum(f.size for f in meta.files), "files": len(meta.files),
    }


def _save_and_continue(rank: int, world: int, path: str, steps: int) -> dict[str, Any]:
    """Phase A on one rank: train, save, keep training; returns losses and save stats."""
    model, optim = build(world, seed=0)
    for step in range(steps):
        train_step(model, optim, step, rank, world)
    monitor = tierckpt.Monitor()
    start = _timed_start(world)
    meta = tierckpt.save(path, {"model": model, "optim": optim, "step": steps}, monitor=monitor)
    save = _io_stats(time.perf_counter() - start, monitor)
    losses = [train_step(model, optim, step, rank, world) for step in range(steps, 2 * steps)]
    return {"losses": losses, "io": save, "meta": _meta_summary(meta)}


def _resume(rank: int, world: int, path: str, steps: int) -> dict[str, Any]:
    """Phases B and C on one rank: a differently seeded model, load, train the next ``steps`` steps."""
    model, optim = build(world, seed=1)
    state = {"model": model, "optim": optim, "step": 0}
    monitor = tierckpt.Monitor()
    start = _timed_start(world)
    tierckpt.load(path, state, monitor=monitor)
    load = _io_stats(time.perf_counter() - start, monitor)
    first = state["step"]
    losses = [train_step(model, optim, step, rank, world) for step in range(first, first + steps)]
    return {"losses": losses, "io": load}


# -- processes ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, job: str, path: str, steps: int, results: Any) -> None:
    """Entry point of a spawned rank: join the gloo group, run ``job``, report to ``results``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        fn = _save_and_continue if job == "save" else _resume
        results.put((rank, fn(rank, world, path, steps)))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, job: str, path: str, steps: int) -> list[dict[str, Any]]:
    """Run ``job`` on ``world`` fresh gloo processes; their results by rank (a rank's error re-raises here)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(_worker, args=(world, _free_port(), job, path, steps, results), nprocs=world, start_method="spawn")
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous
    by_rank = dict(results.get() for _ in range(world))
    return [by_rank[r] for r in range(world)]


def _max_rel_diff(reference: list[float], *others: list[float]) -> float:
    return max(abs(o - r) / max(abs(r), 1e-12) for other in others for o, r in zip(other, reference, strict=True))


class _Progress:
    """The demo's phases on stderr: a tqdm bar on a terminal; elsewhere (output captured to a file or a
    pipe, where a bar's carriage returns run into the text) one newline-terminated line per phase."""

    def __init__(self, total: int, quiet: bool) -> None:
        self._total = total
        self._started = 0
        self._quiet = quiet
        self._bar = tqdm(total=total, desc="demo", unit="phase", leave=False) if not quiet and sys.stderr.isatty() else None

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        elif not self._quiet:
            print(text, file=sys.stderr, flush=True)

    def phase(self, text: str) -> None:
        """Finish the previous phase (if any) and start the one described by ``text``."""
        if self._bar is not None:
            self._bar.update(self._started - self._bar.n)
            self._bar.set_description(text)
        else:
            self.note(f"[{self._started + 1}/{self._total}] {text}")
        self._started += 1

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.update(self._started - self._bar.n)
            self._bar.close()


def run_demo(root: str | None = None, steps: int = 4, quiet: bool = False) -> DemoReport:
    """Run phases A, B and C (see the module docstring) and return what they measured.

    ``root`` is the directory that receives ``step-<steps>`` (default: :func:`default_root`).
    Progress goes to stderr unless ``quiet`` (a bar on a terminal, else a line per phase); the report itself is not printed (see
    :meth:`DemoReport.render`).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    started = time.perf_counter()
    directory = Path(root or default_root()).resolve()
    try:  # here, so an unwritable root is one clear error rather than a traceback from every rank
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(exc, f"creating the demo directory {directory}") from exc
    path = str(directory / f"step-{steps}")
    with _Progress(total=3, quiet=quiet) as progress:
        progress.note(f"tierckpt demo: checkpoint goes to {path}")
        progress.phase("A: train on 2 ranks, save, continue")
        saved = _spawn(2, "save", path, steps)
        progress.phase("B: resume on 3 ranks")
        resumed_3 = _spawn(3, "resume", path, steps)
        progress.phase("C: resume in 1 process")
        resumed_1 = _resume(0, 1, path, steps)
    reference = saved[0]["losses"]
    return DemoReport(
        checkpoint=path,
        reference=reference,
        resumed_3=resumed_3[0]["losses"],
        resumed_1=resumed_1["losses"],
        first_step=steps,
        max_rel_diff=_max_rel_diff(reference, resumed_3[0]["losses"], resumed_1["losses"]),
        tolerance=TOLERANCE,
        save=_merge([r["io"] for r in saved]),
        load_3=_merge([r["io"] for r in resumed_3]),
        load_1=_merge([resumed_1["io"]]),
        checkpoint_meta=saved[0]["meta"],
        wall_seconds=time.perf_counter() - started,
    )
