"""The DeepSpeed configurations whose files differ load exactly, in place and through a universal checkpoint.

Fixtures written by DeepSpeed itself (tests/fixtures/deepspeed/generate.py, VARIANTS; 2 ranks, two param
groups, a frozen 7x7 ``mix`` in no group), each against DeepSpeed's own consolidation (``zero_to_fp32``
for the weights, ``ds_to_universal`` for the moments):

* ``zero3_frozen`` (fp16): ZeRO-3 partitions the frozen parameter too, each rank's part in the
  ``frozen_param_fragments`` of its model states file; ``ds_to_universal`` does not convert it.
* ``zero2_offload`` (bf16, ``offload_optimizer: cpu``) and ``zero3_offload`` (bf16, parameters and optimizer
  offloaded to the CPU, frozen parameter partitioned), ``zero3_nvme`` (bf16, ``offload_optimizer: nvme``):
  DeepSpeed's CPU Adam keeps ``step`` as a Python int.
* ``zero1_bf16``: DeepSpeed's BF16_Optimizer under ZeRO-1 (``bf16_`` rank files).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import scenarios_deepspeed
import tierckpt
from scenarios_deepspeed import FIXTURES, build, mismatches, observed, reference
from tierckpt.errors import CorruptCheckpointError

TAG = "global_step3"


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


# -- ZeRO-3 frozen parameters ------------------------------------------------------------------------------
def test_zero3_frozen_parameters_load_in_place_exactly() -> None:
    model, optim = build(frozen=True)
    before = model.mix.detach().clone()
    tierckpt.load(str(FIXTURES / "zero3_frozen"), {"model": model, "optim": optim})  # strict: every key is there
    expected = reference("zero3_frozen")
    assert not torch.equal(expected["model.mix"].float(), before)  # the load changes it
    assert mismatches(expected, observed(model, optim), cast=True) == []


@pytest.mark.parametrize("folder", ["zero3_frozen", "zero3_frozen_universal"])
def test_read_state_gives_zero3_frozen_parameters_as_saved(folder: str) -> None:
    """The fp16 frozen weights come back in their saved dtype, bitwise what ``zero_to_fp32`` joins."""
    state = tierckpt.read_state(str(FIXTURES / folder))
    expected = reference("zero3_frozen")
    assert state["model.mix"].dtype == torch.float16
    assert torch.equal(state["model.mix"], expected["model.mix"])
    if folder == "zero3_frozen":  # the universal one has no step (ds_to_universal of ZeRO-3 writes none)
        assert mismatches(expected, state, cast=True) == []


def test_a_universal_checkpoint_of_zero3_loads_its_frozen_parameters_from_the_copied_rank_files() -> None:
    """``ds_to_universal`` leaves the frozen parameter out; its parts are read from the model states files it
    copied. Only the step (which a ZeRO-3 universal checkpoint has none of) is missing."""
    model, optim = build(frozen=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tierckpt.load(str(FIXTURES / "zero3_frozen_universal"), {"model": model, "optim": optim}, strict=False)
    said = " ".join(str(w.message) for w in caught)
    assert "optim.state.fc1.bias.step" in said and "mix" not in said, said
    expected = {k: v for k, v in reference("zero3_frozen").items() if not k.endswith(".step")}
    got = {k: v for k, v in observed(model, optim).items() if not k.endswith(".step")}
    assert mismatches(expected, got, cast=True) == []


def test_a_universal_checkpoint_of_zero3_lacking_a_rank_file_names_it(tmp_path: Path) -> None:
    root = _copy(tmp_path, "zero3_frozen_universal")
    (root / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    model, optim = build(frozen=True)
    with pytest.raises(CorruptCheckpointError, match=r"ZeRO-3 frozen parameters \(mix\).*rank\(s\) \[1\].*copy them in"):
        tierckpt.load(str(root), {"model": model, "optim": optim}, strict=False)
    with pytest.raises(CorruptCheckpointError, match=r"rank\(s\) \[1\]"):
        tierckpt.read_state(str(root))


def test_a_zero3_folder_lacking_a_rank_model_file_names_it(tmp_path: Path) -> None:
    root = _copy(tmp_path, "zero3_frozen")
    (root / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"DeepSpeed folder .*frozen parameters \(mix\).*rank\(s\) \[1\]"):
        tierckpt.read_state(str(root))


@pytest.mark.parametrize(("folder", "source"), [("zero3_frozen", "deepspeed"), ("zero3_frozen_universal", "ucp")])
def test_convert_keeps_zero3_frozen_parameters(tmp_path: Path, folder: str, source: str) -> None:
    from tierckpt.cli.main import main as cli_main

    out = str(tmp_path / "converted")
    assert cli_main(["convert", "--from", source, "--to", "tierckpt", str(FIXTURES / folder), out]) == 0
    converted = tierckpt.read_state(out, verify=True)
    assert torch.equal(converted["model.mix"], reference("zero3_frozen")["model.mix"])


# -- CPU offload: DeepSpeed's CPU Adam keeps step as a Python int ------------------------------------------------
OFFLOAD = ["zero2_offload", "zero2_offload_universal", "zero3_offload", "zero3_nvme"]


def _of(folder: str) -> str:
    """The fixture whose reference a folder must give (a universal folder: the one it was made of)."""
    return folder.removesuffix("_universal")


@pytest.mark.parametrize("folder", [*OFFLOAD, "zero3_offload_universal", "zero3_nvme_universal"])
def test_read_state_of_a_cpu_offload_checkpoint_gives_everything_deepspeed_saved(folder: str) -> None:
    """The int step comes back as the int DeepSpeed saved; the bf16 frozen weights as saved (ZeRO-2's
    universal checkpoint holds them as float32, the same values). ZeRO-3's universal one has no step."""
    state = tierckpt.read_state(str(FIXTURES / folder))
    expected = reference(_of(folder))
    if folder.startswith("zero3") and folder.endswith("universal"):
        expected = {k: v for k, v in expected.items() if not k.endswith(".step")}
    else:
        assert type(state["optim.state.fc1.weight.step"]) is int and state["optim.state.fc1.weight.step"] == 3
    assert mismatches(expected, state, cast=folder.endswith("universal")) == []


