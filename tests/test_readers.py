"""The checkpoint readers: one is chosen from what a directory holds (never by a failed read), the
loader asks it what the format allows, and the DCP reader's zip reads stay bounded."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import tierckpt
from tierckpt.backends import open_backend
from tierckpt.formats.reader import Root
from tierckpt.formats.dcp_chunks import MAX_READ_BYTES
from tierckpt.errors import (
    CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError, NotACheckpointError,
)
from tierckpt.io.scheduler import get_scheduler
from tierckpt.formats.native import NATIVE
from tierckpt.formats.select import DCP, SAFETENSORS, read_checkpoint, reader_for, reader_of


def _dcp_save(state: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when it runs without a process group
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _bytes_read() -> int:
    snap = get_scheduler().metrics.snapshot()
    return sum(snap[op].bytes for op in ("read_into", "read_runs", "read_segments") if op in snap)


def test_each_directory_gets_its_reader(tmp_path: Path) -> None:
    """A COMMIT means the native reader; DCP's and save_pretrained's marker files mean theirs; each reader
    says what its format allows, and the checkpoint it read names it."""
    tierckpt.save(str(tmp_path / "native"), {"w": torch.arange(6.0)}, group="self")
    _dcp_save({"w": torch.arange(6.0)}, tmp_path / "dcp")
    (tmp_path / "hf").mkdir()
    save_file({"w": torch.arange(6.0)}, str(tmp_path / "hf" / "model.safetensors"))
    for name, reader in (("native", NATIVE), ("dcp", DCP), ("hf", SAFETENSORS)):
        backend = open_backend(str(tmp_path / name))
        assert reader_for(backend) is reader
        ckpt = read_checkpoint(backend, accept_foreign=True)
        assert reader_of(ckpt) is reader
        assert (reader.generations, reader.checksums) == ((True, True) if reader is NATIVE else (False, False))
    assert set(read_checkpoint(open_backend(str(tmp_path / "hf")), accept_foreign=True).tensors) == {"model.w"}


def test_a_foreign_format_is_refused_unless_accepted(tmp_path: Path) -> None:
    _dcp_save({"w": torch.arange(6.0)}, tmp_path / "dcp")
    with pytest.raises(CheckpointError, match=r"is a torch DCP checkpoint directory \(no COMMIT record\).*tierckpt convert"):
        read_checkpoint(open_backend(str(tmp_path / "dcp")))


def test_roots_no_reader_recognises_say_what_they_hold(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="nothing is stored under it"):
        reader_for(open_backend(str(tmp_path / "empty")))
    (tmp_path / "interrupted" / "g-00000001-abcd").mkdir(parents=True)
    (tmp_path / "interrupted" / "g-00000001-abcd" / "data-0").write_bytes(b"x")
    with pytest.raises(IncompleteCheckpointError, match="a save was interrupted or is still running"):
        reader_for(open_backend(str(tmp_path / "interrupted")))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hi")
    with pytest.raises(NotACheckpointError, match=r"holds other files \(notes.txt\)"):
        reader_for(open_backend(str(tmp_path / "other")))


def test_probes_share_one_listing(tmp_path: Path) -> None:
    """Every probe of a root answers from at most one listing (and one existence check per marker before it)."""
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "model.safetensors").write_bytes(b"")
    calls: list[str] = []
    backend = open_backend(str(tmp_path / "r"))
    listed = backend.list

    async def counting_list(prefix: str = "") -> list[str]:
        calls.append(prefix)
        return await listed(prefix)

    backend.list = counting_list  # type: ignore[method-assign]
    root = Root(backend)
    assert not NATIVE.holds(root) and not DCP.holds(root) and SAFETENSORS.holds(root)
    assert calls == [""]


def _claim_a_huge_zip_directory(data_file: Path) -> None:
    """Rewrite the zip end records of the one ``torch.save`` archive in ``data_file`` so that its central
    directory claims to span the whole archive."""
    data = bytearray(data_file.read_bytes())
    eocd, eocd64 = len(data) - 22, len(data) - 22 - 20 - 56
    assert data[:4] == b"PK\x03\x04" and data[eocd : eocd + 4] == b"PK\x05\x06" and data[eocd64 : eocd64 + 4] == b"PK\x06\x06"
    size = eocd64
    struct.pack_into("<QQ", data, eocd64 + 40, size, 0)
    struct.pack_into("<II", data, eocd + 12, size, 0)
    data_file.write_bytes(bytes(data))


def test_a_crafted_zip_directory_size_is_refused_unread(tmp_path: Path) -> None:
    """A chunk whose zip end record claims a directory of megabytes is refused before that directory is
    fetched (a hand-written parser fetched it: a crafted DCP file could make a load download GiBs)."""
    path = tmp_path / "dcp"
    _dcp_save({"w": torch.randn(1 << 20)}, path)
    data_file = path / "__0_0.distcp"
    assert data_file.stat().st_size > 4 * MAX_READ_BYTES
    _claim_a_huge_zip_directory(data_file)
    before = _bytes_read()
    with pytest.raises(CorruptCheckpointError, match=r"chunk of 'w' .* is not a readable torch.save archive"):
        tierckpt.load(str(path), {"w": torch.zeros(1 << 20)})
    assert _bytes_read() - before < MAX_READ_BYTES


def test_dcp_metadata_document_is_listed_in_the_probe(tmp_path: Path) -> None:
    """A DCP directory is recognised by its data files alone (its .metadata missing: a save in progress)."""
    _dcp_save({"w": torch.arange(6.0)}, tmp_path / "dcp")
    (tmp_path / "dcp" / ".metadata").unlink()
    assert reader_for(open_backend(str(tmp_path / "dcp"))) is DCP
    with pytest.raises(IncompleteCheckpointError, match="torch DCP data files but no .metadata"):
        read_checkpoint(open_backend(str(tmp_path / "dcp")), accept_foreign=True)
