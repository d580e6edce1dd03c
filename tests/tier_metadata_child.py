"""Scenarios run on every rank of the test pool (real gloo ranks of one simulated node) for
``test_tier_metadata.py``: loads whose metadata comes from the node memory tier, and the object gather."""

from __future__ import annotations

from typing import Any

import torch

from collective_count import counting_collectives


def make() -> dict[str, torch.Tensor]:
    """Replicated tensors: on one node the plan gives each rank its own to read."""
    return {name: torch.full((64, 32), float(i)) + torch.arange(32.0) for i, name in enumerate("abcd")}


def save(path: str, config: Any) -> None:
    import tierckpt

    tierckpt.save(path, make(), storage_options={"memory": config})


def load_counting(path: str, config: Any) -> dict[str, Any]:
    """Load on every rank, counting the collectives the load issues; whether it was bit-exact."""
    import tierckpt

    got = {name: torch.zeros(64, 32) for name in "abcd"}
    with counting_collectives() as counts:
        tierckpt.load(path, got, storage_options={"memory": config})
    return {"exact": all(torch.equal(got[n], make()[n]) for n in "abcd"), "collectives": dict(counts)}


def load_counting_reads(path: str) -> dict[str, Any]:
    """Load on every rank with no memory tier, counting the documents this rank reads (by file name)."""
    from collections import Counter

    import tierckpt
    from tierckpt.backends.local import LocalBackend

    reads: Counter[str] = Counter()
    original = LocalBackend.get_capped

    async def counting(self: LocalBackend, key: str, cap: int) -> bytes:
        reads[key.rsplit("/", 1)[-1]] += 1
        return await original(self, key, cap)

    got = {name: torch.zeros(64, 32) for name in "abcd"}
    LocalBackend.get_capped = counting  # type: ignore[method-assign]
    try:
        tierckpt.load(path, got, storage_options={"memory": False})
    finally:
        LocalBackend.get_capped = original  # type: ignore[method-assign]
    return {"exact": all(torch.equal(got[n], make()[n]) for n in "abcd"), "reads": dict(reads)}


def load_error(path: str, config: Any) -> str:
    """The message of the error every rank's load raises ("no error" if it returned)."""
    import tierckpt

    try:
        tierckpt.load(path, {name: torch.zeros(64, 32) for name in "abcd"}, storage_options={"memory": config})
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def gather(sizes: list[int]) -> list[Any]:
    """``Comm.all_gather_object`` of an object that pickles to about ``sizes[rank]`` bytes (``None`` for -1)."""
    import torch.distributed as dist

    from tierckpt.comm import Comm

    rank = dist.get_rank()
    size = sizes[rank]
    return Comm().all_gather_object(None if size < 0 else (rank, bytes([rank]) * size))