@pytest.mark.parametrize("folder", OFFLOAD)
def test_a_cpu_offload_checkpoint_resumes_torch_adamw_exactly(folder: str) -> None:
    """Everything loads; the int step becomes the float32 tensor torch's AdamW keeps (as its own
    ``load_state_dict`` makes of an int step), and the optimizer steps on from it. AdamW's settings that
    CPU Adam has not (``foreach``...) are named missing: a strict load refuses, ``strict=False`` keeps AdamW's."""
    from tierckpt.errors import StateMismatchError

    model, optim = build(frozen=True)
    with pytest.raises(StateMismatchError, match=r"missing from the checkpoint: 'optim\.param_groups\.fc1\.bias\.capturable'"):
        tierckpt.load(str(FIXTURES / folder), {"model": model, "optim": optim})
    with pytest.warns(UserWarning, match="missing from the checkpoint") as caught:
        tierckpt.load(str(FIXTURES / folder), {"model": model, "optim": optim}, strict=False)
    assert ".step" not in str(caught[0].message) and "model." not in str(caught[0].message)
    expected, got = reference(_of(folder)), observed(model, optim)
    assert {k.rsplit(".", 1)[1] for k in expected if k not in got} == {"bias_correction"}  # CPU Adam's own setting
    assert all(".param_groups." in k for k in got if k not in expected)  # AdamW's own settings, kept
    assert mismatches({k: v for k, v in expected.items() if k in got}, {k: v for k, v in got.items() if k in expected}, cast=True) == []
    step = optim.state[model.fc1.weight]["step"]
    assert step.dtype == torch.float32 and step.shape == () and step.item() == 3.0
    for p in optim.param_groups[0]["params"] + optim.param_groups[1]["params"]:
        p.grad = torch.ones_like(p)
    optim.step()
    assert optim.state[model.fc1.weight]["step"].item() == 4.0



@pytest.mark.multiproc
@pytest.mark.parametrize("folder", ["zero3_offload", "zero2_offload_universal"])
def test_fsdp2_on_three_ranks_resumes_a_two_rank_cpu_offload_checkpoint(dist_pool, folder: str) -> None:
    dist_pool.run(scenarios_deepspeed.fsdp2_resumes_offload, str(FIXTURES / folder), _of(folder))


