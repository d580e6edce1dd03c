"""Single-process behaviour of ``tierckpt.save`` / ``tierckpt.load`` on local paths and ``memory://``."""

from __future__ import annotations

import logging
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import tierckpt
from tierckpt.saving import cleanup
from tierckpt.native import layout
from tierckpt.backends import open_backend
from tierckpt.errors import (
    CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError, StateMismatchError,
    UnsupportedURIError,
)
from tierckpt.loading.api import read_checkpoint

# Every save here is followed by loads in the same thread, never raced: superseded generations are swept at
# once, and the tests that wait for the sweeps do not wait out the grace for racing loads.
pytestmark = pytest.mark.usefixtures("no_sweep_grace")


class Custom:
    """A user class: torch.load(weights_only=True) cannot rebuild it, so it is stored as a pickle."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and other.value == self.value


@pytest.fixture(params=["local", "memory"])
def uri(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"memory://api-{uuid.uuid4().hex}/ckpt"


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def generations(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("g-"))


def committed(root: Path) -> str:
    return layout.CommitRecord.decode((root / layout.COMMIT).read_bytes()).generation


# -- round trips -------------------------------------------------------------------------------------
def test_dtypes_zero_dim_and_zero_size_round_trip_bit_exactly(uri):
    """bf16/fp16/fp32/int64/bool tensors (with NaN payloads, -0.0, inf), a 0-d and a zero-size tensor
    come back bit-for-bit."""
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(7, 5, generator=g)
    f32[0, 0], f32[0, 1], f32[0, 2] = float("nan"), -0.0, float("inf")
    raw = torch.tensor([0x7FC00001, -1], dtype=torch.int32).view(torch.float32)  # odd NaN payloads
    state = {
        "bf16": torch.randn(3, 4, generator=g).bfloat16(),
        "fp16": torch.randn(9, generator=g).half(),
        "fp32": f32,
        "nan": raw,
        "i64": torch.randint(-(2**62), 2**62, (6,), generator=g),
        "bool": torch.rand(4, 3, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 5),
    }
    tierckpt.save(uri, state)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    tierckpt.load(uri, target)
    for k, v in state.items():
        assert target[k].dtype == v.dtype and target[k].shape == v.shape, k
        assert bits(target[k]) == bits(v), k


def test_nested_dicts_objects_and_stateful_round_trip(uri):
    """Nested dicts of tensors and plain values, and a StepLR scheduler (a stateful object), round-trip."""
    param = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(5):
        opt.step()
        sched.step()
    state = {"extra": {"step": 17, "name": "run-a", "inner": {"t": torch.arange(4), "xs": [1, 2.5]}},
             "sched": sched}
    tierckpt.save(uri, state)

    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    target = {"extra": {"step": 0, "name": "", "inner": {"t": torch.zeros(4, dtype=torch.int64), "xs": []}},
              "sched": sched2}
    tierckpt.load(uri, target)
    assert target["extra"]["step"] == 17 and target["extra"]["name"] == "run-a"
    assert target["extra"]["inner"]["xs"] == [1, 2.5]
    assert torch.equal(target["extra"]["inner"]["t"], torch.arange(4))
    assert sched2.state_dict() == sched.state_dict()
    assert sched2.last_epoch == 5


def test_tied_weights_stay_tied(uri):
    """A weight shared by two modules is still one tensor after load, holding the saved values."""

    def model() -> nn.Module:
        m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        m[1].weight = m[0].weight
        return m

    torch.manual_seed(0)
    src = model()
    tierckpt.save(uri, {"model": src})
    torch.manual_seed(1)
    dst = model()
    tierckpt.load(uri, {"model": dst})
    assert dst[1].weight is dst[0].weight
    assert torch.equal(dst[0].weight, src[0].weight)


def test_fresh_optimizer_loads_adamw_state(uri):
    """An AdamW that never stepped (no state yet) loads the saved moments, step and hyperparameters,
    and the model's parameters are the saved ones (the state-creating step does not move them)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.param_groups[0]["lr"] = 0.005
    tierckpt.save(uri, {"model": model, "optim": opt})

    model2 = nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01, weight_decay=0.1)
    assert not opt2.state
    tierckpt.load(uri, {"model": model2, "optim": opt2})
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)
        for k, v in opt.state[p].items():
            assert torch.equal(opt2.state[p2][k], v), k
    assert opt2.param_groups[0]["lr"] == 0.005
    assert opt2.param_groups[0]["weight_decay"] == 0.1


