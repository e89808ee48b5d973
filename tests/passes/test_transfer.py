"""Keep / recompute / offload on constructed graphs and profiles whose answer is known."""

import pytest
import torch
import torch.nn as nn

from passes.cost import DeviceProfile, node_seconds
from passes.memory import recomputed_nodes
from passes.offload import eligible_for_offload
from passes.solve import OffloadOptions, solve_greedy
from passes.transfer import plan_transfers

from .joint_capture import capture_analysis


class Tower(nn.Module):
    """tanh(linear(...)) five times: each tanh output is saved for the backward and is
    recomputable only by redoing a matmul."""

    def __init__(self, width=128, depth=5):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.mean()


def profile(link_bytes_per_second: float) -> DeviceProfile:
    """Slow compute (matmuls take milliseconds), and a link of the given speed."""
    return DeviceProfile(
        name=f"test-link-{link_bytes_per_second:g}",
        flops_per_second={"float32": 1e9},
        memory_bandwidth=1e10,
        d2h_bandwidth=link_bytes_per_second,
        h2d_bandwidth=link_bytes_per_second,
        launch_overhead_seconds=1e-6,
    )


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    # A large batch: activations dominate the peak, not parameter gradients.
    return capture_analysis(Tower(), torch.randn(4096, 128))


def solve(tower, link: float, fraction):
    analysis, base = tower
    device = profile(link)

    def seconds(node):
        return node_seconds(node, device)

    options = OffloadOptions(device, lambda node: eligible_for_offload(node)[0])
    return analysis, seconds, device, solve_greedy(analysis, base, seconds, None, fraction, options)


def test_offload_is_chosen_when_compute_hides_the_copy(tower):
    analysis, seconds, device, solution = solve(tower, link=1e12, fraction=0.6)
    chosen = solution.chosen
    assert solution.feasible and chosen.offloaded, "a fast link makes offload the cheapest way down"
    assert not (solution.baseline.saved - chosen.saved), "nothing needed recomputing"
    assert chosen.transfers.exposed_seconds == pytest.approx(0.0, abs=1e-6)
    assert chosen.extra_seconds < 1e-4


def test_recompute_is_chosen_when_the_copy_would_be_exposed(tower):
    # Recompute alone reaches 85% here (every layer needs its input for its weight gradient).
    analysis, seconds, device, solution = solve(tower, link=1e5, fraction=0.85)
    chosen = solution.chosen
    assert solution.feasible
    assert not chosen.offloaded, "a 100 kB/s link exposes every copy: recompute is cheaper"
    assert recomputed_nodes(analysis, set(chosen.saved)) - recomputed_nodes(analysis, set(solution.baseline.saved))


def test_everything_is_kept_when_the_budget_allows(tower):
    analysis, seconds, device, solution = solve(tower, link=1e12, fraction=None)
    assert solution.chosen.saved == solution.baseline.saved and not solution.chosen.offloaded


def test_transfer_model_exposes_copies_only_when_the_link_is_slow(tower):
    analysis, base = tower
    saved = set(base)
    big = max((n for n in saved if n.op == "call_function"), key=lambda n: analysis.bytes_of.get(n, 0))
    fast, slow = profile(1e12), profile(1e5)
    hidden = plan_transfers(analysis, saved, {big}, lambda n: node_seconds(n, fast), fast)
    exposed = plan_transfers(analysis, saved, {big}, lambda n: node_seconds(n, slow), slow)
    assert hidden.exposed_seconds == pytest.approx(0.0, abs=1e-9)
    nbytes = analysis.bytes_of[big]
    assert exposed.exposed_seconds > nbytes / 1e5  # at least one direction's copy is exposed
    assert hidden.reload_distance[big] >= 1


def test_without_prefetch_reloads_start_at_first_use(tower):
    analysis, base = tower
    saved = set(base)
    big = max((n for n in saved if n.op == "call_function"), key=lambda n: analysis.bytes_of.get(n, 0))
    device = profile(1e9)
    plan = plan_transfers(analysis, saved, {big}, lambda n: node_seconds(n, device), device, prefetch=False)
    assert plan.reload_distance[big] == 0


@pytest.mark.parametrize("inner_compiler", ["eager", pytest.param("inductor", marks=[pytest.mark.inductor, pytest.mark.slow])])
def test_planned_offload_trains_like_eager(inner_compiler, monkeypatch, captured_plans):
    """End to end: the solver offloads (a fast-link profile makes that the cheapest way to
    the budget), the backend inserts the copies, and training matches eager."""
    import compile_offload
    from passes import cost

    from ..models import check_training_parity

    monkeypatch.setitem(cost.BUILTIN_PROFILES, "h100", profile(1e12))
    backend = compile_offload.offload_remat(inner_compiler=inner_compiler, memory_budget=0.6, device_profile="h100")
    check_training_parity(Tower, lambda: (torch.randn(4096, 128),), backend, steps=2)
    (plan,) = captured_plans
    assert plan.feasible and plan.count("offload") >= 2, plan.summary()
    assert plan.count("recompute") == 0
