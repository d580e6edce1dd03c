"""``tierckpt.integrations.lightning``: Lightning's ``CheckpointIO`` through tierckpt, against the real library.

Resumes are compared bit for bit with an uninterrupted run (parameters, AdamW moments and steps, scheduler),
in one process and under DDP on 2 ranks (gloo, each rank its own process, a hard deadline so that a hang
fails the test); the loaded checkpoint dict is compared with the one Lightning built; the rank-local save
(``group="self"``) that makes rank-0-only saves possible is tested on its own.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict, namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import tierckpt  # noqa: E402
from tierckpt.errors import CheckpointError  # noqa: E402
from tierckpt.integrations.lightning import STRUCTURE_KEY, TierckptCheckpointIO  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conftest import free_port  # noqa: E402
from lightning_child import fit, trained_state  # noqa: E402
from processes import RankForks  # noqa: E402
import scenarios_rank_local  # noqa: E402

Pair = namedtuple("Pair", "x y")

CHILD = str(Path(__file__).parent / "lightning_child.py")
STEPS_PER_EPOCH = 4  # lightning_child: 32 samples in batches of 8, one process
DDP_STEPS_PER_EPOCH = 2  # ... split over 2 ranks


def assert_same(a: Any, b: Any, where: str = "checkpoint") -> None:
    """``a`` and ``b`` equal, of the same types all the way down; tensors bit for bit (and dtype)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_resume_from_last_is_exact(tmp_path: Path) -> None:
    """k steps + checkpoint + a new Trainer resuming from ``ckpt_path="last"`` to N = N steps uninterrupted."""
    total = 3 * STEPS_PER_EPOCH
    want = trained_state(fit(total, None))
    ckpt_dir = tmp_path / "ckpt"
    fit(STEPS_PER_EPOCH * 2, str(ckpt_dir))
    # top-1 without a monitor keeps the newest epoch's checkpoint: the first was removed through the plugin
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert (ckpt_dir / "last.ckpt" / "COMMIT").is_file()  # a tierckpt checkpoint, not a torch.save file
    got = trained_state(fit(total, str(ckpt_dir), resume=True, init_seed=1))
    assert_same(got, want, "resumed")


def test_loaded_dict_is_lightnings_own(tmp_path: Path) -> None:
    """``load_checkpoint`` returns, without a template, the dict Lightning built: same keys, types, values."""
    trainer = fit(STEPS_PER_EPOCH + 1, None)
    built = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    io = TierckptCheckpointIO()
    io.save_checkpoint(built, tmp_path / "one.ckpt")
    loaded = io.load_checkpoint(tmp_path / "one.ckpt")
    assert_same(loaded, built)
    assert loaded["optimizer_states"][0]["state"][0]["exp_avg"].abs().sum() > 0  # real moments, not zeros
    assert loaded["global_step"] == STEPS_PER_EPOCH + 1


def test_structure_round_trip(tmp_path: Path) -> None:
    """Tensors anywhere (tuples, named tuples, lists, int keys, a key that spells another path), kept exactly."""
    ckpt = {
        "state_dict": OrderedDict([("a.b", torch.arange(3.0)), ("zero_dim", torch.tensor(7, dtype=torch.int64))]),
        "state": {"a": {"b": torch.ones(2, dtype=torch.bfloat16)}},
        "tuples": (torch.zeros(1), (torch.full((2, 2), 3.0), "label")),
        "lists": [{0: torch.eye(2)}, None, 1.5],
        "epoch": 4,
    }
    io = TierckptCheckpointIO()
    io.save_checkpoint(ckpt, tmp_path / "c")
    assert_same(io.load_checkpoint(tmp_path / "c"), ckpt)
    # the tensors are tierckpt entries of their own, named by their path
    assert {"state_dict.a.b", "tuples.1.0", "lists.0.0"} <= set(tierckpt.read_checkpoint(
        tierckpt.store.open_store(str(tmp_path / "c"))).tensors)


def test_pickled_objects_need_weights_only_false(tmp_path: Path) -> None:
    ckpt = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"args": argparse.Namespace(lr=0.1)},
            "pair": Pair(torch.full((2, 2), 3.0), "label")}
    io = TierckptCheckpointIO()
    io.save_checkpoint(ckpt, tmp_path / "p")
    with pytest.raises(CheckpointError, match=r"only unpickling reads.*pass weights_only=False"):
        io.load_checkpoint(tmp_path / "p")
    loaded = io.load_checkpoint(tmp_path / "p", weights_only=False)
    assert loaded["hyper_parameters"]["args"] == argparse.Namespace(lr=0.1)
    assert type(loaded["pair"]) is Pair and torch.equal(loaded["pair"].x, ckpt["pair"].x) and loaded["pair"].y == "label"


