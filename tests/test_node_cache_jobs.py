"""Two jobs on one node cache: two processes sharing one cache directory save the same URI at the same
moment (a fresh URI, then overwrites). Exactly one is told committed, and its generation is the one the
remote's own COMMIT names; the other gets CheckpointBusyError naming the winner and its generation is
gone from the remote. Checked against the remote itself, not through the cache; on moto and on Ceph's radosgw
(``s3_servers``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest

import tierckpt
from racing_child import empty_state, make_state, matches, wait_for
from test_commit_cas import assert_one_winner_per_round, race
from tierckpt import cache_api
from tierckpt.backends import open_backend
from tierckpt.backends.local import LocalBackend
from tierckpt.node.disk import CacheConfig
from tierckpt.node.disk.records import Op
from tierckpt.store import node_cache_over
from tierckpt.errors import CheckpointError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.formats.verify import verify

CHILD = str(Path(__file__).parent / "node_jobs_child.py")


@pytest.fixture
def shared_node_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One fresh node cache directory for both racing jobs, their saves going through it."""
    directory = tmp_path / "node-cache"
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(directory))
    monkeypatch.setenv("RACING_CHILD_CACHE", "on")
    return directory


@pytest.mark.s3_servers
def test_two_jobs_on_one_node_cache_racing_one_s3_uri(s3_bucket_uri: str, shared_node_cache: Path,
                                                      tmp_path: Path) -> None:
    rounds = 4
    lines = race(f"{s3_bucket_uri}/ckpt", rounds, tmp_path / "gates")
    assert_one_winner_per_round(lines, rounds)
    for r in range(rounds):  # the winner's generation is the one S3's own COMMIT names
        winner = next(x for x in lines if x.get("round") == r and x.get("outcome") == "won")
        check = next(x["check"] for x in lines if x.get("round") == r and "check" in x)
        assert check["remote_commit"] == winner["generation"], f"round {r}: {check}"
    assert os.path.isdir(shared_node_cache / "catalog.lmdb")  # the saves did go through the one node cache


def run_child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def outcome_of(job: subprocess.Popen[str]) -> dict:
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    return json.loads(out.splitlines()[-1])


def remote_truth(uri: str) -> tuple[dict, str | None, list[str]]:
    """What the remote itself holds (not through the cache): the loaded state, the generation its COMMIT
    names, and the generations it has files of."""
    loaded = tierckpt.load(uri, empty_state(), storage_options={"cache": False})
    report = verify(uri, storage_options={"cache": False})
    keys = get_scheduler().run(open_backend(uri, cache=False).list(""))
    return loaded, report.generation, sorted({k.split("/")[0] for k in keys if k.startswith("g-")})


@pytest.mark.s3_servers
def test_a_commit_replaced_on_the_node_before_its_upload_is_not_a_success(
        s3_bucket_uri: str, shared_node_cache: Path, tmp_path: Path) -> None:
    """Job A's synchronous save has committed on the node; its COMMIT upload is held. Job B (another
    process) saves on top of it — A's pending commit is the node's view of COMMIT — and B's commit is
    uploaded in its place. A must not report success: its COMMIT never reaches the remote (before,
    A's held upload then overwrote B's newer COMMIT on the remote, and both saves succeeded)."""
    uri, gates = f"{s3_bucket_uri}/ckpt", tmp_path / "gates"
    gates.mkdir()
    job_a = run_child("hold-commit-upload", uri, "1", str(gates))
    wait_for(gates / "held", timeout_s=120)
    b = outcome_of(run_child("save", uri, "2"))
    assert b["outcome"] == "committed", b
    (gates / "go").touch()
    a = outcome_of(job_a)
    assert a["outcome"] == "error" and a["error"] == "CheckpointBusyError", a
    assert b["generation"] in a["message"], a
    loaded, committed, generations = remote_truth(uri)
    assert committed == b["generation"] and generations == [b["generation"]]
    assert loaded["step"] == 2 and matches(loaded)


# -- one node cache, two endpoints ------------------------------------------------------------------------
def test_one_uri_on_two_endpoints_never_shares_the_node_cache(
        s3_bucket_uri: str, shared_node_cache: Path, refused_endpoint: str) -> None:
    """Job A saves ``s3://b/ckpt`` at an endpoint that never answers (committed on the node only, then
    dies); the same bucket and path at the test server's endpoint holds another checkpoint. Through the
    one node cache, a load at the server's endpoint returns the server's checkpoint (before: A's, never
    uploaded anywhere), and a sync there uploads none of A's files (before: it put them in that bucket),
    and says where A's pending uploads belong."""
    uri = f"{s3_bucket_uri}/ckpt"
    committed = tierckpt.save(uri, make_state(2), storage_options={"cache": False}).generation
    env = {**os.environ, "TIERCKPT_S3_ENDPOINT_URL": refused_endpoint}
    job_a = subprocess.run([sys.executable, CHILD, "commit-on-node-and-die", uri, "1"], capture_output=True,
                           text=True, timeout=300, env=env)
    assert job_a.returncode == 0, job_a.stderr[-3000:]
    a_generation = json.loads(job_a.stdout.splitlines()[0])["generation"]
    loaded = tierckpt.load(uri, empty_state())  # the node cache on, the server's endpoint
    assert loaded["step"] == 2 and matches(loaded)
    with pytest.raises(CheckpointError, match=refused_endpoint.split("//")[1]):
        cache_api.sync(uri)
    _, remote_generation, generations = remote_truth(uri)
    assert remote_generation == committed and generations == [committed] and a_generation != committed


# -- pending uploads carry their user ------------------------------------------------------------------
def test_sync_never_uploads_another_users_pending_upload(tmp_path: Path) -> None:
    """A pending upload whose record names another user (and a dead process) is not adopted by ``sync``:
    it is never uploaded with this user's credentials, and sync says whose it is (before: uploaded)."""
    remote_dir = tmp_path / "remote"
    config = CacheConfig(directory=str(tmp_path / "cache"), exit_wait_s=0, poll_s=0.01)
    store = node_cache_over(LocalBackend(str(remote_dir)), config)
    key, data = "g-1/data/planted.bin", b"another user's bytes"
    path = store.written.path_of(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Path(path).write_bytes(data)
    store.catalog.record_write(store.rh, key, len(data), crc32c.crc32c(data), Op.PUT)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    planted = json.loads(store.catalog.pending(store.rh, key).to_json()) | {"uid": os.geteuid() + 4242,
                                                                             "owner": int(dead.stdout)}
    with store.catalog.env.begin(write=True) as txn:  # as that user's process would have recorded it
        txn.put(f"{store.rh}\0{key}".encode(), json.dumps(planted).encode(), db=store.catalog._db["pending"])
    with pytest.raises(CheckpointError, match=f"uid {os.geteuid() + 4242}"):
        cache_api.sync(str(remote_dir), config, timeout_s=20)
    assert not (remote_dir / key).exists()
