"""Fuzz the metadata decoders (decode_header, decode_tensors, decode_pieces) on mutated valid documents.

    python benchmarks/fuzz_metadata.py --cases 100000 [--seed 0]

Mutations: bit flips, truncation, byte overwrites, splices, random JSON edits (header). The only
allowed failure is CorruptCheckpointError; anything else is printed and counted as a finding
(exit status 1).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import random
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tierckpt.errors import CorruptCheckpointError  # noqa: E402
from tierckpt.native.metadata import decode_header, decode_pieces, decode_tensors  # noqa: E402
from test_hostile_input import HEADER, PIECES, TENSOR_META, TENSORS  # noqa: E402

VALUES = [None, True, False, 0, -1, 2**31, 2**63, 2**70, -(2**70), 1.5, float("inf"), "", "x", "..", "/etc/passwd",
          "g-1", [], {}, [1, 2], {"a": 1}, "float32", "pickle"]


def json_edit(data: bytes, rng: random.Random) -> bytes:
    doc = json.loads(data)
    for _ in range(rng.randint(1, 4)):
        node, path = doc, []
        while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
            key = rng.choice(sorted(node) if isinstance(node, dict) else range(len(node)))
            path.append((node, key))
            node = node[key]
        if not path:
            continue
        parent, key = path[-1]
        if rng.random() < 0.75 or isinstance(parent, list):
            parent[key] = copy.deepcopy(rng.choice(VALUES))
        else:
            del parent[key]
    return json.dumps(doc).encode()


def mutate(data: bytes, rng: random.Random, is_json: bool) -> tuple[str, bytes]:
    kinds = ["flip", "truncate", "overwrite", "splice"] + (["json"] * 3 if is_json else [])
    kind = rng.choice(kinds)
    buf = bytearray(data)
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        buf = buf[: rng.randrange(len(buf))]
    elif kind == "overwrite":
        i = rng.randrange(len(buf))
        buf[i : i + 8] = rng.randbytes(rng.randint(1, 8))
    elif kind == "splice":
        i = rng.randrange(len(buf) + 1)
        buf[i:i] = rng.randbytes(rng.randint(1, 32))
    else:
        return kind, json_edit(bytes(buf), rng)
    return kind, bytes(buf)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    docs = {"header": (HEADER, lambda d: decode_header(d)), "tensors": (TENSORS, lambda d: decode_tensors(d)),
            "pieces": (PIECES, lambda d: decode_pieces(d, TENSOR_META))}
    counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
    findings = 0
    started = time.monotonic()
    for case in range(args.cases):
        which = rng.choice(sorted(docs))
        source, decode = docs[which]
        kind, data = mutate(source, rng, which == "header")
        try:
            decode(data)
            outcome = "ok"
        except CorruptCheckpointError:
            outcome = "CorruptCheckpointError"
        except Exception as exc:  # noqa: BLE001 - a finding
            outcome = f"FINDING {type(exc).__name__}"
            findings += 1
            if findings <= 5:
                print(f"case {case} ({which}, {kind}): {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        counts[(which, kind, outcome)] += 1
    elapsed = time.monotonic() - started
    print(f"{args.cases} cases in {elapsed:.1f}s (seed {args.seed}); findings: {findings}")
    for (which, kind, outcome), n in sorted(counts.items()):
        print(f"  {which:8} {kind:10} {outcome:28} {n}")
    totals = collections.Counter()
    for (_, _, outcome), n in counts.items():
        totals[outcome] += n
    print("totals:", dict(totals))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
