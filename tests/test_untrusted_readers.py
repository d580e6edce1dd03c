"""Foreign and crafted checkpoints read in place build nothing the file chooses.

Restricted unpicklers change no global of the process, overlapping pieces of a tensor are refused on
every load (native and foreign), walks of a pickled structure are bounded, metadata files are capped
before they are read, names from a file are keys inside the root, nesting is capped, and the CLI
prints names from a checkpoint escaped.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import crc32c
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierckpt
from tierckpt.formats import dcp_chunks
from tierckpt.formats import torch_archive
from tierckpt.errors import CorruptCheckpointError
from tierckpt.formats.verify import verify

from tamper import reseal


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when it runs without a process group
        dcp.save(state, checkpoint_id=str(path))


def _pickle_ops(*ops: bytes) -> bytes:
    return b"".join(ops)


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def _set_on_global(module: str, name: str, attribute: str) -> bytes:
    """Pickle opcodes that ``BUILD`` on the global ``module.name`` (slot state ``{attribute: "crafted"}``), then drop it."""
    return _pickle_ops(_global(module, name), b"N}", _str(attribute), _str("crafted"), b"s\x86b0")


# -- restricted unpicklers change no global ----------------------------------------------------------------
def test_a_dcp_metadata_cannot_set_attributes_on_the_classes_it_admits(tmp_path: Path) -> None:
    _dcp_save({"w": torch.arange(8.0)}, tmp_path / "dcp")
    metadata = tmp_path / "dcp" / ".metadata"
    real = metadata.read_bytes()
    assert real[:1] == b"\x80"  # PROTO: the crafted opcodes go right after it
    metadata.write_bytes(real[:2] + _set_on_global("pathlib", "PurePosixPath", "crafted_attribute") + real[2:])
    try:
        with pytest.raises(CorruptCheckpointError, match="crafted_attribute"):
            tierckpt.load(str(tmp_path / "dcp"), {"w": torch.zeros(8)})
        assert not hasattr(pathlib.PurePosixPath, "crafted_attribute")
    finally:
        if "crafted_attribute" in vars(pathlib.PurePosixPath):
            delattr(pathlib.PurePosixPath, "crafted_attribute")


def test_a_dcp_metadata_still_loads_after_sealing(tmp_path: Path) -> None:
    """The sealed stand-ins build the same metadata: a real DCP save loads bit-exact."""
    _dcp_save({"w": torch.arange(8.0), "m": torch.ones(2, 3, dtype=torch.bfloat16).to(memory_format=torch.contiguous_format)},
              tmp_path / "dcp")
    target = {"w": torch.zeros(8), "m": torch.zeros(2, 3, dtype=torch.bfloat16)}
    tierckpt.load(str(tmp_path / "dcp"), target)
    assert torch.equal(target["w"], torch.arange(8.0)) and torch.equal(target["m"], torch.ones(2, 3, dtype=torch.bfloat16))


def test_a_tensor_pickle_cannot_change_the_storage_markers() -> None:
    """``BUILD`` on an admitted storage class (a shared marker) with a dtype: refused, the marker unchanged."""
    before = dcp_chunks.tensor_globals()[("torch", "FloatStorage")]
    data = _pickle_ops(b"\x80\x02", _global("torch", "FloatStorage"), _global("torch", "int8"), b"\x85b.")
    with pytest.raises((CorruptCheckpointError, AttributeError, pickle.UnpicklingError)):  # each read as corruption
        dcp_chunks.TensorPickle(data).load()
    assert dcp_chunks.tensor_globals()[("torch", "FloatStorage")] == before
    assert before.dtype == torch.float32


@pytest.mark.parametrize("module, name", [("torch._utils", "_rebuild_parameter"), ("torch", "Tensor"),
                                          ("torch._utils", "_rebuild_tensor_v2")])
def test_a_rank_file_pickle_cannot_set_attributes_on_admitted_globals(module: str, name: str) -> None:
    data = _pickle_ops(b"\x80\x02", _set_on_global(module, name, "crafted_attribute"), b"N.")
    with pytest.raises(CorruptCheckpointError, match="crafted_attribute"):
        torch_archive.unpickle(data)
    for table in (torch_archive._TENSOR_WRAPPERS, dcp_chunks.tensor_globals()):
        assert all(not hasattr(v, "crafted_attribute") for v in table.values())


# -- exact coverage ------------------------------------------------------------------------------------------
def test_a_dcp_chunk_listed_twice_is_refused_not_half_loaded(tmp_path: Path) -> None:
    """``.metadata`` says ``w`` has 100 elements in two chunks, both the same first half: 50 + 50 = 100."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _dcp_save({"w": torch.arange(50.0)}, tmp_path / "dcp")
    path = tmp_path / "dcp" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own trusted file
    item = metadata.state_dict_metadata["w"]
    item.size = torch.Size([100])
    item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([50]))] * 2
    path.write_bytes(pickle.dumps(metadata))
    target = {"w": torch.full((100,), -1.0)}
    with pytest.raises(CorruptCheckpointError) as info:
        tierckpt.load(str(tmp_path / "dcp"), target)
    assert "'w'" in str(info.value) and str(info.value).count("[0:50]") == 2, str(info.value)
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        tierckpt.load(str(tmp_path / "dcp"))  # template-free: refused too, not zeros


