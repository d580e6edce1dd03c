"""Multi-rank scenarios for the measured route costs (run on every rank of the test pool)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

import tierckpt
from distributed import subgroup
from tierckpt.loading import route_costs
from tierckpt.node.host import NODE_ID_ENV


@contextlib.contextmanager
def fresh_job_on_own_node(group: dist.ProcessGroup, override: str | None, record: Callable[[tuple], object]
                          ) -> Iterator[None]:
    """This rank as its own simulated node of a fresh job (nothing measured), ``$TIERCKPT_ROUTE_COSTS`` set to
    ``override`` (``None``: unset), every probe's arguments passed to ``record``; all undone after."""
    saved_env = {k: os.environ.get(k) for k in (NODE_ID_ENV, route_costs.ROUTE_COSTS_ENV)}
    os.environ[NODE_ID_ENV] = f"node-{dist.get_rank(group)}"
    if override is None:
        os.environ.pop(route_costs.ROUTE_COSTS_ENV, None)
    else:
        os.environ[route_costs.ROUTE_COSTS_ENV] = override
    route_costs._kept.clear()
    probe = route_costs._probe
    route_costs._probe = lambda *args: record(args) or probe(*args)
    try:
        yield
    finally:
        route_costs._probe = probe
        for key, value in saved_env.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def measured_load(path: str, override: str) -> dict:
    """Two ranks, each its own simulated node, save a plain (replicated) 2 MiB tensor and load it twice with
    measured costs (``override``: ``$TIERCKPT_ROUTE_COSTS`` for the loads, over the measurement). Returns the
    second load's counters, the costs this rank kept, the probes taken and the tensor's bytes."""
    group = subgroup(2)
    result: dict = {}
    if group is not None:
        w = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)
        tierckpt.save(path, {"w": w}, group=group)
        probes: list[tuple] = []
        with fresh_job_on_own_node(group, override, probes.append):
            for _ in range(2):
                target = torch.zeros(512, 1024)
                monitor = tierckpt.Monitor()
                tierckpt.load(path, {"w": target}, group=group, monitor=monitor)
                assert torch.equal(target, w)
        (_, costs), = route_costs._kept.values()
        result = {**monitor.counters, "costs": costs, "probes": len(probes), "tensor_bytes": w.nbytes}
    dist.barrier()
    return result

