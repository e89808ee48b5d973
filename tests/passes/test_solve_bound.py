"""The branch-and-bound recompute-only optimum (tests/passes/solve_bound.py)."""

from __future__ import annotations

import torch

from compile_offload.passes.solve.recompute import pick
from tests.passes.solve_bound import branch_and_bound
from compile_offload.tools.solve_exhaustive import exhaustive_candidates, greedy_pool

from .joint_capture import Tower, capture_analysis
from .test_solve_exhaustive import _planned_for_h100, tanh_seconds, two_tanh


def test_branch_and_bound_finds_the_hand_computed_optimum_of_two_tanhs():
    # As in test_solve_exhaustive: saving y1 and y2 costs nothing, recomputing either one
    # tanh, both two. The optimum at a budget is the cheapest of those that fits.
    a, _ = capture_analysis(two_tanh, torch.randn(256, requires_grad=True))
    tanhs = sorted((n for n in a.fw_nodes if n.target is torch.ops.aten.tanh.default), key=a.position.__getitem__)
    candidates = exhaustive_candidates(a, tanhs, tanh_seconds, None, set(tanhs))
    hand = {0: 0.0, 1: 1.0, 2: 2.0}  # extra seconds by the number of tanhs recomputed
    for budget in sorted({c.peak_bytes for c in candidates}):
        fitting = [c for c in candidates if c.peak_bytes <= budget]
        expected = min(hand[len([t for t in tanhs if t not in c.saved])] for c in fitting)
        result = branch_and_bound(a, tanhs, tanh_seconds, budget, set(tanhs))
        assert result.complete and result.plan is not None
        assert result.plan.extra_seconds == expected and result.plan.peak_bytes <= budget
    # An incumbent as fast as the optimum leaves nothing to find.
    result = branch_and_bound(a, tanhs, tanh_seconds, max(c.peak_bytes for c in candidates), set(tanhs),
                              incumbent_seconds=0.0)
    assert result.complete and result.plan is None


def test_branch_and_bound_agrees_with_the_exhaustive_search():
    a, base, seconds, _ = _planned_for_h100(Tower(256, 4), torch.randn(512, 256, requires_grad=True))
    pool = greedy_pool(a, base, seconds)
    candidates = exhaustive_candidates(a, base, seconds, None, pool)
    peaks = sorted({c.peak_bytes for c in candidates})
    assert len({pick(candidates, budget)[0].extra_seconds for budget in peaks}) > 1  # the budget matters here
    for budget in peaks:
        exact, fits = pick(candidates, budget)
        result = branch_and_bound(a, base, seconds, budget, pool)
        assert fits and result.complete and result.plan is not None
        assert result.plan.peak_bytes <= budget
        assert abs(result.plan.extra_seconds - exact.extra_seconds) <= 1e-12 * max(1.0, abs(exact.extra_seconds)) + 1e-15
