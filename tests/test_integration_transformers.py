"""tierckpt.integrations.transformers against the real transformers Trainer (tiny GPT-2 from a config, CPU)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer  # noqa: E402

import scenarios  # noqa: E402
import tierckpt  # noqa: E402
from distributed import subgroup  # noqa: E402
from hf_trainer_child import STEPS, CountSteps, dataset, tiny_model, training_args  # noqa: E402
from processes import RankForks  # noqa: E402
from conftest import free_port  # noqa: E402
from tierckpt.errors import CheckpointError, CheckpointNotFoundError  # noqa: E402
from tierckpt.integrations.transformers import TierckptTrainer, checkpoint_steps, latest_checkpoint  # noqa: E402

CHILD = str(Path(__file__).parent / "hf_trainer_child.py")


def make(cls: type[Trainer], output_dir: Path, **kwargs) -> tuple[Trainer, CountSteps]:
    """A trainer of the tiny run: 4 batches per epoch, a checkpoint every 3 steps (checkpoint-6 falls inside
    the second epoch, so a resume skips batches and restores the RNG there)."""
    args = training_args(str(output_dir), **kwargs.pop("args", {}))
    counter = CountSteps()
    return cls(model=tiny_model(), args=args, train_dataset=dataset(), callbacks=[counter], **kwargs), counter


def assert_same_training(a: Trainer, b: Trainer) -> None:
    """Bit-exact weights, optimizer state and lr, scheduler, global step."""
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for index, moments in sa["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, sb["state"][index][key]), (index, key)
    assert sa["param_groups"] == sb["param_groups"]
    assert a.lr_scheduler.state_dict() == b.lr_scheduler.state_dict()
    assert a.state.global_step == b.state.global_step == STEPS


def test_resume_is_bit_exact_against_an_uninterrupted_run(tmp_path: Path) -> None:
    full, _ = make(TierckptTrainer, tmp_path / "full")
    full.train()
    saved = checkpoint_steps(str(tmp_path / "full"))
    assert list(saved) == [3, 6, 9, 10]  # and at the end, as Trainer does
    # Saved through tierckpt, not Trainer's files.
    assert not (tmp_path / "full" / "checkpoint-6" / "optimizer.pt").exists()
    meta = tierckpt.read_checkpoint(tierckpt.store.open_store(saved[6]))
    assert {o.key.split(".")[0] for o in meta.meta.objects} >= {"trainer_state", "lr_scheduler", "rng", "hf_config"}

    # A run interrupted after step 6: its output holds checkpoint-6 only.
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-6", run / "checkpoint-6")
    resumed, counter = make(TierckptTrainer, run)
    assert latest_checkpoint(str(run)) == f"{run}/checkpoint-6"
    resumed.train(resume_from_checkpoint=True)
    assert counter.steps == [7, 8, 9, 10]
    assert_same_training(full, resumed)


def test_plain_trainer_resume_is_bit_exact_too(tmp_path: Path) -> None:
    """The reference: transformers' own checkpoints resume exactly, so exactness is what tierckpt must give."""
    full, _ = make(Trainer, tmp_path / "full", args={"save_only_model": False})
    full.train()
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-6", run / "checkpoint-6")
    resumed, counter = make(TierckptTrainer, run)  # a plain Trainer checkpoint folder resumes as Trainer does
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-6"))
    assert counter.steps == [7, 8, 9, 10]
    assert_same_training(full, resumed)


def test_checkpoint_uri_and_save_total_limit(tmp_path: Path) -> None:
    trainer, _ = make(TierckptTrainer, tmp_path / "out", checkpoint_uri=tmp_path / "ckpts",  # a Path, as a str
                      args={"save_total_limit": 2})
    trainer.train()
    assert list(checkpoint_steps(tmp_path / "ckpts")) == [9, 10]
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["checkpoint-10", "checkpoint-9"]
    assert not any(n.startswith("checkpoint-") for n in os.listdir(tmp_path / "out"))


def test_save_total_limit_counts_the_plain_trainers_checkpoints_of_a_switched_run(tmp_path: Path) -> None:
    """A run that wrote plain ``Trainer`` checkpoints (3, 6) and resumes from checkpoint-6 as a
    ``TierckptTrainer`` with ``save_total_limit=2`` keeps 2 checkpoints in all, as ``Trainer`` would: the plain
    folders are the oldest and go (they were never pruned); a folder that is no checkpoint stays."""
    out = tmp_path / "out"
    plain, _ = make(Trainer, out, args={"save_only_model": False})
    plain.train()
    for step in (9, 10):  # the plain run was stopped after checkpoint-6
        shutil.rmtree(out / f"checkpoint-{step}")
    (out / "checkpoint-1").mkdir()  # no trainer_state.json: not a checkpoint, never deleted
    resumed, counter = make(TierckptTrainer, out, args={"save_total_limit": 2})
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-6"))
    assert counter.steps == [7, 8, 9, 10]
    assert list(checkpoint_steps(str(out))) == [9, 10]
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-1", "checkpoint-10", "checkpoint-9"]


