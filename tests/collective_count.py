"""Counting the torch.distributed calls a save or load issues (run on every rank of a test's group)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather_object", "broadcast_object_list", "broadcast", "all_gather",
               "monitored_barrier", "barrier", "all_to_all_single", "gather_object", "gather")


@contextmanager
def counting_collectives() -> Iterator[Counter[str]]:
    """Within the block, every call of :data:`COLLECTIVES` through ``torch.distributed`` is counted by name
    (point-to-point sends and receives are not)."""
    import torch.distributed as dist

    counts: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