def test_other_checkpoints_and_bad_arguments_are_refused(tmp_path: Path) -> None:
    tierckpt.save(str(tmp_path / "plain"), {"w": torch.ones(2)})
    io = TierckptCheckpointIO()
    with pytest.raises(CheckpointError, match=rf"not one saved by TierckptCheckpointIO \(it has no '{STRUCTURE_KEY}'"):
        io.load_checkpoint(tmp_path / "plain")
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "absent.ckpt")
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "m")
    with pytest.raises(TypeError, match=r"map_location must be a device"):
        io.load_checkpoint(tmp_path / "m", map_location=lambda storage, loc: storage)
    assert io.load_checkpoint(tmp_path / "m", map_location={"cpu": "meta"})["w"].is_meta
    with pytest.raises(TypeError, match=r"storage_options must be a dict"):
        io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "m", storage_options="fast")


def test_remove_checkpoint(tmp_path: Path) -> None:
    io = TierckptCheckpointIO()
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "r.ckpt")
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "r.ckpt")  # a second generation under the same path
    io.remove_checkpoint(tmp_path / "r.ckpt")
    assert not (tmp_path / "r.ckpt").exists()
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "target.ckpt")
    os.symlink("target.ckpt", tmp_path / "last.ckpt")  # ModelCheckpoint(save_last="link")
    io.remove_checkpoint(tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").exists() and torch.equal(io.load_checkpoint(tmp_path / "target.ckpt")["w"], torch.ones(2))


def test_group_self_saves_and_loads_alone(tmp_path: Path) -> None:
    """``group="self"``: this process alone, with or without a process group."""
    uri = str(tmp_path / "alone")
    tierckpt.save(uri, {"w": torch.arange(4.0)}, group="self")
    state = {"w": torch.zeros(4)}
    tierckpt.load(uri, state, group="self")
    assert torch.equal(state["w"], torch.arange(4.0))
    with pytest.raises(CheckpointError, match=r"group='me': pass a torch.distributed ProcessGroup, None .* or 'self'"):
        tierckpt.save(uri, state, group="me")


@pytest.mark.multiproc
def test_group_self_on_rank_zero_alone_while_others_wait(dist_pool, tmp_path: Path) -> None:
    """4 gloo ranks: rank 0 saves alone (``group="self"``) while the others sit in a barrier; every rank then
    loads it alone. On the default group the save would wait for ranks that never come."""
    results = dist_pool.run(scenarios_rank_local.rank_zero_saves_alone, str(tmp_path), timeout_s=120)
    assert results == [(1, [0.0, 1.0, 2.0, 3.0])] * 4


@pytest.fixture(scope="module")
def forks():
    """Lightning imported once; each rank of each run below is a fork of that server (tests/rank_forks.py)."""
    server = RankForks("lightning_child")
    yield server
    server.close()


def _run_ddp(forks: RankForks, mode: str, ckpt_dir: Path, out: Path, max_steps: int, strategy: str,
             world: int = 2, env_extra: dict[str, str] | None = None, fails: bool = False) -> list[Any]:
    """Run ``lightning_child.py`` as ``world`` ranks (torchrun's environment) with ``strategy`` (``ddp`` or
    ``fsdp2``) and ``env_extra``; fail on a hang, or on a failed rank (``fails``: on a rank that did not fail).
    The ranks' results."""
    port = free_port()
    ranks = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1",
               "TORCHELASTIC_RUN_ID": "tierckpt-test", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "LIGHTNING_CHILD_STRATEGY": strategy, **(env_extra or {})}
        ranks.append(([CHILD, mode, str(ckpt_dir), str(out), str(max_steps)], env))
    results = forks.run(ranks, out.parent, 240, f"Lightning {strategy} {mode}")
    for rank, r in enumerate(results):
        if fails:
            assert r.returncode != 0 and "done" not in r.stdout, f"rank {rank} of {mode} did not fail"
        else:
            assert r.returncode == 0 and "done" in r.stdout, f"rank {rank} of {mode}: rc {r.returncode}\n{r.stderr[-3000:]}"
    return results


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_multi_process_resume_from_last_is_exact_and_never_hangs(forks: RankForks, tmp_path: Path, strategy: str) -> None:
    """DDP: Lightning saves and removes on rank 0 only, and the plugin's rank-local saves let it.
    FSDP2 (``TierckptModelParallelStrategy``): every rank saves its shards in one collective save. Resume is
    exact either way."""
    total = 3 * DDP_STEPS_PER_EPOCH
    ckpt_dir = tmp_path / "ckpt"
    _run_ddp(forks, "plain", ckpt_dir, tmp_path / "plain", total, strategy)
    _run_ddp(forks, "first", ckpt_dir, tmp_path / "first", 2 * DDP_STEPS_PER_EPOCH, strategy)
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=1-step=4.ckpt", "last.ckpt"]
    saved = tierckpt.read_checkpoint(tierckpt.store.open_store(str(ckpt_dir / "last.ckpt")))
    if strategy == "fsdp2":  # sharded: each rank wrote its shards, no full copy gathered anywhere
        assert saved.meta.world_size == 2 and "fsdp2" in saved.meta.frameworks
        assert "optimizer_0.state.net.0.weight.exp_avg" in saved.tensors
        with pytest.raises(CheckpointError, match=r"saved by TierckptModelParallelStrategy: .* resume through that"):
            TierckptCheckpointIO().load_checkpoint(ckpt_dir / "last.ckpt")  # not a dict without its weights
    else:  # rank 0 alone
        assert saved.meta.world_size == 1 and "optimizer_states.0.state.0.exp_avg" in saved.tensors
    _run_ddp(forks, "resume", ckpt_dir, tmp_path / "resume", total, strategy)
    want = torch.load(tmp_path / "plain.0.pt")
    for rank in range(2):
        assert_same(torch.load(tmp_path / f"resume.{rank}.pt"), want, f"rank {rank}")


