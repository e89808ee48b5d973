"""torch's own plan at equal memory: the saved set ``torch.compile``'s partitioner chooses
under ``activation_memory_budget`` (its knapsack over what its min-cut saves), at the largest
fraction whose plan the memory model predicts within a budget.

Measured plan choice times it beside the planner's plan (``compile_offload/pipeline/plan_choice.py``):
the planner ranks plans by a cost model, which can misjudge a device; with torch's own choice
among the plans measured, it runs where it measures faster (by that choice's rule).

Limits: the fractions tried are the multiples of ``1 / FRACTIONS`` below 1, from the top,
each running torch's knapsack once, until one is predicted to fit. They are all tried, not
bisected: the predicted peak need not fall with the fraction (recomputing a pointwise chain
in the backward can hold more at once than saving its output). Recompute only: torch's
plan copies nothing to the host.
"""

from __future__ import annotations

import torch.fx as fx

from .. import compat
from ..analyze import JointAnalysis
from ..node_durations import node_durations
from .joint import Evaluator
from .recompute import Prefix, Seconds, Solution, select, without_banned_recompute

FRACTIONS = 16


def torch_saved(a: JointAnalysis, fraction: float) -> frozenset[fx.Node]:
    """What torch's partitioner saves under ``activation_memory_budget=fraction`` (with what
    a checkpoint policy bans from recomputation)."""
    return frozenset(without_banned_recompute(a, compat.budget_saved_values(a.joint, fraction)))


class TorchPlans:
    """torch's plans of one graph, kept between looks (measured plan choice looks again lower
    where Inductor's code peaked over the budget): the saved set at each fraction (a knapsack
    each) and the peaks-only evaluator (a min-cut), each made once, when first needed."""

    def __init__(self, a: JointAnalysis):
        self.analysis = a
        self._saved_at: dict[float, frozenset[fx.Node]] = {}
        self._peak_of: Evaluator | None = None

    def saved(self, fraction: float) -> frozenset[fx.Node]:
        if fraction not in self._saved_at:
            self._saved_at[fraction] = torch_saved(self.analysis, fraction)
        return self._saved_at[fraction]

    def peak_bytes(self, fraction: float) -> int:
        """The memory model's peak of torch's plan at ``fraction``."""
        if self._peak_of is None:
            self._peak_of = Evaluator(self.analysis, lambda _node: 0.0, None,
                                      compat.min_cut_saved_values(self.analysis.joint))
        return self._peak_of(Prefix(self.saved(fraction), frozenset(), ())).peak_bytes


def fitting_fraction(plans: TorchPlans, budget_bytes: int, below: float = 1.0) -> float | None:
    """The largest multiple of ``1 / FRACTIONS`` below ``below`` (and 1) at which torch's plan
    is predicted to peak within ``budget_bytes`` (the least it recomputes, as a torch user
    raises ``activation_memory_budget`` while the step fits); None where none is."""
    for step in range(FRACTIONS - 1, 0, -1):
        fraction = step / FRACTIONS
        if fraction < below and plans.peak_bytes(fraction) <= budget_bytes:
            return fraction
    return None


def torch_plan_solution(a: JointAnalysis, base_saved: list[fx.Node], seconds: Seconds, fraction: float,
                        budget_bytes: int | None) -> Solution:
    """torch's plan at ``fraction`` as a solution against the unconstrained plan
    (``base_saved``), its decisions explained as the planner's are; feasible where its
    predicted peak is within ``budget_bytes``."""
    evaluate = Evaluator(a, node_durations(seconds), None, base_saved)
    start = Prefix(frozenset(base_saved), frozenset(), ())
    plan = evaluate(Prefix(torch_saved(a, fraction), frozenset(), ()))
    # Chosen among the two at the torch plan's own peak: the unconstrained plan only where it
    # peaks no higher (then torch's plan recomputes for nothing).
    solution = select(a, [evaluate(start), plan], plan.peak_bytes, None, evaluate.with_timeline)
    solution.budget_bytes = budget_bytes
    solution.feasible = budget_bytes is None or solution.chosen.peak_bytes <= budget_bytes
    return solution
