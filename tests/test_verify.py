"""``tierckpt verify``: a sound checkpoint passes; every kind of damage is named with file, tensor and offset."""

from __future__ import annotations

import json
from pathlib import Path

import crc32c
import pytest
import torch

import tierckpt
from tierckpt.cli import main as cli
from tierckpt.native import layout
from tierckpt.native.metadata import PieceMeta, decode_header, decode_pieces, decode_tensors, encode_header, encode_pieces
from tierckpt.native.regions import Box, FlatRange
from tierckpt.formats.verify import verify

from tamper import reseal


# -- helpers shared with test_convert.py ---------------------------------------------------------------
def sample_state() -> dict:
    """fp32, bf16 and int64 tensors (one of them 0-d) and a few objects."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(64, 16, generator=g),
            "norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
            "positions": torch.arange(40, dtype=torch.int64).reshape(5, 8),
            "scale": torch.tensor(0.5),
        },
        "step": 12,
        "data": {"epoch": 3, "name": "run"},
    }


def generation_dir(root: Path) -> Path:
    return root / json.loads((root / layout.COMMIT).read_text())["generation"]


def read_pieces(root: Path) -> dict[str, list[PieceMeta]]:
    gen = generation_dir(root)
    tensors = decode_tensors((gen / "meta/tensors.parquet").read_bytes())
    return decode_pieces((gen / "meta/pieces.parquet").read_bytes(), tensors)


def write_pieces(root: Path, pieces: dict[str, list[PieceMeta]]) -> None:
    """Replace the pieces table (and the header's piece count) of a committed checkpoint."""
    gen = generation_dir(root)
    (gen / "meta/pieces.parquet").write_bytes(encode_pieces(p for ps in pieces.values() for p in ps))
    header = decode_header((gen / "meta/header.json").read_bytes())
    count = sum(len(ps) for ps in pieces.values())
    (gen / "meta/header.json").write_bytes(encode_header(type(header)(**{**_fields(header), "num_pieces": count})))
    reseal(root)


def _fields(obj: object) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}  # type: ignore[attr-defined]


def split_flat(root: Path, fqn: str, cuts: list[int]) -> None:
    """Re-describe tensor ``fqn``'s one whole-tensor piece as flat pieces cut at element ``cuts``.

    The bytes stay where they are (a whole tensor's row-major bytes are its flattening), so this is
    how an FSDP1 / ZeRO flat-sharded save looks, crafted in one process.
    """
    pieces = read_pieces(root)
    (whole,) = pieces[fqn]
    data = (generation_dir(root) / whole.file).read_bytes()
    item = whole.byte_length // whole.region.numel
    bounds = [0, *cuts, whole.region.numel]
    new = []
    for start, stop in zip(bounds, bounds[1:]):
        offset = whole.byte_offset + start * item
        length = (stop - start) * item
        new.append(PieceMeta(
            fqn=fqn, region=FlatRange(start, stop), file=whole.file, byte_offset=offset, byte_length=length,
            crc32c=crc32c.crc32c(data[offset : offset + length]),
        ))
    pieces[fqn] = new
    write_pieces(root, pieces)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), sample_state())
    return root


def _verify_json(root: Path, capsys) -> tuple[int, dict]:
    code = cli.main(["verify", str(root), "--json"])
    return code, json.loads(capsys.readouterr().out)


def _piece(root: Path, fqn: str) -> PieceMeta:
    (piece,) = read_pieces(root)[fqn]
    return piece


# -- sound checkpoints ---------------------------------------------------------------------------------
def test_sound_checkpoint_passes(ckpt: Path, capsys) -> None:
    code, doc = _verify_json(ckpt, capsys)
    assert code == cli.EXIT_OK
    assert doc["ok"] is True and doc["problems"] == []
    assert doc["tensors"] == 4 and doc["pieces"] == 4 and doc["objects"] == 3 and doc["files"] == 2
    gen = generation_dir(ckpt)
    pieces = read_pieces(ckpt)
    expected = sum(p.byte_length for ps in pieces.values() for p in ps)
    expected += sum(o.byte_length for o in decode_header((gen / "meta/header.json").read_bytes()).objects)
    assert doc["bytes_checked"] == expected
    assert cli.main(["verify", str(ckpt)]) == cli.EXIT_OK
    assert capsys.readouterr().out.startswith("ok: ")


