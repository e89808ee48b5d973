"""Below the greedy's lowest plan: lower it one step at a time, never to a faster plan.

Where no plan the greedy searched fits the budget, the solver returns the lowest-peak plan
it simulated (``passes.solve.recompute.select``) and the budget is reported as below the minimum.
That plan is the lowest along the greedy's sequences, not the lowest plan there is: on a
GPT-2 block (docs/benchmarks.md, "Optimality") the exhaustive search found plans up to
32 KiB lower at the same predicted time (the greedy recomputes a layer norm's bf16 casts,
which cost no time, where saving them again lowers the backward's peak), so a budget
between the two peaks got no plan.

``lower_peak`` walks from the greedy's lowest plan. Each round it evaluates the plans one
step away (``passes.solve.neighbours``: undos, then swaps), the least estimated change of time
first, and takes the first whose peak is strictly lower and whose predicted time is no
lower. It stops at the first plan that fits the budget, where no step lowers the peak, or
after ``MAX_EVALUATIONS`` new plans.

Why never faster: the walk does not depend on the budget, only where it stops does, so a
lower budget takes the same steps and then more. Were a later step faster, a lower budget
could get a faster plan than a higher one, and the planner's choice would no longer be
monotone in the budget (docs/design.md, "Solver"). Every plan taken is evaluated exactly
(the solver's own evaluator); the estimates only order the steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.fx as fx

from ..analyze import JointAnalysis
from .neighbours import Estimates, swaps, undos
from ..progress import Progress
from .recompute import Candidate, Prefix, Solution, _explain

# New plans evaluated per lowering at most, and steps taken. Each evaluation is a few
# whole-graph passes (about 20 ms on a 24-layer stack on a 2-core machine); on that stack
# at budget 0.0 the lowering took four steps within 16 evaluations (16 more found no
# fifth), and on the GPT-2 block of docs/benchmarks.md two steps within 10.
MAX_EVALUATIONS = 16
MAX_STEPS = 16
# Predicted times this close are the same time: a saved set's seconds are summed in its own
# order, so two plans of the same work can differ in the last bits.
SAME_SECONDS = 1e-12


@dataclass(frozen=True)
class Lowering:
    """The lowered plan and how it was reached."""

    plan: Candidate
    steps: int = 0  # steps taken
    evaluated: int = 0  # new plans evaluated


def least_change_first(saving: float) -> tuple[bool, float]:
    """Steps estimated to cost time (or nothing) first, the least first; then the rest."""
    return saving > 0, abs(saving)


def lower_peak(a: JointAnalysis, plan: Candidate, base_saved: Iterable[fx.Node], budget_bytes: int,
               evaluate: Callable[..., Candidate], max_evaluations: int = MAX_EVALUATIONS,
               progress: Progress | None = None) -> Lowering:
    """``plan`` lowered step by step (see the module doc); ``plan`` itself when it fits
    ``budget_bytes`` already or no step lowers it. ``evaluate``: the solver's ``Evaluator``
    (it keeps every plan it simulated, and evaluates each once)."""
    base_saved = frozenset(base_saved)
    estimate = Estimates(a, evaluate.seconds)
    current = evaluate(Prefix(plan.saved, plan.offloaded, plan.moves))
    steps = evaluated = 0

    def may_evaluate() -> bool:
        return evaluated < max_evaluations and (progress is None or progress.step())

    def first_lower(options) -> Candidate | None:
        nonlocal evaluated
        for _, option in options:
            if not evaluate.simulated(option):
                if not may_evaluate():
                    return None
                evaluated += 1
            candidate = evaluate(option)
            if (candidate.peak_bytes < current.peak_bytes
                    and candidate.extra_seconds >= current.extra_seconds - SAME_SECONDS):
                return candidate
        return None

    while current.peak_bytes > budget_bytes and steps < MAX_STEPS:
        step = first_lower(undos(a, current, base_saved, estimate, least_change_first))
        out = evaluated >= max_evaluations or (progress is not None and progress.out_of_time)
        if step is None and not out:  # swaps list every pair: not built once out of plans or time
            step = first_lower(swaps(a, current, base_saved, estimate, least_change_first))
        if step is None:
            break
        current, steps = step, steps + 1
    return Lowering(current if steps else plan, steps, evaluated)


def lowered_solution(a: JointAnalysis, solution: Solution, base_saved: Iterable[fx.Node],
                     evaluate: Callable[..., Candidate], with_timeline: Callable[[Candidate], Candidate],
                     progress: Progress | None = None) -> Solution:
    """``solution`` where nothing fitted, its lowest plan lowered (``lower_peak``) and
    explained again: the plan chosen and the minimum, feasible when it now fits.
    ``solution`` itself when it fits, has no budget, or no step lowers it."""
    budget_bytes = solution.budget_bytes
    if solution.feasible or budget_bytes is None or (progress is not None and progress.out_of_time):
        return solution
    lowering = lower_peak(a, solution.chosen, base_saved, budget_bytes, evaluate, progress=progress)
    if not lowering.steps:
        return solution
    chosen = with_timeline(lowering.plan)
    lowered = Solution(chosen, solution.baseline, chosen, budget_bytes, chosen.peak_bytes <= budget_bytes,
                       candidates_evaluated=solution.candidates_evaluated + lowering.evaluated,
                       lowered_steps=lowering.steps)
    _explain(a, lowered)
    return lowered


__all__ = ["MAX_EVALUATIONS", "MAX_STEPS", "Lowering", "least_change_first", "lower_peak", "lowered_solution"]
