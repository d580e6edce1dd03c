"""A fork server for the ranks of a multi-process job: its heavy imports paid once, one fork per rank.

``python rank_forks.py MODULE...`` imports the modules (a framework's child program and what it imports:
Lightning, transformers' Trainer), then reads one job per line on stdin: ``{"ranks": [{"argv", "env",
"stdout", "stderr"}, ...]}``. It forks one child per rank, answers ``pids <pid>...``, waits for them all
and answers ``exit <status>...`` (``os.waitstatus_to_exitcode``: ``-9`` for SIGKILL).

Each child is the program ``argv`` run as ``python argv[0] argv[1:]`` would run it, in the environment
``env`` (which replaces the server's), its stdout and stderr going to the named files: the script runs as
``__main__`` and the child ends as any Python process does (an uncaught exception prints its traceback
and exits 1; atexit handlers and exit drains run). Only the imports are shared: they start no threads,
so forking after them is safe. The test side is :class:`processes.RankForks`.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys


def _become(rank: dict) -> None:
    """In the forked child: take the rank's environment, arguments and output files, run its program."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, rank["stdout"]), (2, rank["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)
    os.environ.clear()
    os.environ.update(rank["env"])
    sys.argv = list(rank["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)


def serve(modules: list[str]) -> None:
    for name in modules:
        importlib.import_module(name)
    for line in sys.stdin:
        if not line.strip():
            continue
        ranks = json.loads(line)["ranks"]
        pids = []
        for rank in ranks:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _become(rank)  # ends the child: it never returns here
            pids.append(pid)
        print("pids", *pids, flush=True)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print("exit", *codes, flush=True)


if __name__ == "__main__":
    serve(sys.argv[1:])
