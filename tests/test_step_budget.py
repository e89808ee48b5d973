"""``budget_scope="step"``: one byte budget for a training step Dynamo compiles into several
graphs (``runtime/step_budget.py``).

The split (each graph the same share of its plan range, calls counted) and its edges on
figures; the counting of a step's calls and the recompiles on stand-in compiled graphs; and
a model with two graph breaks on Inductor, whose measured step peak is over the budget with
each graph given the whole budget and within it once the budget is the step's, with eager's
gradients throughout.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import compile_offload
from compile_offload.passes.plan import Decision, Plan
from compile_offload.runtime.step_budget import GraphNeed, StepBudget, need_of, split_budget, split_budget_over_steps

from .models import CompiledFunction

MIB = 2**20


def test_each_graph_gets_the_same_share_of_its_range_with_its_calls_counted():
    needs = [GraphNeed("a", 1, 10 * MIB, 20 * MIB), GraphNeed("b", 2, 5 * MIB, 7 * MIB)]
    shares, share = split_budget(24 * MIB, needs)  # floor 20, room 10 + 2 x 2 = 14
    assert share == pytest.approx(4 / 14)
    assert shares["a"] == 10 * MIB + int(share * 10 * MIB) and shares["b"] == 5 * MIB + int(share * 2 * MIB)
    assert shares["a"] + 2 * shares["b"] <= 24 * MIB  # the bound: calls x share, summed
    # Room for every graph unconstrained: the rest shared per call.
    shares, share = split_budget(40 * MIB, needs)
    assert share == 1.0 and shares == {"a": 22 * MIB, "b": 9 * MIB}
    # Below the minimum-memory plans: each keeps its minimum.
    shares, share = split_budget(19 * MIB, needs)
    assert share < 0 and shares == {"a": 10 * MIB, "b": 5 * MIB}


def test_graphs_that_never_run_in_one_step_are_not_summed():
    """A GAN's discriminator step and generator step (or a module frozen in some steps, whose
    frame then runs another compile): each kind of step is bounded, not the sum of every
    graph's most calls; the tightest kind sets the one share."""
    needs = [GraphNeed("d", 2, 4 * MIB, 8 * MIB), GraphNeed("g", 1, 6 * MIB, 10 * MIB),
             GraphNeed("d_frozen", 1, 5 * MIB, 9 * MIB)]
    steps = [frozenset({("d", 2)}), frozenset({("g", 1), ("d_frozen", 1)})]
    shares, share = split_budget_over_steps(16 * MIB, needs, steps)  # floors 8 and 11 (summed: 19)
    assert share == pytest.approx(min((16 - 8) / 8, (16 - 11) / 8))
    assert 2 * shares["d"] <= 16 * MIB and shares["g"] + shares["d_frozen"] <= 16 * MIB
    assert split_budget(16 * MIB, needs)[1] < 0  # every graph in one step: below the minimum plans
    # room above every kind's unconstrained plans: the least of it per call
    # (the first kind leaves (30 - 16) / 2 = 7 MiB a call, the second (30 - 19) / 2 = 5.5)
    shares, share = split_budget_over_steps(30 * MIB, needs, steps)
    assert share == 1.0 and shares == {"d": 8 * MIB + 11 * MIB // 2, "g": 10 * MIB + 11 * MIB // 2,
                                       "d_frozen": 9 * MIB + 11 * MIB // 2}
    assert 2 * shares["d"] <= 30 * MIB and shares["g"] + shares["d_frozen"] <= 30 * MIB
    # without kinds of step, or a graph in none of them, it counts with its calls in each
    assert split_budget_over_steps(16 * MIB, needs, []) == split_budget(16 * MIB, needs)
    shares, share = split_budget_over_steps(16 * MIB, needs, [frozenset({("d", 2)})])
    assert share < 0


def _graphs_d_and_g(budget: StepBudget):
    """Graphs d and g in ``budget``, each of range 7 to 10 MiB; the shares they compile under."""
    calls: list[str] = []
    shares: dict[str, int] = {}

    def add(name: str):
        def recompile(share: int, args: tuple):
            shares[name] = share
            return _stand_in(calls, name), lambda: _plan(7 * MIB, 10 * MIB)

        return budget.add(name, _stand_in(calls, name), lambda: _plan(7 * MIB, 10 * MIB), recompile)

    return add("d"), add("g"), shares


def test_a_step_budget_over_alternating_steps_splits_for_each_kind_of_step():
    """Two graphs never called in one step (fuzz29b: a GAN loop under budget_scope='step'):
    their minimum plans summed were over the budget, so strict_budget raised and every graph
    stayed at its minimum; each step alone fits."""
    d, g, shares = _graphs_d_and_g(StepBudget(12 * MIB, strict=True))
    x = torch.ones(4, requires_grad=True)
    for _ in range(3):
        d(x).sum().backward()  # the discriminator's step
        g(x).sum().backward()  # the generator's
    assert shares == {"d": 12 * MIB, "g": 12 * MIB}  # each step alone: the whole budget


def test_graphs_split_for_in_different_steps_then_called_in_one_split_again():
    """review29d: steps of d alone, then g alone, then both: the split had bounded only the
    kinds of step it was made for (each graph the whole budget), and the mixed step ran at
    twice the budget; a step no kind split for covers is split for again."""
    d, g, shares = _graphs_d_and_g(StepBudget(20 * MIB))
    x = torch.ones(4, requires_grad=True)
    for _ in range(2):
        d(x).sum().backward()
        g(x).sum().backward()
    assert shares == {"d": 20 * MIB, "g": 20 * MIB}
    for _ in range(2):
        (d(x) + g(x)).sum().backward()  # one step of both
    assert shares["d"] + shares["g"] <= 20 * MIB


def _plan(min_bytes: int, max_bytes: int, scheduled: int | None = None, fallback: str | None = None) -> Plan:
    decisions = [] if fallback else [Decision("t", (4,), "float32", 16, "recompute", "r")]
    return Plan(feasible=True, budget_bytes=None, predicted_peak_bytes=min_bytes, predicted_step_seconds=0.0,
                baseline_peak_bytes=max_bytes, baseline_step_seconds=0.0, min_peak_bytes=min_bytes,
                decisions=decisions, scheduled_peak_bytes=scheduled, fallback=fallback)


def test_a_graphs_need_is_its_minimum_plans_scheduled_peak_up_to_its_unconstrained_one():
    assert need_of("g", _plan(100, 300, scheduled=120), 2) == GraphNeed("g", 2, 120, 300)
    assert need_of("g", _plan(100, 300), 1) == GraphNeed("g", 1, 100, 300)
    # The budget loop kept another plan at 0.0 (the other search start's lowest, or a re-plan):
    # predicted above the search's minimum, its code is still the lowest the graph reaches.
    other_start = _plan(100, 300, scheduled=280)
    other_start.predicted_peak_bytes = 270
    assert need_of("g", other_start, 1) == GraphNeed("g", 1, 280, 300)
    # The budget loop kept the unconstrained plan, lower in code than every plan made for the budget.
    kept_free = _plan(100, 300, scheduled=280)
    kept_free.predicted_peak_bytes, kept_free.unconstrained = 300, True
    assert need_of("g", kept_free, 1) == GraphNeed("g", 1, 280, 300)
    assert need_of("g", _plan(0, 0, fallback="UnsupportedGraph"), 1) is None
    assert need_of("g", None, 1) is None
    # A plan of ours with nothing to decide (its backward reads only the graph's inputs): its own peak.
    nothing = _plan(300, 300, scheduled=320)
    nothing.decisions = []
    assert need_of("g", nothing, 2) == GraphNeed("g", 2, 320, 320)
    unplanned = Plan.unplanned(feasible=True, budget_bytes=None, device_profile="cpu", solver="greedy",
                               graph_name="g", why="no backward: torch's default partition")
    assert need_of("g", unplanned, 1) is None


def _stand_in(calls: list[str], name: str):
    def compiled(x):
        calls.append(name)
        return CompiledFunction.apply(x, 0.0)

    return compiled


def test_the_first_step_is_counted_then_each_graph_compiles_again_under_its_share(caplog):
    budget = StepBudget(30 * MIB)
    calls: list[str] = []
    recompiled: list[tuple[str, int]] = []

    def add(name: str, low: int, high: int):
        def recompile(share: int, args: tuple):
            recompiled.append((name, share))
            return _stand_in(calls, f"{name}@{share // MIB}"), lambda: _plan(low, high, scheduled=low)

        return budget.add(name, _stand_in(calls, name), lambda: _plan(low, high, scheduled=low), recompile)

    block = add("block", 5 * MIB, 10 * MIB)  # called for each of 2 layers
    head = add("head", 10 * MIB, 20 * MIB)
    x = torch.ones(4, requires_grad=True)

    def step():
        head(block(block(x))).sum().backward()

    with caplog.at_level(logging.INFO, logger="compile_offload"):
        step()
    assert budget.state == "done" and [g.most_calls for g in budget.graphs()] == [2, 1]
    assert recompiled == []  # at the next call of each, not inside the backward
    step()
    # floor 2 x 5 + 10 = 20, room 2 x 5 + 10 = 20: half of each range
    assert recompiled == [("block", int(7.5 * MIB)), ("head", 15 * MIB)]
    assert calls[-3:] == ["block@7", "block@7", "head@15"]
    assert "split over 2 graph(s)" in caplog.text
    assert torch.equal(x.grad, torch.full((4,), 16.0))  # every step a real step: 2 x 8 per step

    # A graph compiled later (new sizes): its minimum plan now, a new split after the next full step.
    extra = add("extra", 1 * MIB, 3 * MIB)
    assert budget.state == "wait"
    extra(head(block(block(x)))).sum().backward()
    assert budget.splits == 2 and budget.state == "done"
    # floor 2 x 5 + 10 + 1 = 21 of 30, room 10 + 10 + 2 = 22: each graph a share of 9/22 of its range
    shares = {g.name: g.budget_bytes for g in budget.graphs()}
    assert shares["extra"] == 1 * MIB + int(9 / 22 * 2 * MIB) and all(g.pending for g in budget.graphs())
    assert 2 * shares["block"] + shares["head"] + shares["extra"] <= 30 * MIB


def test_a_step_ends_only_when_every_backward_has_run():
    budget = StepBudget(30 * MIB)
    calls: list[str] = []
    def failing(share, args):
        raise RuntimeError("no compiler here")

    graph = budget.add("g", _stand_in(calls, "g"), lambda: _plan(5 * MIB, 10 * MIB), failing)
    x = torch.ones(4, requires_grad=True)
    first, second = graph(x), graph(x)  # two micro-batches in flight
    first.sum().backward()
    assert budget.state == "count"
    second.sum().backward()
    assert budget.state == "done" and budget.graphs()[0].most_calls == 2
    late = budget.add("late", _stand_in(calls, "late"), lambda: _plan(MIB, 2 * MIB), failing)
    budget.state = "done"  # as if it had been compiled before the split, and not called in the step counted
    late(x).sum().backward()
    # first called after the split: split again at the end of its step, with it
    assert budget.state == "done" and budget.splits == 2 and budget.graphs()[1].most_calls == 1
    with torch.no_grad(), pytest.warns(UserWarning, match="failed .*no compiler here.*keeps the plan it runs"):
        graph(x)  # no backward to wait for: not counted; the recompile fails, the graph runs on
    assert budget.outstanding == 0 and calls == ["g", "g", "late", "g"]


def test_a_call_without_a_backward_does_not_keep_the_step_from_ending(caplog):
    """A forward run with grad whose backward never runs (a check before training; an output
    the loss does not use): once other calls' backwards have run and a graph is called again,
    the step counted ends without it, and the budget is split."""
    budget = StepBudget(30 * MIB)
    calls: list[str] = []
    graph = budget.add("g", _stand_in(calls, "g"), lambda: _plan(5 * MIB, 10 * MIB),
                       lambda share, args: (_stand_in(calls, f"g@{share // MIB}"), lambda: _plan(5 * MIB, 10 * MIB)))
    x = torch.ones(4, requires_grad=True)
    unused = graph(x)  # never backwarded, held
    graph(x).sum().backward()
    assert budget.state == "count" and budget.outstanding == 1  # the step may still need it
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        graph(x).sum().backward()  # the next step: the call above is given up on, the step counted split
    assert "had no backward by the time the next step began" in caplog.text
    assert budget.splits == 1 and budget.state == "done" and budget.graphs()[0].most_calls == 2
    graph(x).sum().backward()
    # both calls counted (the unused output is held): floor 2 x 5, room 2 x 5, the rest 10 shared per call
    assert calls[-1] == "g@15"
    # Its backward running late, or a second time (retain_graph), counts for nothing.
    unused.sum().backward()
    kept = graph(x)
    kept.sum().backward(retain_graph=True)
    kept.sum().backward()
    assert budget.outstanding == 0


def _layered(block):
    """A step that runs ``block`` for each of ``layers`` layers, then the backward."""
    x = torch.ones(4, requires_grad=True)

    def step(layers: int):
        out = x
        for _ in range(layers):
            out = block(out)
        out.sum().backward()

    return step


def test_a_step_that_calls_a_graph_more_often_than_the_split_counted_splits_again(caplog):
    """A data-dependent number of layers: the first step runs the block graph twice, a later
    one four times; at that step's end the budget is split again with four calls."""
    budget = StepBudget(30 * MIB)
    calls: list[str] = []
    low, high = 5 * MIB, 10 * MIB
    block = budget.add("block", _stand_in(calls, "block"), lambda: _plan(low, high, scheduled=low),
                       lambda share, args: (_stand_in(calls, f"block@{share / MIB:g}"),
                                            lambda: _plan(low, high, scheduled=low)))
    step = _layered(block)
    step(2)
    step(2)
    assert budget.splits == 1 and calls[-1] == "block@15"  # 2 calls: floor 10, room 10, 10 more per 2 calls
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        step(4)
    assert "called 4 time(s) in a step, where the split counted 2" in caplog.text
    assert budget.splits == 2 and budget.graphs()[0].most_calls == 4
    step(4)
    assert calls[-1] == "block@7.5"  # 4 calls: floor 20, room 20, half of the range each
    step(2)  # fewer calls: nothing split again
    assert budget.splits == 2


def test_a_call_whose_autograd_graph_was_dropped_is_neither_waited_for_nor_counted():
    """A check forward with grad (or one that raised) whose output is dropped: the training
    step after it begins afresh, and counts its own calls only."""
    budget = StepBudget(30 * MIB)
    calls: list[str] = []
    graph = budget.add("g", _stand_in(calls, "g"), lambda: _plan(5 * MIB, 10 * MIB),
                       lambda share, args: (_stand_in(calls, f"g@{share // MIB}"), lambda: _plan(5 * MIB, 10 * MIB)))
    x = torch.ones(4, requires_grad=True)
    graph(x)  # dropped at once
    graph(x).sum().backward()
    assert budget.splits == 1 and budget.graphs()[0].most_calls == 1 and budget.outstanding == 0
    graph(x).sum().backward()
    assert calls[-1] == "g@30"  # one call: the whole budget


def test_a_graph_its_frames_later_compile_did_not_replace_stays_in_the_split():
    """Dynamo compiled a frame again for inputs that require grad; the first compile still
    runs in the steps whose inputs do not. Steps alternate: the first compile, left out of a
    split counted on a step that called only the second, is counted for good once called."""
    budget = StepBudget(30 * MIB)
    calls: list[str] = []

    def add(name, compile_id):
        return budget.add(name, _stand_in(calls, name), lambda: _plan(5 * MIB, 10 * MIB),
                          lambda share, args: (_stand_in(calls, name), lambda: _plan(5 * MIB, 10 * MIB)),
                          compile_id=compile_id)

    first, second = add("first", (0, 0)), add("second", (0, 1))
    x = torch.ones(4, requires_grad=True)
    for _ in range(3):
        (first(x) + first(x)).sum().backward()  # step A
        second(x).sum().backward()  # step B
    graphs = {g.name: g for g in budget.graphs()}
    assert graphs["first"].most_calls == 2 and graphs["second"].most_calls == 1
    assert budget.splits <= 3 and budget.state == "done"


def test_a_graph_recomputed_inside_the_backward_is_part_of_the_step_and_not_waited_for(caplog):
    """Activation checkpointing around a compiled graph runs it again inside the backward,
    after another call's backward ran: that is no new step (which would give up on the call
    being recomputed); the step ends with its backward."""
    from torch.utils.checkpoint import checkpoint

    budget = StepBudget(30 * MIB)
    calls: list[str] = []

    def squaring(x):
        calls.append("g")
        return _SavingCompiledFunction.apply(x)

    graph = budget.add("g", squaring, lambda: _plan(5 * MIB, 10 * MIB), lambda share, args: pytest.fail("no split"))
    x = torch.full((4,), 2.0, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        graph(checkpoint(graph, x, use_reentrant=False)).sum().backward()
    assert calls == ["g", "g", "g"]  # the second call's backward ran, then the first call was recomputed
    assert "had no backward" not in caplog.text
    assert budget.state == "done" and budget.outstanding == 0 and budget.graphs()[0].most_calls == 2
    assert torch.equal(x.grad, 4 * x.detach() ** 3)  # d/dx (x^2)^2


class _SavingCompiledFunction(torch.autograd.Function):
    """A stand-in compiled graph that saves its input (x^2), as real ones save activations."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def test_a_step_budget_below_the_minimum_plans_raises_under_strict_budget():
    from compile_offload import BudgetError

    budget = StepBudget(MIB, strict=True)
    calls: list[str] = []
    graph = budget.add("g", _stand_in(calls, "g"), lambda: _plan(5 * MIB, 10 * MIB),
                       lambda share, args: pytest.fail("no share to compile under"))
    x = torch.ones(4, requires_grad=True)
    with pytest.raises(BudgetError, match=r"minimum-memory plans need 5.00 MiB .*strict_budget=True"):
        graph(x).sum().backward()


def test_a_step_budget_of_zero_runs_every_graph_at_its_minimum_without_a_warning():
    """0 asks for the minimum-memory plans, which meet it: under budget_scope='step' the
    split warned that they sum 'above the memory budget 0 B' (a BudgetError under
    strict_budget), and explain_all said the same."""
    torch.manual_seed(0)
    model, x = _ThreeGraphs(d=16), torch.randn(64, 16)
    options = {"memory_budget": 0, "budget_scope": "step", "strict_budget": True, "inner_compiler": "eager",
               "device_profile": "cpu"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _peaks(model, copy.deepcopy(model), x, steps=3, **options)
        plans = compile_offload.explain_all(model, x, **options)
    assert not [str(w.message) for w in caught if "compile_offload" in str(w.message)]
    assert len(plans) == 3 and all(p.predicted_peak_bytes == p.min_peak_bytes for p in plans)


def test_a_compiled_train_step_function_runs_the_step_budgets_hooks_untraced(caplog):
    """With loss.backward() inside a compiled function, the callbacks the step budget queues
    for the end of the backward ran in frames Dynamo traced: one of ours recompiled per
    parameter shape until Dynamo's recompile limit named it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(2), nn.Conv1d(4, 4, 3, padding=1),
                          nn.LayerNorm(64), nn.Linear(64, 8))  # parameters of 1, 2, 3 and 4 dimensions

    def step(batch):
        loss = model(batch).square().mean()
        loss.backward()
        return loss.detach()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=compile_offload.offload_remat(
        memory_budget="64KiB", budget_scope="step", inner_compiler="eager", device_profile="cpu"))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, logger="torch._dynamo"):
        warnings.simplefilter("always")
        for _ in range(3):
            model.zero_grad()
            compiled(torch.randn(16, 3, 8, 8))
    traced = [r.getMessage() for r in caplog.records if "start compiling" in r.getMessage()
              and "compile_offload/runtime/" in r.getMessage().splitlines()[0]]
    assert not traced, traced[:3]
    assert not [str(w.message) for w in caught if "recompile_limit" in str(w.message)]


