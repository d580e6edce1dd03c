"""A child program for the manager's kill tests: synchronous ``CheckpointManager`` saves of steps 1..N to a
root, SIGKILLed at a chosen stage.

    TIERCKPT_KILL_AT=<stage>:<n> python tests/manager_kill_child.py ROOT N KEEP_LAST OPTIONS_JSON

Stages (the n-th call of each): ``commit`` (a save about to write its ``COMMIT``), ``upload`` (the node
cache about to upload a step's ``COMMIT``), ``latest`` (a step committed, ``LATEST`` not yet moved), ``retain``
(``LATEST`` moved, retention not yet run), ``delete`` (retention about to delete a step),
``delete_prefix`` (a step's ``COMMIT`` deleted, its files not yet). Prints
``saved <step>`` after each save returned. Step ``s`` holds ``w = arange(64) + s``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import tierckpt  # noqa: E402
from tierckpt.manager import retention as manager_retention
from tierckpt.saving import commit as save_commit  # noqa: E402
from tierckpt.node.disk import tiered, uploads  # noqa: E402

TARGETS: dict[str, tuple[Any, str]] = {
    "commit": (save_commit, "_commit"),
    "upload": (uploads.UploadsMixin, "_upload_commit"),
    "latest": (manager_retention.RetentionMixin, "_after_commit"),
    "retain": (manager_retention.RetentionMixin, "_retain"),
    "delete": (manager_retention.RetentionMixin, "_delete_named"),
    "delete_prefix": (tiered.TieredBackend, "delete_prefix"),
}


def kill_on(stage: str, nth: int) -> None:
    """SIGKILL this process on the ``nth`` call of the stage's function."""
    owner, name = TARGETS[stage]
    original: Callable[..., Any] = getattr(owner, name)
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    if name == "delete_prefix":
        async def wrapped_prefix(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == nth:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return await original(*args, **kwargs)

        setattr(owner, name, wrapped_prefix)
        return
    if name == "_upload_commit":
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            calls[0] += args[1].rpartition("/")[2] == "COMMIT"  # a step's COMMIT, not LATEST
            if calls[0] == nth:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return await original(*args, **kwargs)

        setattr(owner, name, wrapped_async)
    else:
        setattr(owner, name, wrapped)


def main(root: str, steps: int, keep_last: int, options: dict[str, Any]) -> None:
    kill_at = os.environ.get("TIERCKPT_KILL_AT")
    if kill_at:
        stage, _, nth = kill_at.partition(":")
        kill_on(stage, int(nth))
    manager = tierckpt.CheckpointManager(root, keep_last=keep_last, storage_options=options)
    for step in range(1, steps + 1):
        manager.save(step, {"w": torch.arange(64, dtype=torch.float32) + step})
        print(f"saved {step}", flush=True)
    manager.wait_durable(timeout_s=60)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
