"""Which copies the node memory tier drops to make room for a new checkpoint. Pure: no I/O.

A *copy* is one generation of one checkpoint URI held in the tier (its data files and metadata).
:func:`plan_admission` decides, for a checkpoint of ``incoming_bytes`` about to be written:

1. If it fits beside everything held, nothing is evicted.
2. Otherwise copies are evicted, in this order, until it fits: superseded generations (a newer
   generation of their URI is committed in the tier, so none of them can ever be committed or read;
   see :func:`tierckpt.native.layout.is_superseded`), oldest first, even unsealed ones — except those
   the chain below is still owed (``owed_below``: saved to be written down while the newest commit is
   memory-only, so the chain below gets no newer commit of them); then copies that a lower tier already
   holds (``durable_below``), oldest first — so the newest checkpoints stay.
3. A copy that no lower tier holds yet, or one still being written (not sealed), is never evicted.
   If the checkpoint cannot fit even so, :class:`~.config.MemoryTierFullError` is raised naming the
   budget, the sizes and the setting to change — or, with :attr:`~.config.OnFull.FALLBACK`, the
   admission says so and the caller writes the checkpoint to the next tier instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tierckpt.node.memory.config import BYTES_ENV, FULL_ENV, MemoryTierFullError, OnFull


@dataclass(frozen=True, slots=True, kw_only=True)
class TierCopy:
    """One generation of one checkpoint held in the memory tier."""

    copy_id: str
    """``<checkpoint URI>/<generation>`` (see :func:`copy_id`)."""
    nbytes: int
    created_unix: float
    """When it was sealed (or last written, while unsealed): the order in which copies age."""
    sealed: bool = True
    """``False`` while it is still being written: never evicted."""
    superseded: bool = False
    """A newer generation of the same URI is committed in the tier; nobody reads this one."""


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of :func:`plan_admission`."""

    fits: bool
    """Whether the incoming checkpoint goes into the memory tier (after evicting ``evict``)."""
    evict: tuple[str, ...]
    """Copy ids to delete first, in order."""
    used_bytes: int | None
    """Bytes the tier held before (``None``: admitted from the process's credit, the tier not walked)."""
    reason: str | None = None
    """Why it does not fit (``fits`` is ``False``: fall back to the next tier)."""


def copy_id(uri: str, generation: str) -> str:
    """The id of a copy: the full URI of the generation (``s3://bucket/run/step-100/g-...``)."""
    return f"{uri.rstrip('/')}/{generation}"


def _age(copy: TierCopy) -> tuple[float, str]:
    return copy.created_unix, copy.copy_id


def plan_admission(
    copies: Sequence[TierCopy],
    incoming_bytes: int,
    budget_bytes: int,
    durable_below: Iterable[str],
    *,
    incoming: str = "the new checkpoint",
    on_full: OnFull = OnFull.ERROR,
    owed_below: Iterable[str] = (),
) -> Admission:
    """What to evict so ``incoming_bytes`` fit within ``budget_bytes`` (see the module docstring).

    ``durable_below``: copy ids that a lower tier (node disk, remote) holds, so the memory copy may
    go; ``owed_below``: superseded copy ids the chain below still needs, kept. ``incoming`` names the
    checkpoint in messages.
    """
    if incoming_bytes < 0 or budget_bytes < 1:
        raise ValueError(f"incoming_bytes ({incoming_bytes}) must be >= 0 and budget_bytes ({budget_bytes}) >= 1")
    durable = set(durable_below)
    used = sum(c.nbytes for c in copies)
    need = used + incoming_bytes - budget_bytes
    if need <= 0:
        return Admission(fits=True, evict=(), used_bytes=used)
    owed = set(owed_below)
    superseded = sorted((c for c in copies if c.superseded and c.copy_id not in owed), key=_age)
    lower = sorted((c for c in copies if c.sealed and not c.superseded and c.copy_id in durable), key=_age)
    evict: list[str] = []
    freed = 0
    for copy in superseded + lower:
        if freed >= need:
            break
        evict.append(copy.copy_id)
        freed += copy.nbytes
    if freed >= need:
        return Admission(fits=True, evict=tuple(evict), used_bytes=used)
    pinned = [c for c in copies if c.copy_id not in evict]
    reason = (
        f"the node memory tier cannot hold {incoming} ({incoming_bytes} bytes): its budget {BYTES_ENV} is "
        f"{budget_bytes} bytes and {sum(c.nbytes for c in pinned)} bytes are held by {len(pinned)} "
        "checkpoint copies that no lower tier holds yet or that are still being written, which are never "
        f"evicted (evicting all {len(evict)} others frees only {freed} bytes); raise {BYTES_ENV}, let "
        "uploads finish (tierckpt sync) before the next save, or set "
        f"{FULL_ENV}=fallback to write such checkpoints to the next tier instead"
    )
    if on_full is OnFull.ERROR:
        raise MemoryTierFullError(reason)
    return Admission(fits=False, evict=(), used_bytes=used, reason=reason)
