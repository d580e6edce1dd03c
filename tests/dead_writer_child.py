"""A process that commits a generation through one node tier and dies before it reaches the remote (run by
tests/test_writeback_engine.py).

``python dead_writer_child.py TIER URI TIER_DIR GENERATION``: TIER ``memory`` (the node memory tier in
``TIER_DIR``) or ``disk`` (the node disk cache in ``TIER_DIR``). The remote's directory cannot be made (a
file stands where its parent should be), so every copy down fails and stays in the tier's journal; once
the journal records a failed attempt of each key, the process ends without its exit drain (``os._exit``),
like a killed one: its journal entries name a process that is gone.
"""

from __future__ import annotations

import os
import sys
import time

from tierckpt import store
from tierckpt.backends.base import UNCONDITIONAL
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native import layout
from tierckpt.node.disk import CacheConfig
from tierckpt.node.memory import MemoryConfig

DATA = bytes(range(256)) * 64
"""The generation's one file (the test checks it bit-exactly below)."""


def main() -> None:
    tier, uri, directory, generation = sys.argv[1:5]
    options: dict[str, object] = {
        "memory": MemoryConfig(directory=directory) if tier == "memory" else False,
        "cache": CacheConfig(directory=directory, poll_s=0.01) if tier == "disk" else False,
    }
    link = store.open_store(uri, options)
    sched = get_scheduler()
    key = f"{generation}/data/rank-00000.bin"
    sched.run(link.put(key, DATA))
    sched.run(link.commit(layout.COMMIT, layout.CommitRecord(generation, 1.0, seq=1).encode(), expected=UNCONDITIONAL))  # below unreadable
    scope = link.rh if tier == "disk" else generation
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        owed = {o.key: o for o in link.journal.outstanding(scope)}
        if owed.get(key) is not None and owed[key].error and layout.COMMIT in owed:
            os._exit(0)
        time.sleep(0.02)
    os._exit(3)


if __name__ == "__main__":
    main()
