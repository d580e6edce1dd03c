"""Who reads each unit and in which round (steps 3 and 4 of :mod:`.load_planner`)."""

from __future__ import annotations

from collections import defaultdict

from tierckpt.planner.plan_types import ReadUnit, whole_to_other


COALESCE_GAP_BYTES = 64
"""The gap bound: a reader's units of one file at most this many bytes apart — the padding that aligns
saved pieces (64 bytes by default) — may be fetched in one request, where no other read covers the
gap: a few bytes cost an object store's link nanoseconds, a request milliseconds. Wider gaps (a torch
DCP file's record headers, pieces nobody loads) are not read through."""
READER_SHARE = 0.75
"""A rank that needs at least this share of what the top needer needs of a unit may read it."""


def choose_readers(drafts: list[dict], world: int, chunk_bytes: int) -> None:
    """Set each draft's reader, in file order: the least-loaded rank among those that need (nearly)
    the most of it — unless the unit continues in its file, within :data:`COALESCE_GAP_BYTES`, one
    that an eligible rank reads and that rank is at most ``chunk_bytes`` ahead of the least loaded. One reader's adjacent
    units then become one request on stores that charge per request, at a bounded imbalance."""
    load = [0] * world
    previous: tuple[str, int, int] | None = None
    """File, end offset and reader of the last single-run unit."""
    for draft in drafts:
        wanted: dict[int, int] = defaultdict(int)
        for d in draft["deliveries"]:
            wanted[d.rank] += d.numel
        most = max(wanted.values())
        eligible = [r for r, n in wanted.items() if n >= READER_SHARE * most]
        reader = min(eligible, key=lambda r: (load[r], r))
        offsets = draft["run_offsets"]
        if (previous is not None and len(offsets) == 1 and draft["file"] == previous[0]
                and 0 <= int(offsets[0]) - previous[1] <= COALESCE_GAP_BYTES):
            if previous[2] in eligible and load[previous[2]] - load[reader] <= chunk_bytes:
                reader = previous[2]
        draft["reader"] = reader
        load[reader] += draft["box"].numel * draft["item"]
        previous = (draft["file"], int(offsets[0]) + draft["run_bytes"], reader) if len(offsets) == 1 else None


def assign_rounds(
    drafts: list[dict], world: int, round_bytes: int
) -> tuple[tuple[ReadUnit, ...], tuple[tuple[int, ...], ...], tuple[bool, ...]]:
    units: list[ReadUnit] = []
    rounds: list[list[int]] = []
    exchanges: list[bool] = []
    usage = [0] * world
    for draft in drafts:
        item = draft.pop("item")
        reader = draft["reader"]
        add = defaultdict(int)
        if not whole_to_other(reader, draft["box"], draft["deliveries"]):  # else read into the send buffer
            add[reader] += draft["box"].numel * item
        crosses = False
        for d in draft["deliveries"]:
            if d.rank != reader:
                crosses = True
                add[d.rank] += d.numel * item
                add[reader] += d.numel * item
        if not rounds or (rounds[-1] and any(usage[r] + a > round_bytes for r, a in add.items())):
            rounds.append([])
            exchanges.append(False)
            usage = [0] * world
        for r, a in add.items():
            usage[r] += a
        exchanges[-1] = exchanges[-1] or crosses
        rounds[-1].append(len(units))
        units.append(ReadUnit(round=len(rounds) - 1, **draft))
    return tuple(units), tuple(tuple(r) for r in rounds), tuple(exchanges)
