"""Issue 31, round 2 of "nothing silent": bounds on memory and space, folders that are not checkpoints,
and an unusable node cache.

* Every file read whole from a checkpoint or a tier has a size cap checked before reading; a pieces or
  tensors table's row count is checked against the header before decoding (sparse files stand in for
  huge ones: nothing here allocates gigabytes, and each child runs under an address-space limit so a
  regression fails with ``MemoryError`` instead of exhausting the machine).
* A folder that is not a tierckpt checkpoint says what it is and what to do; "a save was interrupted" is
  kept for uncommitted generation files.
* A memory tier whose file system is full (a real tmpfs) raises a clear error, or with ``fallback`` saves
  to the next tier; a budget larger than the file system is clamped with a warning.
* A read-only or full node cache directory names itself, ``TIERCKPT_CACHE_DIR`` and ``cache=False``; after
  a multi-node save, ``status`` on every node reflects the commit another node wrote down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import tierckpt
from tierckpt.errors import CheckpointError, CorruptCheckpointError
from tierckpt.native.metadata import decode_tensors

from tamper import reseal

HUGE = 3 << 30
"""The size of the sparse files standing in for huge ones."""
RSS_BUDGET_MB = 300
"""How much a refused read may raise the peak resident size above the child's baseline."""

_CHILD = textwrap.dedent("""
    import json, os, resource, sys, traceback
    import torch, tierckpt
    from tierckpt.cli.main import main as cli

    def vm_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    def peak_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    spec = json.loads(sys.argv[1])
    tierckpt.load  # imports done before the baseline
    import tierckpt.loading.api, tierckpt.formats.verify, tierckpt.saving.api  # noqa: F401
    limit = vm_bytes() + (2 << 30)  # a regression fails with MemoryError, never exhausts the machine
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    base = peak_mb()
    out = []
    for op in spec["ops"]:
        kind, arg = op
        try:
            if kind == "load":
                tierckpt.load(arg, {"w": torch.zeros(64)})
                result = {"error": None}
            elif kind == "save":
                tierckpt.save(arg, {"w": torch.ones(64)})
                result = {"error": None}
            else:
                import io, contextlib
                err = io.StringIO()
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
                    code = cli(arg)
                result = {"error": "cli", "code": code, "message": err.getvalue()}
        except BaseException as exc:
            result = {"error": type(exc).__name__, "message": str(exc)}
        result["op"] = kind
        result["rss_mb"] = peak_mb() - base
        out.append(result)
    print(json.dumps(out))
""")


