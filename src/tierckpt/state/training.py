"""Training state beyond weights: RNG streams, a resumable data-parallel sampler, a multi-source reader.

Each class here is saved by putting it in the state passed to ``tierckpt.save``/``load``. They
implement ``state_dict()`` and ``load_resharded(states)``: tierckpt saves every rank's state dict
(once if they are all equal) and on load hands each rank the list of every saved rank's value, in
saved rank order, so the object picks, splits or merges per-rank state when the data-parallel (DP)
size changes. State dicts hold only ints, floats, strings, lists, dicts and tensors, so they load
with ``torch.load(weights_only=True)``.

Resharding rules (also in docs/training-state.md):

* :class:`RNGState` — rank ``r`` takes saved rank ``r`` if it exists, else saved rank ``r % saved_world``.
* :class:`ResumableSampler` — the state is the global position in a global sample order that does
  not depend on the DP size; any DP size continues from it with no sample skipped or repeated.
* :class:`MultiSourceReader` — each source is dealt round-robin to DP ranks; resharding recomputes,
  per source, the first unread item and the few already-read items past it from every old rank's
  count, and hands old rank ``r``'s token buffer to new rank ``r % new_dp_size``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import torch

from tierckpt.errors import CheckpointError

__all__ = ["MultiSourceReader", "RNGState", "ResumableSampler", "skip_to"]


def _group_rank_world(group: Any = None) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _dedup_by_rank(states: Sequence[Mapping[str, Any]], key: str) -> dict[int, Mapping[str, Any]]:
    """Saved states keyed by ``state[key]``, keeping the first of replicas (e.g. TP ranks of one DP rank)."""
    if not states:
        raise CheckpointError("load_resharded got no saved state")
    out: dict[int, Mapping[str, Any]] = {}
    for s in states:
        if not isinstance(s, Mapping) or key not in s:
            raise CheckpointError(f"saved state has no {key!r}: it was not written by this class")
        out.setdefault(int(s[key]), s)
    return out


# -- RNG -------------------------------------------------------------------------------------------
class RNGState:
    """This rank's random generators: torch CPU, CUDA (every device, when available), numpy, ``random``.

    Per rank: every rank's state is saved. On load, rank ``r`` of the loading group takes saved rank
    ``r``'s state, else saved rank ``r % saved_world`` (so growing the job repeats streams on the new
    ranks; reseed them if that matters). ``rank``/``world_size`` default to ``group``'s (or 0 and 1
    without torch.distributed).
    """

    def __init__(self, rank: int | None = None, world_size: int | None = None, group: Any = None) -> None:
        g_rank, g_world = _group_rank_world(group)
        self.rank = g_rank if rank is None else rank
        self.world_size = g_world if world_size is None else world_size

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        version, internal, gauss_next = random.getstate()
        sd: dict[str, Any] = {
            "rank": self.rank,
            "world_size": self.world_size,
            "torch": torch.get_rng_state(),
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": {"version": int(version), "internal": list(internal), "gauss_next": gauss_next},
        }
        if torch.cuda.is_available():
            sd["cuda"] = list(torch.cuda.get_rng_state_all())
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        torch.set_rng_state(sd["torch"])
        n = sd["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
        p = sd["python"]
        random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
        if "cuda" in sd and torch.cuda.is_available():
            states = sd["cuda"]
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)
            else:
                torch.cuda.set_rng_state(states[torch.cuda.current_device() % len(states)])

    def load_resharded(self, states: list[Mapping[str, Any]]) -> None:
        by_rank = _dedup_by_rank(states, "rank")
        if len(by_rank) == 1:
            self.load_state_dict(next(iter(by_rank.values())))
            return
        saved_world = int(next(iter(by_rank.values()))["world_size"])
        source = self.rank if self.rank in by_rank else self.rank % saved_world
        if source not in by_rank:
            raise CheckpointError(f"RNG state: no saved state for rank {source} (saved ranks {sorted(by_rank)})")
        self.load_state_dict(by_rank[source])


# -- map-style sampler -----------------------------------------------------------------------------
def _split_sizes(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


class ResumableSampler:
    """A data-parallel batch sampler over ``num_samples`` indices that resumes exactly under any DP size.

    Each epoch has one *global* order (a permutation seeded by ``seed + epoch``, or ``range`` without
    ``shuffle``), cut into global batches of ``global_batch_size``; DP rank ``r`` takes the ``r``-th
    contiguous part of each global batch (sizes as even as possible, earlier ranks one more). Iterating
    yields this rank's index lists and advances the global position ``consumed`` by one global batch
    per yield; at the end of an epoch ``epoch`` increments and ``consumed`` returns to 0. A final
    partial global batch is dealt the same way unless ``drop_last``.

    The state (``seed``, ``epoch``, ``consumed``, batch size) is the same on every rank, so it is stored
    once and loads under any DP size: the remaining samples are exactly the unconsumed ones.

    With a ``DataLoader`` that prefetches (``num_workers > 0``), the sampler runs ahead of training;
    pass ``auto_advance=False`` and call :meth:`advance` after each optimizer step instead.
    """

    def __init__(
        self, num_samples: int, global_batch_size: int, dp_rank: int, dp_size: int, *, seed: int = 0,
        shuffle: bool = True, drop_last: bool = False, auto_advance: bool = True,
    ) -> None:
        if global_batch_size < dp_size:
            raise CheckpointError(f"global_batch_size {global_batch_size} is smaller than dp_size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise CheckpointError(f"dp_rank {dp_rank} is not in 0..{dp_size - 1}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle, self.drop_last, self.auto_advance = seed, shuffle, drop_last, auto_advance
        self.epoch = 0
        self.consumed = 0

    def order(self, epoch: int) -> list[int]:
        """The global sample order of ``epoch``."""
        if not self.shuffle:
            return list(range(self.num_samples))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def _epoch_end(self) -> int:
        if self.drop_last:
            return self.num_samples - self.num_samples % self.global_batch_size
        return self.num_samples

    def local_part(self, global_batch: Sequence[int]) -> list[int]:
        sizes = _split_sizes(len(global_batch), self.dp_size)
        start = sum(sizes[: self.dp_rank])
        return list(global_batch[start : start + sizes[self.dp_rank]])

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches from the current position to the end of the current epoch."""
        end = self._epoch_end()
        if self.consumed >= end:
            self.epoch, self.consumed = self.epoch + 1, 0
        order = self.order(self.epoch)
        pos = self.consumed
        while pos < end:
            global_batch = order[pos : min(pos + self.global_batch_size, end)]
            pos += len(global_batch)
            if self.auto_advance:
                self.advance()
            yield self.local_part(global_batch)

    def advance(self, global_batches: int = 1) -> None:
        """Mark ``global_batches`` global batches consumed (rolling over to the next epoch at its end)."""
        for _ in range(global_batches):
            self.consumed = min(self.consumed + self.global_batch_size, self._epoch_end())
            if self.consumed >= self._epoch_end():
                self.epoch, self.consumed = self.epoch + 1, 0

    def next_batch(self) -> list[int]:
        """This rank's next batch, continuing into the next epoch when one ends."""
        for _ in range(2):
            for batch in self:
                return batch
        raise CheckpointError("the sampler yields no batch (empty dataset?)")

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed,
                "global_batch_size": self.global_batch_size, "num_samples": self.num_samples, "shuffle": self.shuffle}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if sd["num_samples"] != self.num_samples or sd["seed"] != self.seed or sd["shuffle"] != self.shuffle:
            raise CheckpointError(
                f"sampler state is for {sd['num_samples']} samples, seed {sd['seed']}, shuffle {sd['shuffle']}; this "
                f"sampler has {self.num_samples}, {self.seed}, {self.shuffle}: the data order would differ"
            )
        self.epoch, self.consumed = int(sd["epoch"]), int(sd["consumed"])

    def load_resharded(self, states: list[Mapping[str, Any]]) -> None:
        """The state is global (equal on every saved rank); ``states`` normally has one element."""
        if any(dict(s) != dict(states[0]) for s in states[1:]):
            raise CheckpointError("sampler states differ between saved ranks; they must agree on the global position")
        self.load_state_dict(states[0])


