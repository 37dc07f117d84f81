"""``memguard plan``: search the 4D layout space, keep the layouts that fit, rank them by a step-time model.

Pure Python (no torch, no megatron): :mod:`.space` enumerates candidates, :mod:`.bounds` prunes
those that cannot fit, :mod:`.timing` predicts step times, :mod:`.search` ranks, :mod:`.explain`
shows the cost terms of one layout, :mod:`.export` writes the chosen layout as flags and keys.
"""
from .search import RULES, PlanEntry, PlanResult, Planner
from .space import Candidate, Cluster, Constraints, ModelShape
from .timing import StepTime, TimeModel

__all__ = ["Candidate", "Cluster", "Constraints", "ModelShape", "PlanEntry", "PlanResult", "Planner", "RULES",
           "StepTime", "TimeModel"]