@pytest.mark.multiproc
def test_fsdp2_checkpoint_loads_onto_three_ranks(forks: RankForks, tmp_path: Path) -> None:
    """A checkpoint of FSDP2 on 2 ranks restores FSDP2 on 3 (resharded): resuming at the saved step trains
    nothing, and every rank holds the saved parameters and optimizer state, whole, bit for bit."""
    ckpt_dir = tmp_path / "ckpt"
    _run_ddp(forks, "first", ckpt_dir, tmp_path / "first", 2 * DDP_STEPS_PER_EPOCH, "fsdp2")
    _run_ddp(forks, "resume", ckpt_dir, tmp_path / "three", 2 * DDP_STEPS_PER_EPOCH, "fsdp2", world=3)
    want = torch.load(tmp_path / "first.0.pt")
    for rank in range(3):
        assert_same(torch.load(tmp_path / f"three.{rank}.pt"), want, f"rank {rank} of 3")


@pytest.mark.multiproc
def test_fsdp2_custom_hyperparameters_resume_with_the_strategys_weights_only(forks: RankForks, tmp_path: Path) -> None:
    """A hyperparameter of the user's own class is saved by the strategy (as a pickle); Lightning gives the
    strategy no ``weights_only`` when it restores after setup, so ``fit(..., weights_only=False)`` cannot let
    the resume read it: the error names the strategy's own ``weights_only=False``, and with it the resume
    loads the hyperparameter."""
    ckpt_dir = tmp_path / "ckpt"
    custom = {"LIGHTNING_CHILD_HPARAMS": "custom"}
    _run_ddp(forks, "first", ckpt_dir, tmp_path / "first", DDP_STEPS_PER_EPOCH, "fsdp2", env_extra=custom)
    saved = tierckpt.read_checkpoint(tierckpt.store.open_store(str(ckpt_dir / "last.ckpt")))
    assert {o.codec for o in saved.meta.objects if o.key == STRUCTURE_KEY} == {"pickle"}
    for how in ("fit", None):  # fit(weights_only=False) does not reach the strategy; nothing at all
        env = {**custom, **({"LIGHTNING_CHILD_WEIGHTS_ONLY": how} if how else {})}
        failed = _run_ddp(forks, "resume", ckpt_dir, tmp_path / "refused", 2 * DDP_STEPS_PER_EPOCH, "fsdp2",
                          env_extra=env, fails=True)
        for r in failed:
            assert "TierckptModelParallelStrategy(..., weights_only=False)" in r.stderr, r.stderr[-3000:]
    resumed = _run_ddp(forks, "resume", ckpt_dir, tmp_path / "resume", 2 * DDP_STEPS_PER_EPOCH, "fsdp2",
                       env_extra={**custom, "LIGHTNING_CHILD_WEIGHTS_ONLY": "0"})
    assert all("schedule 3" in r.stdout for r in resumed)
