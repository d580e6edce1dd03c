"""Training state round trips: RNG streams, the resumable sampler and multi-source reader (resharded
across DP sizes with no sample skipped or repeated), LR schedulers, GradScaler, counters, user dicts,
and several models in one checkpoint."""

import random
from collections import Counter

import numpy as np
import pytest
import torch

import scenarios_state
import tierckpt
from tierckpt import CheckpointError
from tierckpt.backends import open_backend
from tierckpt.state.training import MultiSourceReader, ResumableSampler, RNGState, skip_to


def _draw():
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)], random.gauss(0, 1)


def test_rng_round_trip(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    tierckpt.save(str(tmp_path / "c"), {"rng": RNGState()})
    after_save = _draw()
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    tierckpt.load(str(tmp_path / "c"), {"rng": RNGState()})
    assert _draw() == after_save
    meta = tierckpt.read_checkpoint(open_backend(str(tmp_path / "c"))).meta
    assert all(o.codec == "torch" for o in meta.objects), "RNG state must load weights-only"


# -- sampler ---------------------------------------------------------------------------------------
def _run(samplers, batches):
    """``batches`` global batches from DP samplers; returns the per-global-batch index sets."""
    return [sorted(i for s in samplers for i in s.next_batch()) for _ in range(batches)]


@pytest.mark.parametrize("before,after", [(2, 3), (3, 2), (4, 1), (1, 5)])
def test_sampler_reshard_no_skip_no_repeat(before, after):
    n, g = 29, 6  # 5 global batches per epoch, the last one partial
    reference = _run([ResumableSampler(n, g, 0, 1, seed=9)], 10)
    old = [ResumableSampler(n, g, r, before, seed=9) for r in range(before)]
    first = _run(old, 3)
    states = [s.state_dict() for s in old]
    assert all(s == states[0] for s in states)  # replicated: stored once
    new = [ResumableSampler(n, g, r, after, seed=9) for r in range(after)]
    for s in new:
        s.load_resharded(states[:1])
    assert first + _run(new, 7) == reference
    epoch0 = [i for b in reference[:5] for i in b]
    assert sorted(epoch0) == list(range(n)) and reference[5:] != reference[:5]  # reshuffled next epoch


def test_sampler_rejects_other_dataset():
    state = ResumableSampler(29, 6, 0, 1).state_dict()
    with pytest.raises(CheckpointError, match="data order would differ"):
        ResumableSampler(30, 6, 0, 1).load_resharded([state])


def test_sampler_manual_advance_for_prefetching_loaders():
    s = ResumableSampler(10, 4, 0, 2, shuffle=False, auto_advance=False)
    it = iter(s)
    assert [next(it), next(it)] == [[0, 1], [4, 5]] and s.consumed == 0  # prefetched, not consumed
    s.advance()
    assert s.state_dict()["consumed"] == 4


# -- multi-source reader ---------------------------------------------------------------------------
def _read_all(readers):
    return Counter(t for r in readers for seq in r for t in seq)


@pytest.mark.parametrize("before,after,reads", [(2, 3, 4), (3, 2, 3), (3, 2, 0), (2, 5, 7), (4, 1, 2)])
def test_reader_reshard_no_skip_no_repeat(before, after, reads):
    uninterrupted = _read_all([scenarios_state.make_reader(r, before) for r in range(before)])
    assert uninterrupted == scenarios_state.all_tokens()
    old = [scenarios_state.make_reader(r, before) for r in range(before)]
    seen = Counter(t for r in old for _ in range(reads) for t in next(r))
    states = [r.state_dict() for r in old]
    assert len({str(s) for s in states}) == before  # genuinely per rank
    new = [scenarios_state.make_reader(r, after) for r in range(after)]
    for r in new:
        r.load_resharded(states)
    assert seen + _read_all(new) == uninterrupted


def test_reader_reshard_twice_and_replicas():
    """2 -> 3 -> 2 with TP replicas (two saved ranks per DP rank): still every token exactly once."""
    old = [scenarios_state.make_reader(r, 2) for r in range(2)]
    seen = Counter(t for r in old for _ in range(3) for t in next(r))
    states = [s for r in old for s in (r.state_dict(), r.state_dict())]  # TP 2 x DP 2, saved rank order
    mid = [scenarios_state.make_reader(r, 3) for r in range(3)]
    for r in mid:
        r.load_resharded(states)
    seen += Counter(t for r in mid for _ in range(2) for t in next(r))
    last = [scenarios_state.make_reader(r, 2) for r in range(2)]
    for r in last:
        r.load_resharded([m.state_dict() for m in mid])
    assert seen + _read_all(last) == scenarios_state.all_tokens()


def test_reader_same_size_resume_is_identical():
    a = scenarios_state.make_reader(1, 3)
    [next(a) for _ in range(4)]
    b = scenarios_state.make_reader(1, 3)
    b.load_state_dict(a.state_dict())
    assert list(a) == list(b)


def test_skip_to_wraps_plain_iterables():
    reader = MultiSourceReader({"s": skip_to(lambda: [[1, 2], [3], [4, 5, 6]])}, {"s": 1.0}, 0, 1, seq_len=4)
    assert list(reader) == [[1, 2, 3, 4], [5, 6]]


@pytest.mark.multiproc
@pytest.mark.parametrize("save_world,load_world", [(2, 3), (3, 2)])
def test_per_rank_state_through_tierckpt(dist_pool, tmp_path, save_world, load_world):
    results = dist_pool.run(scenarios_state.state_reshard, str(tmp_path / "c"), save_world, load_world, 3)
    assert results[0] == {"tokens": sum(scenarios_state.all_tokens().values()), "batches": 5}


# -- generic stateful paths ------------------------------------------------------------------------
def _sched_state(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=1.0, total_steps=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    return model, optim, sched, scaler


def _steps(model, optim, sched, scaler, n, first):
    out = []
    for step in range(first, first + n):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        optim.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optim)
        scaler.update()
        sched.step()
        out.append((loss.item(), sched.get_last_lr()[0], scaler.get_scale()))
    return out


def test_lr_scheduler_grad_scaler_counters_user_dicts(tmp_path):
    reference = _steps(*_sched_state(0), 6, 0)
    parts = _sched_state(0)
    _steps(*parts, 3, 0)
    model, optim, sched, scaler = parts
    user = {"tokens_seen": 12345, "best": {"loss": 0.25, "at": "step-3"}, "history": [1.5, 1.25]}
    tierckpt.save(str(tmp_path / "c"), {"model": model, "optim": optim, "sched": sched, "scaler": scaler,
                                        "step": 3, "user": user})
    model, optim, sched, scaler = _sched_state(1)
    state = {"model": model, "optim": optim, "sched": sched, "scaler": scaler, "step": 0,
             "user": {"tokens_seen": 0, "best": {"loss": 0.0, "at": ""}, "history": []}}
    tierckpt.load(str(tmp_path / "c"), state)
    assert state["step"] == 3 and state["user"] == user
    assert _steps(model, optim, sched, scaler, 3, 3) == reference[3:]  # lr schedule and loss scale continue


# -- several models --------------------------------------------------------------------------------
def _rl(seed):
    torch.manual_seed(seed)
    models = {name: torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, out))
              for name, out in (("actor", 4), ("critic", 1), ("reference", 4), ("reward", 1))}
    optims = {f"{n}_optim": torch.optim.Adam(models[n].parameters(), lr=1e-2) for n in ("actor", "critic")}
    return models, optims


