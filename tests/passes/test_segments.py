"""Per-segment checkpointing as the search's second start (``passes/solve/segments.py``): where
the forward narrows, what the per-segment plan saves, and that the solver takes it only where
its own sequences found nothing within the budget, and then only when it is lower."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import compile_offload
from compile_offload.passes.cost import BUILTIN_PROFILES, node_seconds
from compile_offload.passes.memory import recomputed_nodes
from compile_offload.passes.offload import eligible_for_offload
from compile_offload.passes.solve import joint, segments
from compile_offload.passes.solve.joint import Evaluator, solve_joint

from ..models import check_training_parity
from .joint_capture import capture_analysis

SECONDS = functools.partial(node_seconds, profile=BUILTIN_PROFILES["h100"])


class ResidualMLP(nn.Module):
    """``x + mlp(norm(x))`` ``depth`` times: the residual stream is the only value between blocks."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


class SharedScale(nn.Module):
    """Every block reads one value computed from the input: no point between the blocks has
    a single storage live, so the forward is one segment at most: none to checkpoint apart."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        scale = x.sin()
        for layer in self.layers:
            x = x + torch.tanh(layer(x)) * scale
        return x.pow(2).mean()


class Bottleneck(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        mid = channels // 2
        self.body = nn.Sequential(
            nn.Conv2d(channels, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x):
        return torch.relu(x + self.body(x))


class ConvNet(nn.Module):
    """A stem, bottleneck blocks with BatchNorm, a head: the ResNet shape whose per-block
    checkpointing no single recompute move reaches."""

    def __init__(self, channels: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*(Bottleneck(channels) for _ in range(depth)))
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3))).pow(2).mean()


def _residual_mlp():
    torch.manual_seed(0)
    return capture_analysis(ResidualMLP(), torch.randn(4, 16, 32), fusion=True)


def _conv_net():
    torch.manual_seed(0)
    return capture_analysis(ConvNet(), torch.randn(4, 3, 32, 32), fusion=True)


def _without_segments(monkeypatch):
    monkeypatch.setattr(joint, "segment_sequence", lambda *args: [])


def test_the_boundaries_of_a_residual_stack_are_on_its_residual_stream():
    a, _ = _residual_mlp()
    cuts = segments.boundaries(a, segments.narrow_points(a))
    stream = 4 * 16 * 32 * 4  # batch x seq x width, float32
    residual = [cut for cut in cuts if cut.target is torch.ops.aten.add.Tensor]
    assert len(residual) >= 3 and all(a.storage_bytes(cut) == stream for cut in residual)  # between the blocks
    positions = [a.position[cut] for cut in cuts]
    assert positions == sorted(positions)


def test_a_value_every_block_reads_leaves_no_segment():
    torch.manual_seed(0)
    a, base = capture_analysis(SharedScale(), torch.randn(4, 16, 32), fusion=True)
    assert segments.segment_saved(a, base) is None
    assert segments.segment_sequence(a, base, SECONDS) == []


def test_the_plan_saves_the_boundaries_and_recomputes_what_lies_between():
    a, base = _residual_mlp()
    cuts = segments.boundaries(a, segments.narrow_points(a))
    saved = segments.segment_saved(a, base)
    assert set(cuts) <= set(saved)
    _, order = a.fw_needed_by_outputs
    place = {node: index for index, node in enumerate(order)}
    first, last = place[cuts[0]], place[cuts[-1]]
    inside = [t for t in saved if first < place.get(a.roots.get(t, t), -1) < last]
    assert set(inside) <= set(cuts)  # within the segments only the boundaries are saved
    recomputed = recomputed_nodes(a, set(saved))
    assert recomputed and not any(node in a.ban for node in recomputed)
    held = lambda tensors: sum(a.storage_bytes(root) for root in {a.roots.get(t, t) for t in tensors})  # noqa: E731
    assert held(saved) < held(base)


def test_where_nothing_fits_the_segments_lower_the_lowest_plan(monkeypatch):
    a, base = _conv_net()
    with_segments = solve_joint(a, base, SECONDS, 0, None, None)
    with monkeypatch.context() as patch:
        _without_segments(patch)
        without = solve_joint(a, base, SECONDS, 0, None, None)
    assert not without.feasible
    assert with_segments.chosen.peak_bytes < without.chosen.peak_bytes
    assert with_segments.from_segments and not without.from_segments
    assert with_segments.minimum.peak_bytes == with_segments.chosen.peak_bytes
    # Simulated exactly: a fresh evaluator gives the same peak.
    again = Evaluator(a, SECONDS, None, base).with_timeline(with_segments.chosen)
    assert again.peak_bytes == with_segments.chosen.peak_bytes
    # A budget at that plan's peak is met, where the search without segments met none.
    fitting = solve_joint(a, base, SECONDS, with_segments.chosen.peak_bytes, None, None)
    assert fitting.feasible and fitting.chosen.peak_bytes <= with_segments.chosen.peak_bytes


def test_with_offload_the_lowest_plan_is_never_higher(monkeypatch):
    a, base = _conv_net()
    options = joint.OffloadOptions(BUILTIN_PROFILES["h100"], lambda node: eligible_for_offload(node)[0])
    with_segments = solve_joint(a, base, SECONDS, 0, None, options)
    with monkeypatch.context() as patch:
        _without_segments(patch)
        without = solve_joint(a, base, SECONDS, 0, None, options)
    assert with_segments.chosen.peak_bytes <= without.chosen.peak_bytes
    again = Evaluator(a, SECONDS, options, base).with_timeline(with_segments.chosen)
    assert again.peak_bytes == with_segments.chosen.peak_bytes


def test_a_budget_the_search_meets_is_planned_without_segments(monkeypatch):
    a, base = _conv_net()
    baseline = solve_joint(a, base, SECONDS, None, None, None).chosen.peak_bytes
    budget = int(baseline * 0.8)

    def unexpected(*args):
        raise AssertionError("segments searched for a budget the search meets")

    monkeypatch.setattr(joint, "segment_sequence", unexpected)
    solution = solve_joint(a, base, SECONDS, budget, None, None)
    assert solution.feasible and not solution.from_segments


def test_the_plan_says_where_its_lowest_plan_came_from():
    torch.manual_seed(0)
    plan = compile_offload.explain(ConvNet(), torch.randn(4, 3, 32, 32), memory_budget=0.0, device_profile="h100")
    assert any("per-segment checkpointing" in note for note in plan.notes), plan.notes


@pytest.mark.inductor
@pytest.mark.slow
def test_the_per_segment_plan_trains_like_eager():
    """The conv net at budget 0.0, its plan from the segments, through Inductor (donated
    buffers: the backward may write into what it recomputes) for three optimizer steps in
    float64 against eager."""
    model = lambda: ConvNet().double()  # noqa: E731
    inputs = lambda: (torch.randn(2, 3, 16, 16, dtype=torch.float64),)  # noqa: E731
    backend = compile_offload.offload_remat(memory_budget=0.0, device_profile="h100")
    # Inductor's and AOTAutograd's caches would skip the partitioner on a hit.
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        result = check_training_parity(model, inputs, backend, rtol=1e-9, atol=1e-12, loss_fn=lambda out: out)
    assert result.graphs_compiled == 1
    from compile_offload.reporting.logs import latest_plans
    assert any("per-segment checkpointing" in note for note in latest_plans()[-1].notes)


@pytest.mark.parametrize("offload", [False, True], ids=["recompute-only", "offload"])
def test_the_choice_stays_monotone_in_the_budget(monkeypatch, offload):
    """Falling budgets across the range where the second start decides (from above the
    greedy's lowest plan to below per-segment checkpointing's): the predicted peak never
    rises and the predicted step time never falls."""
    a, base = _conv_net()
    options = joint.OffloadOptions(BUILTIN_PROFILES["h100"], lambda node: eligible_for_offload(node)[0]) if offload else None
    with monkeypatch.context() as patch:
        _without_segments(patch)
        greedy_lowest = solve_joint(a, base, SECONDS, 0, None, options).chosen.peak_bytes
    lowest = solve_joint(a, base, SECONDS, 0, None, options).chosen.peak_bytes
    top, bottom = int(greedy_lowest * 1.1), int(lowest * 0.95)
    budgets = [top - (top - bottom) * i // 11 for i in range(12)]
    solutions = [solve_joint(a, base, SECONDS, budget, None, options) for budget in budgets]
    peaks = [s.chosen.peak_bytes for s in solutions]
    seconds = [s.chosen.extra_seconds for s in solutions]
    assert all(later <= earlier for earlier, later in zip(peaks, peaks[1:])), peaks
    assert all(later >= earlier - 1e-12 for earlier, later in zip(seconds, seconds[1:])), seconds
    assert all(s.chosen.peak_bytes <= b for s, b in zip(solutions, budgets) if s.feasible)
    assert any(s.from_segments for s in solutions) or offload