# -- strict mode -------------------------------------------------------------------------------------
@pytest.fixture
def saved(uri) -> str:
    tierckpt.save(uri, {"a": torch.ones(2, 3), "b": torch.arange(4)})
    return uri


def test_strict_missing_key(saved):
    """A state key absent from the checkpoint is named, with the strict=False hint."""
    with pytest.raises(StateMismatchError, match="strict=False") as info:
        tierckpt.load(saved, {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int64), "c": torch.zeros(1)})
    assert "'c'" in str(info.value) and "missing" in str(info.value)


def test_strict_loads_what_is_asked_for(saved, caplog):
    """Strict checks the requested keys: a checkpoint key the state does not ask for is skipped,
    logged at debug level only (no warning)."""
    target = {"a": torch.zeros(2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.DEBUG, logger="tierckpt"):
            tierckpt.load(saved, target)
    assert torch.equal(target["a"], torch.ones(2, 3))
    (record,) = [r for r in caplog.records if "not requested" in r.getMessage()]
    assert record.levelno == logging.DEBUG and "'b'" in record.getMessage()


def test_strict_mismatch_is_named_before_missing_keys(saved):
    """A shape mismatch comes first in the message, ahead of the list of missing keys."""
    target = {"a": torch.zeros(3, 2), **{f"x{i}": torch.zeros(1) for i in range(20)}}
    with pytest.raises(StateMismatchError) as info:
        tierckpt.load(saved, target)
    msg = str(info.value)
    assert msg.index("shape mismatch 'a'") < msg.index("missing from the checkpoint")


def test_strict_shape_mismatch_names_key_and_both_shapes(saved):
    target = {"a": torch.zeros(3, 2), "b": torch.zeros(4, dtype=torch.int64)}
    with pytest.raises(StateMismatchError, match="strict=False") as info:
        tierckpt.load(saved, target)
    msg = str(info.value)
    assert "'a'" in msg and "[2, 3]" in msg and "[3, 2]" in msg
    assert torch.equal(target["b"], torch.zeros(4, dtype=torch.int64)), "nothing is loaded on a strict error"


def test_a_dtype_that_differs_is_cast_as_dcp_does(saved):
    """An int64 tensor loads into an int32 target, cast (complex into real is the refused case:
    tests/test_silent_round2_api.py)."""
    target = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int32)}
    tierckpt.load(saved, target)
    assert target["b"].dtype == torch.int32 and torch.equal(target["b"], torch.arange(4, dtype=torch.int32))


def test_non_strict_loads_what_matches_and_warns(saved):
    """strict=False loads matching keys, leaves mismatched ones alone, and warns naming them."""
    target = {"a": torch.zeros(3, 2), "b": torch.zeros(4, dtype=torch.int64), "c": torch.zeros(1)}
    with pytest.warns(UserWarning, match="strict=False") as record:
        tierckpt.load(saved, target, strict=False)
    msg = " ".join(str(w.message) for w in record)
    assert "'a'" in msg and "'c'" in msg
    assert torch.equal(target["b"], torch.arange(4))
    assert torch.equal(target["a"], torch.zeros(3, 2)) and torch.equal(target["c"], torch.zeros(1))


# -- missing, incomplete and unsupported ---------------------------------------------------------------
def test_nothing_at_path_raises_not_found(tmp_path):
    """No checkpoint (missing or empty directory, empty memory store): CheckpointNotFoundError, which
    is also a FileNotFoundError."""
    (tmp_path / "empty").mkdir()
    for uri in (str(tmp_path / "nope"), str(tmp_path / "empty"), f"memory://none-{uuid.uuid4().hex}/x"):
        with pytest.raises(CheckpointNotFoundError):
            tierckpt.load(uri, {"a": torch.zeros(1)})
        with pytest.raises(FileNotFoundError):
            tierckpt.load(uri, {"a": torch.zeros(1)})


