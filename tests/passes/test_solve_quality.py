"""The fast solve chooses what a complete search chooses.

Planning stops early (no search without a budget; recompute-only sequences end once no
later plan can be chosen; offload candidates are simulated cheapest first until the
choice is known). The reference is the same solver with ``complete=True``, which
simulates every candidate plan, computed here on a mid-size graph (three transformer
layers) for a sweep of budgets, with and without offload.
"""

import functools

import pytest

from compile_offload.passes.cost import BUILTIN_PROFILES, node_seconds
from compile_offload.passes.offload import eligible_for_offload
from compile_offload.passes.solve.joint import OffloadOptions, solve_joint

from .joint_capture import encoder_stack

H100 = BUILTIN_PROFILES["h100"]
FRACTIONS = (None, 1.0, 0.75, 0.5, 0.25, 0.0)


def transformer():
    return encoder_stack(layers=3, width=64, heads=4, ff=256, batch=4, seq=64)


@functools.cache
def solve(fraction, offload: bool, complete: bool):
    analysis, base = transformer()
    options = OffloadOptions(H100, lambda node: eligible_for_offload(node)[0]) if offload else None
    seconds = functools.partial(node_seconds, profile=H100)
    return solve_joint(analysis, base, seconds, None, fraction, options, complete=complete)


@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "offload"])
def test_fast_solve_chooses_the_complete_searchs_plan(offload):
    peaks = []
    for fraction in FRACTIONS:
        fast, reference = solve(fraction, offload, False), solve(fraction, offload, True)
        assert fast.budget_bytes == reference.budget_bytes
        assert (fast.chosen.saved, fast.chosen.offloaded) == (reference.chosen.saved, reference.chosen.offloaded)
        assert fast.chosen.extra_seconds <= reference.chosen.extra_seconds * 1.002 + 1e-12
        assert fast.feasible == reference.feasible
        if reference.feasible and fast.budget_bytes is not None:
            assert fast.chosen.peak_bytes <= fast.budget_bytes
        if not reference.feasible:  # every plan simulated: the same minimum
            assert fast.minimum.peak_bytes == reference.minimum.peak_bytes
        assert fast.candidates_evaluated <= reference.candidates_evaluated
        peaks.append(fast.chosen.peak_bytes)
    assert peaks == sorted(peaks, reverse=True), "a smaller budget never gets a larger predicted peak"
    # The sweep is not trivial: some budget binds, and a binding one simulates fewer plans.
    assert peaks[-1] < peaks[0]


def test_a_binding_budget_simulates_fewer_plans_than_the_complete_search():
    fast, reference = solve(0.75, True, False), solve(0.75, True, True)
    assert fast.budget_bytes < fast.baseline.peak_bytes
    assert fast.candidates_evaluated < reference.candidates_evaluated


def test_no_budget_is_the_unconstrained_plan_without_a_search():
    for offload in (False, True):
        solution = solve(None, offload, False)
        assert solution.chosen.saved == solution.baseline.saved and not solution.chosen.offloaded
        assert solution.candidates_evaluated == 1
