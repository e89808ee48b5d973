"""The exhaustive keep / recompute / offload search (compile_offload/tools/solve_exhaustive.py)."""

from __future__ import annotations

import torch

from compile_offload.passes.cost import BUILTIN_PROFILES, node_seconds
from compile_offload.passes.offload import eligible_for_offload
from compile_offload.passes.solve.recompute import step_seconds, without_banned_recompute
from compile_offload.passes.solve.recompute import pick
from compile_offload.tools.solve_exhaustive import exhaustive_candidates, greedy_pool, solve_exhaustive
from compile_offload.passes.solve.joint import OffloadOptions, solve_joint

from .joint_capture import Tower, capture_analysis


def two_tanh(x):
    return torch.tanh(torch.tanh(x)).sum()


def tanh_seconds(node) -> float:
    """One second per tanh, nothing else costs: a plan's extra time counts its recomputed tanhs."""
    return 1.0 if node.target is torch.ops.aten.tanh.default else 0.0


def test_exhaustive_search_finds_the_hand_computed_plans_of_two_tanhs():
    # y1 = tanh(x), y2 = tanh(y1): the backward reads y1 and y2. The plans: keep both
    # (0 s extra), recompute y1 from x (1 tanh), recompute y2 from y1 (1 tanh), recompute
    # both from x (2 tanhs: y1 once, then y2), and nothing else.
    # (torch's min-cut would recompute both from x; the search starts from saving both.)
    a, _ = capture_analysis(two_tanh, torch.randn(256, requires_grad=True))
    tanhs = sorted((n for n in a.fw_nodes if n.target is torch.ops.aten.tanh.default), key=a.position.__getitem__)
    assert len(tanhs) == 2
    base = list(tanhs)
    candidates = exhaustive_candidates(a, base, tanh_seconds, None, set(tanhs))
    plans = {frozenset(t.name for t in c.saved if t in tanhs): c for c in candidates}
    y1, y2 = (t.name for t in tanhs)
    assert {key: c.extra_seconds for key, c in plans.items()} == {
        frozenset({y1, y2}): 0.0, frozenset({y2}): 1.0, frozenset({y1}): 1.0, frozenset(): 2.0}
    assert len(candidates) == 4
    # The optimum at a budget is the fastest plan that fits it (ties: the lower peak).
    hand = {frozenset({y1, y2}): 0.0, frozenset({y2}): 1.0, frozenset({y1}): 1.0, frozenset(): 2.0}
    for budget in sorted({c.peak_bytes for c in candidates}):
        chosen, fits = solve_exhaustive(a, base, tanh_seconds, budget, None, set(tanhs))
        assert fits and chosen.peak_bytes <= budget
        assert chosen.extra_seconds == min(hand[key] for key, c in plans.items() if c.peak_bytes <= budget)
    lowest = min(c.peak_bytes for c in candidates)
    chosen, fits = solve_exhaustive(a, base, tanh_seconds, lowest - 1, None, set(tanhs))
    assert not fits and chosen.peak_bytes == lowest  # nothing fits: the lowest-peak plan
    chosen, fits = pick(candidates, None)
    assert fits and chosen.extra_seconds == 0.0  # no budget: the unconstrained plan


def _planned_for_h100(model, x):
    """(analysis, starting saved set, seconds, offload options) of ``model`` under the h100 profile."""
    a, base = capture_analysis(model, x, fusion=True)
    profile = BUILTIN_PROFILES["h100"]

    def seconds(node):
        return node_seconds(node, profile)

    offload = OffloadOptions(profile, lambda node: eligible_for_offload(node)[0], True)
    return a, without_banned_recompute(a, base), seconds, offload


def test_exhaustive_optimum_is_never_slower_than_the_greedy_plan():
    a, base, seconds, offload = _planned_for_h100(Tower(64, 3), torch.randn(32, 64, requires_grad=True))
    pool = greedy_pool(a, base, seconds, offload)
    candidates = exhaustive_candidates(a, base, seconds, offload, pool)
    assert any(c.offloaded for c in candidates) and any(c.saved != frozenset(base) for c in candidates)
    base_seconds = step_seconds(a, base, seconds)
    peaks = sorted({c.peak_bytes for c in candidates})
    for budget in peaks[:: max(1, len(peaks) // 6)]:
        greedy = solve_joint(a, base, seconds, budget, None, offload)
        exact, fits = pick(candidates, budget)
        assert fits
        if greedy.feasible:
            greedy_total = step_seconds(a, greedy.chosen.saved, seconds) + (
                greedy.chosen.transfers.added_seconds if greedy.chosen.transfers else 0.0)
            assert base_seconds + exact.extra_seconds <= greedy_total + 1e-12

