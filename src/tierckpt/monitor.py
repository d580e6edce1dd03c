"""Per-phase timings and byte counts of one save or load on one rank.

Pass a :class:`Monitor` as ``monitor=`` to :func:`tierckpt.save` / :func:`tierckpt.load` to read them
afterwards; saves also store every rank's phases in the checkpoint header (``timings``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Monitor:
    """Seconds per phase (``plan``, ``write``, ``read``...) and counters (``bytes_read``, ``requests``...)."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counters: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def count(self, name: str, amount: int = 1) -> None:
        self.counters[name] += amount

    def as_dict(self) -> dict[str, float]:
        out = {f"{k}_s": round(v, 6) for k, v in self.seconds.items()}
        out.update({k: float(v) for k, v in self.counters.items()})
        return out
