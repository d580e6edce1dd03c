"""One rank of a simulated multi-node job for the peer-replica tests (``tests/test_replica.py``).

Usage::

    python tests/replica_child.py RANK WORLD RANKS_PER_NODE PORT WORKDIR [--fail=kill|hang]

Rank ``r`` runs as node ``node-<r // RANKS_PER_NODE>`` with its own memory tier
``WORKDIR/node-<n>/shm``. Every rank writes its data file of a generation into its node's tier,
rank 0 also the header and ``COMMIT``; then every rank replicates. Two generations are saved; with
``--fail=kill`` the leader of node 1 dies (``os._exit``) on the first file of the second
generation it receives — a node lost during replication; with ``--fail=hang`` it stops receiving
instead (a stuck peer, alive but silent). Each rank writes its results as JSON to
``WORKDIR/result-<rank>.json`` (the file of a rank that died is missing).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch.distributed as dist  # noqa: E402

from tierckpt.native.layout import COMMIT, CommitRecord, new_generation  # noqa: E402
from tierckpt.node.memory import MemoryConfig, NodeMemory  # noqa: E402
from tierckpt.node.memory import incoming as incoming_module  # noqa: E402
from tierckpt.node.memory.replica import Replicator  # noqa: E402

URI = "s3://bucket/run/step-7"
DATA_BYTES = 3 << 20


def data_of(rank: int, seq: int) -> bytes:
    """The exact bytes rank ``rank`` writes in save ``seq`` (the parent recomputes them)."""
    return bytes((rank * 31 + seq * 7 + i) % 251 for i in range(256)) * (DATA_BYTES // 256)


async def write_generation(node: NodeMemory, rank: int, seq: int, generation: str) -> None:
    tier = node.tier(URI)
    await tier.put(f"{generation}/data/rank-{rank:05d}.bin", data_of(rank, seq))
    if rank == 0:
        await tier.put(f"{generation}/meta/header.json", b'{"seq": %d}' % seq)


def fail_on_first_file(how: str) -> None:
    def write_in_place(self: incoming_module.IncomingFile, nbytes: int, fill: object) -> None:
        if how == "kill":
            os._exit(9)
        time.sleep(3600)

    incoming_module.IncomingFile.write_in_place = write_in_place  # type: ignore[method-assign]


def main() -> None:
    rank, world, per_node, port = (int(a) for a in sys.argv[1:5])
    workdir = sys.argv[5]
    fail = next((a.split("=", 1)[1] for a in sys.argv[6:] if a.startswith("--fail=")), None)
    node_name = f"node-{rank // per_node}"
    os.environ["TIERCKPT_NODE_ID"] = node_name
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    node = NodeMemory(MemoryConfig(directory=os.path.join(workdir, node_name, "shm"), budget_bytes=1 << 30))
    replicator = Replicator(node, timeout_s=10)
    results = {}
    for seq in (1, 2):
        generation = dist.get_rank() == 0 and new_generation(seq)
        box = [generation]
        dist.broadcast_object_list(box, src=0)
        generation = box[0]
        asyncio.run(write_generation(node, rank, seq, generation))
        dist.barrier()
        if rank == 0:
            asyncio.run(node.tier(URI).commit(COMMIT, CommitRecord(generation, time.time(), seq).encode()))
        dist.barrier()
        if fail and seq == 2 and rank == per_node:
            fail_on_first_file(fail)
        started = time.monotonic()
        handle = replicator.replicate(URI, generation)
        try:
            result = handle.wait(timeout_s=20)
            results[generation] = {"level": result.level.value, "reason": result.reason,
                                   "acknowledged": list(result.acknowledged), "seconds": time.monotonic() - started}
        except TimeoutError as exc:
            results[generation] = {"level": None, "reason": str(exc), "seconds": time.monotonic() - started}
        if seq == 1:
            dist.barrier()
    with open(os.path.join(workdir, f"result-{rank}.json"), "w") as f:
        json.dump({"node": node_name, "results": results}, f)
    if fail == "hang" and rank == per_node:
        time.sleep(3600)  # stuck, connections open, until the parent kills it
    os._exit(0)  # peers may be dead: no collective teardown


if __name__ == "__main__":
    main()
