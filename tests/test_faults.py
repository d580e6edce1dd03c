"""Storage and collective faults: transient S3 errors are retried, exhausted retries and dead endpoints
fail clearly without harming the committed checkpoint, ENOSPC leaves nothing committed-looking, and a
rank that never joins a save does not hang the other one.

S3 faults go through :class:`fault_proxy.FaultProxy`, a reverse proxy in front of the moto server.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError, StorageError
from tierckpt.io.scheduler import get_scheduler

sys.path.insert(0, str(Path(__file__).parent))
from fault_proxy import FaultProxy, Rule  # noqa: E402

TIMEOUT_S = 2.0
FIGURES: dict[str, Any] = {}


def make_state(i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    return {
        "w": torch.randn(512, 1024, generator=g),  # 2 MiB
        "b": torch.randint(0, 1 << 30, (1000,), generator=g),
        "step": i,
    }


def empty() -> dict[str, Any]:
    return {"w": torch.zeros(512, 1024), "b": torch.zeros(1000, dtype=torch.int64), "step": -1}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def retries_of(op: str) -> int:
    t = get_scheduler().metrics.snapshot().get(op)
    return 0 if t is None else t.retries


def opts(endpoint: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    # cache=False: the S3 backend itself, not the node cache's write-back/read-through tier in front of it
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "region": "us-east-1", "timeout_s": timeout_s,
            "cache": False}


# -- transient faults are retried ------------------------------------------------------------------
def test_load_retries_transient_faults(proxy: FaultProxy, uri: str) -> None:
    o = opts(proxy.endpoint)
    tierckpt.save(uri, make_state(1), storage_options=o)
    proxy.reset_counters()
    data = "/data/rank-"
    proxy.add_rule(Rule("503", method="GET", path=data, count=3))
    proxy.add_rule(Rule("reset", method="GET", path=data, count=2))
    proxy.add_rule(Rule("delay", method="GET", path=data, count=1, seconds=TIMEOUT_S + 1.5))
    proxy.add_rule(Rule("slow", method="GET", path=data, count=1, seconds=0.5))
    before = retries_of("read_into")
    target = empty()
    tierckpt.load(uri, target, storage_options=o, chunk_bytes=1 << 20)
    assert same(target, make_state(1))
    assert proxy.hits == {"503": 3, "reset": 2, "delay": 1, "slow": 1}
    # every 503 and the timeout cost a retry; a reset of a reused keep-alive connection may be retried
    # by aiohttp itself before the scheduler sees it
    assert retries_of("read_into") - before >= 4
    FIGURES["load_transient"] = dict(proxy.hits)


def test_load_retries_transient_faults_on_metadata(proxy: FaultProxy, uri: str) -> None:
    """COMMIT, header and tables are read with the same retry policy as data."""
    o = opts(proxy.endpoint)
    tierckpt.save(uri, make_state(2), storage_options=o)
    proxy.add_rule(Rule("503", method="GET", path="/COMMIT", count=1))
    proxy.add_rule(Rule("reset", method="GET", path="/meta/", count=1))
    target = empty()
    tierckpt.load(uri, target, storage_options=o)
    assert same(target, make_state(2))


def test_save_retries_transient_faults(proxy: FaultProxy, uri: str) -> None:
    o = opts(proxy.endpoint)
    proxy.add_rule(Rule("503", method="PUT", count=2))
    proxy.add_rule(Rule("reset", method="PUT", count=1))
    tierckpt.save(uri, make_state(3), storage_options=o)
    proxy.clear()
    target = empty()
    tierckpt.load(uri, target, storage_options=o)
    assert same(target, make_state(3))
    assert proxy.hits == {"503": 2, "reset": 1}


# -- exhausted retries -------------------------------------------------------------------------------
def test_load_exhausted_retries_clear_error(proxy: FaultProxy, uri: str) -> None:
    o = opts(proxy.endpoint)
    tierckpt.save(uri, make_state(4), storage_options=o)
    proxy.add_rule(Rule("503", method="GET", path="/data/rank-", count=None))
    target = empty()
    started = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        tierckpt.load(uri, target, storage_options=o)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert uri in message and "\n" not in message, message
    assert elapsed < 30
    FIGURES["load_exhausted"] = (proxy.hits["503"], f"{elapsed:.1f}s", message[:200])
    proxy.clear()
    target = empty()
    tierckpt.load(uri, target, storage_options=o, verify=True)  # the checkpoint is untouched
    assert same(target, make_state(4))


def test_save_exhausted_retries_keep_previous(proxy: FaultProxy, uri: str) -> None:
    o = opts(proxy.endpoint)
    tierckpt.save(uri, make_state(5), storage_options=o)
    proxy.add_rule(Rule("503", method="PUT", count=None))
    proxy.add_rule(Rule("503", method="POST", count=None))
    with pytest.raises(CheckpointError) as info:
        tierckpt.save(uri, make_state(6), storage_options=o)
    message = str(info.value)
    assert uri in message and "\n" not in message, message
    FIGURES["save_exhausted"] = (proxy.hits["503"], message[:200])
    proxy.clear()
    target = empty()
    tierckpt.load(uri, target, storage_options=o, verify=True)
    assert same(target, make_state(5))


# -- unreachable endpoint ----------------------------------------------------------------------------
def test_unreachable_endpoint_fails_fast(uri: str, refused_endpoint: str) -> None:
    dead = refused_endpoint
    o = opts(dead, timeout_s=1.0)
    for action in ("save", "load"):
        started = time.monotonic()
        with pytest.raises(CheckpointError) as info:
            if action == "save":
                tierckpt.save(uri, make_state(7), storage_options=o)
            else:
                tierckpt.load(uri, empty(), storage_options=o)
        elapsed = time.monotonic() - started
        message = str(info.value)
        assert "\n" not in message and uri.split("/")[2] in message, message
        assert elapsed < 15, f"{action} took {elapsed:.1f}s against a dead endpoint"
        FIGURES[f"unreachable_{action}"] = (f"{elapsed:.1f}s", type(info.value).__name__, message[:200])


# -- ENOSPC on the local tier ------------------------------------------------------------------------
@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "tiny"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, timeout=20)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=20)


def test_enospc_clear_error_nothing_committed(tiny_tmpfs: Path) -> None:
    uri = str(tiny_tmpfs / "ckpt")
    small = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    tierckpt.save(uri, small, storage_options=None)
    with pytest.raises(StorageError) as info:
        tierckpt.save(uri, make_state(8))  # 2 MiB into 1 MiB
    message = str(info.value)
    assert "No space left" in message or "ENOSPC" in message or "Errno 28" in message, message
    FIGURES["enospc"] = message[:200]
    target = {"w": torch.zeros(1000), "step": -1}
    tierckpt.load(uri, target, verify=True)  # the previous checkpoint is still the committed one
    assert torch.equal(target["w"], small["w"]) and target["step"] == 1
    # a first save that does not fit leaves nothing that looks committed
    fresh = str(tiny_tmpfs / "fresh")
    with pytest.raises(StorageError):
        tierckpt.save(fresh, make_state(9))
    assert not os.path.exists(os.path.join(fresh, "COMMIT"))
    with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)):
        tierckpt.load(fresh, empty())


# -- a rank that never joins a save ------------------------------------------------------------------
GROUP_TIMEOUT_S = 6


def _collective_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    result = "no error"
    started = time.monotonic()
    if rank == 0:
        try:
            tierckpt.save(os.path.join(out_dir, "ckpt"), {"w": torch.ones(10), "step": 1})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result = f"{type(exc).__name__}: {exc}"
    else:
        time.sleep(GROUP_TIMEOUT_S + 40)  # never calls save (killed by the test once rank 0 reported)
    Path(out_dir, f"rank{rank}.txt").write_text(f"{time.monotonic() - started:.2f}\n{result}")
    os._exit(0)  # skip destroy_process_group: the group is broken


def test_missing_rank_times_out(tmp_path: Path) -> None:
    import torch.multiprocessing as tmp

    from conftest import free_port

    # Forked from the session's forkserver (torch imported there once when the worker pool started it); the
    # workers leave with os._exit either way.
    ctx = tmp.start_processes(
        _collective_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=False, start_method="forkserver",
    )
    report = tmp_path / "rank0.txt"
    deadline = time.monotonic() + GROUP_TIMEOUT_S + 20  # start-up (spawn + import torch) is included
    try:
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.2)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(10)
    if not report.exists():
        pytest.fail(f"rank 0's save did not fail within {GROUP_TIMEOUT_S}s group timeout (+20 s start-up)")
    elapsed, _, message = report.read_text().partition("\n")
    FIGURES["collective"] = (elapsed, message[:300])
    assert message != "no error"
    assert message.split(":")[0] in ("CollectiveError", "CheckpointError"), message
    assert float(elapsed) < GROUP_TIMEOUT_S + 5, f"rank 0 waited {elapsed}s, the group timeout is {GROUP_TIMEOUT_S}s"
    assert not (tmp_path / "ckpt" / "COMMIT").exists()


def test_zz_figures() -> None:
    print("\n" + "\n".join(f"{k}: {v}" for k, v in FIGURES.items()))
