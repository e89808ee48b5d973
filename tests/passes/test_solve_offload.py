"""Keep / recompute / offload on constructed graphs and profiles whose answer is known."""

import functools
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from compile_offload.passes.cost import DeviceProfile, node_seconds
from compile_offload.passes.memory import plan_program, recomputed_nodes, simulate
from compile_offload.passes.offload import eligible_for_offload
from compile_offload.passes.solve.recompute import solve_greedy, step_seconds
from compile_offload.passes import progress
from compile_offload.passes.solve.joint import OffloadOptions, offloadable, solve_joint
from compile_offload.passes.solve.peak import peak_moves

from .joint_capture import CHAIN_OPS, Tower, capture_analysis, chain_model, encoder_stack


def profile(flops: float, link: float) -> DeviceProfile:
    return DeviceProfile(f"test-{flops:g}-{link:g}", {"float32": flops}, memory_bandwidth=1e10,
                         d2h_bandwidth=link, h2d_bandwidth=link, launch_overhead_seconds=1e-6)


# Slow matmuls and a fast link: compute hides every copy, recomputing costs a matmul.
HIDING = profile(flops=1e9, link=1e12)
# Fast matmuls and a slow link: a copy would take seconds, recomputing microseconds.
EXPOSING = profile(flops=1e15, link=1e6)


@functools.cache
def tower():
    torch.manual_seed(0)
    # A large batch: activations dominate the peak, not parameter gradients.
    return capture_analysis(Tower(128, 5), torch.randn(4096, 128))


def options(device, prefetch=True):
    return OffloadOptions(device, lambda node: eligible_for_offload(node)[0], prefetch)


def solve(device, budget_fraction=None, budget_bytes=None, prefetch=True, model=None):
    analysis, base = model or tower()
    seconds = functools.partial(node_seconds, profile=device)
    solution = solve_joint(analysis, base, seconds, budget_bytes, budget_fraction, options(device, prefetch))
    return analysis, base, seconds, solution


def newly_recomputed(analysis, base, saved):
    return recomputed_nodes(analysis, set(saved)) - recomputed_nodes(analysis, set(base))


def test_offload_is_chosen_when_compute_hides_the_copy():
    analysis, base, _, solution = solve(HIDING, budget_fraction=0.6)
    chosen = solution.chosen
    assert solution.budget_bytes < solution.baseline.peak_bytes, "the budget binds"
    assert solution.feasible and chosen.peak_bytes <= solution.budget_bytes
    assert chosen.offloaded, "copies hidden behind slow matmuls are the free way down"
    assert not newly_recomputed(analysis, base, chosen.saved), "so nothing is recomputed"
    assert chosen.transfers.exposed_seconds == 0.0
    assert set(solution.offloaded) == set(chosen.offloaded), "every offload has its reason"


def test_recompute_is_chosen_when_the_copy_would_be_exposed():
    # Recompute alone reaches this budget here (each weight gradient needs its layer's input).
    analysis, base, _, solution = solve(EXPOSING, budget_fraction=0.8)
    assert solution.feasible
    assert not solution.chosen.offloaded, "a 1 MB/s link would expose seconds of copies"
    assert newly_recomputed(analysis, base, solution.chosen.saved)


def test_long_solves_report_progress(monkeypatch, caplog, capsys):
    monkeypatch.setattr(progress, "SHOW_AFTER_SECONDS", 0.0)  # from the start,
    monkeypatch.setattr(progress, "EVERY_SECONDS", 0.0)  # every plan
    with caplog.at_level(logging.INFO, logger="compile_offload.solver"):
        solve(HIDING, budget_fraction=0.6)
    lines = [r.getMessage() for r in caplog.records if r.name == "compile_offload.solver"]
    counts = [int(line.split("planning, ")[1].split()[0]) for line in lines]
    assert len(counts) > 1 and counts == sorted(counts) and len(set(counts)) == len(counts)
    assert capsys.readouterr().err.splitlines() == lines, "the same lines on stderr"


def test_no_progress_for_short_solves(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="compile_offload.solver"):
        solve(HIDING, budget_fraction=0.6)
    assert not [r for r in caplog.records if r.name == "compile_offload.solver"]
    assert "planning," not in capsys.readouterr().err


@pytest.mark.parametrize("device", [HIDING, EXPOSING], ids=["hiding", "exposing"])
def test_everything_is_kept_when_the_budget_allows(device):
    for fraction in (None, 1.0):
        analysis, base, _, solution = solve(device, budget_fraction=fraction)
        assert solution.chosen.saved == frozenset(base) and not solution.chosen.offloaded
        assert solution.chosen.extra_seconds == 0.0


