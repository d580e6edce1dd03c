"""The ``tierckpt`` command line: ``inspect`` (text and JSON), error exit codes, ``--version``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt.cli import main as cli
from tierckpt import reports as cli_reports


def _model_and_optim() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model (with a bfloat16 buffer) and AdamW after one step, so the optimizer has state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))
    model.register_buffer("scale", torch.ones(4, 2, dtype=torch.bfloat16))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 5)).sum().backward()
    optim.step()
    return model, optim


def _expected_tensors(model: nn.Module) -> dict[str, tuple[list[int], str]]:
    """fqn -> (global shape, dtype name) of everything the save below stores as tensors."""
    out = {f"model.{k}": (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        out[f"optim.state.{name}.exp_avg"] = (list(p.shape), "float32")
        out[f"optim.state.{name}.exp_avg_sq"] = (list(p.shape), "float32")
        out[f"optim.state.{name}.step"] = ([], "float32")
    return out


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, dict[str, tuple[list[int], str]]]:
    """A checkpoint saved by this process: model, AdamW, and two objects; with its expected tensors."""
    model, optim = _model_and_optim()
    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, {"model": model, "optim": optim, "step": 7, "data": {"epoch": 2, "name": "demo"}}, tags={"run": "t"})
    return uri, _expected_tensors(model)


def test_inspect_json_lists_every_tensor(saved, capsys) -> None:
    uri, expected = saved
    assert cli.main(["inspect", uri, "--json"]) == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    got = {t["fqn"]: (t["shape"], t["dtype"]) for t in doc["tensors"]}
    assert got == expected
    assert all(t["pieces"] == 1 for t in doc["tensors"])  # one process saves each tensor whole
    assert all("piece_list" not in t for t in doc["tensors"])
    objects = {o["key"]: o for o in doc["objects"]}
    model, optim = _model_and_optim()
    settings = [k for k in optim.param_groups[0] if k != "params"]
    groups = {f"optim.param_groups.{name}.{k}" for name, _ in model.named_parameters() for k in settings}
    assert {"step", "data.epoch", "data.name"} | groups == set(objects)
    assert all(o["scope"] == "shared" and o["codec"] == "torch" and o["bytes"] > 0 for o in objects.values())
    assert doc["world_size"] == 1
    assert "module" in doc["frameworks"] and "optimizer" in doc["frameworks"]
    assert doc["tags"] == {"run": "t"}
    assert doc["totals"]["tensors"] == len(expected)
    assert doc["totals"]["pieces"] == len(expected)
    assert doc["totals"]["tensor_bytes"] == sum(t["bytes"] for t in doc["tensors"])
    assert doc["generation"].startswith("g-")


def test_inspect_pieces_json_matches_shapes(saved, capsys) -> None:
    uri, expected = saved
    assert cli.main(["inspect", uri, "--json", "--pieces"]) == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    for t in doc["tensors"]:
        (piece,) = t["piece_list"]
        assert piece["kind"] == "box" and piece["lengths"] == t["shape"] and piece["byte_length"] == t["bytes"]


def test_inspect_text(saved, capsys) -> None:
    uri, expected = saved
    assert cli.main(["inspect", uri, "--pieces"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "saved by 1 rank(s)" in out
    for fqn, (shape, dtype) in expected.items():
        line = next(line for line in out.splitlines() if line.split()[:1] == [fqn])
        assert dtype in line and cli_reports._shape_text(shape) in line
    assert "step" in out and "shared" in out and f"totals: {len(expected)} tensors" in out
    assert "box offsets" in out


def test_missing_checkpoint_exits_3(tmp_path: Path, capsys) -> None:
    assert cli.main(["inspect", str(tmp_path / "nothing")]) == cli.EXIT_NOT_FOUND
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no checkpoint" in err


def test_incomplete_checkpoint_exits_4(saved, capsys) -> None:
    uri, _ = saved
    (Path(uri) / "COMMIT").unlink()
    assert cli.main(["inspect", uri]) == cli.EXIT_INCOMPLETE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no COMMIT" in err


def test_corrupt_header_exits_5(saved, capsys) -> None:
    uri, _ = saved
    (header,) = Path(uri).glob("g-*/meta/header.json")
    header.write_text("{not json")
    assert cli.main(["inspect", uri]) == cli.EXIT_CORRUPT
    err = capsys.readouterr().err
    assert "header.json" in err and "corrupt" in err


def test_bad_uri_and_usage_exit_2(capsys) -> None:
    assert cli.main(["inspect", "nosuchscheme://x/y"]) == cli.EXIT_USAGE
    assert "nosuchscheme" in capsys.readouterr().err
    assert cli.main(["inspect"]) == cli.EXIT_USAGE
    assert cli.main([]) == cli.EXIT_USAGE
    assert cli.main(["demo", "--steps", "0"]) == cli.EXIT_USAGE


def test_version(capsys) -> None:
    assert cli.main(["--version"]) == cli.EXIT_OK
    assert capsys.readouterr().out.strip() == f"tierckpt {tierckpt.__version__}"


def test_subprocess_inspect_and_errors(saved, tmp_path: Path) -> None:
    """The real entry points: ``python -m tierckpt.cli.main`` and ``python -m tierckpt``."""
    uri, expected = saved
    run = [sys.executable, "-m", "tierckpt.cli.main"]
    done = subprocess.run([*run, "inspect", uri, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert {t["fqn"]: (t["shape"], t["dtype"]) for t in json.loads(done.stdout)["tensors"]} == expected
    done = subprocess.run([sys.executable, "-m", "tierckpt", "inspect", str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and done.stdout == "" and len(done.stderr.strip().splitlines()) == 1
    done = subprocess.run([sys.executable, "-m", "tierckpt", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"tierckpt {tierckpt.__version__}"


@pytest.mark.parametrize(("resumed", "code"), [(1.0, cli.EXIT_OK), (1.1, cli.EXIT_DIVERGED)])
def test_demo_exit_code_follows_loss_check(monkeypatch, capsys, tmp_path: Path, resumed: float, code: int) -> None:
    """``demo`` prints the report and exits 6 when the resumed losses diverge (the job itself is faked)."""
    from tierckpt.demo import run

    def fake_run_demo(root: str | None, steps: int, quiet: bool) -> run.DemoReport:
        stats = run.IOStats(seconds=0.1, phases={"read": 0.05}, bytes={"bytes_read": 10})
        meta = {"num_tensors": 1, "num_pieces": 2, "tensor_bytes": 10, "file_bytes": 12, "files": 2, "world_size": 2, "frameworks": ["fsdp2"]}
        return run.DemoReport(
            checkpoint=f"{root}/step-{steps}", reference=[1.0], resumed_3=[resumed], resumed_1=[1.0], first_step=steps,
            max_rel_diff=abs(resumed - 1.0), tolerance=run.TOLERANCE, save=stats, load_3=stats, load_1=stats,
            checkpoint_meta=meta, wall_seconds=1.0,
        )

    monkeypatch.setattr(run, "run_demo", fake_run_demo)
    assert cli.main(["demo", "--root", str(tmp_path), "--steps", "3", "--quiet"]) == code
    out = capsys.readouterr().out
    assert f"{tmp_path}/step-3" in out and ("DIVERGED" in out) == (code == cli.EXIT_DIVERGED)
