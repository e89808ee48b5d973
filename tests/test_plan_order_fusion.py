"""``compile_offload.inductor.plan_order_fusion``: under a budget Inductor refuses a horizontal fusion
that would run a kernel ahead of its place; without one it fuses as ``torch.compile`` does."""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from torch import nn

import compile_offload
from compile_offload.inductor import plan_order_fusion
from compile_offload.inductor.plan_order_fusion import keeping_plan_order, plan_order_choices, pulls_ahead


def _node(name: str, order: int, ancestors: tuple[str, ...] = (), members: tuple[str, ...] = ()):
    """A stand-in for a scheduler node: a fused one spans ``order`` to its last member."""
    names = members or (name,)
    last = order + len(names) - 1
    node = SimpleNamespace(min_order=order, max_order=last, ancestors=set(ancestors))
    node.get_name = lambda: name
    node.get_nodes = lambda: [SimpleNamespace(get_name=lambda n=n: n) for n in names]
    return node


def _scheduler(*nodes):
    fused = {}
    for node in nodes:
        for member in node.get_nodes():
            fused[member.get_name()] = node
    return SimpleNamespace(name_to_fused_node=fused)


def test_a_pair_whose_later_node_waits_for_a_kernel_after_the_earlier_one_pulls_it_ahead():
    a = _node("a", 0)
    mm = _node("mm", 1)
    b = _node("b", 2, ancestors=("mm",))
    scheduler = _scheduler(a, mm, b)
    assert pulls_ahead(scheduler, a, b) and pulls_ahead(scheduler, b, a)  # either way round


def test_a_pair_whose_later_node_waits_only_for_what_runs_by_then_pulls_nothing():
    # a spans orders 0-2 (fused with two more nodes); mm at 1 is inside that span.
    a = _node("a", 0, members=("a0", "mm_user", "a2"))
    mm = _node("mm", 1)
    b = _node("b", 3, ancestors=("mm", "a0"))
    assert not pulls_ahead(_scheduler(a, mm, b), a, b)


def test_the_wrapped_handler_still_answers_first():
    from torch._inductor.choices import InductorChoices

    asked = []

    class UsersChoices(InductorChoices):
        def __init__(self, answer: bool) -> None:
            self.answer = answer

        @staticmethod
        def can_fuse_horizontal(scheduler, node1, node2, shared_data_score):
            asked.append(shared_data_score)
            return node1.min_order != 99

    a, b = _node("a", 0), _node("b", 1)  # nothing pulled
    scheduler = _scheduler(a, b)
    choices = plan_order_choices(UsersChoices(True))
    assert isinstance(choices, UsersChoices) and choices.answer is True
    assert choices.can_fuse_horizontal(scheduler, a, b, 7) and asked == [7]
    assert not choices.can_fuse_horizontal(scheduler, _node("c", 99), b, 8)  # the user's refusal stands
    assert plan_order_choices(choices) is choices  # wrapped once


def _fused_kernel_names(inner_compile) -> list[str]:
    """The C++ kernels Inductor generates for ``sin(x)`` and ``cos(x) * (z @ w)``: the two
    pointwise nodes only share x, and the second waits for the matmul placed after the first."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import run_and_get_code

    def step(x, z, w):
        return x.sin(), x.cos() * (z @ w)

    torch._dynamo.reset()
    inputs = [torch.randn(32, 32) for _ in range(3)]
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(step, backend=lambda gm, example: compile_fx(gm, example, inner_compile=inner_compile))
        _, code = run_and_get_code(compiled, *inputs)
    return sorted(set(re.findall(r"(cpp_fused_\w+)\(", "\n".join(code))))


def test_inductor_keeps_the_pair_apart_only_under_the_rule():
    from torch._inductor.compile_fx import compile_fx_inner

    assert _fused_kernel_names(compile_fx_inner) == ["cpp_fused_cos_mul_sin_0"]  # the matmul moved up
    apart = _fused_kernel_names(keeping_plan_order(compile_fx_inner))
    assert len(apart) == 2 and any("sin" in name and "cos" not in name for name in apart)


def test_the_backend_installs_the_rule_under_a_budget_only(monkeypatch):
    asked = []
    original = plan_order_fusion.pulls_ahead

    def counting(scheduler, node1, node2):
        asked.append((node1, node2))
        return original(scheduler, node1, node2)

    monkeypatch.setattr(plan_order_fusion, "pulls_ahead", counting)

    class Fork(nn.Module):  # sin(h) and cos(h) * lin(h) share h: a horizontal fusion to decide
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            h = self.first(x)
            return torch.cat([h.sin(), h.cos() * self.second(h)])

    model, x = Fork(), torch.randn(16, 32)
    for budget, expect_asked in ((None, False), (10**9, True)):
        asked.clear()
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(model, backend=compile_offload.offload_remat(memory_budget=budget,
                                                                                    device_profile="cpu"))
            compiled(x).sum().backward()
        assert bool(asked) == expect_asked, budget


def test_the_speed_benchmark_compiles_the_same_plan_both_ways():
    """``benchmarks/fusion_rule.py`` times one plan with and without the rule; the planner's
    model is the same both ways, so the plan is (no time is asserted)."""
    from compile_offload.benchmarks import fusion_rule

    row = fusion_rule.compare("transformer", 0.8, "cpu", steps=1)
    assert row.startswith("| transformer | 0.8 |") and row.rstrip().endswith("| same plan |"), row
    assert plan_order_fusion.keeping_plan_order is keeping_plan_order  # put back
