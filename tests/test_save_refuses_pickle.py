"""A value that only unpickling reads back is refused at save, naming its key, its type and the fix, instead of
being pickled silently and failing at the first load; ``allow_pickle=True`` (or ``"warn"``) stores it."""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tierckpt
from tierckpt.errors import CheckpointError


@dataclasses.dataclass
class Settings:
    """A class of the user's own: torch's weights-only unpickler does not rebuild it."""

    lr: float = 0.1


def test_a_custom_object_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    uri = tmp_path / "ckpt"
    with pytest.raises(CheckpointError) as info:
        tierckpt.save(uri, {"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)})
    message = str(info.value)
    assert "'args' (type argparse.Namespace)" in message
    assert "allow_pickle=True" in message and "dataclasses.asdict" in message
    assert not (uri / "COMMIT").exists()
    assert not list(uri.rglob("*.bin")) if uri.exists() else True


def test_the_part_inside_a_container_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"'extra.history' \(type .*Settings at \[1\]\['cfg'\]\)"):
        tierckpt.save(tmp_path / "c", {"extra": {"history": [1, {"cfg": Settings()}]}, "w": torch.ones(1)})


def test_plain_values_are_saved_without_the_flag(tmp_path: Path) -> None:
    state = {"w": torch.ones(2), "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "name": "run"}, "step": 3,
             "settings": dataclasses.asdict(Settings())}
    tierckpt.save(tmp_path / "c", state)
    read = tierckpt.read_state(tmp_path / "c")
    assert (read["cfg"]["betas"], read["cfg"]["name"], read["settings"]["lr"], read["step"]) == ((0.9, 0.99), "run", 0.1, 3)


def test_allow_pickle_stores_it_and_the_load_needs_it_too(tmp_path: Path) -> None:
    uri = tmp_path / "c"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # True: no warning
        tierckpt.save(uri, {"w": torch.ones(2), "settings": Settings(0.5)}, allow_pickle=True)
    target = {"w": torch.zeros(2), "settings": None}
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        tierckpt.load(uri, target)
    tierckpt.load(uri, target, allow_pickle=True)
    assert target["settings"] == Settings(0.5) and torch.equal(target["w"], torch.ones(2))


def test_warn_stores_it_with_a_warning(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"saved as pickle: 'settings' \(type .*Settings\).*allow_pickle=True"):
        handle = tierckpt.async_save(tmp_path / "c", {"w": torch.ones(2), "settings": Settings()}, allow_pickle="warn")
        handle.wait()
    assert tierckpt.read_state(tmp_path / "c", allow_pickle=True)["settings"] == Settings()


def test_async_save_refuses_too_and_a_bad_flag_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"'settings' \(type .*Settings\)"):
        tierckpt.async_save(tmp_path / "c", {"w": torch.ones(2), "settings": Settings()})
    with pytest.raises(CheckpointError, match=r"allow_pickle='yes': pass False .*, True .* or 'warn'"):
        tierckpt.save(tmp_path / "c", {"w": torch.ones(2)}, allow_pickle="yes")  # type: ignore[arg-type]


def one_rank_holds_a_custom_object(root: str) -> str:
    """Rank 1 alone holds a value that needs pickle: every rank raises the refusal (none hangs, none commits)."""
    state = {"w": torch.ones(2) * dist.get_rank(), "extra": Settings() if dist.get_rank() == 1 else {"lr": 0.1}}
    try:
        tierckpt.save(f"{root}/c", state)
    except CheckpointError as exc:
        return str(exc)
    return "saved"


@pytest.mark.multiproc
def test_every_rank_raises_when_one_holds_a_pickle(dist_pool, tmp_path: Path) -> None:
    results = dist_pool.run(one_rank_holds_a_custom_object, str(tmp_path), timeout_s=120)
    assert all("'extra' (type" in r and "Settings" in r for r in results), results
    assert not os.path.exists(tmp_path / "c" / "COMMIT")
