"""The memory tier's background threads run at a lower OS priority (``tiers/background.py``)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch.distributed as dist

from tierckpt.errors import CheckpointError
from tierckpt.node.memory.background import NICE_ENV, background_nice, lower_priority, lower_priority_of_new, started_threads

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")


def test_the_niceness_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NICE_ENV, raising=False)
    assert background_nice() == 10
    monkeypatch.setenv(NICE_ENV, "19")
    assert background_nice() == 19
    for bad in ("-1", "20", "low"):
        monkeypatch.setenv(NICE_ENV, bad)
        with pytest.raises(CheckpointError, match=NICE_ENV):
            background_nice()


def _nice_in_thread() -> int:
    out: list[int] = []

    def body() -> None:
        lower_priority()
        out.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return out[0]


@linux_only
def test_a_tier_thread_lowers_only_its_own_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NICE_ENV, "7")
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert _nice_in_thread() == max(own, 7)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller keeps its priority
    monkeypatch.setenv(NICE_ENV, "0")
    assert _nice_in_thread() == own


@linux_only
def test_the_threads_of_a_new_gloo_group_are_lowered(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv(NICE_ENV, "5")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        existing = started_threads()
        before = started_threads()
        group = dist.new_group([0], backend="gloo")
        lower_priority_of_new(before)
        new = started_threads() - existing
        names = {tid: open(f"/proc/self/task/{tid}/comm").read().strip() for tid in new}
        gloo = [tid for tid, name in names.items() if name in ("gloo_tcp_loop", "pt_gloo_runloop")]
        assert gloo, names
        assert all(os.getpriority(os.PRIO_PROCESS, tid) >= 5 for tid in gloo)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # not the caller
        dist.destroy_process_group(group)
    finally:
        dist.destroy_process_group()
