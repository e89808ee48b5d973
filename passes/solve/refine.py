"""Undo the greedy's moves that a budget does not need: a local search after the solver.

The greedy joint solver orders its moves by bytes freed per second, and a budget picks a
prefix of that order; a move taken early can free bytes away from the peak (the peak sits
elsewhere, e.g. in the backward), so every fitting prefix pays for it. The exhaustive
search (``tools.solve_exhaustive``) showed this on a GPT-2 block: the greedy recomputed
the MLP's first matmul and its GELU at budgets where the optimum keeps them, 9-12% slower
at the same peak.

``refine`` starts from a plan that fits and repeatedly takes an *undo*: stop offloading
one storage, or save again one storage of the unconstrained plan that the plan recomputes
(dropping what was saved only to recompute it). In a round where no undo can be taken it
tries *swaps* (save one storage again while recomputing another one the plan saves), then
undoes again (the steps: ``passes.solve.neighbours``). A step is taken only when its plan,
evaluated exactly (the solver's own evaluator), fits the budget, is strictly faster and peaks no lower than the plan it
replaces. Each round tries the options in a fixed order, the largest estimated saving
first (the recompute time of the storage saved again, the stalls of the copies undone;
for a swap, less the recompute time it adds), and takes the first that qualifies. Every
evaluation costs whole-graph passes (about 60 ms on GPT-8 on a 2-core machine), so the
number of evaluations per refinement is bounded (``MAX_EVALUATIONS``). The result fits
the same budget, is never slower, and the planner's choice stays monotone in the budget
(docs/design.md, "Refinement").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch.fx as fx

from ..analyze import JointAnalysis
from . import neighbours
from ..progress import Progress
from .recompute import Candidate, Seconds, Solution, _explain
from .joint import Evaluator, OffloadOptions, Prefix

# Bounds on the added planning time: candidate plans evaluated per refinement (undos and
# swaps together), and rounds (steps taken).
MAX_EVALUATIONS = 48
MAX_ROUNDS = 32


@dataclass(frozen=True)
class Refinement:
    """The refined plan and how it was reached."""

    plan: Candidate
    undos: int = 0  # undo steps taken
    swaps: int = 0  # swap steps taken
    evaluated: int = 0  # candidate plans evaluated
    out_of_time: bool = False  # stopped by the time limit


def refine(a: JointAnalysis, plan: Candidate, base_saved: Iterable[fx.Node], budget_bytes: int | None,
           evaluate: Evaluator, max_evaluations: int = MAX_EVALUATIONS,
           progress: Progress | None = None) -> Refinement:
    """``plan`` after undoing, one at a time, the moves ``budget_bytes`` does not need (see
    the module doc). ``plan`` itself, unchanged, when no step helps, when it does not fit,
    or without a budget. ``progress``: once out of time, no further plan is evaluated."""
    if budget_bytes is None or plan.peak_bytes > budget_bytes:
        return Refinement(plan)
    base_saved = frozenset(base_saved)
    search = _Search(evaluate, budget_bytes, max_evaluations, progress)
    estimate = neighbours.Estimates(a, evaluate.seconds)
    # Compared against the same evaluator's figures (the solver's may be summed in
    # another order); the peak a step may not go below is the solver's plan's.
    current = evaluate(Prefix(plan.saved, plan.offloaded, plan.moves))
    floor = plan.peak_bytes
    undos = swaps = 0
    for _ in range(MAX_ROUNDS):
        step = search.first(current, floor, _plans(neighbours.undos(a, current, base_saved, estimate)))
        if step is not None:
            undos += 1
        else:
            step = search.first(current, floor, _plans(neighbours.swaps(a, current, base_saved, estimate)))
            swaps += step is not None
        if step is None:
            break
        current, floor = step, step.peak_bytes
    if not undos and not swaps:
        return Refinement(plan, evaluated=search.evaluated, out_of_time=search.out_of_time)
    return Refinement(current, undos, swaps, search.evaluated, search.out_of_time)


def refine_solution(a: JointAnalysis, solution: Solution, base_saved: Iterable[fx.Node], seconds: Seconds,
                    offload: OffloadOptions | None, progress: Progress | None = None) -> tuple[Solution, Refinement]:
    """``solution`` with its chosen plan refined (``refine``), explained again; ``solution``
    itself when refinement changes nothing (no budget, no fitting plan, no step helps).
    ``seconds`` and ``offload``: those the solver used."""
    chosen = solution.chosen
    unconstrained = not chosen.offloaded and chosen.saved == solution.baseline.saved  # nothing to undo
    if (not solution.feasible or solution.budget_bytes is None or unconstrained
            or (progress is not None and progress.out_of_time)):
        return solution, Refinement(chosen)
    base_saved = list(base_saved)
    evaluate = Evaluator(a, seconds, offload, base_saved)
    refinement = refine(a, solution.chosen, base_saved, solution.budget_bytes, evaluate, progress=progress)
    if refinement.plan is solution.chosen:
        return solution, refinement
    plan = refinement.plan
    chosen = evaluate(Prefix(plan.saved, plan.offloaded, plan.moves), keep_timeline=True)
    refined = Solution(chosen, solution.baseline, solution.minimum, solution.budget_bytes, True,
                       candidates_evaluated=solution.candidates_evaluated + refinement.evaluated)
    _explain(a, refined)  # the reasons of the refined decisions, as the solver gives them
    return refined, refinement


def _plans(options: Iterable[tuple[float, Prefix]]) -> Iterable[Prefix]:
    return (plan for _, plan in options)  # the estimates ordered them


class _Search:
    """Evaluates candidate steps, at most ``max_evaluations`` in all."""

    def __init__(self, evaluate: Evaluator, budget_bytes: int, max_evaluations: int,
                 progress: Progress | None) -> None:
        self.evaluate, self.budget_bytes, self.progress = evaluate, budget_bytes, progress
        self.evaluations_left, self.evaluated = max_evaluations, 0

    @property
    def out_of_time(self) -> bool:
        return self.progress is not None and self.progress.out_of_time

    def first(self, current: Candidate, floor: int, options: Iterable[Prefix]) -> Candidate | None:
        """The first option that fits the budget, is strictly faster than ``current`` and
        peaks no lower than ``floor``; None when none does (or the evaluations or the time
        run out first)."""
        for option in options:
            if self.evaluations_left <= 0 or self.out_of_time:
                return None
            if self.progress is not None and not self.progress.step():
                return None
            self.evaluations_left -= 1
            self.evaluated += 1
            candidate = self.evaluate(option)
            if (candidate.peak_bytes <= self.budget_bytes and candidate.peak_bytes >= floor
                    and candidate.extra_seconds < current.extra_seconds):
                return candidate
        return None


__all__ = ["MAX_EVALUATIONS", "MAX_ROUNDS", "Refinement", "refine", "refine_solution"]