def test_without_prefetch_reloads_wait_at_their_first_use():
    analysis, base, _, solution = solve(HIDING, budget_fraction=0.6, prefetch=False)
    transfers = solution.chosen.transfers
    assert solution.chosen.offloaded
    assert all(transfers.reload_distance[t] == 0 for t in solution.chosen.offloaded)
    assert transfers.backward_exposed_seconds > 0, "each reload's copy is waited for in full"


def test_predicted_time_and_peak_are_those_of_the_chosen_plan():
    analysis, base, seconds, solution = solve(HIDING, budget_fraction=0.7)
    chosen, transfers = solution.chosen, solution.chosen.transfers
    added = step_seconds(analysis, chosen.saved, seconds) - step_seconds(analysis, base, seconds)
    assert chosen.extra_seconds == pytest.approx(added + (transfers.added_seconds if transfers else 0.0))
    program = plan_program(analysis, set(chosen.saved), set(chosen.offloaded), fusion=analysis.fusion,
                           reload_distance=transfers.reload_distance if transfers else None,
                           offload_wait_after=transfers.offload_wait_after if transfers else None)
    assert simulate(program).peak_bytes == chosen.peak_bytes == chosen.timeline.peak_bytes


def test_offload_off_is_the_recompute_solver():
    analysis, base = tower()
    seconds = functools.partial(node_seconds, profile=HIDING)
    joint = solve_joint(analysis, base, seconds, None, 0.8, offload=None)
    greedy = solve_greedy(analysis, base, seconds, None, 0.8, more_moves=peak_moves)  # the sequences solve_joint adds
    assert joint.chosen.saved == greedy.chosen.saved and not joint.chosen.offloaded


def returns_an_activation(x):
    """``h`` and ``g`` are saved for the backward; ``h`` is also a user output."""
    h = torch.tanh(x @ x.t())
    g = torch.tanh(h @ x)
    return (g @ x).sum(), h


def test_inputs_outputs_and_views_are_never_offloaded():
    analysis, base = capture_analysis(returns_an_activation, torch.randn(256, 256, requires_grad=True))
    outputs = {analysis.roots.get(o, o) for o in analysis.fw_outputs}
    everything = offloadable(analysis, base, set(), lambda node: True)
    assert [t.name for t in everything] == ["tanh_1"], "g, not the output h nor the input x"
    for tensor in everything:
        assert tensor.op == "call_function" and tensor not in outputs
        assert analysis.roots.get(tensor, tensor) is tensor, "storage owners only"
    _, _, _, solution = solve(HIDING, budget_bytes=0, model=(analysis, base))
    assert not (solution.chosen.offloaded & outputs)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.sampled_from(CHAIN_OPS), min_size=2, max_size=7),
    link_exponent=st.floats(4.0, 12.0),
    fractions=st.lists(st.floats(0.0, 1.0), min_size=3, max_size=6),
)
def test_monotone_in_the_budget_and_never_slower_than_recompute_only(ops, link_exponent, fractions):
    torch.manual_seed(0)
    analysis, base = capture_analysis(chain_model(ops, 32), torch.randn(256, 32, requires_grad=True))
    device = profile(flops=1e10, link=10**link_exponent)
    seconds = functools.partial(node_seconds, profile=device)
    unconstrained = solve_joint(analysis, base, seconds, None, None, options(device))
    budgets = sorted({int(f * unconstrained.baseline.peak_bytes) for f in fractions}, reverse=True)
    peaks = []
    for budget in budgets:
        solution = solve_joint(analysis, base, seconds, budget, None, options(device))
        peaks.append(solution.chosen.peak_bytes)
        assert solution.feasible == (solution.chosen.peak_bytes <= budget)
        greedy = solve_greedy(analysis, base, seconds, budget)
        if greedy.feasible:
            assert solution.feasible
            ours = solution.chosen.extra_seconds
            assert ours <= step_seconds(analysis, greedy.chosen.saved, seconds) - step_seconds(analysis, base, seconds)
        assert solution.minimum.peak_bytes <= greedy.minimum.peak_bytes
    assert all(later <= earlier for earlier, later in zip(peaks, peaks[1:])), (budgets, peaks)



