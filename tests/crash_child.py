"""A child program for crash-consistency tests: save a known state N times, and die on cue.

Standalone::

    TIERCKPT_CRASH_AT=local.put:3 python tests/crash_child.py /tmp/ckpt --saves 3 [--start 0]
        [--storage-options '{"endpoint_url": ...}']

prints ``gen <i> <generation>`` when save *i* has picked its generation and ``committed <i> <generation>``
after save *i* returned (its ``COMMIT`` is written). Save *i* writes :func:`make_state(i)`, so the
parent recomputes the exact bytes of any iteration.

``TIERCKPT_CRASH_AT=<event>:<n>`` makes the child SIGKILL itself on the n-th call of the internal
function named by ``<event>`` (see :data:`EVENTS`); ``<event>.after`` kills right after the n-th call
returned. The patches are installed in this process only. Without the variable the child runs all
saves and exits 0; the parent may also SIGKILL it after a random delay.

Fork server (used by the tests, so torch is imported once instead of once per kill)::

    python tests/crash_child.py --serve

reads one JSON job per line on stdin (``{"uri", "saves", "start", "crash_at", "out",
"storage_options"}``), forks a child per job that writes the lines above to the file ``out``, and
answers ``pid <pid>`` then ``exit <pid> <status>`` (``status`` as ``os.waitstatus_to_exitcode``:
``-9`` for SIGKILL). The server itself never runs torch ops or storage I/O, so forking is safe.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import signal
import sys
from typing import Any, TextIO

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import tierckpt  # noqa: E402
from tierckpt.saving import cleanup
from tierckpt.native import layout  # noqa: E402

# -- the known state ---------------------------------------------------------------------------------
SHAPES = {
    "model.big": ((1024, 4096), torch.float32),  # 16 MiB
    "model.mid": ((512, 512), torch.float64),  # 2 MiB
    "model.bf16": ((3, 5, 7), torch.bfloat16),
    "model.ints": ((10_000,), torch.int64),
    "model.scalar": ((), torch.float32),
    "optim.buf": ((333, 17), torch.float16),
}


def make_state(i: int) -> dict[str, Any]:
    """The state that save ``i`` writes: tensors whose every element depends on ``i``, plus objects."""
    state: dict[str, Any] = {}
    for k, (name, (shape, dtype)) in enumerate(sorted(SHAPES.items())):
        n = 1
        for d in shape:
            n *= d
        if dtype.is_floating_point:
            t = torch.arange(n, dtype=torch.float64).mul_(i + 3).add_(k * 7919).div_(8).sub_(100 * i)
        else:
            t = torch.arange(n, dtype=torch.int64).mul_(i + 1).add_(k)
        state[name] = t.to(dtype).reshape(shape)
    state["step"] = i
    state["extra"] = {"iteration": i, "name": f"iter-{i}", "lr": [0.1 * i, 1e-3], "flags": (True, None)}
    return state


def empty_state() -> dict[str, Any]:
    """A target for :func:`tierckpt.load` with the same keys, filled with garbage."""
    state: dict[str, Any] = {n: torch.full(s, 7, dtype=d) if s else torch.tensor(7, dtype=d) for n, (s, d) in SHAPES.items()}
    state["step"] = -1
    state["extra"] = {"iteration": -1, "name": "", "lr": None, "flags": None}
    return state


def states_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit-exact equality of two states made by :func:`make_state` / loaded into :func:`empty_state`."""
    for name in SHAPES:
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)):
            return False
    return a["step"] == b["step"] and a["extra"] == b["extra"]


