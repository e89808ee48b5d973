"""Per-segment checkpointing as the search's second start (``passes/solve/segments.py``): where
the forward narrows, what the per-segment plan saves, and that the solver takes it only where
its own sequences found nothing within the budget, and then only when it is lower."""

from __future__ import annotations

import copy
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

from .joint_capture import ResidualMLP, capture_analysis

SECONDS = functools.partial(node_seconds, profile=BUILTIN_PROFILES["h100"])


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
    def __init__(self, channels: int, act=nn.GELU, out_channels: int | None = None, stride: int = 1) -> None:
        super().__init__()
        out = out_channels or channels
        mid = out // 4 if out_channels else channels // 2
        self.body = nn.Sequential(
            nn.Conv2d(channels, mid, 1, bias=False), nn.BatchNorm2d(mid), act(),
            nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(mid), act(),
            nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out))
        self.down = (None if out == channels and stride == 1 else
                     nn.Sequential(nn.Conv2d(channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)))
        self.act = act()

    def forward(self, x):
        return self.act(self.body(x) + (x if self.down is None else self.down(x)))


class ConvNet(nn.Module):
    """A stem, bottleneck blocks with BatchNorm, a head: the ResNet shape whose per-block
    checkpointing no single recompute move reaches."""

    def __init__(self, channels: int = 16, depth: int = 4, act=nn.GELU) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), act())
        self.blocks = nn.Sequential(*(Bottleneck(channels, act) for _ in range(depth)))
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3))).pow(2).mean()


