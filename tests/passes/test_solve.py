"""The budgeted rematerialization solver."""

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, example, given, settings, strategies as st

from compile_offload.passes.memory import recomputed_nodes
from compile_offload.passes.solve.recompute import SolverError, solve_exact, solve_greedy, step_seconds

from .joint_capture import CHAIN_OPS, capture_analysis, chain_model


def unit_seconds(node):
    """Every op costs 1 us: the solver then minimises the number of recomputed ops."""
    return 1e-6


def flops_seconds(node):
    """Matmuls cost more than pointwise ops, so which tensor to recompute matters."""
    name = str(node.target)
    return 5e-6 if ("mm" in name or "addmm" in name) else 1e-6


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.sampled_from(CHAIN_OPS), min_size=2, max_size=7),
    width=st.sampled_from([8, 32]),
    fractions=st.lists(st.floats(0.0, 1.0), min_size=3, max_size=6),
)
# A sequence whose peaks bump at its end (3140, 3364, 2852, 3364, 3140): with nothing
# fitting, budget 0 once fell back to the last plan (3140) and budget 1570 to 2852.
@example(ops=["linear", "linear", "mul", "tanh", "linear", "linear"], width=8, fractions=[0.0, 0.0, 0.5])
def test_greedy_is_monotone_in_the_budget(ops, width, fractions):
    torch.manual_seed(0)
    analysis, base = capture_analysis(chain_model(ops, width), torch.randn(16, width, requires_grad=True))
    baseline = solve_greedy(analysis, base, flops_seconds, None)
    budgets = sorted({int(f * baseline.baseline.peak_bytes) for f in fractions}, reverse=True)
    peaks = [solve_greedy(analysis, base, flops_seconds, b).chosen.peak_bytes for b in budgets]
    assert all(later <= earlier for earlier, later in zip(peaks, peaks[1:])), (budgets, peaks)
    for budget, peak in zip(budgets, peaks):
        solution = solve_greedy(analysis, base, flops_seconds, budget)
        assert solution.feasible == (peak <= budget)
        if solution.feasible:
            assert peak <= budget


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(CHAIN_OPS), min_size=2, max_size=6), fraction=st.floats(0.0, 1.0))
def test_greedy_within_5_percent_of_exact(ops, fraction):
    torch.manual_seed(0)
    analysis, base = capture_analysis(chain_model(ops, 16), torch.randn(8, 16, requires_grad=True))
    budget = int(fraction * solve_greedy(analysis, base, flops_seconds, None).baseline.peak_bytes)
    try:
        exact = solve_exact(analysis, base, flops_seconds, budget, max_candidates=12)
    except SolverError:
        return  # too many candidates for exhaustive search: nothing to compare
    greedy = solve_greedy(analysis, base, flops_seconds, budget)
    exact_time = step_seconds(analysis, exact.chosen.saved, flops_seconds)
    greedy_time = step_seconds(analysis, greedy.chosen.saved, flops_seconds)
    if exact.feasible:
        assert greedy.feasible
        assert greedy_time <= 1.05 * exact_time
    # Both fall back to their lowest-peak plan otherwise; greedy's may not be worse.
    assert greedy.minimum.peak_bytes <= exact.minimum.peak_bytes


def test_no_budget_reproduces_torchs_saved_set():
    analysis, base = capture_analysis(chain_model(["linear", "tanh", "linear"], 32), torch.randn(16, 32))
    solution = solve_greedy(analysis, base, unit_seconds, None)
    assert solution.chosen.saved == frozenset(base)
    assert solution.feasible