def test_a_graph_sent_back_to_its_minimum_runs_its_first_compile_again(caplog):
    """Four calls of the block where the split counted two: the minimum-memory plans no longer
    fit, and the block goes back to the plan it was first compiled at, not to a re-plan under
    its minimum's figure (which may peak a few KiB above it)."""
    budget = StepBudget(30 * MIB)
    calls: list[str] = []
    low, high = 5 * MIB, 10 * MIB
    recompiled: list[int] = []

    def recompile(share: int, args: tuple):
        recompiled.append(share)
        return _stand_in(calls, f"block@{share / MIB:g}"), lambda: _plan(low, high, scheduled=low)

    block = budget.add("block", _stand_in(calls, "block"), lambda: _plan(low, high, scheduled=low), recompile)
    step = _layered(block)
    step(2)
    step(2)
    assert recompiled == [15 * MIB] and calls[-1] == "block@15"
    with pytest.warns(UserWarning, match="minimum-memory plans need 35.00 MiB"):
        step(7)  # 7 x 5 MiB > 30 MiB
    with caplog.at_level(logging.INFO, logger="compile_offload"), warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        step(7)
    assert recompiled == [15 * MIB] and calls[-1] == "block"  # its first compile, not a re-plan
    assert "is at or below its minimum: it runs its minimum-memory plan" in caplog.text
    # its part of the budget (its minimum scaled by 30/35), which its plan says it does not meet
    assert budget.graphs()[0].budget_bytes == low * 30 // 35
    plan = block.graph_plan_of()  # what verify_budget measures it against: its share
    assert plan.budget_bytes == low * 30 // 35 and not plan.meets_budget()
    with warnings.catch_warnings(record=True) as more:
        warnings.simplefilter("always")
        budget._share(budget._needs)  # split again with the same figures (a graph compiled later, say)
        step(8)
    # the same figures: not said again; new ones (8 calls): said
    said = [str(w.message) for w in [*again, *more] if "minimum-memory plans need" in str(w.message)]
    assert len(said) == 1 and "need 40.00 MiB" in said[0], said


