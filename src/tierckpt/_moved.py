"""Import paths of modules that moved: ``tierckpt.cache`` is ``tierckpt.node.disk``, and so on (see ``MOVED``).

Code written against the old paths keeps working: importing an old path gives the module at the new one (the
same module object, so its classes and errors are the same), with a :class:`DeprecationWarning` naming the new
path. Installed by ``tierckpt/__init__.py``; nothing in tierckpt imports an old path itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "tierckpt.bounded": "tierckpt.backends.bounded",
    "tierckpt.cache": "tierckpt.node.disk",
    "tierckpt.checkpoint_reader": "tierckpt.formats.reader",
    "tierckpt.cleanup": "tierckpt.saving.cleanup",
    "tierckpt.cli_bench": "tierckpt.cli.bench",
    "tierckpt.cli_cache": "tierckpt.cli.cache",
    "tierckpt.cli_convert": "tierckpt.cli.convert",
    "tierckpt.cli_deadline": "tierckpt.cli.deadline",
    "tierckpt.cli_exit": "tierckpt.cli.exit",
    "tierckpt.cli_reports": "tierckpt.reports",
    "tierckpt.convert_deepspeed": "tierckpt.convert.deepspeed",
    "tierckpt.convert_report": "tierckpt.convert.report",
    "tierckpt.convert_safetensors": "tierckpt.convert.safetensors",
    "tierckpt.coverage": "tierckpt.native.coverage",
    "tierckpt.dcp_chunks": "tierckpt.formats.dcp_chunks",
    "tierckpt.dcp_format": "tierckpt.formats.dcp",
    "tierckpt.deepspeed_format": "tierckpt.formats.deepspeed",
    "tierckpt.deepspeed_objects": "tierckpt.formats.deepspeed_objects",
    "tierckpt.deepspeed_read": "tierckpt.formats.deepspeed_read",
    "tierckpt.entries": "tierckpt.state.entries",
    "tierckpt.foreign": "tierckpt.formats.foreign",
    "tierckpt.keys": "tierckpt.native.keys",
    "tierckpt.layout": "tierckpt.native.layout",
    "tierckpt.load_cast": "tierckpt.loading.cast",
    "tierckpt.load_generation": "tierckpt.loading.generation",
    "tierckpt.load_match": "tierckpt.loading.match",
    "tierckpt.load_wire": "tierckpt.loading.wire",
    "tierckpt.loader": "tierckpt.loading.api",
    "tierckpt.local_load": "tierckpt.loading.locality",
    "tierckpt.manager_best": "tierckpt.manager.best",
    "tierckpt.manager_durable": "tierckpt.manager.durable",
    "tierckpt.manager_retention": "tierckpt.manager.retention",
    "tierckpt.meta_read": "tierckpt.formats.native",
    "tierckpt.meta_records": "tierckpt.native.records",
    "tierckpt.metadata": "tierckpt.native.metadata",
    "tierckpt.nested": "tierckpt.loading.nested",
    "tierckpt.objects": "tierckpt.formats.objects",
    "tierckpt.objects_read": "tierckpt.loading.objects",
    "tierckpt.optim_groups": "tierckpt.state.optim_groups",
    "tierckpt.optim_state": "tierckpt.state.optim",
    "tierckpt.peer_lanes": "tierckpt.loading.peer_lanes",
    "tierckpt.peer_stream": "tierckpt.loading.peer_stream",
    "tierckpt.pickle_seal": "tierckpt.formats.pickle_seal",
    "tierckpt.preemption": "tierckpt.manager.preemption",
    "tierckpt.read_step": "tierckpt.loading.read_step",
    "tierckpt.read_targets": "tierckpt.loading.targets",
    "tierckpt.readers": "tierckpt.formats.select",
    "tierckpt.regions": "tierckpt.native.regions",
    "tierckpt.reread": "tierckpt.loading.reread",
    "tierckpt.retry": "tierckpt.backends.retry",
    "tierckpt.route_costs": "tierckpt.loading.route_costs",
    "tierckpt.safetensors_format": "tierckpt.formats.safetensors",
    "tierckpt.save_commit": "tierckpt.saving.commit",
    "tierckpt.save_handle": "tierckpt.saving.handle",
    "tierckpt.save_plan": "tierckpt.saving.plan",
    "tierckpt.save_prepared": "tierckpt.saving.prepared",
    "tierckpt.save_process": "tierckpt.saving.process",
    "tierckpt.save_snapshot": "tierckpt.saving.snapshot",
    "tierckpt.save_stream": "tierckpt.saving.stream",
    "tierckpt.saver": "tierckpt.saving.api",
    "tierckpt.tier_metadata": "tierckpt.loading.tier_metadata",
    "tierckpt.tiers": "tierckpt.node.memory",
    "tierckpt.tiers.levels": "tierckpt.node.memory.replica_record",
    "tierckpt.torch_archive": "tierckpt.formats.torch_archive",
    "tierckpt.training_state": "tierckpt.state.training",
    "tierckpt.ucp_format": "tierckpt.formats.ucp",
    "tierckpt.verify": "tierckpt.formats.verify",
    "tierckpt.writeback": "tierckpt.node",
}
"""Old dotted path -> new one (a package's modules move with it)."""


def new_path(name: str) -> str | None:
    """Where the module ``name`` lives now, or None if it never moved (its longest moved prefix decides)."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        new = MOVED.get(".".join(parts[:i]))
        if new is not None:
            return ".".join([new, *parts[i:]])
    return None


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on ``sys.meta_path``: an old path loads as the module at its new path, never as a second copy
    (a second copy would have its own classes: ``except ReplicationError`` would miss the real one)."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("tierckpt.") or new_path(fullname) is None:
            return None
        if importlib.util.find_spec(new_path(fullname) or "") is None:
            return None  # an old package's name that was never a module there: the plain "no module named" error
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        new = new_path(module.__name__)
        if new is None:
            raise ImportError(f"{module.__name__} did not move", name=module.__name__)
        warnings.warn(f"{module.__name__} moved to {new}: import it from there", DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)  # what the import statement returns


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
