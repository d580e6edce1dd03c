"""The one place where the node package meets the process's life: a fork's child, the exit, the default group's end.

The node package keeps per-process state (write-down tasks, replicator threads, spare and pool files,
catalogue handles) that must be forgotten in a forked child, and some that must be stopped or removed
when the process ends. Its modules register what to do with the functions below and never with the
interpreter or torch themselves; this module registers with them once, at import, and runs the
handlers:

* :func:`after_fork_in_child`: in a forked child, in the order registered (as ``os.register_at_fork``
  does): it has none of its parent's threads, and inherited handles must not be used. What such a handler
  forgets that holds native threads or handles (a gloo group, an LMDB environment) it hands to
  :func:`keep_in_child` first: freeing it in the child would run a destructor that joins threads the child
  does not have (the child hangs, or aborts) or closes a handle the parent still uses.
* :func:`before_threads_joined`: from :mod:`threading`'s exit hooks, once the main thread is done and
  before the interpreter joins the other threads, last registered first. The saver's exit drain is
  registered there after this module (it imports the node package first), so it runs before these.
* :func:`at_exit`: from ``atexit``, after the threads were joined, last registered first.
* :func:`before_default_group_destroyed`: when ``torch.distributed.destroy_process_group()`` ends the
  default group (which shuts down every group, the node's own included). ``destroy_process_group`` is
  wrapped when the first such handler registers; a reference taken with ``from torch.distributed
  import destroy_process_group`` before that is not wrapped.

A handler that raises is reported on stderr with its traceback; the others still run.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

Handler = Callable[[], None]

_AFTER_FORK: list[Handler] = []
_BEFORE_JOIN: list[Handler] = []
_AT_EXIT: list[Handler] = []
_BEFORE_DESTROY: list[Handler] = []
_LOCK = threading.Lock()
_WRAPPED = "_tierckpt_node_lifecycle"
"""The attribute that marks ``destroy_process_group`` as wrapped here."""


def after_fork_in_child(handler: Handler) -> Handler:
    """Run ``handler`` in every child this process forks (once per handler); returns it."""
    return _add(_AFTER_FORK, handler)


def keep_in_child(objects: Iterable[object]) -> None:
    """In a forked child: never free ``objects`` (inherited from the parent), not even at the child's exit.

    A gloo group's destructor joins its devices' I/O threads, which a forked child does not have: it waits
    forever (or aborts the child). One more reference that nothing drops keeps the destructor from ever
    running; the interpreter's finalization leaves objects still referenced alone."""
    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def before_threads_joined(handler: Handler) -> Handler:
    """Run ``handler`` at exit before the interpreter joins the threads (once per handler); returns it."""
    return _add(_BEFORE_JOIN, handler)


def at_exit(handler: Handler) -> Handler:
    """Run ``handler`` at exit after the threads were joined (once per handler); returns it."""
    return _add(_AT_EXIT, handler)


def before_default_group_destroyed(handler: Handler) -> Handler:
    """Run ``handler`` before ``destroy_process_group()`` ends the default group (once per handler);
    the first registration wraps ``destroy_process_group``. Returns ``handler``."""
    _add(_BEFORE_DESTROY, handler)
    _wrap_destroy_process_group()
    return handler


def _add(handlers: list[Handler], handler: Handler) -> Handler:
    with _LOCK:
        if not any(h is handler for h in handlers):
            handlers.append(handler)
    return handler


def _run(handlers: list[Handler], when: str) -> None:
    """Run each of ``handlers`` in turn (read without the lock: in a forked child a parent thread may have
    held it); one that raises is reported and the next one runs."""
    for handler in handlers:
        try:
            handler()
        except Exception:  # noqa: BLE001 - reported; the process's other handlers still run
            name = getattr(handler, "__qualname__", repr(handler))
            sys.stderr.write(f"tierckpt: {name} ({when}) failed:\n{traceback.format_exc()}")


def _wrap_destroy_process_group() -> None:
    """Make ``dist.destroy_process_group()`` of the default group run the handlers first (installed once)."""
    c10d = dist.distributed_c10d
    if getattr(c10d.destroy_process_group, _WRAPPED, False):
        return
    destroy: Callable[..., None] = c10d.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group: dist.ProcessGroup | None = None, *args: Any, **kwargs: Any) -> None:
        if group is None or group is dist.group.WORLD:
            _run(list(_BEFORE_DESTROY), "before the default process group is destroyed")
        return destroy(group, *args, **kwargs)

    setattr(destroy_process_group, _WRAPPED, True)
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def _in_forked_child() -> None:
    """A forked child: a fresh lock (a parent thread may have held this one), then the handlers."""
    global _LOCK
    _LOCK = threading.Lock()
    _run(list(_AFTER_FORK), "in a forked child")


os.register_at_fork(after_in_child=_in_forked_child)
threading._register_atexit(  # type: ignore[attr-defined]  # before the threads are joined
    lambda: _run(list(reversed(_BEFORE_JOIN)), "at exit, before the threads are joined"))
atexit.register(lambda: _run(list(reversed(_AT_EXIT)), "at exit"))
