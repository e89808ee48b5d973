"""The greedy sequence that simulates every move (passes/solve/peak.py), on one decoder block:
the graph where the byte-ordered greedy misses budgets because its peak is in the backward."""

from __future__ import annotations

import functools

from compile_offload.passes.inductor.rules import INDUCTOR
from compile_offload.tools import model_check
from compile_offload.passes import compat
from compile_offload.passes.analyze import analyze_joint
from compile_offload.passes.cost import BUILTIN_PROFILES
from compile_offload.passes.memory import recomputed_nodes
from compile_offload.passes.solve.recompute import (Prefix, RecomputeEvaluator, RecomputeMoves, pick, prefixes, solve_greedy,
                                          without_banned_recompute)
from compile_offload.tools.solve_exhaustive import exhaustive_candidates, greedy_pool
from compile_offload.passes.solve.joint import solve_joint
from compile_offload.passes.solve.peak import peak_moves

H100 = BUILTIN_PROFILES["h100"]


@functools.cache
def block():
    model, x = model_check.decoder_on_meta({"layers": 1, "d": 256, "heads": 4, "seq": 256, "batch": 4,
                                            "dtype": "bfloat16"})
    a = analyze_joint(model_check.capture_joint(model, x), INDUCTOR)
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


def test_the_plans_simulated_on_the_way_are_candidates_and_the_choice_stays_monotone():
    # The move freeing the most per second can overshoot a budget at a price a smaller drop
    # avoids; every plan the sequence simulates is a candidate (a set that does not depend
    # on the budget, so a smaller budget never gets a higher peak).
    a, base, seconds = block()
    evaluate = RecomputeEvaluator(a)
    start = Prefix(frozenset(base), frozenset(), ())
    alternatives = []
    sequence = [start, *prefixes(a, start, peak_moves(a, base, seconds, evaluate, alternatives))]
    assert len(alternatives) > len(sequence)
    top, lowest = evaluate(start).peak_bytes, evaluate(sequence[-1]).peak_bytes
    cheaper_somewhere, previous_peak = False, None
    for step in range(1, 12):
        budget = int(lowest + (top - lowest) * step / 12)
        chosen = solve_joint(a, base, seconds, budget, None, None).chosen
        assert chosen.peak_bytes <= budget
        simulated = [evaluate(plan) for plan in alternatives if evaluate(plan).peak_bytes <= budget]
        assert simulated, "the sequence simulated no plan under this budget"
        assert chosen.extra_seconds <= min(c.extra_seconds for c in simulated)
        by_sequence = next(evaluate(plan) for plan in sequence if evaluate(plan).peak_bytes <= budget)
        cheaper_somewhere |= chosen.extra_seconds < by_sequence.extra_seconds
        assert previous_peak is None or chosen.peak_bytes >= previous_peak  # monotone in the budget
        previous_peak = chosen.peak_bytes
    assert cheaper_somewhere


def test_the_sequence_is_made_only_up_to_its_first_plan_that_fits_and_the_choice_keeps_its_price():
    # Prices rise along the sequence: past its first plan under the budget (and the plans at
    # that price) nothing it would simulate is cheaper, so the solve stops making it there.
    a, base, seconds = block()
    full = list(peak_moves(a, base, seconds, RecomputeEvaluator(a)))
    top = solve_greedy(a, base, seconds, None).baseline.peak_bytes
    lowest = solve_greedy(a, base, seconds, 1, complete=True, more_moves=peak_moves).minimum.peak_bytes
    shorter = 0
    for step in range(1, 8):
        budget = int(lowest + (top - lowest) * step / 8)
        made = []

        def counted(*args):
            for move in peak_moves(*args):
                made.append(move)
                yield move

        solution = solve_greedy(a, base, seconds, budget, more_moves=counted)
        reference = solve_greedy(a, base, seconds, budget, complete=True, more_moves=peak_moves)
        assert solution.feasible and solution.chosen.peak_bytes <= budget
        assert solution.chosen.extra_seconds == reference.chosen.extra_seconds, step
        assert made == full[:len(made)]
        shorter += len(made) < len(full)
    assert shorter >= 4
