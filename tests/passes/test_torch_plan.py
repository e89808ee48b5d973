"""``passes.solve.torch_plan``: torch's own plan at equal memory, the saved set its
partitioner's knapsack chooses under ``activation_memory_budget``, at the largest fraction
predicted to fit a budget (a rival in measured plan choice)."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch

from compile_offload.passes import compat
from compile_offload.passes.analyze import analyze_joint
from compile_offload.passes.cost import BUILTIN_PROFILES, node_seconds
from compile_offload.passes.inductor.rules import PYTHON
from compile_offload.passes.solve import torch_plan
from compile_offload.passes.solve.joint import Evaluator
from compile_offload.passes.solve.recompute import Prefix, without_banned_recompute

from .joint_capture import ResidualMLP, capture

FRACTIONS = [step / torch_plan.FRACTIONS for step in range(1, torch_plan.FRACTIONS)]


def _peak(a, base, fraction: float) -> int:
    return Evaluator(a, lambda _node: 0.0, None, base)(Prefix(torch_plan.torch_saved(a, fraction), frozenset(),
                                                             ())).peak_bytes


def _peak_of(a, base, saved) -> int:
    return Evaluator(a, lambda _node: 0.0, None, base)(Prefix(saved, frozenset(), ())).peak_bytes


def _observe(joint, _inputs) -> dict:
    """Everything the tests read, taken on the joint graph before torch's partition runs on it."""
    a = analyze_joint(joint, PYTHON)
    base = without_banned_recompute(a, compat.min_cut_saved_values(joint))  # as the planner's start
    peaks = {fraction: _peak(a, base, fraction) for fraction in FRACTIONS}
    lowest, highest = min(peaks.values()), max(peaks.values())
    budget = (lowest + highest) // 2
    baseline = _peak_of(a, base, frozenset(base))
    with _counting() as counts:  # three looks, as measured plan choice makes at most
        plans = torch_plan.TorchPlans(a)
        fraction = torch_plan.fitting_fraction(plans, budget)
        none_below_lowest = torch_plan.fitting_fraction(plans, lowest - 1)
        below_found = torch_plan.fitting_fraction(plans, budget, below=fraction)
    profile = BUILTIN_PROFILES["h100"]
    solution = torch_plan.torch_plan_solution(a, base, lambda node: node_seconds(node, profile), fraction, budget)
    return {
        "baseline": baseline, "peaks": peaks, "lowest": lowest, "highest": highest, "budget": budget, "fraction": fraction,
        "none_below_lowest": none_below_lowest, "below_found": below_found, "counts": counts,
        "solution": solution, "saved": torch_plan.torch_saved(a, fraction), "base": frozenset(base),
        "over": torch_plan.torch_plan_solution(a, base, lambda node: 0.0, fraction, solution.chosen.peak_bytes - 1),
    }


@contextlib.contextmanager
def _counting():
    """Counts the min-cuts and knapsacks ``torch_plan`` runs inside the block."""
    counts = {"min_cuts": 0, "knapsacks": 0}

    def counted(kind, run):
        def call(*args):
            counts[kind] += 1
            return run(*args)
        return call

    with mock.patch.object(compat, "min_cut_saved_values", counted("min_cuts", compat.min_cut_saved_values)), \
            mock.patch.object(torch_plan, "torch_saved", counted("knapsacks", torch_plan.torch_saved)):
        yield counts


@functools.cache
def _tower() -> dict:
    seen, _ = capture(ResidualMLP(width=64, depth=3), torch.randn(1024, 64), hook=_observe)
    return seen


def test_the_fraction_found_is_the_largest_whose_plan_is_predicted_to_fit():
    seen = _tower()
    assert seen["lowest"] < seen["highest"] and seen["budget"] < seen["baseline"]
    fraction, peaks = seen["fraction"], seen["peaks"]
    assert fraction is not None and peaks[fraction] <= seen["budget"]
    assert all(peak > seen["budget"] for higher, peak in peaks.items() if higher > fraction)


def test_no_fraction_where_even_torchs_lowest_plan_is_over_the_budget():
    assert _tower()["none_below_lowest"] is None


def test_a_look_below_a_fraction_finds_the_largest_lower_one_that_fits():
    seen = _tower()
    fitting_lower = [fraction for fraction, peak in seen["peaks"].items()
                     if fraction < seen["fraction"] and peak <= seen["budget"]]
    assert fitting_lower and seen["below_found"] == max(fitting_lower)


def test_each_fraction_is_planned_once_across_looks():
    """Each fraction's knapsack and the peaks' min-cut run once for one graph, however often
    measured plan choice looks again."""
    assert _tower()["counts"] == {"min_cuts": 1, "knapsacks": torch_plan.FRACTIONS - 1}


def test_the_solution_saves_what_torch_saves_and_explains_each_recompute():
    seen = _tower()
    solution, saved = seen["solution"], seen["saved"]
    assert solution.chosen.saved == saved and solution.baseline.saved == seen["base"]
    assert solution.feasible and solution.budget_bytes == seen["budget"]
    assert solution.chosen.peak_bytes <= seen["budget"]
    assert solution.recomputed and set(solution.recomputed) == seen["base"] - saved
    assert solution.chosen.extra_seconds > 0  # it recomputes: slower than the unconstrained plan
    assert not seen["over"].feasible