def test_data_without_commit_raises_incomplete(tmp_path):
    """A directory holding a generation but no COMMIT (an interrupted save) is IncompleteCheckpointError."""
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), {"a": torch.ones(3)})
    (root / layout.COMMIT).unlink()
    with pytest.raises(IncompleteCheckpointError, match="COMMIT"):
        tierckpt.load(str(root), {"a": torch.zeros(3)})


def test_unknown_scheme_raises_unsupported():
    with pytest.raises(UnsupportedURIError, match="nosuchscheme"):
        tierckpt.save("nosuchscheme://bucket/x", {"a": torch.ones(1)})
    with pytest.raises(UnsupportedURIError):
        tierckpt.load("nosuchscheme://bucket/x", {"a": torch.ones(1)})


# -- generations ---------------------------------------------------------------------------------------
def test_failed_resave_keeps_previous_checkpoint(tmp_path):
    """A second save whose state cannot be serialized fails, and the first checkpoint still loads
    bit-exactly; COMMIT is unchanged."""
    root = tmp_path / "ckpt"
    first = {"w": torch.randn(5, 4), "step": 1}
    tierckpt.save(str(root), first)
    commit_bytes = (root / layout.COMMIT).read_bytes()
    with pytest.raises(CheckpointError):
        tierckpt.save(str(root), {"w": torch.randn(5, 4), "step": lambda: 2})
    assert (root / layout.COMMIT).read_bytes() == commit_bytes
    target = {"w": torch.zeros(5, 4), "step": 0}
    tierckpt.load(str(root), target)
    assert bits(target["w"]) == bits(first["w"]) and target["step"] == 1


def test_resave_failing_before_commit_leaves_old_commit(tmp_path, monkeypatch):
    """A re-save that fails after writing its data (while writing metadata) does not commit: COMMIT
    still names the first generation, which loads bit-exactly and is not deleted."""
    import tierckpt.saving.commit as save_commit

    root = tmp_path / "ckpt"
    first = {"w": torch.randn(8, 3)}
    tierckpt.save(str(root), first)
    gen = committed(root)

    def boom(meta):
        raise OSError("disk full while writing the header")

    monkeypatch.setattr(save_commit, "encode_header", boom)
    with pytest.raises(Exception, match="disk full"):
        tierckpt.save(str(root), {"w": torch.randn(8, 3)})
    monkeypatch.undo()
    assert committed(root) == gen
    assert gen in generations(root)
    for other in set(generations(root)) - {gen}:
        assert not (root / other / "meta" / "header.json").exists(), "the failed generation has no header"
    target = {"w": torch.zeros(8, 3)}
    tierckpt.load(str(root), target)
    assert bits(target["w"]) == bits(first["w"])


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def test_successful_resave_deletes_previous_generation_data(tmp_path):
    """After a re-save commits, no file of the old generation is left; keep_previous=True keeps them;
    the latest commit loads."""
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), {"w": torch.ones(2)})
    g1 = committed(root)
    tierckpt.save(str(root), {"w": torch.full((2,), 2.0)})
    g2 = committed(root)
    cleanup.wait_pending()  # the old generation is removed in the background, after the commit
    assert g2 != g1 and files_under(root / g1) == []
    tierckpt.save(str(root), {"w": torch.full((2,), 3.0)}, keep_previous=True)
    g3 = committed(root)
    assert g3 != g2 and (root / g2 / "meta" / "header.json").is_file()
    target = {"w": torch.zeros(2)}
    tierckpt.load(str(root), target)
    assert torch.equal(target["w"], torch.full((2,), 3.0))


def test_successful_resave_deletes_previous_generation_in_memory():
    """Same on memory://: the old generation's keys are gone after the re-save commits."""
    uri = f"memory://gen-{uuid.uuid4().hex}/ckpt"
    tierckpt.save(uri, {"w": torch.ones(2)})
    backend = open_backend(uri)
    g1 = read_checkpoint(backend).meta.generation
    tierckpt.save(uri, {"w": torch.ones(2)})
    cleanup.wait_pending()
    from tierckpt.io.scheduler import get_scheduler

    keys = get_scheduler().run(backend.list(""))
    assert not [k for k in keys if k.startswith(f"{g1}/")]
    assert read_checkpoint(backend).meta.generation != g1