def test_minimum_plan_saves_much_less_than_unconstrained():
    ops = ["linear", "tanh", "linear", "tanh", "linear", "tanh", "linear"]
    # A large batch: activations, not gradients, dominate the peak.
    analysis, base = capture_analysis(chain_model(ops, 64), torch.randn(1024, 64, requires_grad=True))
    solution = solve_greedy(analysis, base, unit_seconds, 0)
    assert not solution.feasible  # nothing fits in 0 bytes...
    assert solution.chosen is not solution.baseline
    assert solution.chosen.peak_bytes == solution.minimum.peak_bytes  # ...so the minimum is used
    assert solution.minimum.peak_bytes < solution.baseline.peak_bytes
    assert solution.recomputed, "the minimum-memory plan recomputes something"


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.b(torch.nn.functional.dropout(self.a(x).relu(), 0.5, training=True)).sum()


def test_random_ops_are_never_recomputed():
    analysis, base = capture_analysis(DropoutNet(), torch.randn(16, 32))
    randoms = [n for n in analysis.fw_nodes if "random" in analysis.ban.get(n, "")]
    assert randoms, "the dropout mask comes from a random op"
    for budget in (None, 1000, 0):
        solution = solve_greedy(analysis, base, unit_seconds, budget)
        recomputed = recomputed_nodes(analysis, set(solution.chosen.saved))
        assert not (recomputed & set(randoms))


# That a plan's peak is the peak of the graphs built from it (not of the program the
# solver simulated, which evaluate() computes anyway): tests/passes/test_memory.py.


def test_exact_refuses_large_graphs():
    ops = ["linear", "tanh"] * 6
    analysis, base = capture_analysis(chain_model(ops, 8), torch.randn(4, 8, requires_grad=True))
    with pytest.raises(SolverError, match="exact_max_candidates"):
        solve_exact(analysis, base, unit_seconds, 0, max_candidates=2)


def _matmul_then_sine(x, w):
    return torch.mm(x, w).sin().sum()


def test_a_fraction_is_that_share_of_the_saved_activations_on_top_of_the_rest():
    """The backward of ``sin(x @ w)`` needs ``x``, ``w`` (inputs: steady state) and the
    product (16 x 32 fp32 = 2048 bytes): the unconstrained plan saves 2048 bytes, so
    ``f`` keeps ``f`` of them on top of the rest of its peak."""
    from compile_offload.passes.solve.recompute import budget_of_fraction

    x, w = torch.randn(16, 32), torch.randn(32, 32, requires_grad=True)
    analysis, base = capture_analysis(_matmul_then_sine, x, w)
    baseline = solve_greedy(analysis, base, flops_seconds, None).baseline
    saved_bytes = 16 * 32 * 4
    assert budget_of_fraction(analysis, baseline, 1.0) == baseline.peak_bytes
    assert budget_of_fraction(analysis, baseline, 0.5) == baseline.peak_bytes - saved_bytes // 2
    assert budget_of_fraction(analysis, baseline, 0.25) == baseline.peak_bytes - 3 * saved_bytes // 4
    assert budget_of_fraction(analysis, baseline, 0.0) == 0  # the minimum-memory plan, whatever it is


@pytest.mark.parametrize("seed", range(2))
def test_recompute_moves_kept_across_plans_match_fresh_ones(seed):
    """One RecomputeMoves walked through plans (random moves applied, jumps back to the
    start) yields exactly the moves a fresh one yields for each plan, skips included."""
    import random

    from compile_offload.passes.solve.recompute import PlanState, RecomputeMoves

    rng = random.Random(seed)
    blocks = nn.Sequential(*(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)))
    analysis, base = capture_analysis(lambda x: blocks(x).sum(), torch.randn(2, 8, 16, requires_grad=True))
    kept = RecomputeMoves(analysis, flops_seconds)
    saved = set(base)
    recomputed = recomputed_nodes(analysis, saved)
    for _ in range(30):
        skip = set(rng.sample(sorted(saved, key=analysis.position.__getitem__), 1)) if saved else set()
        moves = list(RecomputeMoves(analysis, flops_seconds)(saved, recomputed, skip))
        assert list(kept(saved, recomputed, skip)) == moves
        if not moves or rng.random() < 0.15:
            saved = set(base)
            recomputed = recomputed_nodes(analysis, saved)
        else:
            rng.choice(moves).apply(PlanState(saved, recomputed))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("told", [False, True])
