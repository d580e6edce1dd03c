"""Waiting for a group of child processes (one per rank) with one deadline for all."""

from __future__ import annotations

import subprocess
import time

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