def _mixed_sequence(monkeypatch, refresh):
    """A mixed sequence on a two-layer transformer with ``LINK_REFRESH`` set to
    ``refresh``: (analysis, base saved set, seconds, its moves, how many saved sets'
    facts the offload costs read)."""
    from compile_offload.passes.solve import joint as solve_offload
    from compile_offload.passes.cost import BUILTIN_PROFILES
    from compile_offload.passes.solve.joint import SavedSetCache, mixed_moves

    monkeypatch.setattr(solve_offload, "LINK_REFRESH", refresh)
    analysis, base = encoder_stack(layers=2, width=32, heads=2, ff=64, batch=4, seq=32)
    seconds = functools.partial(node_seconds, profile=BUILTIN_PROFILES["h100"])
    read = set()
    original = SavedSetCache.__call__

    def counting(self, saved):
        facts = original(self, saved)
        read.add(id(facts))
        return facts

    monkeypatch.setattr(SavedSetCache, "__call__", counting)
    moves = list(mixed_moves(analysis, base, seconds, options(BUILTIN_PROFILES["h100"])))
    return analysis, base, seconds, moves, len(read)


def test_offload_costs_on_fresh_schedules_are_the_link_estimate(monkeypatch):
    """Schedules derived again at every step: each chosen offload move costs what
    ``LinkEstimate`` says on the schedules of the plan it was chosen in."""
    from compile_offload.passes.cost import BUILTIN_PROFILES
    from compile_offload.passes.solve.recompute import PlanState
    from compile_offload.passes.solve.joint import SavedSetFacts
    from compile_offload.passes.transfer import LinkEstimate

    analysis, base, seconds, moves, _ = _mixed_sequence(monkeypatch, refresh=-1.0)
    assert {m.kind for m in moves} == {"offload", "recompute"}
    state = PlanState(set(base), recomputed_nodes(analysis, set(base)))
    for move in moves:
        if move.kind == "offload":
            facts = SavedSetFacts(analysis, frozenset(state.saved), seconds)
            forward, backward = facts.schedules
            link = LinkEstimate(analysis, forward, backward, state.offloaded, BUILTIN_PROFILES["h100"], True,
                                facts.first_uses)
            tensor = move.group.root
            expected = sum(max(0.0, s) for s in link.marginal(tensor)) + link.launch_seconds(tensor)
            assert move.extra_seconds == expected
        move.apply(state)


def test_offload_costs_keep_schedules_across_recompute_moves(monkeypatch):
    """By default the schedules are derived again only as recompute time accumulates:
    fewer derivations than recompute moves, and the sequence still offloads."""
    _, _, _, moves, derived = _mixed_sequence(monkeypatch, refresh=0.01)
    recompute_moves = sum(m.kind == "recompute" for m in moves)
    assert any(m.kind == "offload" for m in moves)
    assert derived < recompute_moves, (derived, recompute_moves)


@pytest.mark.parametrize("told", [False, True])
@pytest.mark.parametrize("refresh", [-1.0, 0.01])
def test_the_best_offload_move_is_the_best_of_every_offload_move(monkeypatch, refresh, told):
    """``OffloadCosts.best`` (offloadable storages kept up to date, moves in a heap) picks
    ``best_move`` of every offloadable storage's move at each step of a mixed sequence;
    ``told``: told what the last move touched, as ``mixed_moves`` tells it."""
    from compile_offload.passes.cost import BUILTIN_PROFILES
    from compile_offload.passes.solve.recompute import PlanState, best_move
    from compile_offload.passes.solve.joint import OffloadCosts, Offloadable, SavedSetCache

    analysis, base, seconds, moves, _ = _mixed_sequence(monkeypatch, refresh)
    h100 = options(BUILTIN_PROFILES["h100"])
    state = PlanState(set(base), recomputed_nodes(analysis, set(base)))
    saved_sets = SavedSetCache(analysis, seconds)
    heap = OffloadCosts(analysis, h100, saved_sets, state.saved)
    listing = OffloadCosts(analysis, h100, saved_sets, state.saved)
    offloadable_now = Offloadable(analysis, h100.eligible)
    offered = 0
    changed = None
    for move in moves:
        chosen = heap.best(state.saved, state.offloaded, changed if told else None)
        expected = best_move(analysis, listing.moves(offloadable_now(state.saved, state.offloaded), state.offloaded))
        assert chosen is expected or (chosen.group.root is expected.group.root
                                      and chosen.extra_seconds == expected.extra_seconds)
        offered += chosen is not None
        move.apply(state)
        changed = move.touched()
        heap.moved(move)
        listing.moved(move)
    assert offered > 3