def _native_halves(tmp_path: Path, second_offset: int) -> tuple[str, Path]:
    """A native checkpoint of ``w`` (64 floats) whose pieces table lists two pieces of 32 elements: the
    first half, and the half at ``second_offset`` (0: the first half again), COMMIT re-sealed."""
    uri = str(tmp_path / "ckpt")
    tierckpt.save(uri, {"w": torch.arange(64, dtype=torch.float32)})
    gen = json.loads((tmp_path / "ckpt" / "COMMIT").read_text())["generation"]
    path = tmp_path / "ckpt" / gen / "meta" / "pieces.parquet"
    row = pq.read_table(path).to_pylist()[0]
    data = (tmp_path / "ckpt" / gen / row["file"]).read_bytes()
    rows = []
    for offset in (0, second_offset):
        crc = crc32c.crc32c(data[offset * 4 : offset * 4 + 128])
        rows.append({**row, "offsets": [offset], "lengths": [32], "byte_offset": offset * 4, "byte_length": 128,
                     "crc32c": crc, "block_crc32c": [crc]})
    table = pq.read_table(path)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    header = tmp_path / "ckpt" / gen / "meta" / "header.json"
    doc = json.loads(header.read_text())
    doc["num_pieces"] = 2
    header.write_text(json.dumps(doc))
    reseal(tmp_path / "ckpt")
    return uri, path


def test_a_native_piece_listed_twice_is_refused_on_load(tmp_path: Path) -> None:
    uri, _ = _native_halves(tmp_path, second_offset=0)
    target = {"w": torch.full((64,), -1.0)}
    with pytest.raises(CorruptCheckpointError) as info:
        tierckpt.load(uri, target)
    assert "'w'" in str(info.value) and str(info.value).count("[0:32]") == 2, str(info.value)
    assert torch.equal(target["w"], torch.full((64,), -1.0))
    assert any(p.kind == "overlap" for p in verify(uri).problems)


def test_two_disjoint_halves_still_load(tmp_path: Path) -> None:
    """The same rewrite with the two real halves: exact coverage, loaded bit-exact."""
    uri, _ = _native_halves(tmp_path, second_offset=32)
    target = {"w": torch.zeros(64)}
    tierckpt.load(uri, target)
    assert torch.equal(target["w"], torch.arange(64, dtype=torch.float32))


