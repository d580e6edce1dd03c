"""Waiting for a group of child processes (one per rank) with one deadline for all, and forking the ranks
of a job from a server that imported their heavy modules once (:class:`RankForks`)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def communicate_all(procs: list[subprocess.Popen], limit_s: float, what: str) -> list[subprocess.CompletedProcess]:
    """Each process's exit code and output; fails the test (killing them all) when one is still running
    ``limit_s`` after the call — ``what`` names the run in that message."""
    out = []
    deadline = time.monotonic() + limit_s
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{what}: a process did not exit within {limit_s} s (hang at exit)")
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


class RankForks:
    """The ranks of multi-process jobs forked from one server (``tests/rank_forks.py``) that imported
    ``modules`` once: starting a rank of a Lightning or transformers job costs seconds of imports in a fresh
    interpreter, paid here once per test module instead of once per rank and run.

    The server runs with this process's environment, ``PYTHONPATH`` set to its ``sys.path`` and
    ``OMP_NUM_THREADS=1``, as the ranks' own environments do."""

    def __init__(self, *modules: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
        server = str(Path(__file__).parent / "rank_forks.py")
        self.proc = subprocess.Popen([sys.executable, server, *modules], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self._buf = b""

    def _line(self, deadline: float) -> list[str]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise EOFError(f"the rank fork server exited (status {self.proc.wait()})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode().split()

    def run(self, ranks: list[tuple[list[str], dict[str, str]]], workdir: Path, limit_s: float,
            what: str) -> list[subprocess.CompletedProcess]:
        """Run one process per ``(argv, env)`` at once (``argv[0]``: the script); each one's exit code and
        output (kept under ``workdir``). Fails the test, killing them all, when one is still running
        ``limit_s`` after the call (as :func:`communicate_all`)."""
        assert self.proc.stdin is not None
        deadline = time.monotonic() + limit_s
        jobs = [{"argv": argv, "env": env, "stdout": str(workdir / f"{what}.{i}.out".replace(" ", "_")),
                 "stderr": str(workdir / f"{what}.{i}.err".replace(" ", "_"))} for i, (argv, env) in enumerate(ranks)]
        self.proc.stdin.write((json.dumps({"ranks": jobs}) + "\n").encode())
        self.proc.stdin.flush()
        pids = [int(p) for p in self._line(deadline)[1:]]
        try:
            codes = [int(c) for c in self._line(deadline)[1:]]
        except TimeoutError:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._line(time.monotonic() + 30)
            pytest.fail(f"{what}: a process did not exit within {limit_s} s (hang at exit)")
        return [subprocess.CompletedProcess(argv, code, Path(job["stdout"]).read_text(), Path(job["stderr"]).read_text())
                for (argv, _), code, job in zip(ranks, codes, jobs)]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
