"""What planning one joint graph produces, and the error a budget can raise.

A leaf module: planning builds these, the partitioner, ``explain``, the logs, the dump and
the plan cache read them, and none of those imports another to get at them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..passes.analyze import JointAnalysis
from ..passes.plan import Plan
from ..passes.solve.recompute import Solution


class BudgetError(ValueError):
    """The budget is below the minimum achievable peak and ``strict_budget`` is set."""


@dataclass
class PartitionResult:
    """One planned graph: its plan and the forward and backward graphs that carry it out.

    ``analysis`` is None when torch's own partition was used (no backward, or a graph the
    planner does not support); ``solution`` is None then and for a plan from the plan cache.
    ``cache_key``: the plan cache's entry for the graph under the settings it was planned
    with (None without ``plan_cache_dir``).
    """

    plan: Plan
    fw_gm: fx.GraphModule
    bw_gm: fx.GraphModule
    analysis: JointAnalysis | None
    solution: Solution | None
    cache_key: str | None = None
