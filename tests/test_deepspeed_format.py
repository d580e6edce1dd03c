"""DeepSpeed ZeRO-1/2/3 folders and universal checkpoints load in place, exactly, onto any layout.

The fixtures were written by DeepSpeed itself (tests/fixtures/deepspeed/generate.py: 2 ranks, torch
AdamW in two param groups, partitions that split a parameter and end in padding); the reference is
what DeepSpeed's own consolidation gives. DeepSpeed is not needed here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import scenarios_deepspeed
import tierckpt
from scenarios_deepspeed import FIXTURES, build, mismatches, observed, reference
from tierckpt.errors import CheckpointError, CorruptCheckpointError

FOLDERS = {  # fixture folder -> the ZeRO stage whose reference it must give
    "zero1": 1, "zero2": 2, "zero3": 3, "zero1_universal": 1, "zero2_universal": 2,
}
TAG = "global_step3"


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_a_deepspeed_folder_loads_exactly_into_a_module_and_adamw(folder: str) -> None:
    model, optim = build()
    tierckpt.load(str(FIXTURES / folder), {"model": model, "optim": optim})
    expected = reference(FOLDERS[folder])
    assert len(expected) == 61  # 5 tensors of the model, 3 states and 11 settings of 4 parameters
    assert not torch.equal(expected["model.fc1.weight"], build()[0].fc1.weight.detach())  # the load changes it
    assert mismatches(expected, observed(model, optim)) == []


@pytest.mark.parametrize("folder", ["zero2", "zero3", "zero1_universal"])
def test_a_tag_folder_loads_like_its_parent(folder: str) -> None:
    """The folder that ``latest`` (``latest_universal``) names loads by itself too."""
    model, optim = build()
    tierckpt.load(str(FIXTURES / folder / TAG), {"model": model, "optim": optim})
    assert mismatches(reference(FOLDERS[folder]), observed(model, optim)) == []


@pytest.mark.parametrize("folder", ["zero1", "zero3", "zero2_universal"])
def test_read_state_gives_every_tensor_and_setting(folder: str) -> None:
    state = tierckpt.read_state(str(FIXTURES / folder))
    assert mismatches(reference(FOLDERS[folder]), state) == []


@pytest.mark.parametrize(("folder", "source"), [("zero2", "deepspeed"), ("zero3", "deepspeed"), ("zero1_universal", "ucp")])
def test_convert_from_deepspeed_then_load_exactly(tmp_path: Path, folder: str, source: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.cli.main import main as cli_main

    out = str(tmp_path / "converted")
    assert cli_main(["convert", "--from", source, "--to", "tierckpt", str(FIXTURES / folder), out]) == 0
    assert "61 " not in capsys.readouterr().err
    model, optim = build()
    tierckpt.load(out, {"model": model, "optim": optim}, verify=True)  # a tierckpt checkpoint: with checksums
    assert mismatches(reference(FOLDERS[folder]), observed(model, optim)) == []


def test_convert_names_the_right_source_format(tmp_path: Path) -> None:
    from tierckpt.convert.deepspeed import from_deepspeed

    with pytest.raises(CheckpointError, match="is a DeepSpeed universal checkpoint; use --from ucp"):
        from_deepspeed(str(FIXTURES / "zero1_universal"), str(tmp_path / "out"), source="deepspeed")


@pytest.mark.multiproc
@pytest.mark.parametrize("folder", ["zero2", "zero3", "zero1_universal"])
def test_fsdp2_on_three_ranks_loads_a_two_rank_deepspeed_folder_exactly(dist_pool, folder: str) -> None:
    dist_pool.run(scenarios_deepspeed.fsdp2_loads, str(FIXTURES / folder), FOLDERS[folder])


@pytest.mark.multiproc
@pytest.mark.parametrize("folder", ["zero1", "zero2_universal"])
def test_ddp_on_three_ranks_loads_a_two_rank_deepspeed_folder_exactly(dist_pool, folder: str) -> None:
    dist_pool.run(scenarios_deepspeed.ddp_loads, str(FIXTURES / folder), FOLDERS[folder])


def test_verify_true_refuses_with_the_convert_command() -> None:
    model, optim = build()
    with pytest.raises(CheckpointError, match="no checksums.*tierckpt convert --from deepspeed --to tierckpt"):
        tierckpt.load(str(FIXTURES / "zero1"), {"model": model, "optim": optim}, verify=True)


def test_a_tensor_parallel_folder_is_refused_naming_ds_to_universal(tmp_path: Path) -> None:
    """Several mp_rank files (tensor or pipeline parallelism): the error names DeepSpeed's command for its tag folder."""
    root = _copy(tmp_path, "zero2")
    shutil.copy(root / TAG / "mp_rank_00_model_states.pt", root / TAG / "mp_rank_01_model_states.pt")
    model, optim = build()
    with pytest.raises(CheckpointError, match=rf"tensor or pipeline parallelism.*ds_to_universal --input_folder .*zero2/{TAG} ") as caught:
        tierckpt.load(str(root), {"model": model, "optim": optim})
    assert not isinstance(caught.value, CorruptCheckpointError)


@pytest.mark.parametrize(("folder", "file", "cut"), [
    ("zero2", "zero_pp_rank_1_mp_rank_00_optim_states.pt", 100),
    ("zero2", "zero_pp_rank_1_mp_rank_00_optim_states.pt", 3000),
    ("zero3", "zero_pp_rank_0_mp_rank_00_model_states.pt", 2000),
    ("zero1_universal", "zero/fc2.weight/exp_avg.pt", 1000),
])
def test_a_truncated_file_is_corrupt_by_name(tmp_path: Path, folder: str, file: str, cut: int) -> None:
    root = _copy(tmp_path, folder)
    path = root / TAG / file
    path.write_bytes(path.read_bytes()[:cut])
    model, optim = build()
    with pytest.raises(CorruptCheckpointError, match=f"{file}' of .* is not a readable torch.save file"):
        tierckpt.load(str(root), {"model": model, "optim": optim})


