"""Drop the greedy's moves that do not lower the peak: a dominance pass after the solver.

The greedy sequence orders moves by bytes freed per second of recompute, and a move's
freed bytes are counted where the saved tensor lived, not at the simulated peak. A move
can therefore free bytes away from the peak, or even raise it: on a GPT-2 block the
backward writes the GELU's gradient into the saved GELU output in place (Inductor's
in-place reuse, ``passes.memory``), so recomputing that output, the greedy's first move
(48 MiB freed per 48 us), adds a 48 MiB buffer in the backward and the peak rises from
209 to 257 MiB; every later plan of the sequence carries it (docs/benchmarks.md,
"Optimality").

``prune`` starts from the solver's chosen plan and takes, one at a time, *undos*
(``passes.solve.refine``'s: stop offloading one storage, or save again one storage of the
unconstrained plan, dropping what was saved only to recompute it) whose plan, evaluated
exactly by the joint solver's evaluator, *dominates* the current one: a peak no higher,
a predicted time no longer, and one of them strictly lower. Unlike refinement
(``solver="refined"``), a step never raises the predicted peak, so no room under the
budget is spent: the plan's slack, which absorbs the simulator's errors under Inductor,
is kept or grows. The result fits wherever the solver's plan fits, and it may fit a
budget the solver's plan did not (its lowest plan pruned). Each step is one evaluation
(whole-graph passes), so the evaluations are bounded (``MAX_EVALUATIONS``).

Not the planner's default, and not wired into it: measured under Inductor (the contract
suite with pruning after every greedy plan, docs/benchmarks.md), the plans it changes
peak above what the simulator predicts for them (the Llama's minimum: predicted 2.94 MiB,
measured 3.83, against 3.08 unpruned), so the steps it takes are the simulator's errors
as much as the greedy's. ``model-check`` reports it (``pruned_*``) as the gap the model
says a peak-aware greedy would close.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch.fx as fx

from ..analyze import JointAnalysis
from ..progress import Progress
from .neighbours import Estimates, undos
from .recompute import Candidate, Seconds, Solution, _explain
from .joint import Evaluator, OffloadOptions, Prefix

# Plans evaluated per pruning, and steps taken: a bound on the planning time it adds.
MAX_EVALUATIONS = 8
MAX_STEPS = 8


@dataclass(frozen=True)
class Pruning:
    """The pruned plan and how it was reached."""

    plan: Candidate
    steps: int = 0  # undo steps taken
    evaluated: int = 0  # candidate plans evaluated


def prune(a: JointAnalysis, plan: Candidate, base_saved: Iterable[fx.Node], evaluate: Evaluator,
          max_evaluations: int = MAX_EVALUATIONS, progress: Progress | None = None) -> Pruning:
    """``plan`` after the undos that dominate it (see the module doc); ``plan`` itself when
    none does. ``progress``: once out of time, nothing more is evaluated."""
    base_saved = frozenset(base_saved)
    estimate = Estimates(a, evaluate.seconds)
    current = evaluate(Prefix(plan.saved, plan.offloaded, plan.moves), keep_timeline=True)
    evaluated = steps = 0
    # The storages of each undo evaluated: one that did not dominate is not tried again in a
    # later round (a bound: on a 48-layer stack the same eight undos of attention
    # statistics, a little higher at the same time, were evaluated again every round).
    tried: set[frozenset[fx.Node]] = set()
    while steps < MAX_STEPS:
        step = None
        held_at_peak = _held_at_peak(a, current)
        for _, option in undos(a, current, base_saved, estimate):
            key = _undone(a, option, current)
            if key in tried or held_at_peak(option, current) or _saves_nothing(a, option, current, estimate):
                continue
            if evaluated >= max_evaluations or (progress is not None and not progress.step()):
                break
            tried.add(key)
            evaluated += 1
            candidate = evaluate(option)
            if _dominates(candidate, current):
                step = candidate
                break
        if step is None:
            break
        current, steps = evaluate(Prefix(step.saved, step.offloaded, step.moves), keep_timeline=True), steps + 1
    if not steps:
        return Pruning(plan, evaluated=evaluated)
    return Pruning(current, steps, evaluated)


def _undone(a: JointAnalysis, option: Prefix, current: Candidate) -> frozenset[fx.Node]:
    """The storages an undo saves again or stops offloading."""
    return frozenset({a.roots.get(t, t) for t in option.saved - current.saved} | (current.offloaded - option.offloaded))


def _held_at_peak(a: JointAnalysis, plan: Candidate):
    """A filter on undos, so that evaluations are spent where one can dominate: does the
    undo keep a storage on the device across ``plan``'s peak step that is not there now?
    Such an undo adds that storage's bytes at the peak (less the bytes saved only for its
    recomputation, which the move that recomputed it freed fewer of), so it cannot lower
    the peak and, where the peak is the plan's only maximum, raises it. A storage saved
    again (or no longer offloaded) lives from its forward step to its last backward
    reader (a backward step or a recomputation reading it); it is there now only where its
    recomputed copy is (a recompute step of it before the peak, read at or after it). The
    steps are read from the plan's timeline by name (forward and backward nodes have
    distinct names; a recompute step carries its forward node's name). On a GPT-style stack whose peak is where the backward starts,
    every undo is filtered out and pruning evaluates nothing."""
    timeline = plan.timeline
    peak = timeline.peak_index
    first: dict[str, int] = {}  # forward node -> its step
    recomputed_at: dict[str, int] = {}  # recomputed node -> its step
    index_of: dict[str, int] = {}
    for index, (label, kind) in enumerate(zip(timeline.labels, timeline.kinds)):
        if kind == "recompute":
            recomputed_at.setdefault(label, index)
        else:
            first.setdefault(label, index)
            index_of[label] = index
    by_name = {node.name: node for node in a.position}
    last_read: dict[fx.Node, int] = {}  # storage -> the last backward step (recomputation included) reading it
    for index in range(timeline.backward_start, len(timeline.labels)):
        node = by_name.get(timeline.labels[index])
        for arg in a.inputs.get(node, ()) if node is not None else ():
            last_read[a.roots.get(arg, arg)] = index

    def held(option: Prefix, current: Candidate) -> bool:
        for root in _undone(a, option, current):
            produced = first.get(root.name)
            if produced is None or not produced <= peak <= last_read.get(root, -1):
                continue  # not alive at the peak once saved again
            recompute = recomputed_at.get(root.name)
            if recompute is not None and recompute <= peak and root not in current.offloaded:
                continue  # its recomputed copy is there already
            return True
        return False

    return held


def _saves_nothing(a: JointAnalysis, option: Prefix, current: Candidate, estimate: Estimates) -> bool:
    """Is ``option`` a recompute undo whose storage costs no time to recompute (a dtype
    cast of a weight fused into its reader, a view)? Saving it again cannot be faster, and
    on a GPT-style stack there is one per weight: evaluating them all would spend the
    evaluations on plans of the same time."""
    if option.offloaded != current.offloaded:
        return False
    new = option.saved - current.saved
    return bool(new) and estimate.recompute_seconds(new) <= 0.0


def _dominates(candidate: Candidate, current: Candidate) -> bool:
    return (candidate.peak_bytes <= current.peak_bytes and candidate.extra_seconds <= current.extra_seconds
            and (candidate.peak_bytes, candidate.extra_seconds) != (current.peak_bytes, current.extra_seconds))


def prune_solution(a: JointAnalysis, solution: Solution, base_saved: Iterable[fx.Node], seconds: Seconds,
                   offload: OffloadOptions | None, progress: Progress | None = None) -> tuple[Solution, Pruning]:
    """``solution`` with its chosen plan pruned (``prune``) and explained again; ``solution``
    itself when nothing dominates its plan. ``seconds`` and ``offload``: the solver's."""
    chosen = solution.chosen
    if (not chosen.offloaded and chosen.saved == solution.baseline.saved) or (
            progress is not None and progress.out_of_time):
        return solution, Pruning(chosen)
    base_saved = list(base_saved)
    evaluate = Evaluator(a, seconds, offload, base_saved)
    pruning = prune(a, chosen, base_saved, evaluate, progress=progress)
    if pruning.plan is chosen:
        return solution, pruning
    chosen = pruning.plan  # evaluated with its timeline by ``prune``
    feasible = solution.budget_bytes is None or chosen.peak_bytes <= solution.budget_bytes
    minimum = chosen if chosen.peak_bytes < solution.minimum.peak_bytes else solution.minimum
    pruned = Solution(chosen, solution.baseline, minimum, solution.budget_bytes, feasible,
                      candidates_evaluated=solution.candidates_evaluated + pruning.evaluated)
    _explain(a, pruned)
    return pruned, pruning


__all__ = ["MAX_EVALUATIONS", "MAX_STEPS", "Pruning", "prune", "prune_solution"]
