"""What reading checkpoints as untrusted input costs: this tree against a baseline tree, in one run.

    python benchmarks/bench_untrusted.py --baseline OTHER/src [--tensors 100000] [--ranks 8] [--repeats 5]
                                         [--out docs/benchmarks.md]

Every load now checks that each tensor's pieces are disjoint and cover it (:mod:`tierckpt.native.coverage`),
and the restricted unpicklers hand out sealed stand-ins (:mod:`tierckpt.formats.pickle_seal`). Measured, each
tree in a child process of its own (``PYTHONPATH`` = its ``src``), the two trees alternating per repeat:

* ``load 100k``: ``tierckpt.load`` of one checkpoint of ``--tensors`` small fp32 tensors (saved once),
  into preallocated tensors, one process;
* ``reshard N``: ``tierckpt.load`` on ``--ranks`` gloo ranks of a ``Shard(0)`` checkpoint into ``Shard(1)``
  DTensors (saved once by as many ranks), the slowest rank's time: the ranks' first load of it (after a
  one-tensor load in the group), where this tree also measures the routes' costs
  (:mod:`tierckpt.loading.route_costs`, once per process), and a second load of it in the same processes;
* ``DCP metadata``: decoding a DCP ``.metadata`` of ``--tensors`` tensors (``unpickle_metadata``);
* ``coverage``: the coverage check alone on the 100k-tensor table and on the resharded one (this tree).

Reports medians (each run in parentheses) and this tree's ratio to the baseline, of the medians and of
the best runs (on a shared machine the best run is the one least disturbed by others), and beside each the
CPU seconds the load took (``time.process_time`` around it, every thread of the process; summed over the
ranks): on a machine shared with other work, wall time counts the waits for a core too.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from _common import machine_info, md_table, median, publish, rmtree, runs, scratch_dir  # noqa: E402

HERE = Path(__file__).resolve()
RESHARD_GIB = 1 / 16
"""The resharded state: ``_common``'s 8 matrices, 64 MiB in all (a 2-core machine runs 8 ranks)."""


def _small_state(count: int, fill: bool) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.w": torch.full((16,), float(i) if fill else -1.0) for i in range(count)}