# -- metadata files capped before they are read ---------------------------------------------------------------
def test_a_huge_sparse_dcp_metadata_is_refused_unread(tmp_path: Path) -> None:
    _dcp_save({"w": torch.arange(8.0)}, tmp_path / "dcp")
    os.truncate(tmp_path / "dcp" / ".metadata", 2 << 30)
    # The child's own peak is VmHWM, its address space's high-water mark. Not ru_maxrss: subprocess starts the
    # child with vfork, so exec records the test process's peak (a pytest worker's, often over 1 GiB) as the
    # child's, and the check would measure the worker instead of the load.
    code = f"""
import sys, tierckpt
from tierckpt.errors import CorruptCheckpointError
try:
    tierckpt.load({str(tmp_path / "dcp")!r})
except CorruptCheckpointError as exc:
    print("refused:", ".metadata" in str(exc))
hwm_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("peak_mib:", hwm_kib // 1024)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "refused: True" in result.stdout, result.stdout + result.stderr
    peak = int(result.stdout.split("peak_mib:")[1])
    assert peak < 1024, f"{peak} MiB"


# -- a rank file's pickle: walks bounded, class names dropped with the file ----------------------------------
def _shared_tuples(depth: int) -> tuple:
    """A DAG of ``depth`` levels of tuples each holding the one below twice: 2^depth paths, ``depth`` nodes."""
    value: tuple = ()
    for _ in range(depth):
        value = (value, value)
    return value


def test_a_rank_file_of_shared_tuples_is_walked_once_per_node(tmp_path: Path) -> None:
    """A DeepSpeed folder whose model states hold a 64-level DAG of tuples: `inspect` answers at once."""
    folder = tmp_path / "ds"
    folder.mkdir()
    torch.save({"module": {}, "dag": _shared_tuples(64)}, folder / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {}}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert (folder / "mp_rank_00_model_states.pt").stat().st_size < 4096
    code = f"import sys; from tierckpt.cli import main as cli; sys.exit(cli.main(['inspect', '--timeout', '10', {str(folder)!r}]))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode not in (0, 1), result.stdout + result.stderr  # an error the CLI names, no traceback
    assert "Traceback" not in result.stderr, result.stderr


def test_a_setting_that_is_a_dag_of_tuples_is_checked_once_per_node() -> None:
    from tierckpt.formats import deepspeed_objects

    assert deepspeed_objects._plain(_shared_tuples(200))
    assert not deepspeed_objects._plain((_shared_tuples(200), {"not": "plain"}))


def _naming_classes(count: int) -> bytes:
    """A pickle that names ``count`` distinct classes (each dropped), then returns ``None``."""
    return b"\x80\x02" + b"".join(_global("crafted", f"Class{i}") + b"0" for i in range(count)) + b"N."


def test_class_names_of_a_rank_file_are_dropped_with_it() -> None:
    import gc

    gc.collect()  # stand-ins of earlier tests' files still waiting for a collection would be counted as dropped here
    before = len(torch_archive.Opaque.__subclasses__())
    assert torch_archive.unpickle(_naming_classes(1000)) is None
    gc.collect()
    assert len(torch_archive.Opaque.__subclasses__()) == before


def test_a_rank_file_naming_too_many_classes_is_refused() -> None:
    with pytest.raises(CorruptCheckpointError, match="classes"):
        torch_archive.unpickle(_naming_classes(torch_archive.MAX_OPAQUE_CLASSES + 1))


# -- names from a file are keys; JSON nesting capped -----------------------------------------------------------
def _safetensors_folder(folder: Path, tensors: dict[str, torch.Tensor], filename: str = "model.safetensors") -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / filename))


@pytest.mark.parametrize("shard", ["ABSOLUTE", "../other/model.safetensors"])
def test_convert_refuses_an_index_entry_outside_the_folder(tmp_path: Path, shard: str) -> None:
    _safetensors_folder(tmp_path / "other", {"secret": torch.arange(4.0)})
    _safetensors_folder(tmp_path / "hf", {"w": torch.ones(2)}, "model-00001-of-00001.safetensors")
    entry = str(tmp_path / "other" / "model.safetensors") if shard == "ABSOLUTE" else shard
    index = {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors", "secret": entry}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    from tierckpt.convert.safetensors import from_safetensors

    with pytest.raises(CorruptCheckpointError, match="outside its folder"):
        from_safetensors(tmp_path / "hf", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("which", ["config.json", "model.safetensors.index.json", "header"])
def test_json_nested_100000_deep_is_corruption_naming_the_file(tmp_path: Path, which: str) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    folder = tmp_path / "hf"
    if which == "header":
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(len(deep).to_bytes(8, "little") + deep)
    else:
        shard = "model.safetensors" if which == "config.json" else "model-00001-of-00001.safetensors"
        _safetensors_folder(folder, {"w": torch.ones(2)}, shard)
        (folder / which).write_bytes(deep)
    with pytest.raises(CorruptCheckpointError) as info:
        tierckpt.load(str(folder))
    named = "model.safetensors" if which == "header" else which
    assert named in str(info.value), str(info.value)
    if which != "header":
        from tierckpt.convert.safetensors import from_safetensors

        with pytest.raises(CorruptCheckpointError, match=which.replace(".", r"\.")):
            from_safetensors(folder, str(tmp_path / "out"))


# -- the CLI escapes names from a checkpoint ------------------------------------------------------------------
def test_inspect_prints_control_characters_in_names_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.cli import main as cli

    name = "w\x1b]0;owned\x07\x1b[2J\r\u202eevil"
    _safetensors_folder(tmp_path / "hf", {name: torch.ones(2)})
    assert cli.main(["inspect", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\r\u202e"), repr(out)
    assert r"w\x1b]0;owned\x07\x1b[2J\r\u202eevil" in out, out


def test_the_walk_of_a_rank_file_stops_at_the_deadline_and_at_its_depth_cap() -> None:
    import time

    from tierckpt import deadline
    from tierckpt.errors import DeadlineExceededError

    wide = [[i] for i in range(3 * torch_archive.DEADLINE_CHECK_VISITS)]
    with deadline.operation("inspect", "crafted", seconds=0.01):
        time.sleep(0.05)
        with pytest.raises(DeadlineExceededError, match="walk of a data.pkl"):
            torch_archive._Replacer({}).replace(wide, 0)
    deep: list = []
    for _ in range(torch_archive.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(CorruptCheckpointError, match="nests"):
        torch_archive._Replacer({}).replace(deep, 0)


def test_convert_to_safetensors_refuses_a_piece_listed_twice(tmp_path: Path) -> None:
    from tierckpt.convert.safetensors import to_safetensors

    uri, _ = _native_halves(tmp_path, second_offset=0)
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        to_safetensors(uri, tmp_path / "hf")
    assert not (tmp_path / "hf" / "model.safetensors").exists()
