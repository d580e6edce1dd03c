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
    from tierckpt.saver import _PROCESS

    assert _PROCESS.staging._buffer is not None and _PROCESS.staging._buffer.is_pinned()
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    tierckpt.load(str(tmp_path / "c"), target)
    for key, value in expected.items():
        assert target[key].is_cuda and torch.equal(target[key], value), key
