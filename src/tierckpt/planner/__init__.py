"""Pure planning: what each rank writes at save time and reads at load time. No I/O here.

May import: ``errors``, ``native``. No I/O, no torch.distributed.
"""

from tierckpt.planner.load_planner import LoadPlan, ReadUnit, Delivery, TargetPiece, plan_load
from tierckpt.planner.routes import Topology, topology
from tierckpt.planner.save_planner import LocalPiece, SavePlan, WriteAssignment, plan_save

__all__ = [
    "Delivery", "LoadPlan", "LocalPiece", "ReadUnit", "SavePlan", "TargetPiece", "Topology", "WriteAssignment",
    "plan_load", "plan_save", "topology",
]