class _Meter:
    """A stand-in whole-step meter (CUDA's in the backend) reading out the peaks given."""

    def __init__(self, peaks: list[int]) -> None:
        self.peaks, self.started = list(peaks), 0

    def start(self) -> None:
        self.started += 1

    def peak_bytes(self) -> int:
        return self.peaks.pop(0)


def test_a_measured_step_over_the_budget_holds_its_excess_back_and_splits_again(caplog):
    """On CUDA the first step run wholly under the shares is measured; memory outside the
    graphs (FSDP2's gradients, a loss outside them) took it 4 MiB over, so 4 MiB is held
    back and the graphs split the rest; the next step measured within the budget."""
    meter = _Meter([34 * MIB, 29 * MIB])
    budget = StepBudget(30 * MIB, meter)
    calls: list[str] = []
    shares: list[tuple[str, int]] = []

    def add(name: str, low: int, high: int):
        def recompile(share: int, args: tuple):
            shares.append((name, share))
            return _stand_in(calls, name), lambda: _plan(low, high, scheduled=low)

        return budget.add(name, _stand_in(calls, name), lambda: _plan(low, high, scheduled=low), recompile)

    block, head = add("block", 5 * MIB, 10 * MIB), add("head", 10 * MIB, 20 * MIB)
    x = torch.ones(4, requires_grad=True)

    def step():
        head(block(block(x))).sum().backward()

    with caplog.at_level(logging.INFO, logger="compile_offload"):
        step()  # counted: the split, half of each range
        step()  # each graph compiles again under its share: not measured
        assert meter.started == 0 and shares == [("block", int(7.5 * MIB)), ("head", 15 * MIB)]
        step()  # the first wholly under the shares: it may allocate once, not measured
        assert meter.started == 0
        step()  # measured: 34 MiB
        assert meter.started == 1 and budget.measured_excess == 4 * MIB and budget.corrections == 1
        assert {g.name: g.budget_bytes for g in budget.graphs()} == {"block": int(6.5 * MIB), "head": 13 * MIB}
        step()  # compiles again under 26 MiB's split (floor 20, room 20: 30%)
        step()  # settles
        step()  # measured again: 29 MiB, within
    assert meter.started == 2 and not meter.peaks and budget.corrections == 1
    assert "4.00 MiB more is held back" in caplog.text and "took 29.00 MiB at the allocator, within" in caplog.text
    step()  # nothing more is measured
    assert meter.started == 2


