"""The manifest of a checkpoint generation in the node memory tier: each file's size and CRC-32C.

A node's tier may hold one generation's files from several origins: the files its own ranks wrote,
and the replicas other nodes sent it. Each origin's files are listed by one manifest (written once,
atomically, when they are complete), so writers never contend for one file; the generation's
holdings on the node are the union. The manifest ends with the CRC-32C of its own canonical JSON, so
a damaged one is refused rather than trusted.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

import crc32c

from tierckpt.backends.bounded import MAX_TIER_RECORD_BYTES, read_fd_capped
from tierckpt.errors import CorruptCheckpointError
from tierckpt.node.written import FileEntry

FORMAT = "tierckpt-memory-manifest"
VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """The files of one generation that one origin (a node) put into a memory tier."""

    uri: str
    """The checkpoint URI (what the save was given)."""
    generation: str
    origin: str
    """The node whose ranks wrote these files (see :mod:`tierckpt.node.host`)."""
    created_unix: float
    files: tuple[tuple[str, FileEntry], ...]
    """``(key, entry)`` sorted by key; keys are relative to the checkpoint root (``g-.../data/...``)."""

    @property
    def nbytes(self) -> int:
        return sum(e.size for _, e in self.files)

    def encode(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces) whose ``crc32c`` field seals the rest."""
        doc = {
            "format": FORMAT, "version": VERSION, "uri": self.uri, "generation": self.generation,
            "origin": self.origin, "created_unix": self.created_unix,
            "files": {k: [e.size, e.crc32c] for k, e in self.files},
        }
        doc["crc32c"] = crc32c.crc32c(_canonical(doc))
        return _canonical(doc)

    @staticmethod
    def decode(data: bytes, where: str) -> Manifest:
        """Parse and check a manifest read from ``where``; a damaged one raises :class:`CorruptCheckpointError`."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise ValueError(f"not a {FORMAT} version {VERSION}")
            body = {k: v for k, v in doc.items() if k != "crc32c"}
            if crc32c.crc32c(_canonical(body)) != doc.get("crc32c"):
                raise ValueError("its CRC-32C does not match its content")
            files = tuple(sorted((str(k), FileEntry(int(v[0]), int(v[1]))) for k, v in doc["files"].items()))
            return Manifest(
                uri=str(doc["uri"]), generation=str(doc["generation"]), origin=str(doc["origin"]),
                created_unix=float(doc["created_unix"]), files=files,
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise CorruptCheckpointError(
                f"the memory-tier manifest {where} is unreadable ({type(exc).__name__}: {exc}); delete it and "
                "the tier treats those files as unsealed"
            ) from exc


def _canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


_READ: dict[str, tuple[tuple[int, int, int], Manifest]] = {}
"""Manifests this process decoded, by path, with the identity (inode, size, mtime) of the file read."""
_READ_MAX = 4096
_read_lock = threading.Lock()


def read_manifest(path: str) -> Manifest:
    """The manifest in the file ``path``, decoded and checked once per process: a manifest is written once,
    atomically (a rename), so a file of the same inode, size and modification time holds the same bytes.
    Admissions, seals and listings read every manifest of the node's tier many times per checkpoint.
    Raises ``FileNotFoundError`` for a file gone, :class:`CorruptCheckpointError` for a damaged one."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        with _read_lock:
            known = _READ.get(path)
        if known is not None and known[0] == identity:
            return known[1]
        manifest = Manifest.decode(read_fd_capped(fd, MAX_TIER_RECORD_BYTES, path), path)
    finally:
        os.close(fd)
    with _read_lock:
        if len(_READ) >= _READ_MAX:
            _READ.clear()
        _READ[path] = (identity, manifest)
    return manifest
