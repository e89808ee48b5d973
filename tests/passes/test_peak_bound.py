"""The lower bound of a plan's peak (``passes/solve/peak_bound.py``) that lets the searches skip
simulating plans: never above the simulated peak, and not vacuous."""

import functools

import pytest
import torch

from compile_offload.passes.solve import peak_bound, joint as solve_offload
from compile_offload.passes.cost import BUILTIN_PROFILES, DeviceProfile, node_seconds
from compile_offload.passes.offload import eligible_for_offload
from compile_offload.passes.solve.recompute import Prefix, greedy_moves, prefixes
from compile_offload.passes.solve.joint import Evaluator, OffloadOptions, mixed_moves, solve_joint

from .joint_capture import Tower, capture_analysis, chain_model, encoder_stack

# Slow matmuls and a fast link: offloading is worth it, so the mixed sequences offload.
HIDING = DeviceProfile("bound-test", {"float32": 1e9}, memory_bandwidth=1e10, d2h_bandwidth=1e12,
                       h2d_bandwidth=1e12, launch_overhead_seconds=1e-6)
H100 = BUILTIN_PROFILES["h100"]
SECONDS = functools.partial(node_seconds, profile=HIDING)
OPTIONS = OffloadOptions(HIDING, lambda node: eligible_for_offload(node)[0])


def _tower(fusion):
    return capture_analysis(Tower(64, 6), torch.randn(32, 64, requires_grad=True), fusion=fusion)


def _chain(fusion):
    model = chain_model(("linear", "tanh", "mul", "linear", "relu", "sin", "linear", "tanh"), 48)
    return capture_analysis(model, torch.randn(16, 48, requires_grad=True), fusion=fusion)


GRAPHS = {
    "encoder, fused": lambda: encoder_stack(layers=2, width=32, heads=4, ff=64, batch=2, seq=16),
    "encoder, unfused": lambda: encoder_stack(layers=2, width=32, heads=4, ff=64, batch=2, seq=16, fusion=False),
    "tower, fused": lambda: _tower(True),
    "tower, unfused": lambda: _tower(False),
    "chain, fused": lambda: _chain(True),
}


@pytest.mark.parametrize("graph", GRAPHS)
def test_the_bound_is_at_most_the_simulated_peak_of_every_plan_of_the_sequences(graph):
    a, base = GRAPHS[graph]()
    evaluate = Evaluator(a, SECONDS, OPTIONS, base)
    start = Prefix(frozenset(base), frozenset(), ())
    plans = [start, *prefixes(a, start, greedy_moves(a, base, SECONDS)),
             *prefixes(a, start, mixed_moves(a, base, SECONDS, OPTIONS))]
    assert any(plan.offloaded for plan in plans) and len(plans) > 4  # recompute and offload plans both
    ratios = []
    for plan in plans:
        bound = evaluate.bound(plan)
        assert 0 <= bound <= evaluate(plan).peak_bytes, plan
        ratios.append(bound / evaluate(plan).peak_bytes)
    assert evaluate.peak_bound.holds
    # Not vacuous: what the unconstrained plan saves is a large share of its peak.
    assert ratios[0] > 0.25


def _solve(graph, fraction):
    a, base = GRAPHS[graph]()
    return solve_joint(a, base, SECONDS, None, fraction, OPTIONS)


@pytest.mark.parametrize("fraction", [0.6, 0.3, 0.0])
def test_a_bound_found_above_a_simulated_peak_is_no_longer_used(monkeypatch, fraction):
    """The solver checks the bound on every plan it simulates; one above its peak (a graph
    the bound's rules miss) is dropped for the rest of the solve: the plan chosen is the
    one the search gives without a bound."""
    graph = "encoder, fused"
    monkeypatch.setattr(peak_bound, "held_when_backward_starts", lambda *args: 0)
    without = _solve(graph, fraction)
    monkeypatch.setattr(peak_bound, "held_when_backward_starts", lambda *args: 1 << 60)
    wrong = _solve(graph, fraction)
    assert (wrong.chosen.saved, wrong.chosen.offloaded) == (without.chosen.saved, without.chosen.offloaded)
    assert wrong.feasible == without.feasible and wrong.chosen.peak_bytes == without.chosen.peak_bytes


def test_the_bound_changes_no_plan_and_saves_simulations(monkeypatch):
    """On a deeper stack (eight layers, the h100 profile), where the searches run (small
    graphs simulate their peak-ordered sequence move by move): the same plans, fewer
    plans simulated."""
    a, base = encoder_stack(layers=8, width=32, heads=4, ff=64, batch=2, seq=16)
    seconds = functools.partial(node_seconds, profile=H100)
    options = OffloadOptions(H100, lambda node: eligible_for_offload(node)[0])
    simulated = []
    real = solve_offload.peak_bytes
    monkeypatch.setattr(solve_offload, "peak_bytes", lambda program: simulated.append(1) or real(program))
    counts = {}
    for bounded in (True, False):
        if not bounded:
            monkeypatch.setattr(peak_bound, "held_when_backward_starts", lambda *args: 0)
        for fraction in (0.8, 0.5, 0.2):
            simulated.clear()
            solution = solve_joint(a, base, seconds, None, fraction, options)
            counts[bounded, fraction] = (len(simulated), solution.chosen.saved, solution.chosen.offloaded,
                                         solution.minimum.peak_bytes)
    for fraction in (0.8, 0.5, 0.2):
        assert counts[True, fraction][1:] == counts[False, fraction][1:]
        assert counts[True, fraction][0] <= counts[False, fraction][0]
    assert sum(counts[True, f][0] for f in (0.8, 0.5, 0.2)) < sum(counts[False, f][0] for f in (0.8, 0.5, 0.2))


@pytest.mark.parametrize("offload", [True, False], ids=["mixed", "recompute only"])
def test_a_solve_leaves_no_plan_of_its_own_to_the_cyclic_collector(offload):
    """What a solve simulated (candidates, steps, copies, saved sets' schedules) is freed
    by reference counting when the solve returns: a reference cycle through an evaluator
    (its bound's callback reading the evaluator) kept them all for the cyclic collector,
    whose one walk over them after planning grew faster than the graph."""
    import gc
    import sys

    a, base = GRAPHS["encoder, fused"]()
    planner_modules = {f"compile_offload.passes.{name}" for name in
                       ("solve.recompute", "solve.joint", "memory", "transfer", "solve.peak_bound",
                        "solve.search_sequence", "analyze")}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable goes to gc.garbage
    try:
        solution = solve_joint(a, base, SECONDS, None, 0.3, OPTIONS if offload else None)
        assert solution.chosen.saved != frozenset(base)  # plans were searched and simulated
        del solution
        gc.collect()
        left = sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__ in planner_modules})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
    assert planner_modules <= set(sys.modules)  # the names filtered on are the planner's
    assert left == []
