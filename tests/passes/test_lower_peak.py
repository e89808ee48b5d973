"""Lowering the greedy's lowest plan where nothing fits (passes/solve/lower_peak.py)."""

from __future__ import annotations

import pytest

from compile_offload.passes.solve import joint as solve_offload
from compile_offload.passes.build_plan import build_plan
from compile_offload.passes.solve.lower_peak import SAME_SECONDS, lower_peak, lowered_solution
from compile_offload.passes.progress import Progress
from compile_offload.passes.solve.joint import Evaluator, Prefix, solve_joint


@pytest.fixture(scope="module")
def gpt2_block():
    """One GPT-2-small block as the backend plans it (model-check's ``gpt2-block``, on the
    meta device), h100 profile: the greedy's lowest plan recomputes bf16 casts of the
    first layer norm that cost no time, and saving them again lowers the backward's peak
    (docs/benchmarks.md, "Optimality"). (analysis, starting saved set, seconds, offload)."""
    from compile_offload.tools.model_check import _gpt2_block, backend_analysis, seconds_function
    from compile_offload.passes import compat
    from compile_offload.passes.cost import BUILTIN_PROFILES
    from compile_offload.passes.offload import eligible_for_offload
    from compile_offload.passes.solve.recompute import without_banned_recompute
    from compile_offload.passes.solve.joint import OffloadOptions

    profile = BUILTIN_PROFILES["h100"]
    model, x = _gpt2_block()
    a = backend_analysis(model, x)
    base = without_banned_recompute(a, compat.min_cut_saved_values(a.joint))
    offload = OffloadOptions(profile, lambda node: eligible_for_offload(node)[0], True)
    return a, base, seconds_function(a, profile), offload


def _unlowered(monkeypatch, a, base, seconds, budget, offload):
    """The solver's solution without the lowering (what it returned before it)."""
    with monkeypatch.context() as patch:
        patch.setattr(solve_offload, "lowered_solution", lambda a, solution, *args, **kwargs: solution)
        return solve_joint(a, base, seconds, budget, None, offload)


@pytest.mark.parametrize("with_offload", [True, False], ids=["offload", "recompute-only"])
def test_lowering_finds_a_plan_below_the_greedys_lowest_at_no_faster_time(gpt2_block, monkeypatch, with_offload):
    a, base, seconds, offload = gpt2_block
    offload = offload if with_offload else None
    greedy = _unlowered(monkeypatch, a, base, seconds, 0, offload)
    assert not greedy.feasible
    lowered = solve_joint(a, base, seconds, 0, None, offload)
    assert lowered.lowered_steps > 0
    assert lowered.chosen.peak_bytes < greedy.minimum.peak_bytes
    assert lowered.minimum is lowered.chosen
    assert lowered.chosen.extra_seconds >= greedy.chosen.extra_seconds - SAME_SECONDS
    # A budget between the two peaks: nothing the greedy searched fits it, the lowered plan does.
    budget = lowered.chosen.peak_bytes
    assert not _unlowered(monkeypatch, a, base, seconds, budget, offload).feasible
    fitting = solve_joint(a, base, seconds, budget, None, offload)
    assert fitting.feasible and fitting.chosen.peak_bytes <= budget
    # Evaluated exactly: a fresh evaluator simulates the same peak, with its timeline.
    again = Evaluator(a, seconds, offload, base).with_timeline(fitting.chosen)
    assert again.peak_bytes == fitting.chosen.peak_bytes == again.timeline.peak_bytes
    # Its reasons are its own, and the plan says it was lowered.
    assert set(fitting.recomputed) == set(fitting.baseline.saved - fitting.chosen.saved)
    plan = build_plan(a, fitting, seconds, solver="greedy", profile_name="h100", graph_name="block", solve_seconds=0.0)
    assert plan.feasible and any(note.startswith("lowered: ") for note in plan.notes)


def test_lowered_choices_stay_monotone_in_the_budget(gpt2_block, monkeypatch):
    a, base, seconds, offload = gpt2_block
    greedy_lowest = _unlowered(monkeypatch, a, base, seconds, 0, offload).minimum.peak_bytes
    lowest = solve_joint(a, base, seconds, 0, None, offload).chosen.peak_bytes
    budgets = sorted({greedy_lowest + 1, greedy_lowest, (greedy_lowest + lowest) // 2, lowest, lowest - 1, 0},
                     reverse=True)
    chosen = [solve_joint(a, base, seconds, budget, None, offload) for budget in budgets]
    for budget, solution in zip(budgets, chosen):
        assert solution.feasible == (solution.chosen.peak_bytes <= budget)
        assert solution.feasible == (budget >= lowest)
    for higher, lower in zip(chosen, chosen[1:]):  # a lower budget: no higher peak, no faster plan
        assert lower.chosen.peak_bytes <= higher.chosen.peak_bytes
        assert lower.chosen.extra_seconds >= higher.chosen.extra_seconds - SAME_SECONDS


def test_lowering_leaves_a_fitting_plan_alone_and_keeps_its_bounds(gpt2_block):
    a, base, seconds, offload = gpt2_block
    evaluate = Evaluator(a, seconds, offload, base)
    unconstrained = evaluate(Prefix(frozenset(base), frozenset(), ()))
    fits = lower_peak(a, unconstrained, base, unconstrained.peak_bytes, evaluate)
    assert fits.plan is unconstrained and fits.steps == fits.evaluated == 0
    # Below every plan: nothing new is evaluated without evaluations left.
    bounded = lower_peak(a, unconstrained, base, 0, Evaluator(a, seconds, offload, base), max_evaluations=0)
    assert bounded.plan is unconstrained and bounded.evaluated == 0
    steps = lower_peak(a, unconstrained, base, 0, Evaluator(a, seconds, offload, base), max_evaluations=3)
    assert steps.evaluated <= 3


def test_lowering_evaluates_nothing_once_out_of_time(gpt2_block, monkeypatch):
    a, base, seconds, offload = gpt2_block
    greedy = _unlowered(monkeypatch, a, base, seconds, 0, offload)
    evaluate = Evaluator(a, seconds, offload, base)
    out_of_time = Progress(0.0, "block")
    with pytest.warns(UserWarning, match="plan_time_limit"):
        out_of_time.step()
    assert out_of_time.out_of_time
    assert lowered_solution(a, greedy, base, evaluate, evaluate.with_timeline, out_of_time) is greedy
    assert not evaluate.results
