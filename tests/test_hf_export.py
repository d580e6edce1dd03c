"""Hugging Face round trips: ``convert --to safetensors`` writes a folder ``from_pretrained`` loads, and
``convert --from safetensors`` of a ``save_pretrained`` folder loads strict, tied embeddings included.

The model is a tiny ``LlamaConfig`` model with random weights (built locally, nothing downloaded);
logits are compared exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import tierckpt
from tierckpt.cli import main as cli
from tierckpt.convert import api as convert

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

INPUT_IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 60, 7]])


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything here is local: transformers must not reach the network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def tiny_llama(tied: bool, seed: int = 0) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random everywhere (norm weights start at 1)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS).logits


def _keys(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_with_config_in_the_state_loads_with_from_pretrained(tmp_path: Path, tied: bool, capsys) -> None:
    model = tiny_llama(tied)
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "hf"
    tierckpt.save(ckpt, {
        "model": model,
        "hf_config": model.config.to_json_string(),
        "hf_generation_config": model.generation_config.to_json_string(),
    })
    assert cli.main(["convert", ckpt, str(out), "--to", "safetensors", "--prefix", "model."]) == cli.EXIT_OK
    captured = capsys.readouterr()
    assert "warning" not in captured.err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert ("lm_head.weight" in _keys(out)) is not tied  # save_pretrained drops the tied copy too
    assert ("tied: dropped lm_head.weight (the same tensor as model.embed_tokens.weight)" in captured.out) is tied
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert loaded.config.tie_word_embeddings is tied
    assert torch.equal(logits(loaded), logits(model))
    assert loaded.generation_config.to_dict() == model.generation_config.to_dict()


def test_export_with_config_dir(tmp_path: Path, capsys) -> None:
    model = tiny_llama(tied=True)
    ckpt, out, config_dir = str(tmp_path / "ckpt"), tmp_path / "hf", tmp_path / "hf-config"
    tierckpt.save(ckpt, {"model": model})
    model.config.save_pretrained(config_dir)
    model.generation_config.save_pretrained(config_dir)
    args = ["convert", ckpt, str(out), "--to", "safetensors", "--prefix", "model.", "--config", str(config_dir), "--json"]
    assert cli.main(args) == cli.EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == ["model.safetensors", "config.json", "generation_config.json"]
    assert report["tied"] == {"lm_head.weight": "model.embed_tokens.weight"} and report["warnings"] == []
    assert json.loads((out / "config.json").read_text()) == json.loads((config_dir / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert torch.equal(logits(loaded), logits(model))


def test_export_without_config_warns_in_one_line(tmp_path: Path, capsys) -> None:
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "hf"
    tierckpt.save(ckpt, {"model": tiny_llama(tied=False)})
    assert cli.main(["convert", ckpt, str(out), "--to", "safetensors", "--prefix", "model."]) == cli.EXIT_OK
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tierckpt convert: warning: no config.json written")
    assert "--config DIR" in err[0] and "model.config.to_json_string()" in err[0]
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    with pytest.warns(UserWarning, match="from_pretrained needs one"):
        convert.to_safetensors(ckpt, tmp_path / "again", prefix="model.")


def test_bad_config_sources(tmp_path: Path, capsys) -> None:
    ckpt = str(tmp_path / "ckpt")
    tierckpt.save(ckpt, {"model": tiny_llama(tied=False), "hf_config": {"vocab_size": 64}})
    assert cli.main(["convert", ckpt, str(tmp_path / "a"), "--to", "safetensors", "--prefix", "model."]) == cli.EXIT_ERROR
    assert "holds 'hf_config' as a dict" in capsys.readouterr().err  # a dict is saved as one object per field
    tierckpt.save(ckpt, {"model": tiny_llama(tied=False), "hf_config": 64})
    assert cli.main(["convert", ckpt, str(tmp_path / "a"), "--to", "safetensors", "--prefix", "model."]) == cli.EXIT_ERROR
    assert "is of type int; save it as one JSON string" in capsys.readouterr().err
    tierckpt.save(ckpt, {"model": tiny_llama(tied=False), "hf_config": "{not json"})
    assert cli.main(["convert", ckpt, str(tmp_path / "a"), "--to", "safetensors", "--prefix", "model."]) == cli.EXIT_ERROR
    assert "object 'hf_config' is not valid JSON" in capsys.readouterr().err
    args = ["convert", ckpt, str(tmp_path / "b"), "--to", "safetensors", "--config", str(tmp_path)]
    assert cli.main(args) == cli.EXIT_NOT_FOUND
    assert "holds no config.json" in capsys.readouterr().err
    assert cli.main(["convert", ckpt, str(tmp_path / "c"), "--to", "dcp", "--config", str(tmp_path)]) == cli.EXIT_USAGE


def test_dcp_checkpoint_exports_to_a_folder_from_pretrained_loads(tmp_path: Path) -> None:
    """``dcp.save`` of a model's state dict and its config -> ``convert --from dcp --to safetensors``, read in place."""
    import torch.distributed.checkpoint as dcp

    model = tiny_llama(tied=True)
    src, out = tmp_path / "dcp", tmp_path / "hf"
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"model": model.state_dict(), "hf_config": model.config.to_json_string()}, checkpoint_id=src, no_dist=True)
    args = ["convert", str(src), str(out), "--from", "dcp", "--to", "safetensors", "--prefix", "model."]
    assert cli.main(args) == cli.EXIT_OK
    assert "lm_head.weight" not in _keys(out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert torch.equal(logits(loaded), logits(model))


def test_import_of_save_pretrained_with_tied_embeddings_loads_strict(tmp_path: Path, capsys) -> None:
    model = tiny_llama(tied=True)
    hf, ckpt = tmp_path / "hf", str(tmp_path / "ckpt")
    model.save_pretrained(hf)
    assert "lm_head.weight" not in _keys(hf)
    args = ["convert", str(hf), ckpt, "--from", "safetensors", "--to", "tierckpt", "--prefix", "model."]
    assert cli.main(args) == cli.EXIT_OK
    assert "tied: restored model.lm_head.weight (the same tensor as model.model.embed_tokens.weight)" in capsys.readouterr().out
    fresh = tiny_llama(tied=True, seed=1)
    assert not torch.equal(logits(fresh), logits(model))
    tierckpt.load(ckpt, {"model": fresh})  # strict: lm_head.weight is there
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(logits(fresh), logits(model))


def test_import_keeps_an_untied_lm_head(tmp_path: Path) -> None:
    model = tiny_llama(tied=False)
    hf, ckpt = tmp_path / "hf", str(tmp_path / "ckpt")
    model.save_pretrained(hf)
    report = convert.from_safetensors(hf, ckpt, prefix="model.")
    assert report.tied == {}
    fresh = tiny_llama(tied=False, seed=1)
    tierckpt.load(ckpt, {"model": fresh})
    assert torch.equal(logits(fresh), logits(model))