def test_successful_resave_removes_previous_generation_directory(tmp_path):
    """After a re-save commits, the old generation directory itself is gone (only the new one is left)."""
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), {"w": torch.ones(2)})
    tierckpt.save(str(root), {"w": torch.full((2,), 2.0)})
    cleanup.wait_pending()
    assert generations(root) == [committed(root)]


# -- objects -------------------------------------------------------------------------------------------
def test_objects_stored_once_with_rank_none(uri):
    """A single process's objects are values every rank (of one) agrees on: stored once, rank None."""
    tierckpt.save(uri, {"step": 5, "cfg": {"lr": 0.1, "name": "x"}, "t": torch.ones(1)})
    meta = read_checkpoint(open_backend(uri)).meta
    keys = sorted(o.key for o in meta.objects)
    assert keys == ["cfg.lr", "cfg.name", "step"]
    assert all(o.rank is None for o in meta.objects)
    assert all(o.codec == "torch" for o in meta.objects)


def test_allow_pickle_gates_custom_objects(uri):
    """A custom class instance loads only with allow_pickle=True; without it, a CheckpointError
    mentions allow_pickle."""
    tierckpt.save(uri, {"obj": Custom(42), "t": torch.ones(2)}, allow_pickle=True)
    target = {"obj": None, "t": torch.zeros(2)}
    with pytest.raises(CheckpointError, match="allow_pickle"):
        tierckpt.load(uri, target)
    target = {"obj": None, "t": torch.zeros(2)}
    tierckpt.load(uri, target, allow_pickle=True)
    assert target["obj"] == Custom(42)


def test_allow_pickle_refusal_leaves_tensors_untouched(tmp_path):
    """A load refused for want of allow_pickle modifies nothing (like every other refusal)."""
    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, {"obj": Custom(1), "t": torch.ones(3)}, allow_pickle=True)
    target = {"obj": None, "t": torch.zeros(3)}
    with pytest.raises(CheckpointError, match="allow_pickle"):
        tierckpt.load(uri, target)
    assert torch.equal(target["t"], torch.zeros(3))


# -- corruption ----------------------------------------------------------------------------------------
def _data_file(root: Path) -> Path:
    return root / committed(root) / "data" / "rank-00000.bin"


def test_verify_detects_flipped_byte_before_modifying_targets(tmp_path):
    """verify=True finds a flipped byte in a data file and raises CorruptCheckpointError naming the
    file and the tensor, while every target is still untouched."""
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), {"aa": torch.arange(16, dtype=torch.float32), "zz": torch.arange(64, dtype=torch.float32)})
    pieces = tierckpt.native.metadata.decode_pieces((root / committed(root) / "meta" / "pieces.parquet").read_bytes(),
                                             read_checkpoint(open_backend(str(root))).tensors)
    zz = pieces["zz"][0]
    path = _data_file(root)
    data = bytearray(path.read_bytes())
    data[zz.byte_offset + 5] ^= 0x40
    path.write_bytes(bytes(data))
    target = {"aa": torch.full((16,), -1.0), "zz": torch.full((64,), -1.0)}
    with pytest.raises(CorruptCheckpointError) as info:
        tierckpt.load(str(root), target, verify=True)
    assert "rank-00000.bin" in str(info.value) and "'zz'" in str(info.value)
    assert torch.equal(target["aa"], torch.full((16,), -1.0))
    assert torch.equal(target["zz"], torch.full((64,), -1.0))


def test_truncated_data_file_detected_before_modifying_targets(tmp_path):
    """A truncated data file is refused (even without verify) before any target is modified."""
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), {"a": torch.arange(10.0), "b": torch.arange(100.0)})
    path = _data_file(root)
    path.write_bytes(path.read_bytes()[:-16])
    target = {"a": torch.full((10,), -1.0), "b": torch.full((100,), -1.0)}
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        tierckpt.load(str(root), target)
    assert torch.equal(target["a"], torch.full((10,), -1.0))
    assert torch.equal(target["b"], torch.full((100,), -1.0))


