"""Which nodes hold a node's replicas. Pure: no I/O, no torch.distributed.

The nodes of a group are ordered by their lowest rank; node ``i`` sends its files to nodes
``i+1, ..., i+R (mod N)``, so losing any ``R`` nodes loses no checkpoint (each node's files are on
``R`` others). Each node's lowest rank is its *leader*: the one rank that sends its node's files and
receives its peers'. ``R`` comes from ``TIERCKPT_REPLICAS``: default 1 when the group spans more than
one node, 0 on one node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tierckpt.errors import CheckpointError

REPLICAS_ENV = "TIERCKPT_REPLICAS"


def replica_count(num_nodes: int, env: Mapping[str, str] = os.environ) -> int:
    """``R`` for a group on ``num_nodes`` nodes: ``$TIERCKPT_REPLICAS``, else 1 on several nodes, 0 on one."""
    raw = env.get(REPLICAS_ENV, "").strip()
    if not raw:
        return 1 if num_nodes > 1 else 0
    if not raw.isdigit():
        raise CheckpointError(f"{REPLICAS_ENV}={raw!r}: use a whole number of peer copies per node, e.g. 1")
    replicas = int(raw)
    if replicas > num_nodes - 1:
        raise CheckpointError(
            f"{REPLICAS_ENV}={replicas} but the job spans {num_nodes} node(s): each replica goes to another node, "
            f"so at most {num_nodes - 1}; lower {REPLICAS_ENV}"
        )
    return replicas


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """The nodes of a group, their leaders, and where each node's replicas go."""

    nodes: tuple[str, ...]
    """Distinct node ids, ordered by their lowest rank."""
    leaders: tuple[int, ...]
    """Lowest group rank of each node (same order as ``nodes``)."""
    replicas: int

    def node_of(self, rank_nodes: Sequence[str], rank: int) -> int:
        """Index of ``rank``'s node."""
        return self.nodes.index(rank_nodes[rank])

    def targets(self, node: int) -> tuple[int, ...]:
        """Nodes that hold node ``node``'s replicas: ``node+1 .. node+R`` (mod N), in that order."""
        n = len(self.nodes)
        return tuple((node + k) % n for k in range(1, self.replicas + 1))

    def sources(self, node: int) -> tuple[int, ...]:
        """Nodes whose replicas node ``node`` holds: ``node-1 .. node-R`` (mod N), in that order.

        The k-th source of a node is the node whose k-th target it is, so a sender's k-th transfer
        always meets its receiver's k-th: transfers done in these orders never wait on each other in a cycle.
        """
        n = len(self.nodes)
        return tuple((node - k) % n for k in range(1, self.replicas + 1))


def plan_replicas(rank_nodes: Sequence[str], replicas: int | None = None, env: Mapping[str, str] = os.environ) -> ReplicaPlan:
    """The plan for a group whose rank ``r`` runs on node ``rank_nodes[r]`` (all-gathered node ids).

    ``replicas``: ``R``; default :func:`replica_count` from ``env``.
    """
    if not rank_nodes:
        raise CheckpointError("cannot plan replicas for an empty group")
    leaders: dict[str, int] = {}
    for rank, node in enumerate(rank_nodes):
        leaders.setdefault(node, rank)
    nodes = tuple(leaders)
    count = replica_count(len(nodes), env) if replicas is None else replicas
    if not 0 <= count <= len(nodes) - 1:
        raise CheckpointError(
            f"{count} replicas per node cannot be placed on the job's {len(nodes)} node(s): use 0 to {len(nodes) - 1}"
        )
    return ReplicaPlan(nodes=nodes, leaders=tuple(leaders[n] for n in nodes), replicas=count)
