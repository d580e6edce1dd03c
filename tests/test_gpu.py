"""CUDA paths: pinned staging for async saves and loads into CUDA tensors (skipped without a GPU)."""

import pytest
import torch

import tierckpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("staging_bytes", [None, 1 << 16])  # whole-file copy; ping-pong through 64 KiB
def test_async_save_of_cuda_tensors_uses_pinned_staging_and_loads_back(tmp_path, staging_bytes):
    """Side-stream copies see the values at the call (even of a transposed, non-contiguous tensor
    whose contiguous copy is made on the current stream) and training may change them right after."""
    state = {
        "w": torch.randn(1024, 1024, device="cuda"),
        "t": torch.randn(300, 200, device="cuda").t(),
        "b": torch.arange(7, device="cuda"),
    }
    expected = {k: v.clone() for k, v in state.items()}
    handle = tierckpt.async_save(str(tmp_path / "c"), state, staging_bytes=staging_bytes)
    for value in state.values():
        value.add_(1)  # training continues on the GPU while the save is written
    handle.wait()
    from tierckpt.saving.api import _PROCESS

    assert _PROCESS.staging._buffer is not None and _PROCESS.staging._buffer.is_pinned()
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    tierckpt.load(str(tmp_path / "c"), target)
    for key, value in expected.items():
        assert target[key].is_cuda and torch.equal(target[key], value), key


def test_an_async_save_of_an_unchanged_layout_copies_from_cuda_while_agreeing(tmp_path):
    """The second save of the same CUDA state copies its snapshot (side streams, pinned buffer) while the
    group agrees; what it holds is the values at the call."""
    state = {"w": torch.randn(512, 256, device="cuda"), "b": torch.randn(33, device="cuda").half()}
    for step in range(2):
        expected = {k: v.clone() for k, v in state.items()}
        monitor = tierckpt.Monitor()
        handle = tierckpt.async_save(str(tmp_path / f"c{step}"), state, monitor=monitor)
        for value in state.values():
            value.mul_(3).add_(1)
        handle.wait()
        assert monitor.counters.get("snapshots_while_agreeing", 0) == step
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        tierckpt.load(str(tmp_path / f"c{step}"), target)
        assert all(torch.equal(target[k], v) for k, v in expected.items())
