"""Loads and saves run with the cyclic garbage collector paused (tierckpt.gc_pause): no collection
walks the process's heap in the middle of one, and the collector is left as the caller had it."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import tierckpt
import tierckpt.loading.api  # noqa: F401  (imported here: a first use's import is not the call's work)
from tierckpt.gc_pause import gc_paused


@pytest.fixture
def collections() -> list[int]:
    """Generations of the collections that start while the test runs."""
    seen: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)


def _state() -> dict[str, torch.Tensor]:
    return {f"layers.{i}.bias": torch.full((64,), float(i)) for i in range(400)}


def test_a_load_and_a_save_collect_nothing_while_they_run(tmp_path: Path, collections: list[int]) -> None:
    state, root = _state(), str(tmp_path / "ckpt")
    assert gc.isenabled()
    tierckpt.save.__wrapped__(root, state)  # the same save without the pause: the collector does run
    assert collections
    collections.clear()
    tierckpt.save(root, state)
    assert collections == [] and gc.isenabled()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    collections.clear()
    tierckpt.load(root, target)
    assert collections == [] and gc.isenabled()
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_the_collector_is_left_as_the_caller_had_it() -> None:
    @gc_paused
    def fails() -> None:
        assert not gc.isenabled()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        fails()
    assert gc.isenabled()
    gc.disable()
    try:
        gc_paused(lambda: None)()
        assert not gc.isenabled()  # a caller that turned it off keeps it off
    finally:
        gc.enable()
