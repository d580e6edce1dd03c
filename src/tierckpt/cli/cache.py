"""CLI commands for the node cache: ``status``, ``wait``, ``sync``, ``prefetch``, ``gc``.

They wrap :mod:`tierckpt.node.disk` (write-back uploads, read-through cache, retention); see the user
guide's section on the node cache. Every command prints one line per item, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from tierckpt import cache_api as cache
from tierckpt import progress
from tierckpt.node.disk.config import CacheConfig
from tierckpt.cli.deadline import add_timeout
from tierckpt.cli.exit import EXIT_UNREACHABLE
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError, StorageUnreachableError
from tierckpt.formats.foreign import missing_commit_error
from tierckpt.io.scheduler import get_scheduler
from tierckpt.monitor import format_bytes
from tierckpt.node.status import UNREACHABLE, StoreStatus
from tierckpt.store import open_store, read_in_place


def _add_status(subparsers: Any) -> None:
    """Register ``status``."""
    p = subparsers.add_parser(
        "status", help="where a checkpoint stands: staged, local (upload pending) or remote; with the memory tier, each level",
        description="Show the committed generation of a checkpoint and whether it is durable on the remote store, "
        "or still only in this node's cache with uploads pending. When the node memory tier is on (TIERCKPT_MEMORY=on) "
        "or holds the checkpoint, one line per level follows: memory, replicated (or why not), local (node disk "
        "cache), remote.",
    )
    p.add_argument("uri", help="checkpoint root, e.g. s3://bucket/run1/step-00001000")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_timeout(p, "status")
    p.set_defaults(handler=cmd_status)


def _nothing_committed(uri: str) -> CheckpointNotFoundError:
    """The error of ``status`` on a URI with nothing committed or pending: what it holds instead, as ``load``
    says it (a CheckpointManager root and how to load its steps, another format...), when that is known."""
    try:
        keys = get_scheduler().run(open_store(uri).list(""))
    except CheckpointError:
        keys = []
    error = missing_commit_error(uri, keys) if keys else None
    if isinstance(error, NotACheckpointError):
        return error
    return CheckpointNotFoundError(f"no checkpoint at {uri!r}: nothing committed, and nothing pending upload from this node")


def cmd_status(args: argparse.Namespace) -> int:
    """Print what is committed on this node and on the remote; exit 1 when an upload failed, 7 when what the
    remote holds is unknown (it did not answer, and nothing of the checkpoint is pending here)."""
    st = cache.status(args.uri)
    if st.state is None and not st.pending_keys and st.remote_generation is None:
        if st.remote_unreachable:  # nothing here, and the remote did not answer: unknown, not "none"
            raise StorageUnreachableError(
                f"cannot tell where {args.uri!r} stands: nothing is committed or pending on this node, and the "
                f"remote did not answer: {st.remote_error}"
            )
        raise _nothing_committed(args.uri)
    levels = st.levels()  # with the node memory tier: each level (none without it)
    local = read_in_place(args.uri)  # the checkpoint is where the path points: no remote, no node cache
    node_cache = _node_cache() | ({"used": False, "reason": LOCAL_PATH_NOTE} if local else {"used": True})
    doc = dataclasses.asdict(st) | {
        "state": st.reported_state, "durable": st.durable, "committed_on_node": st.committed_on_node, "committed_on_remote": st.committed_on_remote,
        "node_cache": node_cache,
    } | ({"levels": levels} if levels else {})
    if args.json:
        print(json.dumps(doc | {"local_path": local}, indent=1))
    elif local and not levels:
        print(f"{st.uri}: local path; committed: {st.generation}; {LOCAL_PATH_NOTE}")
        if node_cache["enabled"]:
            print(f"  {_cache_line(node_cache)}")
    else:
        remote = st.remote_generation or (f"unreadable ({st.remote_error})" if st.remote_error else "nothing")
        print(f"{st.uri}: {_state_text(st)}; committed on this node: {st.generation or '-'}; "
              f"committed on the remote: {remote}; {len(st.pending_keys)} object(s) / {st.pending_bytes} bytes "
              "pending upload")
        if local:
            print(f"  {LOCAL_PATH_NOTE}")
        elif not node_cache["enabled"]:
            print(f"  node cache off (TIERCKPT_CACHE={node_cache['setting']}): not opened; uploads that processes with "
                  f"the cache on left pending are not shown (TIERCKPT_CACHE=on tierckpt status {st.uri})")
        else:
            print(f"  {_cache_line(node_cache)}")
        for level, reached, detail in levels:
            print(f"  {level:<10} {'yes' if reached else 'no':<3}  {detail}")
        for error in st.errors:
            print(f"  upload error: {error}")
        if st.errors:
            print(f"  fix the remote, then: tierckpt sync {st.uri}   (or discard: tierckpt sync --drop {st.uri})")
    if st.reported_state == UNREACHABLE:
        return EXIT_UNREACHABLE  # where it stands on the remote is unknown: never the exit of a durable checkpoint
    return 1 if st.errors else 0


def _state_text(st: StoreStatus) -> str:
    """The state at the head of ``status``'s line; ``remote unreachable`` says what is unknown and why."""
    if st.reported_state == UNREACHABLE:
        return ("remote unreachable (committed on this node, uploaded from or fetched to it; whether the remote "
                "still holds it is unknown)")
    return st.reported_state or "nothing committed"


LOCAL_PATH_NOTE = "local paths are read and written in place, never through the node cache (nothing to upload)"


def _cache_line(node_cache: dict[str, Any]) -> str:
    """This node's cache in one line: where, why there, and its budget."""
    return (f"node cache {node_cache['directory']} ({node_cache['directory_reason']}); budget "
            f"{format_bytes(node_cache['disk_bytes'])} ({node_cache['disk_bytes_reason']})")


