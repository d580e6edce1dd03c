"""A child program for the tests of concurrent jobs on one checkpoint URI (one process per job).

Commands (each prints one JSON object per line on stdout)::

    python tests/racing_child.py race URI ROLE ROUNDS GATE_DIR
        two of these (ROLE 0 and 1) save to URI at the same moment in every round: each save's read
        of the base COMMIT waits until the other job has read it too (:class:`BaseReadBarrier`), so
        both saves start from the same COMMIT. Prints ``{"round", "role", "outcome", "generation"}``;
        ROLE 0 then checks the round (the winner's state loads bit-exactly and verifies, the
        root holds only the winner's generation) and prints ``{"round", "check"}``.
    python tests/racing_child.py pause URI VALUE DIR [--skew-s S] [--keep-previous] [--while-writing]
        saves make_state(VALUE) with this host's clock S seconds off, writes DIR/paused once every data
        file is written (``--while-writing``: before its data file is put in place), waits for DIR/go
        before committing (closing it), and prints ``{"outcome", "generation"}``.
    python tests/racing_child.py save-loop URI SECONDS
        saves make_state(1), make_state(2), ... to URI for SECONDS; prints ``{"saved": n}``.
    python tests/racing_child.py save-once URI VALUE
        saves make_state(VALUE) plus a spent :class:`SaveHook` under ``"hook"``.

:func:`load_replaced_midway` is a scenario for the multi-rank worker pool (tests/distributed.py).

S3 URIs are written without the node cache (``cache=False``), so the compare-and-swap on S3 itself
is what decides; with ``RACING_CHILD_CACHE=on`` in the environment they go through this job's node cache
(``TIERCKPT_CACHE_DIR``), and ``race`` checks report the generation the remote ``COMMIT`` names too.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import tierckpt  # noqa: E402
from tierckpt.saving import cleanup
from tierckpt.saving import commit as save_commit  # noqa: E402
from tierckpt.backends import open_backend  # noqa: E402
from tierckpt.errors import CheckpointBusyError  # noqa: E402
from tierckpt.io.scheduler import get_scheduler  # noqa: E402
from tierckpt.formats.verify import verify  # noqa: E402


def make_state(value: int) -> dict[str, Any]:
    """Save ``value``'s state: tensors whose every element depends on ``value``, and the value itself."""
    g = torch.Generator().manual_seed(value)
    return {
        "w": torch.randn(256, 64, generator=g),
        "ints": torch.randint(-(2**40), 2**40, (1000,), generator=g, dtype=torch.int64),
        "half": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "step": value,
    }


def empty_state() -> dict[str, Any]:
    return {"w": torch.zeros(256, 64), "ints": torch.zeros(1000, dtype=torch.int64),
            "half": torch.zeros(33, 7, dtype=torch.bfloat16), "step": -1}


def matches(loaded: dict[str, Any]) -> bool:
    """Whether a loaded state is exactly make_state(loaded["step"])."""
    want = make_state(loaded["step"])
    return all(torch.equal(loaded[k], want[k]) for k in ("w", "ints", "half"))


def options(uri: str) -> dict[str, Any]:
    cached = os.environ.get("RACING_CHILD_CACHE") == "on"
    return {"cache": False} if uri.startswith("s3://") and not cached else {}


def remote_commit(uri: str) -> str | None:
    """The generation the ``COMMIT`` of ``uri`` names on the store itself, past any node cache."""
    from tierckpt.native import layout
    from tierckpt.errors import CheckpointNotFoundError

    try:
        record = get_scheduler().run(open_backend(uri, cache=False).get(layout.COMMIT))
    except CheckpointNotFoundError:
        return None
    return layout.CommitRecord.decode(record).generation


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s}s")
        time.sleep(0.002)


class BaseReadBarrier:
    """Makes both racing jobs read the base COMMIT before either goes on: the next read of COMMIT after
    :meth:`arm` meets the other job's (a two-process barrier on files) once it has its answer.

    The saver reads COMMIT on its I/O loop while the state is flattened, so a barrier anywhere in the
    state would not hold a slow first read back: one job could read the other's fresh COMMIT and be a
    later save instead of a racing one."""

    def __init__(self, gates: Path, role: int) -> None:
        self.gates, self.role, self.armed = gates, role, None
        self.original = save_commit._read_commit
        save_commit._read_commit = self.read_commit  # type: ignore[assignment]

    def arm(self, name: str) -> None:
        self.armed = name

    async def read_commit(self, *args: Any) -> bytes | None:
        found = await self.original(*args)
        name, self.armed = self.armed, None
        if name is not None:
            (self.gates / f"{name}-{self.role}").touch()
            other = self.gates / f"{name}-{1 - self.role}"
            deadline = time.monotonic() + 60
            while not other.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{other} did not appear within 60s")
                await asyncio.sleep(0.002)
        return found


