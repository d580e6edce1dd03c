"""A training script that saves to a URI and exits normally (run by tests/test_write_back_exit.py).

``python writeback_child.py MODE URI RANK WORLD PORT [CACHE]``: MODE ``sync`` (one ``save``), ``async2``
(two ``async_save`` to the URI, nothing waited), ``manager`` (three steps through an async
``CheckpointManager``). CACHE ``off`` passes ``cache=False``. Ranks join a gloo group on ``PORT``.
The saved tensors depend only on the step, so the test can check them bit-exactly.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

import tierckpt


def state(step: int, rank: int, world: int) -> dict:
    """A tensor every rank holds alike, one of this rank's own, and the step."""
    shared = torch.randn(64, 256, generator=torch.Generator().manual_seed(step))
    own = torch.randn(32, 128, generator=torch.Generator().manual_seed(1000 * step + rank))
    return {"w": shared, f"rank{rank}": own, "step": step}


def main() -> None:
    mode, uri, rank, world, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    options = {"cache": False} if len(sys.argv) > 6 and sys.argv[6] == "off" else {}
    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
    if mode == "sync":
        tierckpt.save(uri, state(1, rank, world), group=group, storage_options=options)
    elif mode == "async2":
        tierckpt.async_save(uri, state(1, rank, world), group=group, storage_options=options)
        tierckpt.async_save(uri, state(2, rank, world), group=group, storage_options=options)
    elif mode == "manager":
        manager = tierckpt.CheckpointManager(uri, keep_last=2, use_async=True, group=group, storage_options=options)
        for step in (1, 2, 3):
            manager.save(step, state(step, rank, world))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(f"rank {rank}: returned", flush=True)
    if world > 1 and mode == "sync":  # write-back saves still use the group's store in the background
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