def _node_cache() -> dict[str, Any]:
    """This node's cache (from the environment, as the commands open it): where, why there, and its budget."""
    config = CacheConfig.from_env()
    return {"enabled": config.enabled, "setting": os.environ.get("TIERCKPT_CACHE", "on"), "directory": config.directory, "directory_reason": config.directory_reason,
            "disk_bytes": config.disk_bytes, "disk_bytes_reason": config.disk_bytes_reason}


def _add_wait(subparsers: Any) -> None:
    """Register ``wait``."""
    p = subparsers.add_parser(
        "wait", help="block until a checkpoint is durable on the remote store",
        description="Block until everything written to URI through this node's cache is on the remote store, "
        "COMMIT last. Exits 1 when an upload failed, 7 when --timeout passed.",
    )
    p.add_argument("uri", help="checkpoint root")
    add_timeout(p, "wait")
    progress.add_flags(p, "wait")
    p.set_defaults(handler=cmd_wait)


def cmd_wait(args: argparse.Namespace) -> int:
    cache.wait(args.uri)  # --timeout is the command's deadline (tierckpt.cli.deadline)
    print(f"{args.uri}: durable on the remote")
    return 0


def _add_sync(subparsers: Any) -> None:
    """Register ``sync``."""
    p = subparsers.add_parser(
        "sync", help="finish uploads left pending in this node's cache (after a crash or restart)",
        description="Resume the uploads that this node's cache catalogue records as pending (left by a crashed, "
        "killed or exited process) for URI, or for every store of the node, and wait until they are on the remote. "
        "With the node memory tier, it also writes down what the tier holds and the URI lacks: write-downs a process "
        "left unfinished, and checkpoints saved to memory only (persist=False).",
    )
    p.add_argument("uri", nargs="?", default=None, help="only this store (default: every store of the node)")
    add_timeout(p, "sync")
    p.add_argument("--drop", action="store_true",
                   help="discard the pending uploads of URI instead (e.g. to a mistyped bucket); they never reach it")
    progress.add_flags(p, "sync")
    p.set_defaults(handler=cmd_sync)


def cmd_sync(args: argparse.Namespace) -> int:
    if args.drop:
        if args.uri is None:
            raise CheckpointError("tierckpt sync --drop needs the URI whose pending uploads to discard")
        dropped = cache.drop(args.uri)
        print(f"{args.uri}: dropped {len(dropped)} pending upload(s)" + "".join(f"\n  {k}" for k in dropped))
        return 0
    synced = cache.sync(args.uri)  # --timeout is the command's deadline (tierckpt.cli.deadline)
    print(f"synced {len(synced)} store(s)" + "".join(f"\n  {u}" for u in synced))
    return 0


def _add_prefetch(subparsers: Any) -> None:
    """Register ``prefetch``."""
    p = subparsers.add_parser(
        "prefetch", help="pull a checkpoint (or some of its tensors) into this node's cache",
        description="Pull a committed checkpoint into the node cache so that later loads (eval jobs) read it "
        "locally. --only limits it to the tensors whose names match the glob patterns.",
    )
    p.add_argument("uri", help="checkpoint root, e.g. s3://bucket/run1/step-00001000")
    p.add_argument("--only", nargs="+", metavar="PATTERN", default=None, help="fqn glob patterns, e.g. 'model.*'")
    progress.add_flags(p, None)  # prefetch draws its own bar (its total is known)
    add_timeout(p, "prefetch")
    p.set_defaults(handler=cmd_prefetch)


def cmd_prefetch(args: argparse.Namespace) -> int:
    handle = cache.prefetch(args.uri, only=args.only, progress=progress.command_wants(args))
    nbytes = handle.result()
    if handle.in_place:
        print(f"{args.uri}: nothing to prefetch: {LOCAL_PATH_NOTE}; loads read it where it is")
    else:
        print(f"{args.uri}: {nbytes} bytes in the node cache")
    return 0


def _add_gc(subparsers: Any) -> None:
    """Register ``gc``."""
    p = subparsers.add_parser(
        "gc", help="retention over a directory of checkpoints, and removal of crashed saves' leftovers",
        description="Delete old checkpoints under ROOT (children such as ROOT/step-00000100), keeping the newest "
        "--keep-last and every checkpoint whose step is a multiple of --keep-every; at least one of the two is "
        "required, and the newest committed one is never deleted. In what is kept (and in ROOT itself when it is "
        "a checkpoint), generations that can never be committed — leftovers of crashed, failed or losing saves, "
        "decided by commit sequence, never by clocks — are removed; a save in flight keeps its generation.",
    )
    p.add_argument("root", help="a directory of checkpoints")
    p.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep the N newest committed checkpoints")
    p.add_argument("--keep-every", type=int, default=None, metavar="K",
                   help="keep every checkpoint whose step is a multiple of K")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_timeout(p, "gc")
    p.set_defaults(handler=cmd_gc)


def cmd_gc(args: argparse.Namespace) -> int:
    result = cache.gc(args.root, keep_last=args.keep_last, keep_every=args.keep_every, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=1))
    else:
        verb = "would delete" if result.dry_run else "deleted"
        print(f"{'dry run: ' if result.dry_run else ''}kept {len(result.kept)}, {verb} {len(result.deleted)}, "
              f"{verb} {len(result.leftovers)} leftover generation(s)"
              + "".join(f"\n  {verb} {d}" for d in (*result.deleted, *result.leftovers)))
    return 0


COMMANDS = (_add_status, _add_wait, _add_sync, _add_prefetch, _add_gc)