def test_the_heap_of_moves_picks_what_comparing_them_all_picks(seed, told):
    """``RecomputeMoves.best`` (a heap, only changed storages worked out again) chooses
    ``best_move`` of every move listed, at each step of a sequence whose skipped storages
    only grow, as in a mixed sequence; ``told``: each step is told what the last move
    touched (``Move.touched``, as the sequences do) instead of comparing the plans whole."""
    import random

    from compile_offload.passes.solve.recompute import PlanState, RecomputeMoves, best_move

    rng = random.Random(seed)
    blocks = nn.Sequential(*(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)))
    analysis, base = capture_analysis(lambda x: blocks(x).sum(), torch.randn(2, 8, 16, requires_grad=True))
    kept = RecomputeMoves(analysis, flops_seconds)
    saved = set(base)
    state = PlanState(saved, recomputed_nodes(analysis, saved))
    skip: set = set()
    steps = 0
    changed = None
    while True:
        listed = list(RecomputeMoves(analysis, flops_seconds)(state.saved, state.recomputed, skip))
        expected = best_move(analysis, listed)
        chosen = kept.best(state.saved, state.recomputed, skip, changed=changed if told else None)
        assert chosen is expected or (chosen is not None and expected is not None
                                      and (chosen.group, chosen.added, chosen.closure)
                                      == (expected.group, expected.added, expected.closure))
        if chosen is None:
            break
        steps += 1
        if rng.random() < 0.2 and len(listed) > 1:  # a storage leaves the candidates for good
            skip.add(rng.choice([m.group.root for m in listed if m.group.root != chosen.group.root]))
            changed = set()
            continue
        chosen.apply(state)
        changed = chosen.touched()
    assert steps > 3


def test_with_no_plan_fitting_the_lowest_plan_simulated_is_chosen():
    """A search may read a plan lower than every candidate (a bump hid it from ``lowest``):
    below the minimum, that plan is the one chosen, and ``minimum`` reports it."""
    from compile_offload.passes.solve.recompute import Candidate, select

    torch.manual_seed(0)
    analysis, base = capture_analysis(chain_model(["sin", "linear", "relu"], 16), torch.randn(8, 16, requires_grad=True))
    saved = frozenset(base)
    candidates = [Candidate(saved, 0.0, 1000), Candidate(saved, 2e-6, 700)]
    passed_over = Candidate(saved, 3e-6, 600)
    solution = select(analysis, candidates, 100, None, lambda c: c, [*candidates, passed_over])
    assert not solution.feasible
    assert solution.chosen is passed_over and solution.minimum is passed_over
    # a plan that fits is still chosen among the candidates only
    solution = select(analysis, candidates, 800, None, lambda c: c, [*candidates, passed_over])
    assert solution.feasible and solution.chosen is candidates[1] and solution.minimum is passed_over


def test_the_exact_solvers_progress_says_how_many_plans_it_will_simulate(monkeypatch, capsys):
    """audit29a: exact_max_candidates has no upper limit (the user may ask for 2^N plans); a
    long exact search said how many plans it had simulated, not of how many."""
    from compile_offload.passes import progress

    monkeypatch.setattr(progress, "SHOW_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(progress, "EVERY_SECONDS", 0.0)
    torch.manual_seed(0)
    analysis, base = capture_analysis(chain_model(["linear", "tanh", "linear", "relu"], 8),
                                      torch.randn(4, 8, requires_grad=True))
    solve_exact(analysis, base, unit_seconds, None, max_candidates=12, progress=progress.Progress(graph_name="g"))
    lines = capsys.readouterr().err.splitlines()
    totals = {int(line.split(" of ")[1].split()[0]) for line in lines}
    counts = [int(line.split("planning, ")[1].split()[0]) for line in lines]
    assert len(lines) > 1 and len(totals) == 1
    total = totals.pop()
    assert total & (total - 1) == 0 and counts[-1] <= total  # 2^candidates, every subset
