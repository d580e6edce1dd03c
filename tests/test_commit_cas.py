"""One writer wins: two jobs (real processes) saving to one URI from the same COMMIT — exactly one
commits, the other gets CheckpointBusyError and its generation is removed; the committed checkpoint
loads bit-exactly and verifies. Plus the compare-and-swap contract of each backend's commit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt.backends import open_plain_backend
from tierckpt.backends.base import UNCONDITIONAL
from tierckpt.errors import CheckpointBusyError
from tierckpt.io.scheduler import get_scheduler

CHILD = str(Path(__file__).parent / "racing_child.py")


def race(uri: str, rounds: int, gates: Path) -> list[dict]:
    """Run two racing jobs for ``rounds`` rounds; their JSON lines, both jobs together."""
    gates.mkdir()
    jobs = [
        subprocess.Popen([sys.executable, CHILD, "race", uri, str(role), str(rounds), str(gates)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for role in (0, 1)
    ]
    lines = []
    for job in jobs:
        out, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-3000:]
        lines += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return lines


def assert_one_winner_per_round(lines: list[dict], rounds: int) -> None:
    for r in range(rounds):
        outcomes = sorted((x["outcome"], x["role"]) for x in lines if x.get("round") == r and "outcome" in x)
        assert [o for o, _ in outcomes] == ["busy", "won"], f"round {r}: {outcomes}"
        winner = next(x for x in lines if x.get("round") == r and x.get("outcome") == "won")
        loser = next(x for x in lines if x.get("round") == r and x.get("outcome") == "busy")
        assert "another job committed" in loser["message"]
        check = next(x["check"] for x in lines if x.get("round") == r and "check" in x)
        assert check["step"] == winner["value"] and check["exact"], f"round {r}: {check}"
        assert check["verify_ok"] and check["committed"] == winner["generation"]
        assert check["generations"] == [winner["generation"]], f"round {r}: the loser's generation remains: {check}"
    print(f"\nconcurrent writers: {rounds} of {rounds} rounds with exactly one winner, the loser busy and removed")


def test_two_processes_racing_saves_to_one_local_uri(tmp_path: Path) -> None:
    lines = race(str(tmp_path / "ckpt"), 10, tmp_path / "gates")
    assert_one_winner_per_round(lines, 10)


@pytest.mark.s3_servers
def test_two_processes_racing_saves_to_one_s3_uri(s3_bucket_uri: str, tmp_path: Path) -> None:
    lines = race(f"{s3_bucket_uri}/ckpt", 5, tmp_path / "gates")
    assert_one_winner_per_round(lines, 5)


# -- the compare-and-swap contract, per backend ---------------------------------------------------------
@pytest.fixture(params=["local", "memory", "moto", "radosgw"])
def backend_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "root")
    if request.param == "memory":
        return "memory://cas/root"
    return request.getfixturevalue("s3_bucket_uri")  # on the server the parameter names


def test_commit_compares_and_swaps(backend_uri: str) -> None:
    backend = open_plain_backend(backend_uri)
    run = get_scheduler().run
    run(backend.commit("COMMIT", b"one", expected=None))
    with pytest.raises(CheckpointBusyError, match="refused"):
        run(backend.commit("COMMIT", b"two", expected=None))         # it exists already
    with pytest.raises(CheckpointBusyError, match="refused"):
        run(backend.commit("COMMIT", b"two", expected=b"stale"))     # it holds something else
    assert run(backend.get("COMMIT")) == b"one"
    run(backend.commit("COMMIT", b"two", expected=b"one"))
    assert run(backend.get("COMMIT")) == b"two"
    with pytest.raises(CheckpointBusyError):
        run(backend.commit("MISSING", b"x", expected=b"anything"))   # nothing there to match
    run(backend.commit("COMMIT", b"three", expected=UNCONDITIONAL))
    assert run(backend.get("COMMIT")) == b"three"
    assert run(backend.list("")) == ["COMMIT"], "the commit lock must not show up as an object"


@pytest.mark.s3_servers
def test_s3_commit_is_refused_when_the_object_changes_after_the_comparison(s3_bucket_uri: str) -> None:
    """The If-Match precondition, not the read before it, is what excludes a concurrent writer: every read of
    the commit (the comparison, and the second one before radosgw's retry with the bare ETag) still finds the
    expected object, and another writer replaces it right after each."""
    backend = open_plain_backend(s3_bucket_uri)
    run = get_scheduler().run
    run(backend.commit("COMMIT", b"one", expected=None))
    original = backend._get_with_etag
    first: list[tuple[bytes | None, str | None]] = []
    writes = 0

    async def read_then_overwritten(*args):
        nonlocal writes
        first.append(await original(*args))
        writes += 1
        await backend.put("COMMIT", f"other writer {writes}".encode())
        return first[0]

    backend._get_with_etag = read_then_overwritten
    with pytest.raises(CheckpointBusyError, match="PreconditionFailed"):
        run(backend.commit("COMMIT", b"two", expected=b"one"))
    assert run(backend.get("COMMIT")) == f"other writer {writes}".encode()
