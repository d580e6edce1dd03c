"""A child program for the tests of two jobs on one node cache (one process per job; both share the
node cache of ``TIERCKPT_CACHE_DIR``). Commands (each prints one JSON object on stdout)::

    python tests/node_jobs_child.py hold-commit-upload URI VALUE DIR
        saves make_state(VALUE) through the node cache; its COMMIT upload, read and about to be sent,
        writes DIR/held and waits for DIR/go. Prints ``{"outcome", "generation" | "error", "message"}``.
    python tests/node_jobs_child.py save URI VALUE
        saves make_state(VALUE) through the node cache; prints the same.
    python tests/node_jobs_child.py commit-on-node-and-die URI VALUE
        a write-back save of make_state(VALUE), committed in the node cache, then the process dies at once
        (its uploads stay pending in the catalogue, their owner dead). Prints ``{"generation"}`` first.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import tierckpt
from racing_child import announce, make_state, wait_for
from tierckpt.node.disk import uploads


def hold_commit_uploads(directory: Path) -> None:
    """Make this process's COMMIT uploads wait for ``directory/go`` once they have read their record."""
    upload = uploads.UploadsMixin._upload_commit

    async def held(self: Any, key: str, data: bytes, rec: Any) -> bool:
        announce(directory / "held", rec.gen or "")
        await asyncio.to_thread(wait_for, directory / "go", 120)
        return await upload(self, key, data, rec)

    uploads.UploadsMixin._upload_commit = held  # type: ignore[method-assign]


def save(uri: str, value: int) -> None:
    try:
        meta = tierckpt.save(uri, make_state(value))
        print(json.dumps({"outcome": "committed", "generation": meta.generation}), flush=True)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        print(json.dumps({"outcome": "error", "error": type(exc).__name__, "message": str(exc)}), flush=True)


def commit_on_node_and_die(uri: str, value: int) -> None:
    meta = tierckpt.async_save(uri, make_state(value), storage_options={"timeout_s": 2}).wait("memory", 120)
    print(json.dumps({"generation": meta.generation}), flush=True)
    os._exit(0)


def main(argv: list[str]) -> None:
    command, uri, value = argv[0], argv[1], int(argv[2])
    if command == "commit-on-node-and-die":
        commit_on_node_and_die(uri, value)
    if command == "hold-commit-upload":
        hold_commit_uploads(Path(argv[3]))
    elif command != "save":
        raise SystemExit(f"unknown command {command!r}")
    save(uri, value)


if __name__ == "__main__":
    main(sys.argv[1:])