class ReLUBottleneck(nn.Module):
    def __init__(self, channels: int, mid: int, stride: int = 1, inputs: int | None = None) -> None:
        super().__init__()
        inputs = inputs or channels
        self.c1, self.b1 = nn.Conv2d(inputs, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.c2, self.b2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.c3, self.b3 = nn.Conv2d(mid, channels, 1, bias=False), nn.BatchNorm2d(channels)
        self.down = (None if stride == 1 and inputs == channels else
                     nn.Sequential(nn.Conv2d(inputs, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels)))

    def forward(self, x):
        h = nn.functional.relu(self.b1(self.c1(x)))
        h = nn.functional.relu(self.b2(self.c2(h)))
        h = self.b3(self.c3(h))
        return nn.functional.relu(h + (x if self.down is None else self.down(x)))


class ReLUResNet(nn.Module):
    """Bottlenecks with ReLU after BatchNorm, a downsampling stage, cross-entropy: where a
    recomputed ReLU mask once flipped (``segments.masks_kept``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(ReLUBottleneck(32, 8, inputs=16), ReLUBottleneck(32, 8),
                                    ReLUBottleneck(64, 16, stride=2, inputs=32), ReLUBottleneck(64, 16))
        self.fc = nn.Linear(64, 10)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.fc(self.blocks(self.stem(x)).mean((2, 3))), y)


def _residual_mlp():
    torch.manual_seed(0)
    return capture_analysis(ResidualMLP(), torch.randn(4, 16, 32), fusion=True)


def _conv_net():
    torch.manual_seed(0)
    return capture_analysis(ConvNet(), torch.randn(4, 3, 32, 32), fusion=True)


# The C++ backend's profile: where the conv net's lowest plan comes from the segments.
CPU_SECONDS = functools.partial(node_seconds, profile=BUILTIN_PROFILES["cpu"])


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
    with_segments = solve_joint(a, base, CPU_SECONDS, 0, None, None)
    with monkeypatch.context() as patch:
        _without_segments(patch)
        without = solve_joint(a, base, CPU_SECONDS, 0, None, None)
    assert not without.feasible
    assert with_segments.chosen.peak_bytes < without.chosen.peak_bytes
    assert with_segments.from_segments and not without.from_segments
    assert with_segments.minimum.peak_bytes == with_segments.chosen.peak_bytes
    # Simulated exactly: a fresh evaluator gives the same peak.
    again = Evaluator(a, CPU_SECONDS, None, base).with_timeline(with_segments.chosen)
    assert again.peak_bytes == with_segments.chosen.peak_bytes
    # A budget at that plan's peak is met, where the search without segments met none.
    fitting = solve_joint(a, base, CPU_SECONDS, with_segments.chosen.peak_bytes, None, None)
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
    plan = compile_offload.explain(ConvNet(), torch.randn(4, 3, 32, 32), memory_budget=0.0, device_profile="cpu")
    assert any("per-segment checkpointing" in note for note in plan.notes), plan.notes


@pytest.mark.inductor
@pytest.mark.slow
def test_a_per_segment_plan_gives_eager_gradients_in_float32_at_every_step():
    """A float32 ReLU ResNet at budget 0.0, its plan from the segments, through Inductor:
    three AdamW steps, each from the eager run's parameters, on the batches of the sweep that
    found a flipped mask (step ``s`` from seed 900 + 10 s); each step's gradients equal
    eager's. Its ReLU masks are saved from the forward (``segments.masks_kept``): recomputed in
    another kernel, one flipped at the second step on one machine and put the gradients 6e-4
    off. Each step starts from eager's parameters because AdamW's first steps move every
    element by about its learning rate whatever its gradient's size, so rounding-level
    differences on the smallest gradients (5e-6 of each tensor's largest, as plain
    torch.compile's) would otherwise compound into 1e-2 by the third step on some CPUs."""
    torch.manual_seed(0)
    model = ReLUResNet()
    compiled_model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    errors = []
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(compiled_model, backend=compile_offload.offload_remat(memory_budget=0.0))
        for step in range(3):
            compiled_model.load_state_dict(model.state_dict())  # eager's parameters and statistics
            generator = torch.Generator().manual_seed(900 + 10 * step)
            x, y = torch.randn(4, 3, 16, 16, generator=generator), torch.randint(0, 10, (4,), generator=generator)
            optimizer.zero_grad(set_to_none=True)
            compiled_model.zero_grad(set_to_none=True)
            model(x, y).backward()
            compiled(x, y).backward()
            errors.append(max(((p.grad - q.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item()
                              for p, q in zip(model.parameters(), compiled_model.parameters())))
            optimizer.step()
    from compile_offload.reporting.logs import latest_plans
    plan = latest_plans()[-1]
    assert any("per-segment checkpointing" in note for note in plan.notes)
    masks = [d for d in plan.decisions if "bool" in d.dtype]
    assert masks and all(d.decision == "keep" for d in masks), plan.table()
    assert max(errors) <= 1e-4, errors


@pytest.mark.parametrize("offload", [False, True], ids=["recompute-only", "offload"])
def test_the_choice_stays_monotone_in_the_budget(monkeypatch, offload):
    """Falling budgets across the range where the second start decides (from above the
    greedy's lowest plan to below per-segment checkpointing's): the predicted peak never
    rises and the predicted step time never falls."""
    a, base = _conv_net()
    options = joint.OffloadOptions(BUILTIN_PROFILES["h100"], lambda node: eligible_for_offload(node)[0]) if offload else None
    seconds = SECONDS if offload else CPU_SECONDS
    with monkeypatch.context() as patch:
        _without_segments(patch)
        greedy_lowest = solve_joint(a, base, seconds, 0, None, options).chosen.peak_bytes
    lowest = solve_joint(a, base, seconds, 0, None, options).chosen.peak_bytes
    top, bottom = int(greedy_lowest * 1.1), int(lowest * 0.95)
    budgets = [top - (top - bottom) * i // 11 for i in range(12)]
    solutions = [solve_joint(a, base, seconds, budget, None, options) for budget in budgets]
    peaks = [s.chosen.peak_bytes for s in solutions]
    times = [s.chosen.extra_seconds for s in solutions]
    assert all(later <= earlier for earlier, later in zip(peaks, peaks[1:])), peaks
    assert all(later >= earlier - 1e-12 for earlier, later in zip(times, times[1:])), times
    assert all(s.chosen.peak_bytes <= b for s, b in zip(solutions, budgets) if s.feasible)
    assert any(s.from_segments for s in solutions) or offload