def test_a_graph_given_a_share_and_not_called_again_keeps_no_step_from_being_measured():
    """review30c F1: a step was measured only once no graph waited to compile under its share;
    a graph that is not called again (its frame compiled again for another batch size) waited
    for ever, and no step was measured, corrected or warned about."""
    meter = _Meter([40 * MIB])
    budget = StepBudget(30 * MIB, meter)
    compiles: list[str] = []

    def add(name: str, low: int, high: int):
        plan = lambda: _plan(low, high, scheduled=low)  # noqa: E731
        return budget.add(name, _stand_in([], name), plan,
                          lambda share, args: (compiles.append(name), (_stand_in([], name), plan))[1])

    block, head = add("block", 5 * MIB, 10 * MIB), add("head", 10 * MIB, 20 * MIB)
    x = torch.ones(4, requires_grad=True)
    head(block(block(x))).sum().backward()  # counted: both get a share
    for _ in range(3):  # head is not called again
        block(block(x)).sum().backward()
    assert compiles == ["block"] and meter.started == 1 and budget.corrections == 1


def test_a_graph_compiled_again_in_a_measured_step_leaves_the_measure_to_a_later_step():
    meter = _Meter([29 * MIB])
    budget = StepBudget(30 * MIB, meter)

    def add(name: str, low: int, high: int):
        plan = lambda: _plan(low, high, scheduled=low)  # noqa: E731
        return budget.add(name, _stand_in([], name), plan, lambda share, args: (_stand_in([], name), plan))

    block, head = add("block", 5 * MIB, 10 * MIB), add("head", 10 * MIB, 20 * MIB)
    x = torch.ones(4, requires_grad=True)
    head(block(block(x))).sum().backward()  # counted: both get a share
    block(block(x)).sum().backward()  # block compiles again (its first run settles)
    head(block(block(x))).sum().backward()  # measured from its start, but head compiles again in it
    assert meter.started == 1 and meter.peaks == [29 * MIB]
    for _ in range(2):  # settles, then measured
        head(block(block(x))).sum().backward()
    assert meter.started == 2 and not meter.peaks


