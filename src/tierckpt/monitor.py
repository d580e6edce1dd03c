"""Monitoring: per-phase timings and byte counts of every save and load, on every rank.

* :class:`Monitor` — pass one as ``monitor=`` to read a call's phases (``plan``, ``stage``, ``write``,
  ``commit``, ``metadata``, ``read``, ...) and counters (``bytes_written``, ``bytes_read``,
  ``requests``, ``bytes_exchanged``...). After the call, ``monitor.ranks`` holds every rank's summary
  and :func:`straggler_report` names the slowest rank and the skew of each phase.
* Saves store every rank's phases and counters in the checkpoint header (``timings``), so
  ``tierckpt stats URI`` shows them later.
* Opt-in outputs, per process: ``TIERCKPT_TRACE=path`` appends a Chrome-trace/Perfetto timeline to
  ``path.rank<R>.json``; ``TIERCKPT_METRICS=path`` appends one JSON line per call to
  ``path.rank<R>.jsonl``; :func:`prometheus_text` renders cumulative counters for scraping.
* Logging goes to the ``tierckpt`` logger, which is quiet unless the application configures it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tierckpt import progress as _progress

logger = logging.getLogger("tierckpt")

TRACE_ENV = "TIERCKPT_TRACE"
METRICS_ENV = "TIERCKPT_METRICS"


@dataclass(frozen=True, slots=True)
class Span:
    """One timed phase: wall-clock start (seconds since the epoch) and duration."""

    phase: str
    start_unix: float
    seconds: float


@dataclass
class Monitor:
    """Seconds per phase and counters of one call on one rank (see the module docstring)."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counters: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    spans: list[Span] = field(default_factory=list)
    ranks: list[dict[str, float]] = field(default_factory=list)
    """Every rank's :meth:`summary`, in rank order, once the call has finished."""
    trace_path: str | None = None
    """Where to append a Chrome trace (defaults to ``$TIERCKPT_TRACE``)."""
    progress: Any = field(default_factory=_progress.current, repr=False, compare=False)
    """The :class:`~tierckpt.progress.ByteProgress` fed by the byte counters in
    :data:`~tierckpt.progress.MOVED_COUNTERS` (default: the bar shown when the monitor was made)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        wall, start = time.time(), time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[name] += elapsed
            self.spans.append(Span(name, wall, elapsed))

    def add_seconds(self, name: str, seconds: float) -> None:
        """Busy time of a stage that overlaps others (checksum, file write, upload): no span of its own."""
        self.seconds[name] += seconds

    def count(self, name: str, amount: int = 1) -> None:
        self.counters[name] += amount
        if self.progress is not None and name in _progress.MOVED_COUNTERS:
            self.progress.add(amount)

    def summary(self) -> dict[str, float]:
        """Phases as ``<phase>_s`` and counters, as plain floats (what the header stores)."""
        out = {f"{k}_s": round(v, 6) for k, v in self.seconds.items()}
        out.update({k: float(v) for k, v in self.counters.items()})
        return out

    as_dict = summary

    def finish(self, op: str, uri: str, rank: int, ranks: Sequence[Mapping[str, float]]) -> None:
        """Record the group's summaries and write the opt-in outputs for this call."""
        self.ranks = [dict(r) for r in ranks]
        REGISTRY.add(op, self)
        trace = self.trace_path or os.environ.get(TRACE_ENV)
        if trace:
            _append_trace(f"{trace}.rank{rank}.json", op, uri, rank, self.spans)
        metrics = os.environ.get(METRICS_ENV)
        if metrics:
            line = {"op": op, "uri": uri, "rank": rank, "time_unix": time.time(), **self.summary()}
            with open(f"{metrics}.rank{rank}.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s %s on rank %d: %s", op, uri, rank, self.describe())

    def describe(self) -> str:
        """One readable line: phases in seconds, then counters as integers, byte counts also in binary units.

        ``plan 0.002 s, stage 0.812 s, write 0.815 s; bytes_written 1288490188 (1.2 GiB), requests 12``
        """
        phases = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in self.seconds.items())
        counters = ", ".join(
            f"{name} {value} ({format_bytes(value)})" if name.startswith("bytes_") else f"{name} {value}"
            for name, value in sorted(self.counters.items())
        )
        return "; ".join(part for part in (phases, counters) if part) or "nothing measured"


