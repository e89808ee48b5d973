"""Refinement after the greedy solver (passes/solve/refine.py): undo the moves a budget does not need."""

from __future__ import annotations

import pytest
import torch

from compile_offload.passes.inductor.rules import INDUCTOR
from compile_offload.passes.memory import recomputed_nodes
from compile_offload.passes.progress import Progress
from compile_offload.passes.solve.refine import refine, refine_solution
from compile_offload.passes.solve.recompute import pick
from compile_offload.tools.solve_exhaustive import exhaustive_candidates, greedy_pool
from compile_offload.passes.solve.joint import Evaluator, solve_joint

from .test_solve_exhaustive import _planned_for_h100

SWEEP = 12


@pytest.fixture(scope="module", autouse=True)
def _without_in_place_reuse():
    """The block below makes the greedy overpay when the simulator counts no in-place reuse
    into saved tensors; with it (Inductor's default, ``passes.memory.in_place_candidates``)
    its peaks span 5% and the greedy's plan is the exact optimum at every budget of the
    sweep, which leaves refinement nothing to do. The subject here is refinement, so the
    reuse is switched off the way Inductor's config switches it off."""
    with torch._inductor.config.patch(inplace_buffers=False):
        yield


@pytest.fixture(autouse=True)
def byte_ordered_greedy(monkeypatch):
    """The plans refinement starts from are the byte-ordered greedy's: on a graph this small
    the sequence that simulates every move, with the plans it simulates on the way
    (passes/solve/peak.py, part of the default solve), reaches the optimum at every budget
    of the sweep by itself, and would leave refinement nothing to show."""
    from compile_offload.passes.solve import peak as solve_peak

    monkeypatch.setattr(solve_peak, "MAX_MOVES", 0)


@pytest.fixture(scope="module")
def gpt2_like_block():
    """One GPT-2-style block (d 128, 4 heads, seq 128, batch 2, bf16) on the meta device,
    planned for the h100 profile, recompute only: the greedy orders its moves by bytes
    freed per second and recomputes the MLP's activations, which free bytes away from the
    peak, so it overpays at most budgets (the case of docs/benchmarks.md, at a size the
    exhaustive search finishes in seconds). (analysis, starting saved set, seconds)."""
    from compile_offload.tools.model_check import capture_joint, decoder_on_meta, seconds_function
    from compile_offload.passes import compat
    from compile_offload.passes.analyze import analyze_joint
    from compile_offload.passes.cost import BUILTIN_PROFILES
    from compile_offload.passes.solve.recompute import without_banned_recompute

    model, x = decoder_on_meta({"layers": 1, "d": 128, "heads": 4, "seq": 128, "batch": 2, "dtype": "bfloat16"})
    a = analyze_joint(capture_joint(model, x), INDUCTOR)
    seconds = seconds_function(a, BUILTIN_PROFILES["h100"])
    return a, without_banned_recompute(a, compat.min_cut_saved_values(a.joint)), seconds