def _counted_graph_whose_share_fails(error: Exception, strict: bool = False):
    """A graph of a 30 MiB step budget whose compile under its share raises ``error``, and
    its input, after the step that split the budget: its next call compiles for its share."""
    budget = StepBudget(30 * MIB, strict=strict)

    def recompile(share: int, args: tuple):
        raise error

    plan = lambda: _plan(5 * MIB, 10 * MIB, scheduled=5 * MIB)  # noqa: E731
    graph = budget.add("block", _stand_in([], "block"), plan, recompile)
    x = torch.ones(4, requires_grad=True)
    graph(x).sum().backward()  # counted: the split
    return graph, x


def test_a_share_below_what_its_compile_can_reach_raises_under_strict_budget():
    """review30c F5: under strict_budget the share's compile raised BudgetError, which the
    step budget turned into a warning ("compiling this graph under its share ... failed")."""
    from compile_offload import BudgetError

    graph, x = _counted_graph_whose_share_fails(BudgetError("below the minimum; strict_budget=True"), strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(BudgetError, match="strict_budget=True"):
            graph(x).sum().backward()


def test_a_share_whose_compile_failed_is_what_its_plan_is_measured_against():
    """review30c F12: the graph kept its minimum-memory plan, made at budget 0 B, and
    verify_budget measured the step against that 0 B, not the share."""
    graph, x = _counted_graph_whose_share_fails(RuntimeError("no compiler today"))
    with pytest.warns(UserWarning, match="compiling this graph under its share 30.00 MiB failed .*no compiler today"):
        graph(x).sum().backward()
    assert graph.graph_plan_of().budget_bytes == 30 * MIB


def _two_graphs(budget: StepBudget):
    """A block graph called twice and a head graph, both with room above their minimum."""
    def add(name: str, low: int, high: int):
        plan = lambda: _plan(low, high, scheduled=low)  # noqa: E731
        return budget.add(name, _stand_in([], name), plan, lambda share, args: (_stand_in([], name), plan))

    block, head = add("block", 5 * MIB, 10 * MIB), add("head", 10 * MIB, 20 * MIB)
    x = torch.ones(4, requires_grad=True)
    return lambda: head(block(block(x))).sum().backward()


def test_a_measured_step_well_under_the_budget_gives_the_graphs_the_rest_once(caplog):
    """The sum of peaks over-counts: the step under a split of 30 MiB measured 20. The 10 MiB
    left are split too (the graphs compile again under more) and the next step measured 28:
    kept; nothing more is measured or given."""
    meter = _Meter([20 * MIB, 28 * MIB])
    budget = StepBudget(30 * MIB, meter)
    step = _two_graphs(budget)
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        for _ in range(4):
            step()  # counted, recompiled, settled, measured: 20 MiB
        assert budget.measured_excess == -10 * MIB and budget.relaxations == 1
        # 40 MiB split (floor 20, room 20): every graph unconstrained
        assert {g.name: g.budget_bytes for g in budget.graphs()} == {"block": 10 * MIB, "head": 20 * MIB}
        for _ in range(5):
            step()  # recompiled, settled, measured: 28 MiB, within; then nothing more
    assert meter.started == 2 and not meter.peaks and budget.relaxed_from is None
    assert "plus 10.00 MiB a measured step was under" in caplog.text
    assert "took 28.00 MiB at the allocator, within" in caplog.text


def test_a_relaxed_split_that_measures_over_the_budget_goes_back_to_the_one_that_fit(caplog):
    meter = _Meter([20 * MIB, 33 * MIB])
    budget = StepBudget(30 * MIB, meter)
    step = _two_graphs(budget)
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        for _ in range(7):
            step()  # counted, recompiled, settled, measured 20, recompiled, settled, measured 33: back
    assert budget.measured_excess == 0 and budget.relaxed_from is None and not budget.to_check
    assert {g.name: g.budget_bytes for g in budget.graphs()} == {"block": int(7.5 * MIB), "head": 15 * MIB}
    assert "back to the split that measured within it" in caplog.text
    for _ in range(3):
        step()
    assert meter.started == 2 and budget.corrections == 0


def test_a_step_still_over_after_the_corrections_warns_with_its_measured_peak():
    meter = _Meter([40 * MIB, 40 * MIB, 40 * MIB])
    budget = StepBudget(30 * MIB, meter)
    graph = budget.add("g", _stand_in([], "g"), lambda: _plan(5 * MIB, 20 * MIB, scheduled=5 * MIB),
                       lambda share, args: (_stand_in([], "g"), lambda: _plan(5 * MIB, 20 * MIB, scheduled=5 * MIB)))
    x = torch.ones(4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(12):
            graph(x).sum().backward()
    messages = [str(w.message) for w in caught]
    # 10 MiB held back, then 20 in all: the graph's share went 30, 20, 10 MiB, each step measured 40
    assert budget.corrections == 2 and budget.measured_excess == 20 * MIB
    over = [m for m in messages if "measured 40.00 MiB at the allocator" in m]
    assert len(over) == 1 and "after 2 correction(s)" in over[0] and "+33.3%" in over[0], messages
    assert not meter.peaks


def test_parameters_gathered_for_the_step_and_freed_in_it_are_held_back_from_the_split(caplog):
    """FSDP2 all-gathers a module's parameters before its graph runs and frees their storage
    after (resize to 0): graph inputs, in no graph's peak. Here two "modules" of 1 MiB and
    2 MiB, each gathered for its own call and backward, and a persistent 4 MiB parameter
    (not gathered: counted for nothing). The most gathered at once, 3 MiB (in the backward
    of the first, the second not yet freed), is held back from the split."""
    budget = StepBudget(30 * MIB)
    small, large = (nn.Parameter(torch.zeros(n * MIB // 4)) for n in (1, 2))
    persistent = nn.Parameter(torch.zeros(MIB))
    graphs = {}

    def gathered(x, weight, also):
        return CompiledFunction.apply(x, 0.0)

    for name in ("first", "second"):
        graphs[name] = budget.add(name, gathered, lambda: _plan(5 * MIB, 10 * MIB, scheduled=5 * MIB),
                                  lambda share, args: (gathered, lambda: _plan(5 * MIB, 10 * MIB, scheduled=5 * MIB)))

    def free(parameter):
        def hook(*_):
            parameter.untyped_storage().resize_(0)

        return hook

    x = torch.ones(4, requires_grad=True)
    h = graphs["first"](x, small, persistent)
    h.grad_fn.register_hook(free(small))  # freed after its backward, the last to run
    y = graphs["second"](h, large, persistent)
    y.grad_fn.register_hook(free(large))
    with caplog.at_level(logging.INFO, logger="compile_offload"), pytest.warns(UserWarning) as caught:
        y.sum().backward()
    assert budget.splits == 1 and budget.gathered_bytes == 3 * MIB and budget.reserved == 3 * MIB
    # their gradients are not held back, and without a meter nothing says how much they took: one warning
    (message,) = [str(w.message) for w in caught]
    assert "not the gradients FSDP2 reduce-scatters" in message and "up to 3.00 MiB unsharded" in message
    assert "less 3.00 MiB of parameters gathered outside the graphs (FSDP2)" in caplog.text
    # the split is of what is left: floor 10, room 10 of 27 MiB: both unconstrained, 7 MiB to share
    assert {g.name: g.budget_bytes for g in budget.graphs()} == {"first": 13.5 * MIB, "second": 13.5 * MIB}


def test_without_a_meter_nothing_is_measured():
    budget = StepBudget(30 * MIB)
    graph = budget.add("g", _stand_in([], "g"), lambda: _plan(5 * MIB, 20 * MIB, scheduled=5 * MIB),
                       lambda share, args: (_stand_in([], "g"), lambda: _plan(5 * MIB, 20 * MIB, scheduled=5 * MIB)))
    x = torch.ones(4, requires_grad=True)
    for _ in range(4):
        graph(x).sum().backward()
    assert budget.splits == 1 and budget.to_check and not budget.measuring


def test_a_call_on_fake_tensors_is_not_part_of_a_step():
    """DDPOptimizer runs each bucket graph on fake tensors while it compiles the next: such a
    call's backward never runs, and counted it would keep every step from ending."""
    from compile_offload.torch_api.fake_tensors import FakeTensorMode

    budget = StepBudget(30 * MIB)
    calls: list[str] = []
    graph = budget.add("g", _stand_in(calls, "g"), lambda: _plan(5 * MIB, 10 * MIB), lambda share, args: None)
    with FakeTensorMode() as mode:
        graph(mode.from_tensor(torch.ones(4, requires_grad=True)))
    assert budget.outstanding == 0 and budget.state == "wait"
    graph(torch.ones(4, requires_grad=True)).sum().backward()
    assert budget.state == "done" and budget.graphs()[0].most_calls == 1 and calls == ["g", "g"]


class _ThreeGraphs(nn.Module):
    """Three residual blocks with a graph break after each of the first two: three graphs
    whose activations dwarf their weights."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d), nn.GELU()) for _ in range(3))

    def forward(self, x):
        x = x + self.blocks[0](x)
        torch._dynamo.graph_break()
        x = x + self.blocks[1](x)
        torch._dynamo.graph_break()
        return x + self.blocks[2](x)


def _peaks(model, eager, x, steps: int, device="cpu", rtol=1e-4, atol=1e-5, **options) -> list[int]:
    """Each step's peak at ``device``'s allocator, gradients checked against eager's."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=compile_offload.offload_remat(**options))
    peaks = []
    for _ in range(steps):
        for p in (*model.parameters(), *eager.parameters()):
            p.grad = None
        with compile_offload.measure_peak(device) as measured:
            compiled(x).square().mean().backward()
        peaks.append(measured.peak_bytes)
        eager(x).square().mean().backward()
        for (name, a), b in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=atol, msg=name)
    return peaks


@pytest.mark.inductor
@pytest.mark.slow
def test_a_step_of_three_graphs_keeps_one_budget_where_three_budgets_would_not(caplog):
    torch.manual_seed(0)
    model = _ThreeGraphs()
    eager = copy.deepcopy(model)
    x = torch.randn(2048, 64)
    with torch._inductor.config.patch(fx_graph_cache=False):
        unconstrained = _peaks(model, eager, x, 1, memory_budget="1GiB")[0]
        budget = int(unconstrained * 0.92)
        per_graph = _peaks(model, eager, x, 2, memory_budget=budget)
        with caplog.at_level(logging.INFO, logger="compile_offload"):
            per_step = _peaks(model, eager, x, 3, memory_budget=budget, budget_scope="step")
        # verify_budget (its own profiler: outside measure_peak) waits for each graph's share:
        # the minimum plan's budget ("0 B") is not the step's
        torch._dynamo.reset()
        verified = torch.compile(model, backend=compile_offload.offload_remat(
            memory_budget=budget, budget_scope="step", verify_budget=True))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                verified(x).square().mean().backward()
    assert not [str(w.message) for w in caught if "above the memory budget" in str(w.message)]
    assert min(per_graph) > budget  # each graph under the whole budget: the step over it
    assert "split over 3 graph(s)" in caplog.text, caplog.text
    assert max(per_step[1:]) <= budget * 1.01, (per_step, budget)  # after the split
    assert per_step[0] <= budget * 1.01  # the first step, at the minimum-memory plans


@pytest.mark.inductor
def test_explain_all_shows_each_graph_under_its_share_of_the_step():
    torch.manual_seed(0)
    model, x = _ThreeGraphs(), torch.randn(2048, 64)
    whole = compile_offload.explain_all(model, x, memory_budget="17MiB")
    assert all(p.budget_bytes == 17 * MIB for p in whole)
    shared = compile_offload.explain_all(model, x, memory_budget="17MiB", budget_scope="step")
    assert len(shared) == 3 and sum(p.budget_bytes for p in shared) <= 17 * MIB
    assert all(p.min_peak_bytes <= p.budget_bytes < 17 * MIB for p in shared)
    assert all("planned under this graph's share" in p.notes[-1] for p in shared)
    with pytest.warns(UserWarning, match="minimum-memory plans sum to .* above the memory budget 4.00 MiB"):
        lowest = compile_offload.explain_all(model, x, memory_budget="4MiB", budget_scope="step")
    assert all(p.predicted_peak_bytes == p.min_peak_bytes for p in lowest)
    # each under its part of the 4 MiB, which it does not meet (it said 'budget 0' and met it: fuzz30b F3)
    assert sum(p.budget_bytes for p in lowest) <= 4 * MIB and not any(p.meets_budget() for p in lowest)
    with pytest.raises(compile_offload.BudgetError, match=r"minimum-memory plans sum to .* above the memory "
                                                          r"budget 4.00 MiB; strict_budget=True"):
        compile_offload.explain_all(model, x, memory_budget="4MiB", budget_scope="step", strict_budget=True)


class _EagerBetween(nn.Module):
    """Two graphs with an eager function between them whose saved tensors (a sigmoid's input
    and output) are in neither graph's plan."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.second = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.first(x)
        x = _eager_gate(x)
        return x + self.second(x)


@torch._dynamo.disable
def _eager_gate(x):
    wide = x.repeat(1, 8)
    return (torch.sigmoid(wide) * wide).view(x.shape[0], 8, -1).sum(1)


@pytest.mark.cuda
@pytest.mark.inductor
def test_on_cuda_a_measured_step_over_the_budget_corrects_the_split(caplog):
    """What runs between the graphs (here an eager gate whose saved tensors no plan sees) is
    measured on CUDA: the step ends within the budget, or one warning names its measured peak.
    Gradients equal eager throughout."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = _EagerBetween().to(device)
    eager = copy.deepcopy(model)
    x = torch.randn(4096, 256, device=device)
    with torch._inductor.config.patch(fx_graph_cache=False):
        unconstrained = _peaks(model, eager, x, 1, device, 1e-3, 1e-4, memory_budget="64GiB")[0]
        budget = int(unconstrained * 0.8)
        with caplog.at_level(logging.INFO, logger="compile_offload"), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            peaks = _peaks(model, eager, x, 12, device, 1e-3, 1e-4, memory_budget=budget, budget_scope="step")
    over = [str(w.message) for w in caught if "at the allocator, above the memory budget" in str(w.message)]
    assert "split over 2 graph(s)" in caplog.text, caplog.text
    assert "the step measured under the split took" in caplog.text or "more is held back" in caplog.text
    assert peaks[-1] <= budget * 1.01 or over, (peaks, budget, caplog.text)



def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))


def _step_as_eager(compiled, model: nn.Module, eager: nn.Module, x: torch.Tensor) -> None:
    """One training step of ``compiled`` (of ``model``) and of ``eager`` on ``x``: the same gradients."""
    compiled(x).sum().backward()
    eager(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"{tuple(x.shape)} {name}: {m}")
    model.zero_grad(), eager.zero_grad()


@pytest.mark.parametrize("inner_compiler", ["eager", "inductor"])
def test_a_dynamic_graph_compiled_again_under_its_share_still_serves_every_size(inner_compiler, caplog):
    """The share's compile runs outside Dynamo and so is specialized to the first call's
    sizes: it runs for those, and the graph as Dynamo compiled it (its minimum-memory plan,
    for every size) for the others. It used to be called with any size, and the backward
    failed at the first other batch."""
    caplog.set_level(logging.INFO, logger="compile_offload")
    model, eager = _mlp(), _mlp()
    backend = compile_offload.offload_remat(memory_budget="40MiB", budget_scope="step", inner_compiler=inner_compiler,
                                            device_profile="cpu")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for batch in (512, 512, 512, 1024, 256, 512):
        x = torch.randn(batch, 64)
        _step_as_eager(compiled, model, eager, x)
    assert any("compiling this graph again under its share" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("inner_compiler", ["eager", "inductor"])
def test_a_larger_size_on_the_minimum_plan_over_the_share_warns_once(inner_compiler):
    """Sizes other than the one the share's plan was compiled for run the graph's
    minimum-memory plan. Its predicted peak at each new size is checked against the graph's
    share of the step's budget: batch 4096 (8x the share's 512) is over a 4 MiB share and
    warns once, naming the size, the predicted peak and the share; a smaller batch does not
    warn. It used to run unchecked. (Inductor's C++ kernels guard batches up to 4096: a
    larger one would compile a new graph, which the split handles.)"""
    model, eager = _mlp(), _mlp()
    backend = compile_offload.offload_remat(memory_budget="4MiB", budget_scope="step", inner_compiler=inner_compiler,
                                            device_profile="cpu")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    caught_per_batch = []
    for batch in (512, 512, 512, 4096, 4096, 256):
        x = torch.randn(batch, 64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step_as_eager(compiled, model, eager, x)
        caught_per_batch.append([str(w.message) for w in caught if "compile_offload" in str(w.message)])
    assert caught_per_batch[:3] == [[], [], []] and caught_per_batch[4:] == [[], []], caught_per_batch
    (message,) = caught_per_batch[3]
    assert "budget_scope='step' with dynamic shapes: at s" in message and "=4096 this graph runs its minimum" in message
    assert "above its share 4.00 MiB of the step's memory budget" in message, message
    peak = float(message.split("predicted peak of ")[1].split(" MiB")[0])
    assert peak > 4.0, message


def test_a_graph_its_dynamic_recompile_replaces_is_left_out_of_the_split(caplog):
    """Batch 512, then a smaller batch: Dynamo compiles the frame again with a dynamic batch,
    and that code serves every batch after it. The static graph never runs again, so the
    split after the recompile is over the dynamic graph alone, which gets the whole budget
    (it used to be split over both, each getting less)."""
    model, eager = _mlp(), _mlp()
    backend = compile_offload.offload_remat(memory_budget="6MiB", budget_scope="step", inner_compiler="eager",
                                            device_profile="cpu")
    compiled = torch.compile(model, backend=backend)
    caplog.set_level(logging.INFO, logger="compile_offload")
    for batch in (512, 512, 256, 512, 512):
        x = torch.randn(batch, 64)
        _step_as_eager(compiled, model, eager, x)
    splits = [r.getMessage() for r in caplog.records if "split over" in r.getMessage()]
    assert len(splits) == 2, splits
    assert "split over 1 graph(s)" in splits[0] and "graph_0_0:" in splits[0], splits
    assert "split over 1 graph(s)" in splits[1] and "graph_0_1:" in splits[1] and "graph_0_0:" not in splits[1], splits
    assert splits[0].rsplit("-> ", 1)[1] == splits[1].rsplit("-> ", 1)[1] == "6.00 MiB", splits
    assert any("graph_0_0: budget_scope='step': left out of the split" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("inner_compiler", ["eager", "inductor"])
def test_a_size_named_with_hint_override_still_runs_its_share_at_the_size_compiled(inner_compiler, monkeypatch):
    """mark_dynamic(x, 0, hint_override=2048) with calls at 512: the share's compile
    (specialized to the 512 of the first call) runs for every call at 512, and the
    minimum-memory plan for the others. The dispatch used to expect the size argument at
    its hint, 2048, where the tensors were 512, so no call ever ran the share's plan."""
    from compile_offload.pipeline import dynamic_check

    ran: list[str] = []
    dispatch = dynamic_check.for_the_sizes_of

    def counted(gm, example_inputs, share, *, otherwise):
        def run_share(*args):
            ran.append("share")
            return share(*args)

        def run_minimum(*args):
            ran.append("minimum")
            return otherwise(*args)
        return dispatch(gm, example_inputs, run_share, otherwise=run_minimum)

    monkeypatch.setattr(dynamic_check, "for_the_sizes_of", counted)
    model, eager = _mlp(), _mlp()
    backend = compile_offload.offload_remat(memory_budget="40MiB", budget_scope="step", inner_compiler=inner_compiler,
                                            device_profile="cpu")
    compiled = torch.compile(model, backend=backend)
    for step, batch in enumerate((512, 512, 512, 2048, 512, 300)):
        x = torch.randn(batch, 64)
        if step == 0:
            torch._dynamo.mark_dynamic(x, 0, hint_override=2048)
        before = len(ran)
        _step_as_eager(compiled, model, eager, x)
        if step >= 2:  # the first step is counted, the second compiles the share
            assert ran[before:] == ["share" if batch == 512 else "minimum"], (step, batch, ran)


def test_the_first_calls_tensors_are_not_held_by_the_step_budget():
    """Dynamo hands the backend the first call's real tensors (the batch; after a graph break,
    the activations the next graph gets). The share's compile uses the arguments of the call
    it runs at, so nothing keeps those alive past their step."""
    import gc
    import weakref

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(64, 256), nn.GELU())
            self.b = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))

        def forward(self, x):
            h = self.a(x)
            torch._dynamo.graph_break()
            return self.b(h)

    compiled = torch.compile(Broken(), backend=compile_offload.offload_remat(
        memory_budget="30MiB", budget_scope="step", inner_compiler="eager", device_profile="cpu"))
    first = torch.randn(512, 64)
    held = weakref.ref(first)
    compiled(first).sum().backward()
    del first
    for _ in range(3):  # counted, then split and compiled again under the shares
        compiled(torch.randn(512, 64)).sum().backward()
    gc.collect()
    assert held() is None


class _ScalarAcrossABreak(nn.Module):
    """The second graph reads the first's ``.item()``: torch passes the float in as a 0-d
    tensor that the graph reads with ``.item()`` again (fuzz29b F2)."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(16, 256), nn.Linear(256, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        s = h.mean().item()
        return self.c(h * s)


class _SizeFromAValue(_ScalarAcrossABreak):
    """A size that depends on the values (nonzero, with capture_dynamic_output_shape_ops)."""

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(h * (torch.nonzero(h > 0).shape[0] / h.numel()))


@pytest.mark.parametrize("inner_compiler", ["eager", "inductor"])
@pytest.mark.parametrize("in_one_graph", [False, True, "nonzero"])
def test_a_graph_reading_a_scalar_from_a_tensor_is_compiled_again_under_its_share(inner_compiler, in_one_graph,
                                                                                  caplog):
    """Compiled again outside Dynamo on the call's real tensors, the ``.item()`` raised
    DataDependentOutputException: the graph kept its minimum-memory plan, with a warning.
    In one graph (capture_scalar_outputs) the retrace on fakes met the unbacked symbol Dynamo
    had bound ("zuf0 possible memo disaster")."""
    caplog.set_level(logging.INFO, logger="compile_offload")
    torch.manual_seed(0)
    model = _SizeFromAValue() if in_one_graph == "nonzero" else _ScalarAcrossABreak()
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=bool(in_one_graph), backend=compile_offload.offload_remat(
        memory_budget="600KiB", budget_scope="step", inner_compiler=inner_compiler, device_profile="cpu"))
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(
            capture_scalar_outputs=in_one_graph is True, capture_dynamic_output_shape_ops=in_one_graph == "nonzero"):
        warnings.simplefilter("always")
        for _ in range(4):
            _step_as_eager(compiled, model, eager, torch.randn(64, 16))
    assert not [str(w.message) for w in caught if "compile_offload" in str(w.message)]
    again = [r.getMessage() for r in caplog.records if "compiling this graph again under its share" in r.getMessage()]
    assert len(again) == (1 if in_one_graph else 2), again  # review30d: nonzero raised another exception


def test_graphs_below_a_step_budget_their_minimums_exceed_say_they_do_not_meet_it():
    """fuzz30b F3: every graph's plan said 'budget 0 (the minimum-memory plan)' and met it,
    where the step's budget was below the sum of the minimums: a printed or saved plan said
    the user's budget was met."""
    budget = StepBudget(12 * MIB)
    plan = lambda: _plan(5 * MIB, 10 * MIB, scheduled=5 * MIB)  # noqa: E731
    block = budget.add("block", _stand_in([], "block"), plan, lambda share, args: pytest.fail("no compile"))
    x = torch.ones(4, requires_grad=True)
    with pytest.warns(UserWarning, match="minimum-memory plans need 15.00 MiB"):
        block(block(block(x))).sum().backward()  # counted: 3 calls of a 5 MiB minimum
    block(x).sum().backward()
    run = block.graph_plan_of()
    assert run.budget_bytes == 4 * MIB and not run.meets_budget() and "over budget" in run.summary()


def test_a_graph_never_trained_is_not_said_replaced_by_a_later_compile_of_its_frame():
    """fuzz31b F4: a frozen teacher's graph (no backward) and the student's, one frame: the
    teacher's was logged 'left out of the split: a later compile of its frame runs in its
    place', though it runs every step. Left out it is (it saves nothing), for that reason."""
    from compile_offload.runtime.step_budget import _Graph

    def graph(name, compile_id, calls, trained):
        return _Graph(name, None, lambda: None, None, calls=calls, compile_id=compile_id, trained=trained)

    student = graph("graph_0_1", (0, 1), calls=1, trained=True)
    assert not graph("graph_0_0", (0, 0), calls=0, trained=False).superseded_by(student)
    assert graph("graph_0_0", (0, 0), calls=0, trained=True).superseded_by(student)  # a recompile for new sizes