def test_convert_of_a_cpu_offload_checkpoint_loads_with_checksums(tmp_path: Path) -> None:
    from tierckpt.cli.main import main as cli_main

    out = str(tmp_path / "converted")
    assert cli_main(["convert", "--from", "deepspeed", "--to", "tierckpt", str(FIXTURES / "zero2_offload"), out]) == 0
    model, optim = build(frozen=True)
    with pytest.warns(UserWarning, match="missing from the checkpoint"):
        tierckpt.load(out, {"model": model, "optim": optim}, verify=True, strict=False)
    assert optim.state[model.fc2.bias]["step"].item() == 3.0
    assert torch.equal(model.mix, reference("zero2_offload")["model.mix"].float())


def test_inspect_lists_a_cpu_offload_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.cli.main import main as cli_main

    assert cli_main(["inspect", str(FIXTURES / "zero2_offload")]) == 0
    out = capsys.readouterr().out
    assert "optim.state.fc1.weight.step" in out and "optim.state.fc1.weight.exp_avg_sq" in out, out


def test_a_number_saved_where_the_state_has_a_0d_tensor_loads_into_it(tmp_path: Path) -> None:
    """The rule the int step relies on, on a tierckpt checkpoint: a saved number loads into a 0-d tensor;
    anything else is refused before any tensor is written."""
    from tierckpt.errors import StateMismatchError

    tierckpt.save(str(tmp_path / "num"), {"step": 7, "w": torch.arange(3.0)})
    target = {"step": torch.tensor(0.0), "w": torch.zeros(3)}
    tierckpt.load(str(tmp_path / "num"), target)
    assert target["step"].item() == 7.0 and torch.equal(target["w"], torch.arange(3.0))
    tierckpt.save(str(tmp_path / "text"), {"step": "seven", "w": torch.arange(3.0)})
    target = {"step": torch.tensor(0.0), "w": torch.zeros(3)}
    with pytest.raises(StateMismatchError, match="'step' is a 0-d tensor in the state, but the checkpoint holds a str"):
        tierckpt.load(str(tmp_path / "text"), target)
    assert target["step"].item() == 0.0 and not target["w"].any()
    tierckpt.save(str(tmp_path / "float"), {"count": 2.5})
    target = {"count": torch.tensor(0)}
    with pytest.raises(StateMismatchError, match="'count' is a 0-d torch.int64 tensor in the state, but the checkpoint holds the float 2.5"):
        tierckpt.load(str(tmp_path / "float"), target)
    assert target["count"].item() == 0


# -- bf16 under ZeRO-1 (DeepSpeed's BF16_Optimizer) ------------------------------------------------------------
@pytest.mark.parametrize("folder", ["zero1_bf16", "zero1_bf16_universal"])
def test_a_bf16_zero1_checkpoint_resumes_exactly(folder: str) -> None:
    """``bf16_zero_pp_rank_*`` files load strictly into a module and AdamW. BF16_Optimizer records no
    ``frozen_param_shapes``, so ``zero_to_fp32`` leaves the frozen parameter out of the reference; it is
    in ``module`` (and in the universal checkpoint, as ``ds_to_universal`` wrote it): both give the same values."""
    model, optim = build(frozen=True)
    tierckpt.load(str(FIXTURES / folder), {"model": model, "optim": optim})
    got = observed(model, optim)
    assert mismatches(reference("zero1_bf16"), {k: v for k, v in got.items() if k != "model.mix"}, cast=True) == []
    in_ucp = tierckpt.read_state(str(FIXTURES / "zero1_bf16_universal"))["model.mix"]
    assert torch.equal(got["model.mix"], in_ucp.float()) and not torch.equal(in_ucp.float(), build(frozen=True)[0].mix)


# -- inspect -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("folder", "name"), [("zero3_frozen", "DeepSpeed ZeRO"), ("zero3_frozen_universal", "DeepSpeed universal")])
def test_inspect_text_says_what_a_deepspeed_folder_is_not_a_creation_time(folder: str, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.cli.main import main as cli_main

    assert cli_main(["inspect", str(FIXTURES / folder)]) == 0
    out = capsys.readouterr().out
    assert f"{name} checkpoint, read in place: no generations, no checksums" in out, out
    assert "None" not in out and "model.mix" in out, out
