"""The greedy sequence that simulates every move (passes/solve_peak.py), on one decoder block:
the graph where the byte-ordered greedy misses budgets because its peak is in the backward."""

from __future__ import annotations

import functools

from compile_offload import model_check
from compile_offload.passes import compat
from compile_offload.passes.analyze import analyze_joint
from compile_offload.passes.cost import BUILTIN_PROFILES
from compile_offload.passes.memory import recomputed_nodes
from compile_offload.passes.solve import Prefix, RecomputeEvaluator, RecomputeMoves, pick, prefixes, without_banned_recompute
from compile_offload.passes.solve_exhaustive import exhaustive_candidates, greedy_pool
from compile_offload.passes.solve_offload import solve_joint
from compile_offload.passes.solve_peak import peak_moves

H100 = BUILTIN_PROFILES["h100"]


@functools.cache
def block():
    model, x = model_check.decoder_on_meta({"layers": 1, "d": 256, "heads": 4, "seq": 256, "batch": 4,
                                            "dtype": "bfloat16"})
    a = analyze_joint(model_check.capture_joint(model, x), fusion=True)
    base = without_banned_recompute(a, compat.min_cut_saved_values(a.joint))
    return a, base, model_check.seconds_function(a, H100)


def test_each_move_lowers_the_simulated_peak_and_adds_time():
    a, base, seconds = block()
    evaluate = RecomputeEvaluator(a)
    start = Prefix(frozenset(base), frozenset(), ())
    plans = [start, *prefixes(a, start, peak_moves(a, base, seconds, evaluate))]
    assert len(plans) > 2
    candidates = [evaluate(plan) for plan in plans]
    peaks = [c.peak_bytes for c in candidates]
    assert all(later < earlier for earlier, later in zip(peaks, peaks[1:])), peaks
    times = [c.extra_seconds for c in candidates]
    assert times == sorted(times)


def test_no_sequence_where_the_first_plan_lists_more_moves_than_the_limit():
    a, base, seconds = block()
    listed = len(list(RecomputeMoves(a, seconds)(set(base), recomputed_nodes(a, set(base)))))
    assert listed > 1
    assert list(peak_moves(a, base, seconds, RecomputeEvaluator(a), max_moves=listed - 1)) == []
    assert list(peak_moves(a, base, seconds, RecomputeEvaluator(a), max_moves=listed))


def test_the_solver_finds_a_plan_wherever_an_exhaustive_search_does():
    # Recompute only (2^n plans of the greedy's storages, seconds to enumerate): budgets evenly
    # spaced above the lowest peak the exhaustive search reaches, up to the unconstrained peak.
    a, base, seconds = block()
    exact = exhaustive_candidates(a, base, seconds, None, greedy_pool(a, base, seconds, None), 100_000)
    lowest, top = min(c.peak_bytes for c in exact), solve_joint(a, base, seconds, None, None, None).baseline.peak_bytes
    assert lowest < 0.8 * top
    for step in range(1, 8):
        budget = int(lowest + (top - lowest) * step / 7)
        _, fits = pick(exact, budget)
        solution = solve_joint(a, base, seconds, budget, None, None)
        assert fits and solution.feasible, (step, budget)
        assert solution.chosen.peak_bytes <= budget
