"""A Hugging Face hub-cache snapshot (``models--org--name/snapshots/<revision>``, whose files are symbolic links
to ``../../blobs/<hash>``) is read in place; a link that leads anywhere but that repository's ``blobs`` is
refused as before (crafted links: into another repository, elsewhere in the repository, out of the cache)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

import tierckpt  # noqa: E402
from tierckpt.backends.local import hub_blobs_of  # noqa: E402
from tierckpt.errors import CorruptCheckpointError  # noqa: E402

pytestmark = pytest.mark.fast

WEIGHT = torch.arange(12, dtype=torch.float32).reshape(3, 4)


def _hub_snapshot(cache: Path, repo: str = "models--org--tiny") -> Path:
    """The layout ``huggingface_hub`` writes: blobs by hash, a snapshot of links to them, a ref naming it."""
    root = cache / repo
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    snapshot = root / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    save_file({"w": WEIGHT}, str(root / "blobs" / "5f1e"))
    (root / "blobs" / "9c2a").write_text(json.dumps({"tie_word_embeddings": False}))
    (root / "refs" / "main").write_text("0123abcd")
    os.symlink("../../blobs/5f1e", snapshot / "model.safetensors")
    os.symlink("../../blobs/9c2a", snapshot / "config.json")
    return snapshot


def test_a_hub_snapshot_is_read_in_place(tmp_path: Path) -> None:
    snapshot = _hub_snapshot(tmp_path / "hub")
    assert tierckpt.read_state(snapshot)["model.w"].equal(WEIGHT)
    target = {"model": {"w": torch.zeros(3, 4)}}
    tierckpt.load(str(snapshot), target)
    assert torch.equal(target["model"]["w"], WEIGHT)
    doc = tierckpt.inspect(snapshot)
    assert doc["format"] == "safetensors" and doc["tensors"][0]["fqn"] == "model.w"
    assert hub_blobs_of(str(snapshot)) == os.path.realpath(tmp_path / "hub" / "models--org--tiny" / "blobs")


@pytest.mark.parametrize("target", [
    "../../../models--other--repo/blobs/5f1e",  # another repository's blob
    "../../refs/main-weights",  # inside the repository, outside its blobs
    "OUTSIDE",  # out of the hub cache altogether (an absolute path)
])
def test_a_link_out_of_the_repositorys_blobs_is_refused(tmp_path: Path, target: str) -> None:
    snapshot = _hub_snapshot(tmp_path / "hub")
    other = _hub_snapshot(tmp_path / "hub", "models--other--repo")
    outside = tmp_path / "secret.safetensors"
    save_file({"w": torch.ones(3, 4)}, str(outside))
    os.link(other.parent.parent / "blobs" / "5f1e", tmp_path / "hub" / "models--org--tiny" / "refs" / "main-weights")
    link = snapshot / "model.safetensors"
    link.unlink()
    os.symlink(str(outside) if target == "OUTSIDE" else target, link)
    with pytest.raises(CorruptCheckpointError, match=r"leads outside the checkpoint root .* through a symbolic link"):
        tierckpt.read_state(snapshot)


def test_a_folder_that_only_looks_like_a_snapshot_keeps_the_strict_rule(tmp_path: Path) -> None:
    """Links out of an ordinary folder are refused whatever its name; only ``<repo>/snapshots/<rev>`` of a
    repository folder named as the hub names them gets its ``blobs``."""
    snapshot = _hub_snapshot(tmp_path / "hub")
    plain = tmp_path / "not-a-repo" / "snapshots" / "rev"
    plain.mkdir(parents=True)
    os.symlink(snapshot.parent.parent / "blobs" / "5f1e", plain / "model.safetensors")
    assert hub_blobs_of(str(plain)) is None
    with pytest.raises(CorruptCheckpointError, match="through a symbolic link"):
        tierckpt.read_state(plain)