def format_bytes(n: float) -> str:
    """``1288490188`` -> ``"1.2 GiB"``; under 1 KiB, ``"512 B"``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def straggler_report(ranks: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per phase (``*_s`` keys): slowest rank, max, mean, min seconds and skew (max / mean)."""
    report: dict[str, dict[str, float]] = {}
    phases = sorted({k for r in ranks for k in r if k.endswith("_s")})
    for phase in phases:
        values = [r.get(phase, 0.0) for r in ranks]
        mean = sum(values) / len(values)
        slowest = max(range(len(values)), key=lambda i: values[i])
        report[phase.removesuffix("_s")] = {
            "slowest_rank": float(slowest),
            "max_s": values[slowest],
            "mean_s": mean,
            "min_s": min(values),
            "skew": values[slowest] / mean if mean > 0 else 1.0,
        }
    return report


def ranks_from_timings(timings: Mapping[str, float]) -> list[dict[str, float]]:
    """Undo the header's ``rank<R>.<name>`` flattening into one summary per rank."""
    per_rank: dict[int, dict[str, float]] = defaultdict(dict)
    for key, value in timings.items():
        head, _, name = key.partition(".")
        if head.startswith("rank") and head[4:].isdigit() and name:
            per_rank[int(head[4:])][name] = value
    return [per_rank[r] for r in sorted(per_rank)]


def _append_trace(path: str, op: str, uri: str, rank: int, spans: Sequence[Span]) -> None:
    """Append complete ('X') events; Chrome's JSON array format allows the closing bracket to be omitted."""
    new = not os.path.exists(path)
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write("[\n")
        for span in spans:
            event = {
                "name": span.phase, "cat": op, "ph": "X", "pid": rank, "tid": op,
                "ts": span.start_unix * 1e6, "dur": span.seconds * 1e6, "args": {"uri": uri},
            }
            f.write(json.dumps(event) + ",\n")


class _Registry:
    """Cumulative, process-wide counters for the Prometheus exposition."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, int] = defaultdict(int)
        self._seconds: dict[tuple[str, str], float] = defaultdict(float)
        self._counters: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, op: str, monitor: Monitor) -> None:
        with self._lock:
            self._calls[op] += 1
            for phase, seconds in monitor.seconds.items():
                self._seconds[(op, phase)] += seconds
            for name, value in monitor.counters.items():
                self._counters[(op, name)] += value

    def text(self) -> str:
        with self._lock:
            lines = [
                "# HELP tierckpt_calls_total Saves and loads finished by this process.",
                "# TYPE tierckpt_calls_total counter",
                *(f'tierckpt_calls_total{{op="{op}"}} {n}' for op, n in sorted(self._calls.items())),
                "# HELP tierckpt_phase_seconds_total Seconds spent per phase.",
                "# TYPE tierckpt_phase_seconds_total counter",
                *(f'tierckpt_phase_seconds_total{{op="{op}",phase="{p}"}} {v:.6f}' for (op, p), v in sorted(self._seconds.items())),
                "# HELP tierckpt_events_total Bytes and requests counted per call (bytes_written, bytes_read, requests...).",
                "# TYPE tierckpt_events_total counter",
                *(f'tierckpt_events_total{{op="{op}",name="{n}"}} {v}' for (op, n), v in sorted(self._counters.items())),
            ]
        return "\n".join(lines) + "\n"


REGISTRY = _Registry()


def prometheus_text() -> str:
    """This process's cumulative tierckpt metrics in the Prometheus text exposition format."""
    return REGISTRY.text()