def test_resume_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    trainer, _ = make(TierckptTrainer, tmp_path / "out")
    (tmp_path / "out").mkdir(exist_ok=True)
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint-N under .*out"):
        trainer.train(resume_from_checkpoint=True)


def test_save_only_model_resumes_the_model_alone(tmp_path: Path) -> None:
    full, _ = make(TierckptTrainer, tmp_path / "full", args={"save_only_model": True})
    full.train()
    ckpt = tierckpt.read_checkpoint(tierckpt.store.open_store(str(tmp_path / "full" / "checkpoint-6")))
    assert {k.split(".")[0] for k in [*ckpt.tensors, *(o.key for o in ckpt.meta.objects)]} == {
        "model", "trainer_state", "hf_config"}
    resumed, counter = make(TierckptTrainer, tmp_path / "full")
    seen = {}
    original = resumed._load_from_checkpoint

    def spy(path: str, model: torch.nn.Module | None = None) -> None:
        original(path, model)
        seen.update({n: p.detach().clone() for n, p in resumed.model.named_parameters()})

    resumed._load_from_checkpoint = spy
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-6"))
    assert counter.steps == [7, 8, 9, 10]
    expected = tiny_model()
    tierckpt.load(str(tmp_path / "full" / "checkpoint-6"), {"model": expected})
    for name, value in expected.named_parameters():
        assert torch.equal(seen[name], value), name


def test_resume_from_a_checkpoint_without_trainer_state_is_refused(tmp_path: Path) -> None:
    tierckpt.save(str(tmp_path / "plain"), {"model": tiny_model()})
    trainer, _ = make(TierckptTrainer, tmp_path / "out")
    with pytest.raises(CheckpointError, match=r"holds no 'trainer_state': it was not saved by TierckptTrainer"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain"))

def test_load_best_model_at_end_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="load_best_model_at_end"):
        make(TierckptTrainer, tmp_path / "out", eval_dataset=dataset(), args={
            "load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3,
        })


# -- a save_pretrained folder loads in place ---------------------------------------------------------------
def assert_same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("shard", [None, "10KB"], ids=["single", "sharded"])
def test_save_pretrained_folder_loads_in_place(tmp_path: Path, shard: str | None) -> None:
    torch.manual_seed(0)
    saved = tiny_model()
    saved.save_pretrained(tmp_path / "hf", **({"max_shard_size": shard} if shard else {}))
    files = sorted(os.listdir(tmp_path / "hf"))
    if shard:
        assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    else:
        assert "model.safetensors" in files
    torch.manual_seed(1)
    loaded = tiny_model()
    tierckpt.load(str(tmp_path / "hf"), {"model": loaded})
    assert_same_model(saved, loaded)
    # GPT-2 ties lm_head to wte and save_pretrained leaves lm_head out: it reads the embedding's bytes.
    ckpt = tierckpt.read_checkpoint(tierckpt.store.open_store(str(tmp_path / "hf")), accept_foreign=True)
    assert "model.lm_head.weight" in ckpt.tensors and "model.transformer.wte.weight" in ckpt.tensors


