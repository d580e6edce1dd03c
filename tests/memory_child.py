"""A child process for tests/test_memory_link.py: an ``async_save`` into the node memory tier that then
dies (``kill``: SIGKILL right after the memory commit) or exits normally (``exit``: the exit drain must
write the checkpoint down). Usage: ``memory_child.py MODE URI ENDPOINT EXIT_WAIT_S`` with
``TIERCKPT_MEMORY_DIR`` set; prints ``committed <generation>`` once the save is committed in memory."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch


def state() -> dict[str, Any]:
    """The state every child saves (deterministic, so the parent can compare bit-exactly)."""
    g = torch.Generator().manual_seed(15)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.arange(4096, dtype=torch.int64), "step": 7}


def options(endpoint: str, exit_wait_s: float = 600.0) -> dict[str, Any]:
    from tierckpt.node.memory import MemoryConfig

    return {"memory": MemoryConfig(directory=os.environ["TIERCKPT_MEMORY_DIR"], budget_bytes=1 << 30, exit_wait_s=exit_wait_s),
            "cache": False, "endpoint_url": endpoint, "key": "testing", "secret": "testing", "region": "us-east-1",
            "timeout_s": 5}


def main() -> None:
    import tierckpt

    mode, uri, endpoint, exit_wait_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    handle = tierckpt.async_save(uri, state(), storage_options=options(endpoint, exit_wait_s))
    meta = handle.wait()
    print(f"committed {meta.generation}", flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()


def ranks_share_the_tier(path: str, config: Any) -> list[str]:
    """Every rank of the pool (one node) async-saves into the node's memory tier, waits until it is written
    down, and loads it back bit-exact, from memory and from the path alone; returns the data files the
    tier holds of the generation (rank 0)."""
    import torch.distributed as dist

    import tierckpt
    from tierckpt.backends import LocalBackend
    from tierckpt.io.scheduler import get_scheduler
    from tierckpt.native.layout import COMMIT, CommitRecord
    from tierckpt.store import memory_tier_of, open_store

    def make() -> dict[str, torch.Tensor]:  # replicated on every rank: the plan gives each rank one tensor
        return {name: torch.full((128, 64), float(i)) + torch.arange(64.0) for i, name in enumerate("abcd")}

    handle = tierckpt.async_save(path, make(), storage_options={"memory": config})
    meta = handle.wait()
    handle.wait_durable(120)
    dist.barrier()
    for memory in (config, False):
        got = {name: torch.zeros(128, 64) for name in "abcd"}
        tierckpt.load(path, got, storage_options={"memory": memory})
        assert all(torch.equal(got[n], make()[n]) for n in "abcd")
    dist.barrier()
    if dist.get_rank() != 0:
        return []
    assert CommitRecord.decode(get_scheduler().run(LocalBackend(path).get(COMMIT))).generation == meta.generation
    tier = memory_tier_of(open_store(path, {"memory": config}))
    return [k for k in tier.held(meta.generation) if "/data/" in k]


def ranks_disagree_on_the_tier(path: str, config: Any) -> str:
    """Rank 0 saves through the node memory tier, the others without: every rank gets the same error,
    before anything is written (no COMMIT, nothing in the tier); returns the error's message."""
    import torch.distributed as dist

    import tierckpt
    from tierckpt.errors import CheckpointError

    memory = config if dist.get_rank() == 0 else False
    try:
        tierckpt.save(path, {"w": torch.ones(8, 8)}, storage_options={"memory": memory})
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("a save with the memory tier on for some ranks only succeeded")


def ranks_disagree_on_persist(path: str, config: Any) -> str:
    """Rank 0 saves with ``persist=False``, the others with ``persist=True``: every rank gets the same
    error before anything is written; returns the error's message."""
    import torch.distributed as dist

    import tierckpt
    from tierckpt.errors import CheckpointError

    try:
        tierckpt.save(path, {"w": torch.ones(8, 8)}, storage_options={"memory": config}, persist=dist.get_rank() != 0)
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("a save with persist=False on some ranks only succeeded")
