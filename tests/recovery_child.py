"""One rank of a simulated multi-node job that saves into, or recovers from, node memory tiers
(``tests/test_memory_recovery.py``).

The parent starts :func:`run` in a process forked from a server that imported torch once (starting
Python and torch per rank costs seconds), with this process's node in ``env`` (``TIERCKPT_NODE_ID``,
``TIERCKPT_MEMORY_DIR``, ``TIERCKPT_MEMORY=on``). ``spec`` holds ``rank``, ``world``, ``port``, ``result`` (where this rank writes its JSON result),
``layout`` (``"shard"``: DTensor ``Shard(0)`` over all ranks, as FSDP2 holds parameters; ``"big"``: the same
with one more tensor of 8 MiB, so each rank's part is a unit large enough to stream in peer recovery; ``"replicate"``:
plain full tensors, as DDP does; ``"fsdp2"`` / ``"ddp"``: a small transformer and its AdamW state, trained
two steps before a save, compared with the full state saved beside the test, ``expected``) and either

* ``saves``: a list of ``{"uri", "seed", "level"}``: each is saved with ``async_save`` and waited for
  to ``level``; ``"kill_receiver": true`` on one makes that node's leader die when the first
  replica file of it arrives (a node lost during replication); ``"sync": true`` saves it with ``save``
  instead (its outcome is the call's), ``"fail_write_downs": true`` makes every write-down of a data file
  fail from that save on, ``"key"`` names its result (default: the URI); or
* ``lose_after_saves``: nodes whose memory is lost once every rank's saves are done, in the same processes
  (their tier directories are deleted, and the URIs' remote with them), so that the loads that follow
  recover those nodes' parts from their peers' replicas; and/or
* ``loads``: a list of ``{"uri", "seed"}``: each is loaded and compared bit-exactly with what
  ``seed`` saved (or the error is reported), and the level recorded in this node's tier is read
  (``"unopenable_tier_files": true``: this node's tier files cannot be opened to stream them;
  ``"kill_receiver": true``: rank ``kill_rank`` dies as it is about to receive its streamed units); and/or
* ``latest``: ``{"root", "seeds"}``: ``CheckpointManager(root).load_latest`` into a fresh state, the step it
  returns compared with what ``seeds[step]`` saved; or
* ``manager``: ``{"root", "keep_last", "saves": [{"step", "seed"}]}``: synchronous ``CheckpointManager``
  saves, each followed by a wait until every node records the step ``replicated``; the steps the manager
  sees after each save are reported.

The process ends with ``os._exit`` (no exit drain, no collective teardown): a crash, as far as the
memory tier is concerned.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402

import tierckpt  # noqa: E402
from collective_count import counting_collectives  # noqa: E402
from scenarios import as_dtensor, assert_same, build, full_state, make_mesh, reference, train  # noqa: E402
from tierckpt.store import memory_tier_of, open_store  # noqa: E402
from tierckpt.node.memory.replica_record import recorded_level  # noqa: E402
from tierckpt.node.memory.sidegroup import side_groups  # noqa: E402

SPECS = {"w": ((67, 24), torch.float32), "b16": ((33, 7), torch.bfloat16), "i": ((9,), torch.int64)}
BIG = {"big": ((4096, 512), torch.float32)}
"""The ``big`` layout's extra tensor: 2 MiB per rank of 4, at least what peer recovery streams
(:data:`tierckpt.loading.peer_stream.STREAM_MIN_BYTES`)."""


def specs(layout: str) -> dict:
    return {**SPECS, **BIG} if layout == "big" else SPECS


def full(name: str, seed: int) -> torch.Tensor:
    shape, dtype = {**SPECS, **BIG}[name]
    return reference(f"{name}-{seed}", shape, dtype)


def state(layout: str, seed: int | None) -> dict:
    """The model as this rank holds it: the values of ``seed``, or zeros to load into (``None``)."""
    mesh = make_mesh((dist.get_world_size(),)) if layout in ("shard", "big") else None
    model = {}
    for name, (shape, dtype) in specs(layout).items():
        value = full(name, seed) if seed is not None else torch.zeros(shape, dtype=dtype)
        model[name] = as_dtensor(value, mesh, [Shard(0)]) if mesh is not None else value
    return {"model": model, "extra": {"step": -1 if seed is None else seed}}


def model_state(layout: str, seed: int | None, expected: str) -> dict:
    """A real module and optimizer (``fsdp2`` or ``ddp``): trained and its full state kept in ``expected``
    when saving (``seed``), fresh when loading (``None``)."""
    model, optim = build(layout, None, make_mesh((dist.get_world_size(),)), seed=0 if seed is not None else 1)
    if seed is not None:
        train(model, optim, 2, dist.get_rank())
        full_sd = full_state(model, optim)
        if dist.get_rank() == 0:
            torch.save(full_sd, expected)
    return {"model": model, "optim": optim, "extra": {"step": -1 if seed is None else seed}}


def compare_model(loaded: dict, seed: int, expected: str) -> list[str]:
    try:
        assert_same(torch.load(expected), full_state(loaded["model"], loaded["optim"]))
    except AssertionError as exc:
        return [str(exc)]
    return [] if loaded["extra"]["step"] == seed else ["extra.step"]


def compare(loaded: dict, seed: int) -> list[str]:
    """Names of the tensors (and objects) that differ from what ``seed`` saved, bit for bit."""
    bad = []
    for name, value in loaded["model"].items():
        expected = full(name, seed)
        if hasattr(value, "to_local"):
            shape, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            expected = expected[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]
            value = value.to_local()
        if value.dtype != expected.dtype or not torch.equal(value.view(torch.uint8), expected.view(torch.uint8)):
            bad.append(name)
    if loaded["extra"]["step"] != seed:
        bad.append("extra.step")
    return bad


def kill_on_first_replica_file() -> None:
    from tierckpt.node.memory import replica

    def receive_file(*args: object) -> None:
        os._exit(9)

    replica.receive_file = receive_file  # type: ignore[assignment]


COPIES: list[str] = []
"""The keys this process's write-down copied to the URI's store."""


def record_write_downs(delay_s: float) -> None:
    """Record every write-down copy, each started ``delay_s`` late (a slow store: the replicas reach the
    peers before their own node has written them down)."""
    import asyncio

    from tierckpt.node.memory.writedown import WriteDown

    copy = WriteDown._copy

    async def recorded(self: WriteDown, key: str) -> None:
        await asyncio.sleep(delay_s)
        COPIES.append(key)
        await copy(self, key)

    WriteDown._copy = recorded  # type: ignore[method-assign]


def fail_write_downs() -> None:
    """From now on every write-down of a data file fails for good (the URI's store refuses it)."""
    from tierckpt.errors import StorageError
    from tierckpt.node.memory.writedown import WriteDown

    copy = WriteDown._copy

    async def refused(self: WriteDown, key: str) -> None:
        if "/data/" in key:
            raise StorageError(f"the store refused {key} (injected by the test)")
        await copy(self, key)

    WriteDown._copy = refused  # type: ignore[method-assign]


def refuse_tier_opens_for_streams() -> None:
    """This rank's node memory tier files cannot be opened to stream a peer's replica (an I/O error)."""
    import errno

    from tierckpt.loading import peer_stream

    def refused(path: str) -> int:
        raise OSError(errno.EIO, f"injected by the test: cannot open {path}")

    peer_stream.open_shared = refused  # type: ignore[assignment]


def die_when_receiving_a_stream() -> None:
    """This process dies as its read step is about to post its first streamed receive (a replacement rank
    lost while its peer starts streaming to it: the lanes to it never connect)."""
    from tierckpt.loading import peer_stream

    def die(self: object, indices: object) -> None:
        os._exit(9)

    peer_stream.PeerStream.receive = die  # type: ignore[assignment,method-assign]


def lose_in_place(nodes: list[str], uris: list[str]) -> None:
    """``nodes`` lose their memory tiers and ``uris`` their remote, while every process lives on."""
    import shutil

    dist.barrier()  # every rank's saves are done
    if os.environ["TIERCKPT_NODE_ID"] in nodes:
        shutil.rmtree(os.environ["TIERCKPT_MEMORY_DIR"], ignore_errors=True)  # the node's ranks alike
    if dist.get_rank() == 0:
        for uri in uris:
            shutil.rmtree(uri)
    dist.barrier()


def run(spec: dict, env: dict[str, str]) -> None:
    """One rank: ``env`` is this rank's node; ends the process with ``os._exit``."""
    os.environ.update(env)
    try:
        main(spec)
    except BaseException:  # noqa: BLE001 - the parent reads the exit status and the output
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def main(spec: dict) -> None:
    rank, world = spec["rank"], spec["world"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    out: dict = {"started": time.monotonic() - spec["launched"], "node": os.environ["TIERCKPT_NODE_ID"], "saves": {}, "loads": {}}
    if "slow_write_down_s" in spec:
        record_write_downs(spec["slow_write_down_s"])
    for save in spec.get("saves", []):
        if save.get("kill_receiver") and rank == spec["kill_rank"]:
            kill_on_first_replica_file()
        started = time.monotonic()
        modules = spec["layout"] in ("fsdp2", "ddp")
        saved = model_state(spec["layout"], save["seed"], spec["expected"]) if modules else state(spec["layout"], save["seed"])
        name = save.get("key", save["uri"])
        if save.get("fail_write_downs"):
            fail_write_downs()
        if save.get("sync"):  # a synchronous save: its outcome is the call's
            try:
                meta = tierckpt.save(save["uri"], saved)
                out["saves"][name] = {"ok": True, "generation": meta.generation}
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out["saves"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            continue
        handle = tierckpt.async_save(save["uri"], saved, persist=save.get("persist", True))
        try:
            for level in save["level"] if isinstance(save["level"], list) else [save["level"]]:
                meta = handle.wait(level, timeout_s=60)
            out["saves"][name] = {"ok": True, "generation": meta.generation,
                                         "at_uri": os.path.exists(os.path.join(save["uri"], "COMMIT"))}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["saves"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out["saves"][name]["seconds"] = time.monotonic() - started
    if "lose_after_saves" in spec:
        lose_in_place(spec["lose_after_saves"], [load["uri"] for load in spec.get("loads", [])])
    for load in spec.get("loads", []):
        if load.get("unopenable_tier_files"):
            refuse_tier_opens_for_streams()
        if load.get("kill_receiver") and rank == spec["kill_rank"]:
            die_when_receiving_a_stream()
        modules = spec["layout"] in ("fsdp2", "ddp")
        target = model_state(spec["layout"], None, "") if modules else state(spec["layout"], None)
        record: dict = {}
        started = time.monotonic()
        try:
            monitor = tierckpt.Monitor()
            with counting_collectives() as collectives:
                tierckpt.load(load["uri"], target, monitor=monitor, verify=load.get("verify", False))
            record["collectives"] = dict(collectives)
            record["differs"] = compare_model(target, load["seed"], spec["expected"]) if modules else compare(target, load["seed"])
            counts = monitor.summary()
            record["bytes_read"] = counts.get("bytes_read", 0)
            record["bytes_read_memory"] = counts.get("bytes_read_memory", 0)
            record["bytes_exchanged"] = counts.get("bytes_exchanged", 0)
            record["bytes_packed"] = counts.get("bytes_packed", 0)
            record["bytes_streamed"] = counts.get("bytes_streamed", 0)
            record["stream_lanes"] = counts.get("stream_lanes", 0)
            record["bytes_checked"] = counts.get("bytes_checked", 0)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["trace"] = traceback.format_exc()
        record["seconds"] = time.monotonic() - started
        tier = memory_tier_of(open_store(load["uri"]))
        committed = tier.committed() if tier is not None else None
        level = recorded_level(tier, committed.generation) if committed is not None else None
        record["level"] = None if level is None else {"level": level.level.value, "reason": level.reason}
        out["loads"][load["uri"]] = record
    if "manager" in spec:
        manager = tierckpt.CheckpointManager(spec["manager"]["root"], keep_last=spec["manager"]["keep_last"],
                                             persist_every=spec["manager"].get("persist_every"))
        out["manager"] = []
        for save in spec["manager"]["saves"]:
            manager.save(save["step"], state(spec["layout"], save["seed"]))
            deadline = time.monotonic() + 60
            while not (manager.levels(save["step"]) or {}).get("replicated") and time.monotonic() < deadline:
                time.sleep(0.02)
            dist.barrier()  # every node has recorded the step replicated before any rank saves the next one
            out["manager"].append({"step": save["step"], "steps": manager.steps()})
    out["write_downs"] = COPIES
    out["side_groups"] = [sorted(side.users) for side in side_groups()]
    if "latest" in spec:
        target = state(spec["layout"], None)
        try:
            step = tierckpt.CheckpointManager(spec["latest"]["root"]).load_latest(target)
            out["latest"] = {"step": step, "differs": compare(target, spec["latest"]["seeds"][str(step)])}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["latest"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    with open(spec["result"], "w") as f:
        json.dump(out, f)
    if not any(step.get("kill_receiver") for step in [*spec.get("saves", []), *spec.get("loads", [])]):
        dist.barrier()  # rank 0 serves the group's store: it leaves last (with a node lost, nobody waits)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