# -- crash points -------------------------------------------------------------------------------------
def _targets() -> dict[str, tuple[Any, str]]:
    from tierckpt.saving import commit as save_commit
    from tierckpt.backends import files, fsspec_backend, local, s3
    from tierckpt.io import staging

    return {
        # local backend: whole-object writes (objects, 3 metadata docs, COMMIT), streamed data file
        "local.put": (local.LocalBackend, "put"),
        "local.commit": (local.LocalBackend, "commit"),
        "local.open_writer": (local.LocalBackend, "open_writer"),
        "local.write": (local._LocalWriter, "write"),
        "local.close": (local._LocalWriter, "close"),
        "local.delete_prefix": (local.LocalBackend, "delete_prefix"),  # the sweep: a generation's directory
        "local.unlink": (files.os, "unlink"),  # each file the sweep's removal of that directory unlinks
        # between fsync of the temp file and the rename, in the worker thread
        "local.publish": (files, "publish"),
        "local.replace": (files.os, "replace"),
        # the saver: metadata + COMMIT (rank 0), and the data stream of the rank
        "saver.commit": (save_commit, "_commit"),
        "saver.finish_rank": (save_commit, "_finish_rank"),
        "staging.put": (staging.FileStream, "put"),
        "staging.finish": (staging.FileStream, "finish"),
        # S3 / fsspec backend
        "s3.commit": (s3.S3Backend, "commit"),
        "s3.upload_part": (s3._MultipartWriter, "_upload_part"),
        "s3.mpu_close": (s3._MultipartWriter, "close"),
        "s3.delete_prefix": (fsspec_backend.FsspecBackend, "delete_prefix"),
    }


def _s3op_target() -> tuple[Any, str]:
    import s3fs

    return s3fs.S3FileSystem, "_call_s3"


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install_crash(spec: str | None) -> None:
    """Install the patch described by ``<event>[.after]:<n>`` (no-op for ``None`` / empty)."""
    if not spec:
        return
    event, _, count = spec.rpartition(":")
    n = int(count)
    after = event.endswith(".after")
    if after:
        event = event[: -len(".after")]
    op_name = None
    if event.startswith("s3op."):  # s3op.<botocore method>, e.g. s3op.upload_part
        owner, attr = _s3op_target()
        op_name = event[len("s3op.") :]
    else:
        targets = _targets()
        if event not in targets:
            raise SystemExit(f"unknown crash event {event!r}; known: {sorted(targets)} and s3op.<method>")
        owner, attr = targets[event]
    original = getattr(owner, attr)
    calls = [0]

    def hit(args: tuple[Any, ...]) -> bool:
        if op_name is not None and (len(args) < 2 or args[1] != op_name):
            return False  # _call_s3(self, method, ...)
        calls[0] += 1
        return calls[0] == n

    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            fire = hit(args)
            if fire and not after:
                _die()
            result = await original(*args, **kwargs)
            if fire:
                _die()
            return result

    else:

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            fire = hit(args)
            if fire and not after:
                _die()
            result = original(*args, **kwargs)
            if fire:
                _die()
            return result

    setattr(owner, attr, wrapper)
    from tierckpt.backends import local

    if owner is not local and getattr(local, attr, None) is original:  # a file operation the backend imported by name
        setattr(local, attr, wrapper)


# -- the save loop ---------------------------------------------------------------------------------
def run_saves(uri: str, saves: int, start: int, storage_options: dict[str, Any] | None, out: TextIO) -> None:
    torch.set_num_threads(1)
    current = [start]
    new_generation = layout.new_generation

    def announced(*args: Any) -> str:
        gen = new_generation(*args)
        out.write(f"gen {current[0]} {gen}\n")
        out.flush()
        return gen

    layout.new_generation = announced  # type: ignore[assignment]
    for i in range(start, start + saves):
        current[0] = i
        state = make_state(i)
        meta = tierckpt.save(uri, state, storage_options=storage_options)
        out.write(f"committed {i} {meta.generation}\n")
        out.flush()


def _child(job: dict[str, Any]) -> None:
    with open(job["out"], "w", buffering=1) as out:
        try:
            install_crash(job.get("crash_at"))
            run_saves(job["uri"], job["saves"], job.get("start", 0), job.get("storage_options"), out)
            cleanup.wait_pending()  # what a normal exit's drain waits for (os._exit skips it)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent through the file
            out.write(f"error {type(exc).__name__}: {' '.join(str(exc).split())}\n")
            out.flush()
            os._exit(3)
    os._exit(0)


def serve() -> None:
    """The fork server (see the module docstring)."""
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                _child(job)
            finally:
                os._exit(4)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("uri", nargs="?")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--storage-options", type=json.loads, default=None)
    parser.add_argument("--serve", action="store_true")
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return
    if not args.uri:
        parser.error("a URI is required (or --serve)")
    install_crash(os.environ.get("TIERCKPT_CRASH_AT"))
    run_saves(args.uri, args.saves, args.start, args.storage_options, sys.stdout)


if __name__ == "__main__":
    main()