def test_memory_store_names_are_isolated():
    """Two memory:// stores with different names do not see each other's checkpoints."""
    a, b = f"memory://iso-{uuid.uuid4().hex}/c", f"memory://iso-{uuid.uuid4().hex}/c"
    tierckpt.save(a, {"t": torch.ones(1)})
    with pytest.raises(CheckpointNotFoundError):
        tierckpt.load(b, {"t": torch.zeros(1)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target = {"t": torch.zeros(1)}
        tierckpt.load(a, target)
    assert torch.equal(target["t"], torch.ones(1))


def test_gc_removes_leftovers_of_crashed_saves_but_not_newer_ones(tmp_path):
    """A superseded generation (a crashed re-save's data) is garbage; a newer one may be in flight."""
    from tierckpt.native import layout
    from tierckpt.cache_api import gc

    root = tmp_path / "ckpt"
    tierckpt.save(str(root), {"w": torch.ones(4)})
    cleanup.wait_pending()  # the save's own sweep is over before the leftovers appear
    committed = read_checkpoint(open_backend(str(root))).meta.generation
    old_name, new_name = layout.new_generation(1), layout.new_generation(2)
    old = root / old_name / "data"
    new = root / new_name / "data"
    for leftover in (old, new):
        leftover.mkdir(parents=True)
        (leftover / "rank-00000.bin").write_bytes(b"partial")
    result = gc(str(root), keep_last=1)
    assert result.leftovers == (old_name,)
    assert not old.exists() and new.exists() and (root / committed).exists()
    target = {"w": torch.zeros(4)}
    tierckpt.load(str(root), target)
    assert torch.equal(target["w"], torch.ones(4))


def test_a_load_of_a_few_tensors_fetches_only_their_row_groups(tmp_path):
    """The pieces table is read by ranges: footer plus the row groups that can hold the wanted tensors."""
    import hashlib

    from tierckpt.io.rangefile import RangeFile
    from tierckpt.native.layout import pieces_key
    from tierckpt.loading.api import Checkpoint, read_pieces
    from tierckpt.native.metadata import CheckpointMeta, PieceMeta, TensorMeta, encode_pieces
    from tierckpt.native.regions import Box

    names = [f"layer{i:06d}.{hashlib.sha1(str(i).encode()).hexdigest()}" for i in range(40_000)]
    tensors = {n: TensorMeta(fqn=n, dtype="float32", shape=(4,)) for n in names}
    table = encode_pieces(
        PieceMeta(fqn=n, region=Box((0,), (4,)), file="data/rank-00000.bin", byte_offset=64 * i, byte_length=16,
                  crc32c=i) for i, n in enumerate(names)
    )
    generation = "g-0000000000001-abcdefabcdef"
    path = tmp_path / "c" / pieces_key(generation)
    path.parent.mkdir(parents=True)
    path.write_bytes(table)
    meta = CheckpointMeta(generation=generation, world_size=1, created_unix=0.0, num_tensors=len(names), num_pieces=len(names))
    ckpt = Checkpoint(meta=meta, tensors=tensors)
    backend = open_backend(str(tmp_path / "c"))

    fetched = []
    original = RangeFile.readinto

    def counting(self, buffer):
        n = original(self, buffer)
        fetched.append(n)
        return n

    RangeFile.readinto = counting
    try:
        pieces = read_pieces(backend, ckpt, {names[7]})
    finally:
        RangeFile.readinto = original
    assert list(pieces) == [names[7]] and pieces[names[7]][0].byte_offset == 64 * 7
    assert 0 < sum(fetched) < len(table) / 4, (sum(fetched), len(table))
    assert read_pieces(backend, ckpt).keys() == set(names)


def test_save_and_async_save_share_their_parameters_and_their_documentation():
    """``save`` and ``async_save`` are one ``_save``: the parameters they share keep their names, kinds and
    defaults in both public signatures, and one text documents them in both docstrings."""
    import inspect

    from tierckpt.saving import api as saver

    shared = ("group", "storage_options", "tags", "keep_previous", "align_bytes", "monitor", "collective_timeout_s",
              "persist")
    sync, background = inspect.signature(tierckpt.save).parameters, inspect.signature(tierckpt.async_save).parameters
    for name in shared:
        assert sync[name].kind is background[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert sync[name].default == background[name].default, name
    assert list(sync)[:2] == list(background)[:2] == ["uri", "state"]
    assert {"replicated", "progress"} <= set(sync) and {"staging_bytes", "if_busy"} <= set(background)
    for fn in (tierckpt.save, tierckpt.async_save):
        assert saver._SHARED_DOC.strip() in (fn.__doc__ or ""), fn