def _run_child(ops: list[list[Any]], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``ops`` in a fresh interpreter under an address-space limit; each op's outcome and the peak
    resident size above the child's baseline after it."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps({"ops": ops})], capture_output=True, text=True,
                          timeout=240, env=full_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _save(root: Path) -> tuple[str, str]:
    uri = str(root / "ckpt")
    tierckpt.save(uri, {"w": torch.arange(64, dtype=torch.float32)})
    gen = json.loads((root / "ckpt" / "COMMIT").read_text())["generation"]
    return uri, gen


def _assert_refused(results: list[dict[str, Any]], names: str, size: int) -> None:
    for r in results:
        assert r["error"] is not None, r
        message = r["message"]
        if r["error"] == "cli":
            assert r["code"] == 5, r  # corrupt
        else:
            assert r["error"] == "OversizedFileError", r
        assert names in message and str(size) in message and "not a tierckpt checkpoint" in message, r
        assert r["rss_mb"] < RSS_BUDGET_MB, r


def test_a_huge_commit_is_refused_unread_by_load_verify_inspect_and_ls(tmp_path: Path) -> None:
    uri, _ = _save(tmp_path)
    commit = tmp_path / "ckpt" / "COMMIT"
    os.truncate(commit, HUGE)
    results = _run_child([["load", uri], ["cli", ["verify", uri]], ["cli", ["inspect", uri]]])
    _assert_refused(results, str(commit), HUGE)
    (ls,) = _run_child([["cli", ["ls", "--json", str(tmp_path)]]])
    assert ls["code"] == 0 and ls["rss_mb"] < RSS_BUDGET_MB, ls


def test_a_huge_memory_tier_uri_file_is_refused_unread_by_a_save(tmp_path: Path) -> None:
    from tierckpt.node.memory.config import MemoryConfig
    from tierckpt.node.memory.memory import MemoryTier

    uri = str(tmp_path / "ckpt")
    memory = tmp_path / "mem"
    tier = MemoryTier(uri, MemoryConfig(directory=str(memory), budget_bytes=1 << 30))
    os.makedirs(tier.home)
    uri_file = os.path.join(tier.home, "URI")
    with open(uri_file, "wb") as f:
        f.write(uri.encode())
    os.truncate(uri_file, HUGE)
    env = {"TIERCKPT_MEMORY": "on", "TIERCKPT_MEMORY_DIR": str(memory), "TIERCKPT_MEMORY_BYTES": "1G"}
    _assert_refused(_run_child([["save", uri]], env), uri_file, HUGE)


def _explode_pieces(path: Path, rows: int) -> None:
    """Rewrite the pieces table as ``rows`` copies of its first row (a few MB, zstd), in batches."""
    table = pq.read_table(path)
    batch = 100_000
    one = table.slice(0, 1)
    block = pa.concat_tables([one] * batch).combine_chunks()
    with pq.ParquetWriter(path, table.schema, compression="zstd") as writer:
        for _ in range(rows // batch):
            writer.write_table(block, row_group_size=batch)


def test_a_pieces_table_with_millions_of_rows_is_refused_before_decoding(tmp_path: Path) -> None:
    uri, gen = _save(tmp_path)
    pieces = tmp_path / "ckpt" / gen / "meta" / "pieces.parquet"
    _explode_pieces(pieces, 3_000_000)
    reseal(tmp_path / "ckpt")
    assert pieces.stat().st_size < 16 << 20 and pq.ParquetFile(pieces).metadata.num_rows == 3_000_000
    results = _run_child([["load", uri], ["cli", ["verify", uri]], ["cli", ["inspect", uri]]])
    for r in results:
        assert r["error"] in ("CorruptCheckpointError", "cli"), r
        assert r.get("code", 5) == 5, r
        assert "pieces table holds 3000000 rows" in r["message"] and "declares 1" in r["message"], r
        assert r["rss_mb"] < RSS_BUDGET_MB, r


def test_a_tensors_table_row_count_is_checked_against_the_header(tmp_path: Path) -> None:
    _, gen = _save(tmp_path)
    data = (tmp_path / "ckpt" / gen / "meta" / "tensors.parquet").read_bytes()
    assert list(decode_tensors(data, 1)) == ["w"]
    with pytest.raises(CorruptCheckpointError, match="tensors table holds 1 rows, the checkpoint header declares 5"):
        decode_tensors(data, 5)


# -- case 10: a folder that is not a tierckpt checkpoint says what it is ------------------------------------
def _folder(root: Path, files: list[str]) -> str:
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    root.mkdir(parents=True, exist_ok=True)
    return str(root)


FOREIGN = {
    # (a folder with model.safetensors or its sharded index loads in place: tests/test_integration_transformers.py)
    "safetensors export": (["weights.safetensors"],
                           ["holds safetensors files (weights.safetensors)", "tierckpt convert --from safetensors --to tierckpt"]),
    "save_pretrained": (["config.json", "adapter_model.safetensors", "tokenizer.json"],
                        ["Hugging Face save_pretrained folder", "tierckpt convert --from safetensors --to tierckpt"]),
    # (a DeepSpeed folder loads in place, and one whose files are not DeepSpeed's is corrupt by name:
    # tests/test_deepspeed_format.py)
    "other": (["notes.txt", "run/log.txt"], ["holds other files (notes.txt, run/log.txt)", "Check the path"]),
    "empty": ([], ["nothing is stored under it", "check the path"]),
}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_a_folder_that_is_not_a_checkpoint_says_what_it_is(tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.cli.main import main as cli_main
    from tierckpt.errors import CheckpointNotFoundError

    files, expected = FOREIGN[kind]
    uri = _folder(tmp_path / kind, files)
    with pytest.raises(CheckpointNotFoundError) as caught:
        tierckpt.load(uri, {"w": torch.zeros(2)})
    message = str(caught.value)
    assert all(part in message for part in expected) and "interrupted" not in message, message
    for command in ("verify", "inspect"):
        assert cli_main([command, uri]) == 3
        err = capsys.readouterr().err
        assert all(part in err for part in expected) and "interrupted" not in err, err


def test_a_hugging_face_folder_whose_weights_are_not_safetensors_names_the_file(tmp_path: Path) -> None:
    """A folder with ``model.safetensors`` is read in place; a file of that name that is not one is corrupt, by name."""
    uri = _folder(tmp_path / "hf", ["config.json", "model.safetensors"])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors") as caught:
        tierckpt.load(uri, {"w": torch.zeros(2)})
    assert "interrupted" not in str(caught.value)


def test_a_checkpoint_manager_root_names_a_step_and_load_latest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.cli.main import main as cli_main
    from tierckpt.errors import NotACheckpointError

    root = str(tmp_path / "run")
    manager = tierckpt.CheckpointManager(root)
    for step in (10, 20):
        manager.save(step, {"w": torch.full((2,), float(step))})
    latest = manager.uri_of(20)
    with pytest.raises(NotACheckpointError) as caught:
        tierckpt.load(root, {"w": torch.zeros(2)})
    message = str(caught.value)
    assert "is a CheckpointManager root" in message and f"tierckpt.load('{latest}', state)" in message, message
    assert f"CheckpointManager('{root}').load_latest(state)" in message and "interrupted" not in message, message
    assert cli_main(["verify", root]) == 3 and "CheckpointManager root" in capsys.readouterr().err
    target = {"w": torch.zeros(2)}
    tierckpt.load(latest, target)  # the step the message names loads
    assert torch.equal(target["w"], torch.full((2,), 20.0))


def test_uncommitted_generation_files_are_still_an_interrupted_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.cli.main import main as cli_main
    from tierckpt.errors import IncompleteCheckpointError

    uri, _ = _save(tmp_path)
    os.unlink(tmp_path / "ckpt" / "COMMIT")
    with pytest.raises(IncompleteCheckpointError, match="a save was interrupted or is still running"):
        tierckpt.load(uri, {"w": torch.zeros(64)})
    assert cli_main(["verify", uri]) == 4 and "a save was interrupted" in capsys.readouterr().err


# -- case 7: a full memory tier file system ---------------------------------------------------------------
TMPFS_BYTES = 8 << 20
TENSOR_NUMEL = 3 << 18
"""3 MiB of float32 per save."""


def _mounted(mount: Path, options: str):
    """A tmpfs at ``mount`` with ``options`` (a real file system that really fills up, or is read-only),
    unmounted afterwards; skips where mounting is refused."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """An 8 MiB tmpfs."""
    yield from _mounted(tmp_path / "tmpfs", f"size={TMPFS_BYTES}")


@pytest.fixture
def readonly_tmpfs(tmp_path: Path):
    """A read-only tmpfs (writes fail with EROFS, errno 30)."""
    yield from _mounted(tmp_path / "rofs", "ro,size=1m")


def _memory(mount: Path, budget: int, on_full: str) -> Any:
    from tierckpt.node.memory.config import MemoryConfig, OnFull

    return MemoryConfig(directory=str(mount / "tier"), budget_bytes=budget, on_full=OnFull(on_full))


def _fill_up(mount: Path, leave: int) -> None:
    """Leave about ``leave`` bytes free on the tmpfs at ``mount``, whatever it holds already."""
    st = os.statvfs(mount)
    with open(mount / "filler", "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


def _fill(mount: Path, leave: int) -> None:
    """Leave only ``leave`` bytes free on the tmpfs (another user of the node's tmpfs)."""
    with open(mount / "filler", "wb") as f:
        f.write(b"\0" * (TMPFS_BYTES - leave))


def test_a_full_tier_file_system_with_fallback_saves_to_the_next_tier(small_tmpfs: Path, tmp_path: Path) -> None:
    _fill(small_tmpfs, 2 << 20)  # the budget (7 MiB) admits a 3 MiB file; the file system refuses it
    memory = _memory(small_tmpfs, 7 << 20, "fallback")
    uri = str(tmp_path / "remote" / "ckpt")
    for i in range(3):
        state = {"w": torch.arange(TENSOR_NUMEL, dtype=torch.float32) + i}
        tierckpt.save(uri, state, storage_options={"memory": memory})
        for options in ({"memory": memory}, {"memory": False}):  # the next tier holds it on its own
            target = {"w": torch.zeros(TENSOR_NUMEL)}
            tierckpt.load(uri, target, storage_options=options)
            assert torch.equal(target["w"], state["w"]), (i, options)


def test_a_full_tier_file_system_without_fallback_names_the_tier_and_the_settings(small_tmpfs: Path, tmp_path: Path) -> None:
    from tierckpt.node.memory.config import MemoryTierFullError

    _fill(small_tmpfs, 2 << 20)
    memory = _memory(small_tmpfs, 7 << 20, "error")
    uri = str(tmp_path / "remote" / "ckpt")
    with pytest.raises(MemoryTierFullError) as caught:
        tierckpt.save(uri, {"w": torch.ones(TENSOR_NUMEL)}, storage_options={"memory": memory})
    message = str(caught.value)
    for part in (f"node memory tier {small_tmpfs / 'tier'} ran out of space", "No space left on device",
                 f"its file system holds {TMPFS_BYTES} bytes", f"TIERCKPT_MEMORY_BYTES is {7 << 20} bytes",
                 "TIERCKPT_MEMORY_FULL=fallback", "storage_options={'memory': False}"):
        assert part in message, message
    from tierckpt.backends.files import is_temp_name

    assert not [p for p in (small_tmpfs / "tier").rglob("*") if p.is_file() and is_temp_name(p.name)], \
        "a refused write leaves no temp file in the tier"


def test_a_budget_larger_than_the_file_system_is_clamped_with_a_warning(small_tmpfs: Path, tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match=f"larger than the file system that holds .* \\({TMPFS_BYTES} bytes\\)"):
        memory = _memory(small_tmpfs, 1 << 30, "error")
    assert memory.budget_bytes == TMPFS_BYTES
    uri = str(tmp_path / "remote" / "ckpt")
    for i in range(3):  # 9 MiB in all through an 8 MiB tier: older copies are evicted once written down
        state = {"w": torch.arange(TENSOR_NUMEL, dtype=torch.float32) * i}
        tierckpt.save(uri, state, storage_options={"memory": memory})
        target = {"w": torch.zeros(TENSOR_NUMEL)}
        tierckpt.load(uri, target, storage_options={"memory": memory})
        assert torch.equal(target["w"], state["w"])


# -- case 13: an unusable node cache ----------------------------------------------------------------------
def _assert_names_the_cache(exc: BaseException, directory: Path, reason: str) -> None:
    message = str(exc)
    for part in (f"the node cache {directory} cannot be used", reason, "TIERCKPT_CACHE_DIR",
                 "storage_options={'cache': False}"):
        assert part in message, message
    from tierckpt.errors import NodeCacheError

    assert isinstance(exc, NodeCacheError), repr(exc)


def test_a_read_only_cache_dir_names_the_cache_and_cache_false(readonly_tmpfs: Path, s3_bucket_uri: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cache = readonly_tmpfs / "cache"
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(cache))
    uri = f"{s3_bucket_uri}/ro"
    state = {"w": torch.arange(64, dtype=torch.float32)}
    with pytest.raises(CheckpointError) as caught:
        tierckpt.save(uri, state)
    _assert_names_the_cache(caught.value, cache, "Read-only file system")
    tierckpt.save(uri, state, storage_options={"cache": False})  # the way out the message names
    target = {"w": torch.zeros(64)}
    tierckpt.load(uri, target, storage_options={"cache": False})
    assert torch.equal(target["w"], state["w"])


def test_a_full_cache_disk_names_the_cache_and_cache_false(small_tmpfs: Path, s3_bucket_uri: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cache = small_tmpfs / "cache"
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(cache))
    uri = f"{s3_bucket_uri}/full"
    tierckpt.save(uri, {"w": torch.zeros(16)})  # the catalogue and its directories exist
    _fill_up(small_tmpfs, 1 << 20)
    with pytest.raises(CheckpointError) as caught:
        tierckpt.save(uri, {"w": torch.ones(TENSOR_NUMEL)})
    _assert_names_the_cache(caught.value, cache, "No space left on device")


def _status_on(node_dir: Path, node: str, uri: str) -> dict[str, Any]:
    """``tierckpt status --json URI`` run as a process of simulated node ``node`` (its own memory tier)."""
    env = {**os.environ, "TIERCKPT_NODE_ID": node, "TIERCKPT_MEMORY_DIR": str(node_dir / "shm"), "TIERCKPT_MEMORY": "on",
           "TIERCKPT_MEMORY_BYTES": "256M"}
    done = subprocess.run([sys.executable, "-m", "tierckpt", "status", "--json", uri], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.multiproc
def test_status_on_every_node_reflects_a_commit_another_node_wrote_down(tmp_path: Path) -> None:
    """Two simulated nodes save with ``wait("remote")``; node-0 writes the COMMIT down, so node-1's own log
    never records it: its ``status`` must still say the checkpoint is on the remote, nothing pending."""
    from test_memory_recovery import Job

    uri = str(tmp_path / "remote" / "step-1")
    saved = Job(tmp_path, ["node-0", "node-1"], "shard", saves=[{"uri": uri, "seed": 1, "level": ["replicated", "remote"]}]).wait()
    assert all(r["saves"][uri]["ok"] for r in saved), saved
    generation = json.loads((Path(uri) / "COMMIT").read_text())["generation"]
    for node in ("node-0", "node-1"):
        st = _status_on(tmp_path / node, node, uri)
        assert st["generation"] == st["remote_generation"] == generation, (node, st)
        assert st["state"] == "remote" and st["pending_keys"] == [] and st["durable"], (node, st)
        assert dict((level, reached) for level, reached, _ in st["levels"])["remote"], (node, st)