def test_a_missing_rank_file_is_named(tmp_path: Path) -> None:
    root = _copy(tmp_path, "zero1")
    (root / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    model, optim = build()
    with pytest.raises(CorruptCheckpointError, match=r"optimizer files of ranks \[1\].*zero_pp_rank_<r>_mp_rank_00_optim_states.pt is missing"):
        tierckpt.load(str(root), {"model": model, "optim": optim})


def test_a_crafted_pickle_runs_no_code(tmp_path: Path) -> None:
    """A rank file whose data.pkl calls a function: the call is never made, the file is refused by name."""
    import io
    import os
    import pickle
    import zipfile

    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    root = _copy(tmp_path, "zero2")
    path = root / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"optimizer_state_dict": Evil()}, protocol=2))
        z.writestr("archive/byteorder", "little")
    path.write_bytes(buf.getvalue())
    model, optim = build()
    with pytest.raises(CorruptCheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt.*not a ZeRO optimizer file"):
        tierckpt.load(str(root), {"model": model, "optim": optim})
    assert not (tmp_path / "pwned").exists()


def test_the_cli_says_what_a_deepspeed_folder_is(capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.cli.main import main as cli_main

    assert cli_main(["verify", str(FIXTURES / "zero2")]) != 0
    err = capsys.readouterr().err
    assert "DeepSpeed ZeRO checkpoint" in err and "tierckpt convert --from deepspeed --to tierckpt" in err, err


@pytest.mark.parametrize("latest", ["global_step10", "global_step9"])
def test_a_folder_shaped_like_deepspeed_with_other_files_is_corrupt_by_name(tmp_path: Path, latest: str) -> None:
    """``latest`` and the file names of a DeepSpeed folder, but not its files (or not the tag ``latest`` names)."""
    root = tmp_path / "ds"
    for name in ("global_step10/mp_rank_00_model_states.pt", "global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
    (root / "latest").write_text(latest)
    expected = ("mp_rank_00_model_states.pt' of .* is not a readable torch.save file" if latest == "global_step10"
                else "'latest' of DeepSpeed folder .* names tag 'global_step9', but there is no folder global_step9/")
    with pytest.raises(CorruptCheckpointError, match=expected):
        tierckpt.load(str(root), {"w": torch.zeros(2)})


def test_inspect_lists_a_deepspeed_folder_in_place(capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.cli.main import main as cli_main

    assert cli_main(["inspect", str(FIXTURES / "zero3")]) == 0
    out = capsys.readouterr().out
    assert "deepspeed=zero3" in out and "optim.state.fc2.weight.exp_avg_sq" in out, out


def test_a_folder_with_latest_and_latest_universal_reads_latest(tmp_path: Path) -> None:
    """``ds_to_universal`` writes ``latest_universal`` beside the training folder's tags: ``latest`` (the
    engine's newest save, as DeepSpeed loads by default) is read; the universal tag folder loads by itself."""
    from tierckpt.formats.select import read_checkpoint
    from tierckpt.store import open_store

    root = _copy(tmp_path, "zero2")
    shutil.copytree(FIXTURES / "zero1_universal" / TAG, root / "global_step3_universal")
    (root / "latest_universal").write_text("global_step3_universal")
    assert read_checkpoint(open_store(str(root), {}), accept_foreign=True).meta.tags["deepspeed"] == "zero2"
    universal = read_checkpoint(open_store(str(root / "global_step3_universal"), {}), accept_foreign=True)
    assert universal.meta.tags["deepspeed"] == "universal"
    model, optim = build()
    tierckpt.load(str(root), {"model": model, "optim": optim})
    assert mismatches(reference(2), observed(model, optim)) == []


def test_a_universal_checkpoint_of_zero3_loads_all_it_holds(tmp_path: Path) -> None:
    """``ds_to_universal`` of a ZeRO-3 folder writes flat tensors and no step: they load with the parameters'
    shapes, and a strict load names the missing step."""
    from tierckpt.errors import StateMismatchError

    model, optim = build()
    with pytest.raises(StateMismatchError, match=r"optim\.state\.fc1\.bias\.step"):
        tierckpt.load(str(FIXTURES / "zero3_universal"), {"model": model, "optim": optim})
    model, optim = build()
    with pytest.warns(UserWarning, match="missing from the checkpoint: 'optim.state.fc1.bias.step'"):
        tierckpt.load(str(FIXTURES / "zero3_universal"), {"model": model, "optim": optim}, strict=False)
    expected = {k: v for k, v in reference(3).items() if not k.endswith(".step")}
    got = {k: v for k, v in observed(model, optim).items() if not k.endswith(".step")}
    assert mismatches(expected, got) == []


@pytest.mark.parametrize(("folder", "name"), [("zero3", "DeepSpeed ZeRO"), ("zero2_universal", "DeepSpeed universal")])
def test_inspect_json_names_the_deepspeed_format(folder: str, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``inspect --json`` says the format of the reader that read the folder (not "tierckpt"), and gives no
    creation time for a folder without one."""
    import json

    from tierckpt.cli.main import main as cli_main

    assert cli_main(["inspect", "--json", str(FIXTURES / folder)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["format"], doc["created"]) == (name, None), doc