def test_untied_output_embedding_must_be_in_the_folder(tmp_path: Path) -> None:
    """Without tied embeddings nothing is made up: a folder missing lm_head.weight fails the strict load."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, tie_word_embeddings=False)
    saved = GPT2LMHeadModel(config)
    saved.save_pretrained(tmp_path / "hf")
    loaded = GPT2LMHeadModel(config)
    tierckpt.load(str(tmp_path / "hf"), {"model": loaded})
    assert_same_model(saved, loaded)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(tierckpt.StateMismatchError, match="model.lm_head.weight"):
        tierckpt.load(str(tmp_path / "hf"), {"model": GPT2LMHeadModel(config)})


def test_bad_safetensors_header_and_verify_are_refused(tmp_path: Path) -> None:
    tiny_model().save_pretrained(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="safetensors folder .*records no checksums"):
        tierckpt.load(str(tmp_path / "hf"), {"model": tiny_model()}, verify=True)
    path = tmp_path / "hf" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[0:8] = (len(data) + 1).to_bytes(8, "little")  # a header longer than the file
    path.write_bytes(bytes(data))
    with pytest.raises(tierckpt.CorruptCheckpointError, match=r"model.safetensors.*claims a header of"):
        tierckpt.load(str(tmp_path / "hf"), {"model": tiny_model()})



def test_inspect_names_a_safetensors_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.cli import main as cli

    tiny_model().save_pretrained(tmp_path / "hf")
    assert cli.main(["inspect", str(tmp_path / "hf"), "--json"]) == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "safetensors" and doc["created"] is None
    assert {t["fqn"] for t in doc["tensors"]} >= {"model.transformer.wte.weight", "model.lm_head.weight"}
    assert cli.main(["inspect", str(tmp_path / "hf")]) == cli.EXIT_OK
    assert "Hugging Face safetensors folder, read in place" in capsys.readouterr().out


def test_checkpoints_on_s3_resume_exactly(tmp_path: Path, s3_server: str, s3_bucket_uri: str) -> None:
    """checkpoint_uri on S3: saved there, the latest found by listing the bucket, resumed from it."""
    full, _ = make(TierckptTrainer, tmp_path / "full", checkpoint_uri=f"{s3_bucket_uri}/full")
    full.train()
    assert list(checkpoint_steps(f"{s3_bucket_uri}/full")) == [3, 6, 9, 10]
    assert not (tmp_path / "full").exists() or not os.listdir(tmp_path / "full")
    # The resumed run's URI holds checkpoint-6 only (copied object by object).
    import boto3

    bucket, prefix = s3_bucket_uri.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    for item in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/full/checkpoint-6/")["Contents"]:
        key = item["Key"].replace("/full/", "/run/", 1)
        client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": item["Key"]})
    resumed, counter = make(TierckptTrainer, tmp_path / "run", checkpoint_uri=f"{s3_bucket_uri}/run")
    resumed.train(resume_from_checkpoint=True)
    assert counter.steps == [7, 8, 9, 10]
    assert_same_training(full, resumed)


def hf_load_sharded(path: str, mesh: tuple[int, ...], spec: str) -> dict[str, int]:
    """Every rank of the pool: ``tierckpt.load`` of a safetensors folder into DTensors laid out as ``spec``."""
    group = subgroup(scenarios._size(mesh))
    targets = scenarios._layout_state(mesh, spec, fill=False)
    stats: dict[str, int] = {}
    if group is not None:
        monitor = tierckpt.Monitor()
        tierckpt.load(path, {"model": targets}, group=group, monitor=monitor)
        for name, (shape, dtype) in scenarios.SPECS.items():
            scenarios.check_tensor(name, targets[name], scenarios.reference(name, shape, dtype))
        stats = dict(monitor.counters)
    torch.distributed.barrier()
    return stats


@pytest.mark.multiproc
def test_sharded_safetensors_folder_loads_resharded_on_3_ranks(dist_pool, tmp_path: Path) -> None:
    """Two shard files (every dtype of the scenarios, a 0-d and an empty tensor) into DTensors on 3 ranks,
    sharded by columns: each element bit-exact, each tensor byte read once by the group."""
    from safetensors.torch import save_file

    refs = {n: scenarios.reference(n, shape, dtype) for n, (shape, dtype) in scenarios.SPECS.items()}
    folder = tmp_path / "hf"
    folder.mkdir()
    names = sorted(refs)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    for file, members in shards.items():
        save_file({n: refs[n] for n in members}, str(folder / file))
    weight_map = {n: file for file, members in shards.items() for n in members}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    stats = dist_pool.run(hf_load_sharded, str(folder), (3,), "S1")
    needed = sum(t.nbytes for t in refs.values()) + 2 * refs["scalar"].nbytes  # the 0-d tensor: read by each rank
    assert sum(s.get("bytes_read", 0) for s in stats) == needed

# -- DDP, 2 ranks --------------------------------------------------------------------------------------
@pytest.fixture
def forks():
    """transformers' Trainer imported once; each rank of each run is a fork of that server."""
    server = RankForks("hf_trainer_child", "tierckpt.integrations.transformers")
    yield server
    server.close()


def run_ddp(forks: RankForks, mode: str, output_dir: Path, result: Path, world: int = 2) -> list[dict]:
    """``world`` ranks of hf_trainer_child.py on gloo (torchrun's variables), forked from a server that imported
    transformers' Trainer once (tests/rank_forks.py); each rank's result."""
    port = free_port()
    ranks = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        ranks.append(([CHILD, mode, str(output_dir), str(result)], env))
    for rank, done in enumerate(forks.run(ranks, result.parent, 240, f"DDP {mode} run")):
        assert done.returncode == 0, f"rank {rank}:\n{done.stderr[-4000:]}"
    return [torch.load(f"{result}-{rank}.pt", weights_only=True) for rank in range(world)]


@pytest.mark.multiproc
def test_ddp_two_ranks_resume_is_bit_exact(forks: RankForks, tmp_path: Path) -> None:
    full = run_ddp(forks, "full", tmp_path / "full", tmp_path / "full-result")
    assert full[0]["world"] == 2
    assert list(checkpoint_steps(str(tmp_path / "full"))) == [5, 10]
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-5", run / "checkpoint-5")
    resumed = run_ddp(forks, "resume", run, tmp_path / "resumed-result")
    for rank in range(2):
        a, b = full[rank], resumed[rank]
        assert b["steps"] == [6, 7, 8, 9, 10]
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), (rank, name)
        for index, moments in a["optimizer"]["state"].items():
            for key, value in moments.items():
                assert torch.equal(value, b["optimizer"]["state"][index][key]), (rank, index, key)
        assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
        assert a["scheduler"] == b["scheduler"]
