"""A fresh process that loads plain tensors from a local path imports no object-store client, no
pyarrow.dataset and no DTensor: those imports took 0.2-0.5 s and 0.7 s of a restarted process's recovery
(the clients' exception types are now imported on the first failure to classify; Parquet tables are read
without pyarrow.dataset; a tensor is a DTensor only if DTensor's module was imported)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import tierckpt
from tierckpt.backends.fsspec_backend import translate_error
from tierckpt.errors import TransientStorageError

CHILD = """
import sys, torch, tierckpt
state = {"w": torch.zeros(4, 4)}
tierckpt.load(sys.argv[1], state)
assert torch.equal(state["w"], torch.arange(16.0).reshape(4, 4)), state["w"]
print(sorted(m for m in ("aiohttp", "botocore", "s3fs", "pyarrow.dataset", "torch.distributed.tensor") if m in sys.modules))
"""


def test_local_load_imports_no_store_client(tmp_path) -> None:
    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, {"w": torch.arange(16.0).reshape(4, 4)})
    env = {**os.environ, "TIERCKPT_MEMORY": "off"}
    out = subprocess.run([sys.executable, "-c", CHILD, uri], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_client_errors_still_classified_after_lazy_import() -> None:
    import aiohttp

    err = translate_error(aiohttp.ClientConnectionError("reset"), "reading 's3://b/k'")
    assert isinstance(err, TransientStorageError)


FIRST_USE = """
import gc, torch, tierckpt
starts = []
gc.callbacks.append(lambda phase, info: starts.append(info["generation"]) if phase == "start" else None)
tierckpt.load, tierckpt.save, tierckpt.native.layout
gc.callbacks.clear()
print(starts, gc.isenabled())
"""


def test_a_first_use_imports_with_the_collector_paused_and_leaves_it_on() -> None:
    """The first use of a public name imports its modules (thousands of long-lived objects) with no
    collection walking the process's heap, torch's included (unpaused: 38 collections, one of them full); the
    collector is on again after it, and at most the youngest generation's collection that its first
    allocations set off has run."""
    out = subprocess.run([sys.executable, "-c", FIRST_USE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] in ("[] True", "[0] True")