def test_small_chunks_stream_large_pieces(ckpt: Path) -> None:
    """With 64-byte chunks every piece above 64 bytes is checksummed in parts, continuing the CRC."""
    assert verify(str(ckpt), chunk_bytes=64).ok
    assert verify(str(ckpt), chunk_bytes=7).ok


def test_flat_pieces_pass(ckpt: Path) -> None:
    split_flat(ckpt, "model.embed.weight", [5, 333, 1000])
    report = verify(str(ckpt), chunk_bytes=100)
    assert report.ok, report.render()
    assert report.pieces == 7


# -- damage --------------------------------------------------------------------------------------------
def test_flipped_data_byte_names_file_tensor_offset(ckpt: Path, capsys) -> None:
    piece = _piece(ckpt, "model.positions")
    path = generation_dir(ckpt) / piece.file
    data = bytearray(path.read_bytes())
    data[piece.byte_offset + 17] ^= 0x01
    path.write_bytes(bytes(data))
    code, doc = _verify_json(ckpt, capsys)
    assert code == cli.EXIT_CORRUPT
    (problem,) = doc["problems"]
    assert problem["kind"] == "checksum"
    assert problem["tensor"] == "model.positions"
    assert problem["file"] == piece.file == "data/rank-00000.bin"
    assert problem["byte_offset"] == piece.byte_offset
    assert problem["byte_length"] == piece.byte_length
    assert "model.positions" in problem["message"] and f"@ {piece.byte_offset}" in problem["message"]


def test_flip_found_in_a_later_chunk_of_a_streamed_piece(ckpt: Path) -> None:
    piece = _piece(ckpt, "model.embed.weight")
    path = generation_dir(ckpt) / piece.file
    data = bytearray(path.read_bytes())
    data[piece.byte_offset + piece.byte_length - 1] ^= 0x80
    path.write_bytes(bytes(data))
    report = verify(str(ckpt), chunk_bytes=256)
    assert [(p.kind, p.tensor) for p in report.problems] == [("checksum", "model.embed.weight")]


def test_truncated_data_file(ckpt: Path, capsys) -> None:
    pieces = read_pieces(ckpt)
    last = max((p for ps in pieces.values() for p in ps), key=lambda p: p.byte_offset)
    path = generation_dir(ckpt) / last.file
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: last.byte_offset + 1])
    code, doc = _verify_json(ckpt, capsys)
    assert code == cli.EXIT_CORRUPT
    kinds = {p["kind"]: p for p in doc["problems"]}
    assert set(kinds) == {"file-size", "past-end"}
    assert kinds["file-size"]["file"] == last.file and str(size) in kinds["file-size"]["message"]
    assert kinds["past-end"]["tensor"] == last.fqn
    assert kinds["past-end"]["byte_offset"] == last.byte_offset


def test_missing_data_file(ckpt: Path, capsys) -> None:
    (generation_dir(ckpt) / "data/rank-00000.bin").unlink()
    code, doc = _verify_json(ckpt, capsys)
    assert code == cli.EXIT_CORRUPT
    assert [(p["kind"], p["file"]) for p in doc["problems"]] == [("missing-file", "data/rank-00000.bin")]


def test_missing_piece_row(ckpt: Path, capsys) -> None:
    split_flat(ckpt, "model.embed.weight", [100, 700])
    pieces = read_pieces(ckpt)
    del pieces["model.embed.weight"][1]  # elements 100..699 are no longer in the checkpoint
    write_pieces(ckpt, pieces)
    code, doc = _verify_json(ckpt, capsys)
    assert code == cli.EXIT_CORRUPT
    (problem,) = doc["problems"]
    assert problem["kind"] == "uncovered" and problem["tensor"] == "model.embed.weight"
    assert "cover 424 of 1024 elements (600 missing)" in problem["message"]


def test_tensor_without_any_piece(ckpt: Path) -> None:
    pieces = read_pieces(ckpt)
    del pieces["model.scale"]
    write_pieces(ckpt, pieces)
    (problem,) = verify(str(ckpt)).problems
    assert problem.kind == "uncovered" and problem.tensor == "model.scale"


