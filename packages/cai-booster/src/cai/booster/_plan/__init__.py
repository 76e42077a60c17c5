"""The planner: which configurations of a model fit a machine, and which is fastest (``cai plan``)."""

from cai.booster._plan._candidate import Candidate
from cai.booster._plan._hardware import Hardware, calibrate
from cai.booster._plan._search import Plan, PlanRow, largest_model, plan
from cai.booster._plan._spec import ModelSpec

__all__ = ["Candidate", "Hardware", "ModelSpec", "Plan", "PlanRow", "calibrate", "largest_model", "plan"]
