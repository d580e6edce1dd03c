"""A training script that checkpoints into node memory tiers and exits normally right after its last
``async_save`` committed (run by ``tests/test_replication_exit.py``).

``python exit_child.py MODE WORKDIR RANK WORLD PORT``: every rank is its own simulated node
(``TIERCKPT_NODE_ID`` = ``node-RANK``, ``TIERCKPT_MEMORY_DIR`` under ``WORKDIR``, set by the test). A DDP
model and AdamW train a few steps with an ``async_save`` every other step, each waiting only for the previous
save to commit (level ``memory``); then MODE ``return`` returns from the script with the process group still
up, MODE ``destroy`` calls ``dist.destroy_process_group()`` first. Peer replication of the last save is
still in flight when the script ends: the process must exit cleanly with it finished (or reported cut short).
Prints ``generation <name>`` of the last save.

MODE ``slow-reader`` (no memory tier): one ``async_save``, waited for, then the script returns; rank 1's view
of the group's store answers ``get`` five seconds late (a busy rank), so rank 0, which serves the store, reaches
its exit before rank 1 read the outcome. Every rank prints ``committed <generation>`` or ``failed <error>``.

MODE ``stuck-peer``: one save whose replication to node 1 cannot finish (node 1's receiver hangs), with an
exit wait of 3 s: the exit drain gives up, says so on stderr, and node 0's level stays ``memory``.

MODE ``interrupted`` (no memory tier): two ``async_save`` calls on both ranks (the second copies while the
group agrees); then rank 1 stays away from the third for ``AWAY_S`` seconds while rank 0 makes it and is
interrupted (``KeyboardInterrupt``, as from Ctrl-C) two seconds in, its agreement still waiting for rank 1.
Rank 0 must exit at once, not when rank 1 leaves or the group's timeout ends the collective.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import tierckpt
from tierckpt.demo.model import TinyTransformer, batch

EXTRA_BYTES = 48 << 20
"""A buffer saved beside the model, so that replicating a checkpoint takes a while."""


class SlowStore:
    """The group's store as a busy rank sees it: each ``get`` answers five seconds late."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def get(self, key: str) -> bytes:
        time.sleep(5.0)
        return self._store.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def slow_reader(workdir: str, rank: int) -> None:
    if rank == 1:
        default_store = dist.distributed_c10d._get_default_store
        dist.distributed_c10d._get_default_store = lambda: SlowStore(default_store())
    handle = tierckpt.async_save(os.path.join(workdir, "remote", "ckpt"), {"w": torch.arange(1000.0), "step": 1})
    try:
        print(f"committed {handle.wait(60).generation}", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        print(f"failed {type(exc).__name__}: {exc}", flush=True)


def stuck_peer(workdir: str, rank: int) -> None:
    """One save whose replication cannot finish in time: rank 1's node stops taking replicas (its receiver
    hangs 8 s on the first file, then fails); the memory tier's exit wait is 3 s."""
    from tierckpt.node.memory import MemoryConfig, replica

    if rank == 1:
        def receive_file(*args: object) -> None:
            time.sleep(8)
            raise RuntimeError("this node stopped taking replicas")

        replica.receive_file = receive_file  # type: ignore[assignment]
    memory = MemoryConfig.from_env(exit_wait_s=3.0)
    handle = tierckpt.async_save(os.path.join(workdir, "remote", "ckpt"), {f"extra{rank}": torch.ones(EXTRA_BYTES // 4)},
                                 storage_options={"memory": memory})
    print(f"generation {handle.wait(60).generation}", flush=True)


AWAY_S = 45.0
"""How long rank 1 stays out of the third save in MODE ``interrupted``."""


def interrupted(workdir: str, rank: int) -> None:
    import signal

    uri = os.path.join(workdir, "remote", "ckpt")
    state = {"w": torch.arange(1 << 20, dtype=torch.float32) + rank, "step": 0}
    for _ in range(2):
        tierckpt.async_save(uri, state).wait(60)
    if rank == 1:
        time.sleep(AWAY_S)
        return

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(2)
    print("saving", flush=True)
    tierckpt.async_save(uri, state)


def main() -> None:
    mode, workdir, rank, world, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    if mode == "slow-reader":
        slow_reader(workdir, rank)
        return
    if mode == "stuck-peer":
        stuck_peer(workdir, rank)
        return
    if mode == "interrupted":
        interrupted(workdir, rank)
        return
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyTransformer())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = torch.full((EXTRA_BYTES // 4,), float(rank))
    uri = os.path.join(workdir, "remote", "ckpt")
    handle = None
    for step in range(6):
        x, y = batch(step, rank)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 61), y.reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 2 == 1:
            if handle is not None:
                handle.wait()
            extra += 1
            handle = tierckpt.async_save(uri, {"model": model.state_dict(), "optim": optim.state_dict(),
                                               f"extra{rank}": extra, "step": step})
    meta = handle.wait()
    print(f"generation {meta.generation}", flush=True)
    if mode == "destroy":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