def _dcp_metadata(count: int) -> bytes:
    """A DCP ``.metadata`` of ``count`` tensors of 16 fp32 elements, one chunk each (as ``dcp.save`` pickles it)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    props = TensorProperties(dtype=torch.float32)
    entries = {}
    storage = {}
    for i in range(count):
        fqn = f"layers.{i}.w"
        entries[fqn] = TensorStorageMetadata(properties=props, size=torch.Size([16]), chunks=[
            ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([16]))])
        storage[MetadataIndex(fqn=fqn, offset=torch.Size([0]), index=0)] = _StorageInfo(
            relative_path="__0_0.distcp", offset=i * 1024, length=1024)
    return pickle.dumps(Metadata(state_dict_metadata=entries, storage_data=storage))


# -- the child: one tree's measurements --------------------------------------------------------------------
def _reshard_save(rank: int, world: int, uri: str) -> bool:
    import tierckpt

    tierckpt.save(uri, C.make_state(RESHARD_GIB, shard_dim=0, fill=True))
    return True


def _reshard_load(rank: int, world: int, uri: str, warm: str) -> list[tuple[float, float]]:
    """``(seconds, CPU seconds)`` of this rank's first and second load of ``uri``, after an untimed load of
    ``warm`` in the group (the first use's imports)."""
    import torch.distributed as dist

    import tierckpt

    tierckpt.load(warm, {"w": torch.zeros(4)})
    state = C.make_state(RESHARD_GIB, shard_dim=1, fill=False)
    out = []
    for _ in range(2):
        C.reset_state(state)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        tierckpt.load(uri, state)
        cpu = time.process_time() - c0
        dist.barrier()
        out.append((time.perf_counter() - t0, cpu))
        C.check_state(state, RESHARD_GIB)
    return out


def child(what: str, root: str, tensors: int, ranks: int) -> dict[str, tuple[float, float]]:
    """One measurement, ``{case: (seconds, CPU seconds)}``, with whichever ``tierckpt`` is first on the path
    (after a first, untimed load of a one-tensor checkpoint and the DCP imports: the first use's imports are
    not what is compared)."""
    import torch.distributed.checkpoint.filesystem  # noqa: F401

    import tierckpt

    tierckpt.load(os.path.join(root, "warm"), {"w": torch.zeros(4)})
    if what == "load":
        target = _small_state(tensors, fill=False)
        t0, c0 = time.perf_counter(), time.process_time()
        tierckpt.load(os.path.join(root, "small"), target)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        if not all(float(t[0]) == i for i, t in enumerate(target.values())):
            raise AssertionError("the 100k-tensor load returned other values")
        return {"load": (seconds, cpu)}
    if what == "reshard":
        per_rank = C.run_ranks(_reshard_load, ranks, os.path.join(root, "reshard"), os.path.join(root, "warm"))
        return {case: (max(r[i][0] for r in per_rank), sum(r[i][1] for r in per_rank))
                for i, case in enumerate(("reshard", "reshard_again"))}
    if what == "dcp_meta":
        try:
            from tierckpt.formats.dcp import unpickle_metadata
        except ModuleNotFoundError:  # a baseline tree from before the package layout
            from tierckpt.dcp_format import unpickle_metadata  # type: ignore[no-redef]

        data = Path(root, "dcp.metadata").read_bytes()
        t0, c0 = time.perf_counter(), time.process_time()
        unpickle_metadata(data, "bench")
        return {"dcp_meta": (time.perf_counter() - t0, time.process_time() - c0)}
    raise SystemExit(f"unknown measurement {what!r}")


def _coverage_seconds(root: str) -> dict[str, float]:
    """The coverage check alone on both saved tables (this tree)."""
    from tierckpt.backends import open_backend
    from tierckpt.native.coverage import check_exact_coverage
    from tierckpt.formats.select import read_checkpoint, read_pieces

    out = {}
    for name in ("small", "reshard"):
        backend = open_backend(os.path.join(root, name))
        ckpt = read_checkpoint(backend)
        pieces = read_pieces(backend, ckpt)
        t0 = time.perf_counter()
        check_exact_coverage(ckpt.tensors, pieces, name)
        out[name] = time.perf_counter() - t0
    return out


def _run_child(src: str, what: str, args: argparse.Namespace, root: str) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(HERE.parent)])}
    cmd = [sys.executable, str(HERE), "--child", what, "--root", root, "--tensors", str(args.tensors), "--ranks", str(args.ranks)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{what} with {src} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="the other tree's src directory")
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the Markdown section into this file (docs/benchmarks.md)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.root, args.tensors, args.ranks)))
        return
    import tierckpt

    mine = str(Path(tierckpt.__file__).resolve().parents[1])
    trees = {"this tree": mine, "baseline": str(Path(args.baseline).resolve())}
    root = scratch_dir("bench-untrusted-")
    try:
        tierckpt.save(os.path.join(root, "warm"), {"w": torch.ones(4)})
        tierckpt.save(os.path.join(root, "small"), _small_state(args.tensors, fill=True))
        C.run_ranks(_reshard_save, args.ranks, os.path.join(root, "reshard"))
        Path(root, "dcp.metadata").write_bytes(_dcp_metadata(args.tensors))
        cases = {"load": f"load {args.tensors:,} tensors",
                 "reshard": f"reshard {args.ranks} ranks, Shard(0) -> Shard(1): first load (this tree: + route probe)",
                 "reshard_again": f"reshard {args.ranks} ranks: second load, same processes",
                 "dcp_meta": f"DCP .metadata of {args.tensors:,} tensors, decode"}
        times: dict[tuple[str, str], list[float]] = {(c, t): [] for c in cases for t in trees}
        cpus: dict[tuple[str, str], list[float]] = {(c, t): [] for c in cases for t in trees}
        for r in range(args.repeats):
            for what in ("load", "reshard", "dcp_meta"):
                for tree in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                    for case, (seconds, cpu) in _run_child(trees[tree], what, args, root).items():
                        times[(case, tree)].append(seconds)
                        cpus[(case, tree)].append(cpu)
        coverage = _coverage_seconds(root)
    finally:
        rmtree(root)
    rows = [[label, f"{median(times[(c, 'baseline')]):.3f} s ({runs(times[(c, 'baseline')])})",
             f"{median(times[(c, 'this tree')]):.3f} s ({runs(times[(c, 'this tree')])})",
             f"{median(times[(c, 'this tree')]) / median(times[(c, 'baseline')]):.2f}",
             f"{min(times[(c, 'this tree')]) / min(times[(c, 'baseline')]):.2f}",
             f"{median(cpus[(c, 'baseline')]):.3f} / {median(cpus[(c, 'this tree')]):.3f} s",
             f"{median(cpus[(c, 'this tree')]) / median(cpus[(c, 'baseline')]):.2f}",
             f"{min(cpus[(c, 'this tree')]) / min(cpus[(c, 'baseline')]):.2f}"] for c, label in cases.items()]
    body = "\n".join([
        "## Untrusted input: the cost of exact coverage and sealed unpicklers (`benchmarks/bench_untrusted.py`)",
        "",
        f"{machine_info(tempfile_dir())}; {args.repeats} repeats, the trees alternating, medians (runs).",
        "",
        md_table(["case", "baseline", "this tree", "ratio of medians", "ratio of best runs",
                  "CPU s, baseline / this tree (medians)", "CPU ratio of medians", "CPU ratio of best runs"], rows),
        "",
        f"The coverage check alone (this tree): {coverage['small'] * 1e3:.1f} ms for the {args.tensors:,}-tensor "
        f"table, {coverage['reshard'] * 1e3:.2f} ms for the {args.ranks}-rank resharded one.",
    ])
    publish(body, args.out, "bench_untrusted")


def tempfile_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


if __name__ == "__main__":
    main()
