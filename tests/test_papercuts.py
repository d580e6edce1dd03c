"""First-impression details: step names, the CLI's help, exit codes and messages, URI forms, write
errors, log lines, the demo's progress output, import cost, and docs that say what the code does."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt.cli import main as cli
from tierckpt.native import layout
from tierckpt.backends import LocalBackend
from tierckpt.backends.files import write_error
from tierckpt.node.disk import CacheConfig
from tierckpt.store import node_cache_over
from tierckpt.node.disk import placement
from tierckpt.node.disk.placement import DEFAULT_DISK_BYTES, default_directory
from tierckpt.errors import (
    CheckpointError, CheckpointNotFoundError, StorageError, StoragePermissionError, UnsupportedURIError,
)
from tierckpt.io.scheduler import get_scheduler

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), value)}


# -- one rule for step names -------------------------------------------------------------------------
def test_step_of_reads_padded_and_unpadded_step_names() -> None:
    assert layout.step_of("step-3") == 3
    assert layout.step_of("step-1000") == 1000
    assert layout.step_of("step-00001000") == 1000
    assert layout.step_of(layout.step_name(42)) == 42 and layout.step_name(42) == "step-00000042"
    for name in ("step-", "step-1a", "ckpt-3", "step-3/COMMIT", "xstep-3", "step--3", "step-\u0663"):
        assert layout.step_of(name) is None, name


def test_ls_and_manager_see_unpadded_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    tierckpt.save(str(root / "step-3"), _state(3.0))
    tierckpt.save(str(root / "step-1000"), _state(1000.0))

    assert cli.main(["ls", str(root), "--json"]) == 0
    rows = {e["path"]: e for e in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows["step-3"]["step"] == 3 and not rows["step-3"]["latest"]
    assert rows["step-1000"]["step"] == 1000 and rows["step-1000"]["latest"]
    assert cli.main(["ls", str(root)]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^\s+1000\s+\*\s+committed.*step-1000$", table, re.MULTILINE), table

    manager = tierckpt.CheckpointManager(str(root), keep_last=1)
    assert manager.steps() == [3, 1000] and manager.latest() == 1000
    state = _state(0.0)
    assert manager.load_latest(state) == 1000
    assert torch.equal(state["w"], _state(1000.0)["w"])

    manager.save(2000, _state(2000.0))  # retention removes the hand-named steps by their real names
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-00002000"]


# -- import cost ----------------------------------------------------------------------------------
def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_version_imports_no_torch() -> None:
    out = _python(
        "import runpy, sys\n"
        "sys.argv = ['tierckpt', '--version']\n"
        "try:\n    runpy.run_module('tierckpt', run_name='__main__')\n"
        "except SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
        "print('torch' in sys.modules, 'tierckpt.node.disk' in sys.modules)\n"
    )
    assert out.splitlines() == ["tierckpt 0.1.0", "False False"]


def test_import_is_cheap_and_every_public_name_still_imports() -> None:
    out = _python(
        "import sys, tierckpt\n"
        "print('torch' in sys.modules)\n"
        "from tierckpt import *\n"
        "import tierckpt.cache_api, tierckpt.formats.verify, tierckpt.native.layout\n"
        "assert all(getattr(tierckpt, n) is not None for n in tierckpt.__all__)\n"
        "assert tierckpt.native.layout.COMMIT == 'COMMIT' and callable(tierckpt.formats.verify.verify)\n"
        "assert tierckpt.sync is tierckpt.cache_api.sync and tierckpt.save.__module__ == 'tierckpt.saving.api'\n"
        "assert set(tierckpt.__all__) <= set(dir(tierckpt))\n"
        "print('torch' in sys.modules)\n"
    )
    assert out.splitlines() == ["False", "True"]
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        tierckpt.no_such_name  # noqa: B018


# -- the command line -------------------------------------------------------------------------------
def _subcommands() -> dict:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


def test_every_command_has_a_description() -> None:
    for name, sub in _subcommands().items():
        assert sub.description and len(sub.description) > 40, name


def test_cli_md_documents_every_command_and_its_json_option() -> None:
    doc = (ROOT / "docs" / "cli.md").read_text()
    assert "to be documented" not in doc
    for name, sub in _subcommands().items():
        block = re.search(rf"^### {name}\n\n```\n(tierckpt {name}.*?)```", doc, re.MULTILINE | re.DOTALL)
        assert block, f"docs/cli.md has no section with the usage of {name}"
        has_json = any("--json" in a.option_strings for a in sub._actions)
        assert ("--json" in block.group(1)) == has_json, name
        assert f"[`{name}`](#{name})" in doc, f"{name} is missing from the commands table"
    listed = re.search(r"`inspect`, `verify`.*?have `--json`", doc, re.DOTALL).group(0)
    with_json = {n for n, sub in _subcommands().items() if any("--json" in a.option_strings for a in sub._actions)}
    assert set(re.findall(r"`(\w+)`", listed)) == with_json


def test_status_of_a_missing_checkpoint_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", str(tmp_path / "nothing-here")]) == cli.EXIT_NOT_FOUND
    assert "no checkpoint at" in capsys.readouterr().err


def test_failed_upload_error_names_the_sync_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a-file").write_bytes(b"x")
    remote = str(tmp_path / "a-file" / "remote")  # every upload fails: a file stands where a directory goes
    store = node_cache_over(LocalBackend(remote), CacheConfig.from_env(poll_s=0.01, exit_wait_s=0))
    get_scheduler().run(store.put("obj", b"payload"))

    assert cli.main(["wait", remote, "--timeout", "60"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert f"tierckpt sync {remote}" in err and "tierckpt.cache_api.sync" not in err
    assert get_scheduler().run(store.drop_pending()) == ["obj"]  # nothing left for the exit drain to report


# -- URIs and storage options ------------------------------------------------------------------------
@pytest.mark.parametrize("uri, fixed", [
    ("s3:/ckpts/x", "s3://ckpts/x"), ("s3:ckpts/x", "s3://ckpts/x"), ("memory:/m/x", "memory://m/x"),
    ("foo:/x", "foo://x"), ("file:relative", "file://relative"),
])
def test_a_scheme_without_slashes_is_an_error(uri: str, fixed: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedURIError, match=re.escape(fixed)) as info:
        tierckpt.save(uri, _state(1.0))
    assert repr(uri) in str(info.value)
    with pytest.raises(UnsupportedURIError):
        tierckpt.load(uri, _state(0.0))
    assert list(tmp_path.iterdir()) == []  # nothing written to ./s3: or anywhere else
    assert cli.main(["ls", uri]) == cli.EXIT_USAGE


def test_file_uris_and_unknown_schemes(tmp_path: Path) -> None:
    tierckpt.save(f"file:{tmp_path}/one-slash", _state(1.0))  # RFC 8089's file:/path stays valid
    tierckpt.save(f"file://{tmp_path}/two-slashes", _state(2.0))
    state = _state(0.0)
    tierckpt.load(str(tmp_path / "one-slash"), state)
    assert torch.equal(state["w"], _state(1.0)["w"])
    with pytest.raises(UnsupportedURIError, match="nosuchscheme"):
        tierckpt.save("nosuchscheme://bucket/x", _state(1.0))


def test_storage_option_cache_true_or_a_clear_error(tmp_path: Path, s3_bucket_uri: str) -> None:
    tierckpt.save(str(tmp_path / "local"), _state(1.0), storage_options={"cache": True})
    uri = f"{s3_bucket_uri}/cached"
    tierckpt.save(uri, _state(5.0), storage_options={"cache": True})
    state = _state(0.0)
    tierckpt.load(uri, state, storage_options={"cache": True})
    assert torch.equal(state["w"], _state(5.0)["w"])
    with pytest.raises(CheckpointError, match=r"cache='yes'.*True or False"):
        tierckpt.save(str(tmp_path / "bad"), _state(1.0), storage_options={"cache": "yes"})


def test_a_bad_endpoint_variable_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TIERCKPT_S3_ENDPOINT_URL", "127.0.0.1:5577")
    for cache in ("off", "on"):
        monkeypatch.setenv("TIERCKPT_CACHE", cache)
        with pytest.raises(UnsupportedURIError, match=r"TIERCKPT_S3_ENDPOINT_URL='127.0.0.1:5577'.*http:// or https://"):
            tierckpt.save("s3://bucket/x", _state(1.0))
    assert cli.main(["ls", "s3://bucket/x"]) == cli.EXIT_USAGE
    assert "TIERCKPT_S3_ENDPOINT_URL" in capsys.readouterr().err
    monkeypatch.delenv("TIERCKPT_S3_ENDPOINT_URL")
    with pytest.raises(UnsupportedURIError, match="storage option endpoint_url='localhost:9000'"):
        tierckpt.save("s3://bucket/x", _state(1.0), storage_options={"endpoint_url": "localhost:9000"})


# -- local write errors ------------------------------------------------------------------------------
def test_a_write_under_proc_is_not_reported_as_not_found() -> None:
    with pytest.raises(StorageError) as info:
        tierckpt.save("/proc/tierckpt-no-such-dir/ckpt", _state(1.0))
    assert not isinstance(info.value, CheckpointNotFoundError)
    assert "/proc/tierckpt-no-such-dir" in str(info.value) and "writable" in str(info.value)


def test_demo_under_an_unwritable_root_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--root", "/proc/tierckpt-no-such-dir", "--steps", "1", "--quiet"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/proc/tierckpt-no-such-dir" in err and "Traceback" not in err


def test_a_file_in_the_path_is_named(tmp_path: Path) -> None:
    (tmp_path / "plain-file").write_bytes(b"x")
    with pytest.raises(StorageError, match="not a directory") as info:
        tierckpt.save(str(tmp_path / "plain-file" / "ckpt"), _state(1.0))
    assert not isinstance(info.value, CheckpointNotFoundError)
    assert str(tmp_path / "plain-file") in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_a_read_only_directory_is_a_permission_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(StoragePermissionError, match=str(locked)):
        tierckpt.save(str(locked / "ckpt"), _state(1.0))


def test_write_errors_are_classified_by_errno() -> None:
    for code, cls, words in (
        (errno.EROFS, StoragePermissionError, "read-only"),
        (errno.EACCES, StoragePermissionError, "permissions"),
        (errno.ENOSPC, StorageError, "device is full"),
        (errno.EISDIR, StorageError, "directory stands where the file goes"),
    ):
        error = write_error(OSError(code, os.strerror(code), "/data/ckpt/x"), "writing /data/ckpt/x")
        assert type(error) is cls and words in str(error) and "/data/ckpt/x" in str(error), error


# -- logs and progress -------------------------------------------------------------------------------
def test_info_log_line_is_readable(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tierckpt"):
        tierckpt.save(str(tmp_path / "ckpt"), {"w": torch.zeros(300_000)})
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("save "))
    assert re.search(r" on rank 0: .*plan \d+\.\d{3} s", line), line
    assert re.search(r"bytes_written 1200\d{3} \(1\.1 MiB\)", line), line
    assert "{" not in line and not re.search(r"bytes_written \d+\.0", line)


def test_demo_progress_is_one_line_per_phase_when_captured(capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.demo.run import _Progress

    with _Progress(total=2, quiet=False) as progress:
        progress.note("checkpoint goes to X")
        progress.phase("A: first")
        progress.phase("B: second")
    err = capsys.readouterr().err
    assert "\r" not in err and err == "checkpoint goes to X\n[1/2] A: first\n[2/2] B: second\n"
    with _Progress(total=1, quiet=True) as progress:
        progress.phase("A")
    assert capsys.readouterr().err == ""


# -- the user guide ----------------------------------------------------------------------------------
def test_user_guide_states_the_cache_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    defaults = CacheConfig(directory=str(tmp_path))
    assert f"{DEFAULT_DISK_BYTES // 2**30} GiB" in guide
    assert f"{defaults.memory_bytes // 2**20} MiB" in guide
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 {tmp_path} ext4 rw 0 0\n")
    monkeypatch.setattr(placement, "MOUNTS", str(mounts))
    assert default_directory()[0] == str(tmp_path / ".cache" / "tierckpt")
    assert "`~/.cache/tierckpt`" in guide and "`/tmp/tierckpt-cache-<uid>`" in guide


def test_user_guide_prefetch_example_waits(s3_bucket_uri: str) -> None:
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", guide, re.DOTALL) if "prefetch" in b)
    assert ".result()" in example
    uri = f"{s3_bucket_uri}/run1/step-00005000"
    tierckpt.save(uri, {"model.w": torch.arange(1000.0), "optim.m": torch.ones(10)})
    scope = {"tierckpt": tierckpt}
    exec(example.replace("s3://bucket/run1/step-00005000", uri), scope)  # noqa: S102 - our own docs
    handle = scope["handle"]
    assert handle.done() and scope["nbytes"] == handle.bytes_total == 1000 * 4  # model.w only
