"""Every public call that takes a URI takes a path object too (``pathlib.Path``, as torch DCP users pass), and
``tierckpt.inspect(uri)`` gives Python the document ``tierckpt inspect --json`` prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt.cli import main as cli
from tierckpt.node.disk import CacheConfig
from tierckpt.convert.api import from_safetensors, to_dcp, to_safetensors
from tierckpt.errors import CheckpointError
from tierckpt.formats.verify import verify

pytestmark = pytest.mark.fast


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint saved under a ``Path``, and what it holds."""
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([7, 8], dtype=torch.int64)}
    uri = tmp_path / "ckpt"
    tierckpt.save(uri, state)
    return uri, state


def test_read_state_and_load_take_a_path(tmp_path: Path) -> None:
    uri, state = _saved(tmp_path)
    read = tierckpt.read_state(uri)
    assert torch.equal(read["w"], state["w"]) and torch.equal(read["b"], state["b"])
    target = {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.int64)}
    tierckpt.load(uri, target)
    assert torch.equal(target["w"], state["w"])


def test_verify_inspect_and_node_cache_calls_take_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "cache"))
    uri, _ = _saved(tmp_path)
    report = verify(uri)
    assert report.ok and report.uri == str(uri) and report.bytes_checked > 0
    assert tierckpt.inspect(uri)["uri"] == str(uri)
    assert tierckpt.status(uri).remote_generation == report.generation
    assert tierckpt.status(uri, config=CacheConfig(directory=str(tmp_path / "cache"), enabled=False)).uri == str(uri)
    handle = tierckpt.prefetch(uri, progress=False)
    assert handle.result(30) == 0 and handle.in_place
    result = tierckpt.gc(tmp_path, keep_last=1, dry_run=True)
    assert result.kept == ("ckpt",)


def test_convert_takes_paths(tmp_path: Path) -> None:
    uri, state = _saved(tmp_path)
    to_safetensors(uri, tmp_path / "hf")
    back = tmp_path / "back"
    from_safetensors(tmp_path / "hf", back)
    assert torch.equal(tierckpt.read_state(back)["w"], state["w"])
    to_dcp(back, tmp_path / "dcp")
    assert (tmp_path / "dcp" / ".metadata").is_file()


@pytest.mark.parametrize("call", ["read_state", "inspect", "status", "prefetch"])
def test_a_uri_of_another_type_names_the_call(call: str) -> None:
    with pytest.raises(CheckpointError, match=rf"tierckpt\.{call}: the URI must be a str or a path object.*got int"):
        getattr(tierckpt, call)(42)


def test_inspect_is_the_cli_json_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri, state = _saved(tmp_path)
    assert cli.main(["inspect", str(uri), "--json", "--pieces"]) == 0
    printed = json.loads(capsys.readouterr().out)
    doc = tierckpt.inspect(str(uri), pieces=True)
    assert doc == printed
    assert {t["fqn"]: t["shape"] for t in doc["tensors"]} == {"b": [2], "w": [3, 4]}
    assert doc["totals"]["tensor_bytes"] == sum(t.nbytes for t in state.values())
    assert "piece_list" not in tierckpt.inspect(uri)["tensors"][0]


def test_inspect_of_a_missing_checkpoint_raises(tmp_path: Path) -> None:
    with pytest.raises(tierckpt.CheckpointNotFoundError):
        tierckpt.inspect(tmp_path / "nothing")


def test_a_local_path_is_neither_prefetched_nor_called_remote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The guide says local paths never go through the node cache: ``prefetch`` copies nothing into it (it
    copied the whole checkpoint), and ``status`` says where the checkpoint is (it called the path "remote")."""
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(cache_dir))
    uri, _ = _saved(tmp_path)
    assert cli.main(["prefetch", str(uri)]) == 0
    assert "nothing to prefetch" in capsys.readouterr().out
    copied = [p for p in cache_dir.rglob("*") if p.is_file() and p.stat().st_size > 0 and "ckpt" in str(p)]
    assert not copied, copied
    assert cli.main(["status", str(uri)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{uri}: local path; committed: g-") and "remote" not in out
    assert cli.main(["status", str(uri), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["local_path"] and doc["durable"] and not doc["node_cache"]["used"]
    assert cli.main(["prefetch", str(tmp_path / "missing")]) == 3