def generations(uri: str) -> list[str]:
    keys = get_scheduler().run(open_backend(uri, **options(uri)).list(""))
    return sorted({k.split("/")[0] for k in keys if k.startswith("g-")})


def race(uri: str, role: int, rounds: int, gates: Path) -> None:
    barrier = BaseReadBarrier(gates, role)
    for r in range(rounds):
        value = 1000 * (r + 1) + role
        state = make_state(value)
        barrier.arm(f"round{r}")
        try:
            meta = tierckpt.save(uri, state, storage_options=options(uri))
            emit(round=r, role=role, outcome="won", generation=meta.generation, value=value)
        except CheckpointBusyError as exc:
            emit(round=r, role=role, outcome="busy", message=str(exc))
        cleanup.wait_pending()  # the replaced generation is removed in the background after the commit
        (gates / f"done{r}-{role}").touch()
        if role == 0:
            wait_for(gates / f"done{r}-1")
            loaded = tierckpt.load(uri, empty_state(), storage_options=options(uri))
            report = verify(uri, storage_options=options(uri))
            emit(round=r, check={"step": loaded["step"], "exact": matches(loaded), "verify_ok": report.ok,
                                 "committed": report.generation, "generations": generations(uri),
                                 "remote_commit": remote_commit(uri)})


def announce(path: Path, text: str) -> None:
    """Write ``path`` whole at once (a temp file renamed over it): the test polls for it and reads it at once."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pause(uri: str, value: int, directory: Path, skew_s: float, keep_previous: bool, writing: bool = False) -> None:
    wall = time.time
    time.time = lambda: wall() + skew_s  # this host's clock is off by skew_s
    if writing:  # paused with its data file written but not yet in place (its writer not closed)
        from tierckpt.backends import local

        close = local._LocalWriter.close

        async def paused_close(self: Any) -> None:
            announce(directory / "paused", Path(self._tmp).parent.parent.name)
            await asyncio.to_thread(wait_for, directory / "go", 120)
            await close(self)

        local._LocalWriter.close = paused_close  # type: ignore[method-assign]
    else:
        original = save_commit._commit

        def paused_commit(p: Any, meta: Any, pieces: Any) -> None:
            announce(directory / "paused", p.generation)
            wait_for(directory / "go", timeout_s=120)
            original(p, meta, pieces)

        save_commit._commit = paused_commit  # type: ignore[assignment]
    try:
        meta = tierckpt.save(uri, make_state(value), keep_previous=keep_previous, storage_options=options(uri))
        emit(outcome="committed", generation=meta.generation)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        emit(outcome=f"error: {type(exc).__name__}: {exc}")


class SaveHook:
    """A stateful object whose first state_dict() on a load (``value`` set) saves make_state(value) to
    ``uri`` from another process: the generation the load follows is replaced and deleted midway."""

    def __init__(self, uri: str, value: int | None = None) -> None:
        self.uri, self.value = uri, value

    def state_dict(self) -> dict[str, Any]:
        if self.value is not None:
            value, self.value = self.value, None
            subprocess.run([sys.executable, __file__, "save-once", self.uri, str(value)], check=True, timeout=120)
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def load_replaced_midway(uri: str) -> tuple[int, bool] | None:
    """On 2 ranks: load ``uri`` while rank 0's hook replaces the checkpoint; ``(step, exact)`` per rank."""
    import torch.distributed as dist
    from distributed import subgroup

    group = subgroup(2)
    if group is None:
        return None
    hook = SaveHook(uri, 2 if dist.get_rank() == 0 else None)
    loaded = tierckpt.load(uri, empty_state() | {"hook": hook}, group=group)
    return loaded["step"], matches(loaded)


def save_loop(uri: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        n += 1
        tierckpt.save(uri, make_state(n), storage_options=options(uri))
    emit(saved=n)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    command, uri = argv[0], argv[1]
    if command == "race":
        race(uri, int(argv[2]), int(argv[3]), Path(argv[4]))
    elif command == "pause":
        skew = float(argv[argv.index("--skew-s") + 1]) if "--skew-s" in argv else 0.0
        pause(uri, int(argv[2]), Path(argv[3]), skew, "--keep-previous" in argv, "--while-writing" in argv)
    elif command == "save-once":
        tierckpt.save(uri, make_state(int(argv[2])) | {"hook": SaveHook(uri)}, storage_options=options(uri))
    elif command == "save-loop":
        save_loop(uri, float(argv[2]))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