def _train(models, optims):
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
    for name in ("actor", "critic"):
        loss = models[name](x).square().mean()
        optims[f"{name}_optim"].zero_grad()
        loss.backward()
        optims[f"{name}_optim"].step()


def test_several_models_full_and_partial_load(tmp_path):
    models, optims = _rl(0)
    _train(models, optims)
    tierckpt.save(str(tmp_path / "c"), {**models, **optims})
    got_models, got_optims = _rl(1)
    tierckpt.load(str(tmp_path / "c"), {**got_models, **got_optims})
    for name in models:
        for a, b in zip(models[name].state_dict().values(), got_models[name].state_dict().values()):
            assert torch.equal(a, b), name
    for name in optims:
        a, b = optims[name].state_dict()["state"], got_optims[name].state_dict()["state"]
        assert all(torch.equal(a[i]["exp_avg"], b[i]["exp_avg"]) for i in a)

    actor_only, _ = _rl(2)
    untouched = {k: v.clone() for k, v in actor_only["critic"].state_dict().items()}
    tierckpt.load(str(tmp_path / "c"), {"actor": actor_only["actor"]})  # strict: the other models are not asked for
    for a, b in zip(models["actor"].parameters(), actor_only["actor"].parameters()):
        assert torch.equal(a, b)
    assert all(torch.equal(v, actor_only["critic"].state_dict()[k]) for k, v in untouched.items())
