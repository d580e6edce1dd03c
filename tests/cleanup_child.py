"""A child program for the background-removal tests: two saves to one URI, then a normal exit.

    python tests/cleanup_child.py URI slow SECONDS   each removal of a generation starts SECONDS late
    python tests/cleanup_child.py URI stuck EXIT_S   removals never finish; the exit drain waits EXIT_S

Saves ``make_state(1)`` then ``make_state(2)`` (tests/racing_child.py) and prints one JSON line with
both generations. The patch is in this process only: the removal runs on the I/O loop of the real
saver, and only its start is delayed (``asyncio.sleep``, so the loop's shutdown at exit cancels it).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from racing_child import make_state  # noqa: E402

import tierckpt  # noqa: E402
from tierckpt.saving import cleanup  # noqa: E402
from tierckpt.backends import local  # noqa: E402


def delay_removals(seconds: float) -> None:
    original = local.LocalBackend.delete_prefix

    async def delayed(self: Any, prefix: str) -> None:
        await asyncio.sleep(seconds)
        await original(self, prefix)

    local.LocalBackend.delete_prefix = delayed  # type: ignore[method-assign]


def main(uri: str, mode: str, seconds: float) -> None:
    if mode == "slow":
        delay_removals(seconds)
    elif mode == "stuck":
        delay_removals(3600.0)
        cleanup.EXIT_WAIT_S = seconds
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    first = tierckpt.save(uri, make_state(1)).generation
    second = tierckpt.save(uri, make_state(2)).generation
    print(json.dumps({"first": first, "second": second}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