def test_overlapping_pieces(ckpt: Path) -> None:
    pieces = read_pieces(ckpt)
    (whole,) = pieces["model.positions"]
    half = PieceMeta(
        fqn=whole.fqn, region=Box((0, 0), (3, 8)), file=whole.file, byte_offset=whole.byte_offset,
        byte_length=3 * 8 * 8, crc32c=0,
    )
    pieces["model.positions"].append(half)
    write_pieces(ckpt, pieces)
    report = verify(str(ckpt))
    kinds = sorted((p.kind, p.tensor) for p in report.problems)
    assert ("overlap", "model.positions") in kinds
    assert "offsets [0, 0] lengths [3, 8]" in next(p.message for p in report.problems if p.kind == "overlap")


def test_flipped_object_byte(ckpt: Path, capsys) -> None:
    gen = generation_dir(ckpt)
    header = decode_header((gen / "meta/header.json").read_bytes())
    obj = next(o for o in header.objects if o.key == "data.name")
    path = gen / obj.file
    data = bytearray(path.read_bytes())
    data[obj.byte_offset + obj.byte_length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    code, doc = _verify_json(ckpt, capsys)
    assert code == cli.EXIT_CORRUPT
    (problem,) = doc["problems"]
    assert problem["kind"] == "object-checksum" and problem["object"] == "data.name"
    assert problem["file"] == "objects/rank-00000.bin" and problem["byte_offset"] == obj.byte_offset


def test_every_problem_is_reported(ckpt: Path) -> None:
    """Damage in two files: both are reported, not just the first."""
    gen = generation_dir(ckpt)
    for rel in ("data/rank-00000.bin", "objects/rank-00000.bin"):
        data = bytearray((gen / rel).read_bytes())
        data[0] ^= 0x01
        (gen / rel).write_bytes(bytes(data))
    kinds = {p.kind for p in verify(str(ckpt)).problems}
    assert kinds == {"checksum", "object-checksum"}


# -- metadata, incomplete, missing ---------------------------------------------------------------------
def test_unreadable_pieces_table_is_a_metadata_problem(ckpt: Path, capsys) -> None:
    (generation_dir(ckpt) / "meta/pieces.parquet").write_bytes(b"not parquet")
    code, doc = _verify_json(ckpt, capsys)
    assert code == cli.EXIT_CORRUPT
    assert [p["kind"] for p in doc["problems"]] == ["metadata"]


def test_incomplete_and_missing(ckpt: Path, tmp_path: Path, capsys) -> None:
    (ckpt / layout.COMMIT).unlink()
    assert cli.main(["verify", str(ckpt)]) == cli.EXIT_INCOMPLETE
    assert cli.main(["verify", str(tmp_path / "nothing")]) == cli.EXIT_NOT_FOUND
    err = capsys.readouterr().err
    assert "no COMMIT" in err and "tierckpt verify: error:" in err


def test_block_checksums_that_disagree_with_the_piece_crc(tmp_path: Path, capsys) -> None:
    """A flipped bit in one block CRC (what every load checks) is reported, naming the piece."""
    import dataclasses

    root = tmp_path / "big"
    tierckpt.save(str(root), {"w": torch.arange(3 * (1 << 18), dtype=torch.float32)})  # 3 MiB: 3 blocks
    pieces = read_pieces(root)
    (piece,) = pieces["w"]
    assert len(piece.block_crc32c) == 3
    blocks = list(piece.block_crc32c)
    blocks[1] ^= 1 << 7
    pieces["w"] = [dataclasses.replace(piece, block_crc32c=tuple(blocks))]
    write_pieces(root, pieces)
    report = verify(str(root))
    assert [p.kind for p in report.problems] == ["block-checksums"]
    assert report.problems[0].tensor == "w" and report.problems[0].file == piece.file
    assert cli.main(["verify", str(root)]) == 5
    with pytest.raises(tierckpt.CorruptCheckpointError, match="'w'"):
        tierckpt.load(str(root), {"w": torch.zeros(3 * (1 << 18))})