# -- multi-source streaming reader -----------------------------------------------------------------
def skip_to(make: Callable[[], Iterable[Any]]) -> Callable[[int], Iterator[Any]]:
    """Adapt a plain iterable factory to the ``factory(start)`` form by reading and dropping ``start`` items."""
    return lambda start: islice(iter(make()), start, None)


@dataclass
class _Stream:
    """One source as dealt to one DP rank: items ``j >= base`` with ``(j - base) % dp_size == dp_rank``,
    except ``excluded`` (already read before a reshard); ``count`` of them have been read."""

    base: int = 0
    excluded: list[int] = field(default_factory=list)
    count: int = 0

    def end(self, rank: int, size: int) -> int:
        """One past the global index of this rank's last read item (``base + rank`` when none)."""
        if self.count == 0:
            return self.base + rank
        pos = self.base + rank + (self.count - 1) * size
        for x in self.excluded:  # sorted: each excluded item of this class at or below pos shifts it
            if (x - self.base) % size == rank and x <= pos:
                pos += size
        return pos + size


class MultiSourceReader:
    """Mixes several streaming sources into fixed-length token sequences for one DP rank.

    ``sources`` maps a name to ``factory(start) -> iterator`` of items from global item index
    ``start`` on (use :func:`skip_to` for a plain iterable); an item is a sequence of token ids. Each
    source is dealt round-robin to the DP ranks at item granularity. Each draw picks a non-exhausted
    source with probability proportional to ``weights`` (a deterministic function of seed, DP rank and
    draw number), appends its next item's tokens to a buffer, and the reader yields ``seq_len``-token
    lists from the buffer (and the final partial one when every source is exhausted).

    Per-rank state: per source the number of items read, the token buffer and the draw count. On
    load under another DP size, :meth:`load_resharded` merges the saved ranks' counts into, per
    source, the first unread global item (``base``) and the already-read items past it
    (``excluded``); the new ranks deal the items from ``base`` round-robin, skipping ``excluded``. Old
    rank ``r``'s buffer goes to new rank ``r % dp_size`` (concatenated in rank order). So the items and
    tokens read before and after a reshard are exactly those of an uninterrupted run: none skipped,
    none repeated.
    """

    def __init__(
        self, sources: Mapping[str, Callable[[int], Iterable[Sequence[int]]]], weights: Mapping[str, float],
        dp_rank: int, dp_size: int, *, seq_len: int, seed: int = 0,
    ) -> None:
        if set(weights) != set(sources):
            raise CheckpointError(f"weights name {sorted(weights)}, sources {sorted(sources)}: they must match")
        if not 0 <= dp_rank < dp_size:
            raise CheckpointError(f"dp_rank {dp_rank} is not in 0..{dp_size - 1}")
        self.sources = dict(sources)
        self.weights = {k: float(v) for k, v in weights.items()}
        self.dp_rank, self.dp_size, self.seq_len, self.seed = dp_rank, dp_size, seq_len, seed
        self.streams = {name: _Stream() for name in sorted(sources)}
        self.buffer: list[int] = []
        self.draws = 0
        self._iters: dict[str, Iterator[Any] | None] = {}
        self._exhausted: set[str] = set()

    # reading
    def _open(self, name: str) -> Iterator[tuple[int, Any]]:
        """(global index, item) of this rank's remaining items of ``name``."""
        s = self.streams[name]
        start = s.end(self.dp_rank, self.dp_size)
        excluded = set(s.excluded)
        for j, item in enumerate(self.sources[name](start), start=start):
            if (j - s.base) % self.dp_size == self.dp_rank and j not in excluded:
                yield j, item

    def _next_item(self, name: str) -> Sequence[int] | None:
        it = self._iters.get(name)
        if it is None:
            it = self._iters[name] = self._open(name)
        try:
            _, item = next(it)
        except StopIteration:
            self._exhausted.add(name)
            return None
        self.streams[name].count += 1
        return item

    def _choose(self) -> str | None:
        live = [n for n in self.streams if n not in self._exhausted and self.weights[n] > 0]
        if not live:
            return None
        u = random.Random(f"{self.seed}/{self.dp_rank}/{self.draws}").random() * sum(self.weights[n] for n in live)
        for name in live:
            u -= self.weights[name]
            if u < 0:
                return name
        return live[-1]

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        while len(self.buffer) < self.seq_len:
            name = self._choose()
            if name is None:
                break
            self.draws += 1
            item = self._next_item(name)
            if item is not None:
                self.buffer.extend(int(t) for t in item)
        if not self.buffer:
            raise StopIteration
        out, self.buffer = self.buffer[: self.seq_len], self.buffer[self.seq_len :]
        return out

    # state
    def state_dict(self) -> dict[str, Any]:
        return {
            "dp_rank": self.dp_rank, "dp_size": self.dp_size, "seed": self.seed, "draws": self.draws,
            "buffer": list(self.buffer),
            "sources": {n: {"base": s.base, "excluded": list(s.excluded), "count": s.count} for n, s in self.streams.items()},
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore this rank's own state, saved under the same DP size."""
        self.load_resharded([sd])

    def load_resharded(self, states: list[Mapping[str, Any]]) -> None:
        by_rank = _dedup_by_rank(states, "dp_rank")
        some = next(iter(by_rank.values()))
        old_size = int(some["dp_size"])
        own = old_size == self.dp_size and self.dp_rank in by_rank
        if sorted(by_rank) != list(range(old_size)) and not own:
            raise CheckpointError(f"reader state: saved DP ranks {sorted(by_rank)} do not cover dp_size {old_size}")
        if set(some["sources"]) != set(self.streams):
            raise CheckpointError(f"reader state names sources {sorted(some['sources'])}, this reader {sorted(self.streams)}")
        self._iters, self._exhausted = {}, set()
        if own:
            sd = by_rank[self.dp_rank]
            self.streams = {n: _Stream(v["base"], list(v["excluded"]), v["count"]) for n, v in sd["sources"].items()}
            self.buffer, self.draws = list(sd["buffer"]), int(sd["draws"])
            return
        for name in self.streams:
            olds = {r: by_rank[r]["sources"][name] for r in range(old_size)}
            first = olds[0]
            base, excluded = int(first["base"]), list(first["excluded"])
            ends = {r: _Stream(base, excluded, int(v["count"])).end(r, old_size) for r, v in olds.items()}
            read = set(excluded)
            for r, e in ends.items():
                read.update(range(base + r, e, old_size))
            new_base = base
            while new_base in read:
                new_base += 1
            self.streams[name] = _Stream(new_base, sorted(j for j in read if j >= new_base), 0)
        self.buffer = [t for r in range(old_size) if r % self.dp_size == self.dp_rank for t in by_rank[r]["buffer"]]
        self.draws = sum(int(by_rank[r]["draws"]) for r in range(old_size) if r % self.dp_size == self.dp_rank)