def _sweep(low: int, high: int, points: int = SWEEP) -> list[int]:
    return [low + (high - low) * i // (points - 1) for i in range(points)]


def _budgets(a, base, seconds, points: int = SWEEP, offload=None) -> list[int]:
    """``points`` budgets from the lowest peak the greedy reaches to the unconstrained one."""
    unconstrained = solve_joint(a, base, seconds, None, None, offload).baseline.peak_bytes
    lowest = solve_joint(a, base, seconds, 0, None, offload).minimum.peak_bytes
    return _sweep(lowest, unconstrained, points)


def test_refined_plan_is_never_slower_and_reaches_the_optimum_where_the_greedy_overpays(gpt2_like_block):
    a, base, seconds = gpt2_like_block
    exact_all = exhaustive_candidates(a, base, seconds, None, greedy_pool(a, base, seconds))
    lowest = min(c.peak_bytes for c in exact_all)
    overpaid = reached_where_overpaid = 0
    for budget in _sweep(lowest, exact_all[0].peak_bytes):
        greedy = solve_joint(a, base, seconds, budget)
        refined, _ = refine_solution(a, greedy, base, seconds, None)
        exact, exact_fits = pick(exact_all, budget)
        assert exact_fits
        if not greedy.feasible:
            assert refined is greedy  # nothing to refine: the lowest-peak plan, as solved
            continue
        overpays = greedy.chosen.extra_seconds > exact.extra_seconds * (1 + 1e-9) + 1e-15
        overpaid += overpays
        assert refined.feasible and refined.chosen.peak_bytes <= budget
        assert refined.chosen.extra_seconds <= greedy.chosen.extra_seconds
        assert refined.chosen.peak_bytes >= greedy.chosen.peak_bytes
        assert refined.chosen.extra_seconds >= exact.extra_seconds * (1 - 1e-9) - 1e-15
        reached_where_overpaid += overpays and refined.chosen.extra_seconds == pytest.approx(
            exact.extra_seconds, rel=1e-9, abs=1e-15)
    assert overpaid, "the greedy was optimal at every budget: this graph no longer tests refinement"
    # Refinement is a local search: since the simulator runs each fused kernel as one
    # (passes/inductor/kernel_local.py), the byte-ordered greedy's plans on this block are further
    # from the optimum than one undo or swap reaches at most budgets (it reached it at every
    # budget before); it still reaches it where the greedy overpaid by one move.
    assert reached_where_overpaid, "refinement reached the optimum at no budget where the greedy overpaid"


def test_refined_plans_stay_monotone_in_the_budget(gpt2_like_block):
    """A smaller budget never gets a larger predicted peak, refined or not."""
    a, base, seconds = gpt2_like_block
    peaks = []
    for budget in _budgets(a, base, seconds, 25):
        refined, _ = refine_solution(a, solve_joint(a, base, seconds, budget), base, seconds, None)
        peaks.append(refined.chosen.peak_bytes)
    assert peaks == sorted(peaks)


def test_refine_keeps_the_budget_with_offload_and_is_never_slower():
    from compile_offload.benchmarks.workloads import Decoder

    a, base, seconds, offload = _planned_for_h100(Decoder(1, 64, 4), torch.randn(2, 32, 64, requires_grad=True))
    evaluate = Evaluator(a, seconds, offload, base)
    previous_peak = 0
    for budget in _budgets(a, base, seconds, 9, offload):
        greedy = solve_joint(a, base, seconds, budget, None, offload)
        refined = refine(a, greedy.chosen, base, budget, evaluate).plan
        solution, _ = refine_solution(a, greedy, base, seconds, offload)
        assert (solution.chosen.saved, solution.chosen.offloaded) == (refined.saved, refined.offloaded)
        if greedy.feasible:
            assert refined.peak_bytes <= budget and refined.peak_bytes >= greedy.chosen.peak_bytes
        assert refined.extra_seconds <= greedy.chosen.extra_seconds
        assert not any(n in a.ban for n in recomputed_nodes(a, set(refined.saved)))
        assert refined.offloaded <= refined.saved
        assert solution.chosen.peak_bytes >= previous_peak  # monotone in the budget
        previous_peak = solution.chosen.peak_bytes


def test_refined_solution_explains_its_own_decisions(gpt2_like_block):
    a, base, seconds = gpt2_like_block
    for budget in _budgets(a, base, seconds):
        greedy = solve_joint(a, base, seconds, budget)
        refined, refinement = refine_solution(a, greedy, base, seconds, None)
        if refined is greedy:
            continue
        assert refinement.undos + refinement.swaps > 0 and refinement.plan.saved == refined.chosen.saved
        assert set(refined.recomputed) == set(base) - refined.chosen.saved
        assert set(refined.added) == refined.chosen.saved - set(base)
        assert refined.chosen.timeline is not None and refined.chosen.timeline.peak_bytes == refined.chosen.peak_bytes
        assert refined.minimum is greedy.minimum and refined.baseline is greedy.baseline
        return
    pytest.fail("no budget of the sweep was refined")


def test_refinement_evaluates_nothing_once_out_of_time(gpt2_like_block):
    a, base, seconds = gpt2_like_block
    for budget in _budgets(a, base, seconds):
        greedy = solve_joint(a, base, seconds, budget)
        if refine_solution(a, greedy, base, seconds, None)[0] is greedy:
            continue
        progress = Progress(time_limit=0.0)
        with pytest.warns(UserWarning, match="plan_time_limit"):
            progress.step()  # the limit passes
        assert progress.out_of_time
        refined, refinement = refine_solution(a, greedy, base, seconds, None, progress)
        assert refined is greedy and refinement.evaluated == 0
        return
    pytest.fail("no budget of the sweep was refined")
