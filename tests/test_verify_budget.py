"""``config.verify_budget``: the first compiled step of each graph is measured at the
allocator and a measured peak over the budget warns once, with the three figures."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

import compile_offload
from compile_offload.runtime.memory_tracker import measure_peak
from compile_offload.passes.plan import Decision, Plan, format_bytes
from compile_offload.runtime.verify_budget import warn_if_over_budget


def _plan(budget: int, predicted: int) -> Plan:
    return Plan(feasible=predicted <= budget, budget_bytes=budget, predicted_peak_bytes=predicted,
                predicted_step_seconds=0.0, baseline_peak_bytes=predicted, baseline_step_seconds=0.0,
                min_peak_bytes=predicted)


def test_warns_only_beyond_one_percent_over_the_budget():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not warn_if_over_budget(_plan(1_000_000, 990_000), 1_010_000, "graph_0")
        assert warn_if_over_budget(_plan(1_000_000, 990_000), 1_010_001, "graph_0")
    (warning,) = caught
    text = str(warning.message)
    assert "graph_0" in text and "verify_budget" in text
    for figure in (1_010_001, 1_000_000, 990_000):  # measured, budget, predicted
        assert format_bytes(figure) in text, text


def test_a_budget_of_zero_the_minimum_plan_asked_for_warns_without_a_percentage():
    """memory_budget=0.0 asks for the minimum-memory plan, whose budget is 0 bytes: the
    warning cannot say by what share the step is over it (it divided by zero, in the user's
    backward)."""
    with pytest.warns(UserWarning, match=r"above the memory budget 0 B \(a budget of 0; predicted peak") as caught:
        assert warn_if_over_budget(_plan(0, 900), 1000, "graph_0")
    # The minimum-memory plan asked for meets its budget (Plan.meets_budget): not "holds more than predicted".
    assert "no step fits in 0 bytes" in str(caught[0].message)


def test_the_warning_says_what_the_plan_already_said_about_the_budget():
    def message(plan):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert warn_if_over_budget(plan, 1_100_000, "graph_0")
        return str(caught[0].message)

    below = _plan(1_000_000, 1_050_000)  # the planner's minimum is over the budget
    assert "did not fit" in message(below)
    below.time_limit_reached = True  # the search stopped early: its lowest plan is not the planner's minimum
    assert "plan_time_limit stopped the search" in message(below) and "below the minimum" not in message(below)
    below.time_limit_reached = False
    below.scheduled_peak_bytes = 950_000  # ... but its code fits (the budget loop kept it): not "did not fit"
    assert "holds more than the plan predicts" in message(below)
    kept_over = _plan(1_000_000, 990_000)  # the planner says it fits, no plan's code did
    kept_over.scheduled_peak_bytes = 1_080_000
    assert f"scheduled peak {format_bytes(1_080_000)}" in message(kept_over)
    fits = _plan(1_000_000, 990_000)
    fits.scheduled_peak_bytes = 990_000
    assert "holds more than the plan predicts" in message(fits)
    # fuzz35b: bf16 on the CPU, where ATen's matmul temporaries are the known cause
    fits.device_profile = "cpu"
    fits.decisions = [Decision("mm", (64, 512), "bfloat16", 65536, "keep", "fits the budget")]
    assert "bf16 and fp16 matmuls hold temporaries" in message(fits) and "design.md" not in message(fits)
    # a graph torch partitioned (the planner refused it): no plan, nothing predicted at 0 B
    fell_back = Plan.unplanned(feasible=False, budget_bytes=1_000_000, device_profile="cpu", solver="greedy",
                               graph_name="graph_0", why="torch.cond", fallback="UnsupportedGraph: torch.cond")
    said = message(fell_back)
    assert "no plan: torch's partition ran" in said and "predicted peak" not in said
    assert "did not plan this graph (UnsupportedGraph: torch.cond)" in said and "did not fit" not in said


def _verify_messages(caught) -> list[str]:
    return [str(w.message) for w in caught if "verify_budget" in str(w.message)]


def _steps(model, x, steps=3, **options):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=compile_offload.offload_remat(verify_budget=True, device_profile="cpu",
                                                                          **options))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            compiled(x).sum().backward()
    return _verify_messages(caught)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)), torch.randn(128, 64)


def test_a_step_over_the_budget_warns_once_and_one_within_it_does_not():
    model, x = _model()
    # 64 KiB is below what this step can reach (its gradients alone are larger): measured
    # above the budget, on the first step only.
    over = _steps(model, x, memory_budget="64KiB", inner_compiler="eager")
    assert len(over) == 1, over
    # A budget far above the step's peak: measured within it, no warning.
    with measure_peak("cpu") as measured:
        model(x).sum().backward()
    assert _steps(model, x, memory_budget=str(10 * measured.peak_bytes), inner_compiler="eager") == []


def test_a_call_on_fake_tensors_is_not_the_first_step():
    """DDPOptimizer runs each compiled bucket graph on fake tensors while it compiles the
    next: that call counted as the measured first step, and no real step was ever measured."""
    from compile_offload.runtime.verify_budget import verify_first_step
    from compile_offload.torch_api.fake_tensors import FakeTensorMode

    plan = Plan(feasible=True, budget_bytes=1, predicted_peak_bytes=1, predicted_step_seconds=0.0,
                baseline_peak_bytes=1, baseline_step_seconds=0.0, min_peak_bytes=1)
    weight = torch.randn(64, 64, requires_grad=True)
    wrapped = verify_first_step(lambda x: (x @ weight).relu(), lambda: plan, torch.device("cpu"), "g")
    x = torch.randn(256, 64)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        wrapped(mode.from_tensor(x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped(x).sum().backward()
    (message,) = [str(w.message) for w in caught if "verify_budget" in str(w.message)]
    assert "g: verify_budget: the first compiled step measured" in message, message


def _verified_stand_in():
    """A compiled graph's stand-in (its backward is waited for) under ``verify_first_step``,
    with a budget of 1 byte: the step it measures warns."""
    from compile_offload.runtime.verify_budget import verify_first_step

    from .models import CompiledFunction

    plan = Plan(feasible=True, budget_bytes=1, predicted_peak_bytes=1, predicted_step_seconds=0.0,
                baseline_peak_bytes=1, baseline_step_seconds=0.0, min_peak_bytes=1)
    return verify_first_step(lambda x: CompiledFunction.apply(x, 0.0), lambda: plan, torch.device("cpu"), "g")


def test_a_first_call_whose_backward_never_runs_is_not_the_step_measured():
    """A forward with grad on whose output is dropped (a sanity pass without no_grad) was
    taken as the step to measure; its backward never ran, and no step ever was measured."""
    wrapped = _verified_stand_in()
    x = torch.randn(256, 64, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped(x).sum().item()  # no backward
        assert not [w for w in caught if "verify_budget" in str(w.message)]
        for _ in range(2):
            wrapped(x).sum().backward()
    (message,) = [str(w.message) for w in caught if "verify_budget" in str(w.message)]
    assert "g: verify_budget: the first compiled step measured" in message, message


def test_a_step_whose_first_call_is_always_detached_is_measured_from_the_call_that_trains():
    """Self-distillation: each step computes a target with the compiled graph, grad on, and
    detaches it, then trains on a second call. The detached call was measured, dropped at
    the next step, and the next detached call measured instead: no step ever was (a budget
    broken by 9%, with verify_budget on, and no warning)."""
    wrapped = _verified_stand_in()
    x = torch.randn(256, 64, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            target = wrapped(x).detach()
            (wrapped(x) - target).square().sum().backward()
    (message,) = [str(w.message) for w in caught if "verify_budget" in str(w.message)]
    assert "g: verify_budget: the first compiled step measured" in message, message


def test_a_graph_called_twice_in_a_step_is_measured_from_its_first_call():
    """A model calling one compiled graph several times a step: the second call found the
    first's backward pending and took the measure over, from its own smaller forward."""
    wrapped = _verified_stand_in()
    large, small = torch.randn(1024, 256, requires_grad=True), torch.randn(4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (wrapped(large).sum() + wrapped(small).sum()).backward()
        wrapped(small).sum().backward()
    (message,) = [str(w.message) for w in caught if "at the allocator" in str(w.message)]
    assert "MiB at the allocator" in message, message  # the 1 MiB call's step, not the 16-byte one's


def _verified_calls(budget_per_call: bool, calls: int, detached: int = 0) -> list[str]:
    """The verify_budget warnings of steps calling a verified stand-in ``calls`` times for the
    loss (and ``detached`` more times for a target, grad on, then detached)."""
    from compile_offload.runtime.verify_budget import verify_first_step

    from .models import CompiledFunction

    plan = Plan(feasible=True, budget_bytes=1 << 30, predicted_peak_bytes=1, predicted_step_seconds=0.0,
                baseline_peak_bytes=1, baseline_step_seconds=0.0, min_peak_bytes=1)
    wrapped = verify_first_step(lambda x: CompiledFunction.apply(x, 0.0), lambda: plan, torch.device("cpu"), "g",
                                budget_per_call=budget_per_call)
    x = torch.randn(64, 64, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            targets = [wrapped(x).detach() for _ in range(detached)]
            sum(wrapped(x).sum() for _ in range(calls)).backward()
            del targets
    return [str(w.message) for w in caught if "verify_budget" in str(w.message)]


def test_a_graph_called_again_before_its_backward_says_the_budget_bounds_one_call():
    """fuzz35b: a siamese step (one graph called twice for one loss) measured 2.09x the
    per-graph budget, silently: each call holds its own saved tensors, and on the CPU the
    measure sees the first call's forward and backward only. Under budget_scope="graph"
    one warning now says so, once; under "step" (budget_per_call=False) the split counts
    the calls, and nothing is said."""
    (said,) = _verified_calls(budget_per_call=True, calls=2)
    assert "g: verify_budget: the first step called this graph 2 times" in said and "budget_scope='step'" in said
    assert "4 times" in _verified_calls(budget_per_call=True, calls=4)[0]
    assert _verified_calls(budget_per_call=False, calls=2) == []
    assert _verified_calls(budget_per_call=True, calls=1) == []
    # a target computed with grad on and detached: its saved tensors go with its output
    assert _verified_calls(budget_per_call=True, calls=1, detached=1) == []


@pytest.mark.parametrize("scope, budget, warned", [("graph", 0.5, True), ("step", "64MiB", False),
                                                    ("step", 0.5, False)])
def test_the_backend_says_so_for_a_siamese_step_under_the_graph_scope_only(scope, budget, warned):
    """review35e: the called-again warning fired under budget_scope='step' with a fraction
    (which the step scope does not split), naming 'graph' and advising 'step'."""
    model, x = _model()
    compiled = torch.compile(model, backend=compile_offload.offload_remat(
        verify_budget=True, device_profile="cpu", inner_compiler="eager", memory_budget=budget, budget_scope=scope))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            (compiled(x) * compiled(x + 1)).sum().backward()
    said = [m for m in _verify_messages(caught) if "called this graph 2 times" in m]
    assert len(said) == int(warned), _verify_messages(caught)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_a_graph_with_dynamic_sizes_is_measured_again_at_larger_sizes(dynamic):
    """fuzz34a F3: one plan serves every size of a dynamic graph, and its first call is often
    its smallest (a short batch compiled it): only that step was measured, and a budget
    broken at every larger batch went without a warning, verify_budget on. A call larger than
    every step measured is measured too (a static graph's are not)."""
    from compile_offload.runtime.verify_budget import verify_first_step

    from .models import CompiledFunction

    small, large = torch.randn(4, 64, requires_grad=True), torch.randn(4096, 64, requires_grad=True)
    with measure_peak("cpu") as measured:
        CompiledFunction.apply(small, 0.0).sum().backward()
    plan = _plan(8 * measured.peak_bytes, 1)
    wrapped = verify_first_step(lambda x: CompiledFunction.apply(x, 0.0), lambda: plan, torch.device("cpu"), "g",
                                (lambda args: args[0].numel()) if dynamic else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in (small, small, large, large):
            wrapped(x).sum().backward()
    messages = [str(w.message) for w in caught if "verify_budget" in str(w.message)]
    if dynamic:
        (message,) = messages
        assert "g: verify_budget: the first step at larger sizes measured" in message, message
    else:
        assert messages == []


def test_the_size_of_a_call_is_the_elements_of_its_dynamically_sized_inputs():
    """review34f F2: Dynamo hands the backend real tensors, so the size read the symbolic
    shapes off nothing and summed the size arguments: batch x 64 was measured as the batch,
    and with two dimensions (12, 48) then (30, 20) read as smaller. The graph's placeholders
    say which inputs are sized."""
    from compile_offload.pipeline.backend import _sized_inputs

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (x * 2).sum(), backend=capture, dynamic=True)
    compiled(torch.randn(12, 48))
    (gm,) = graphs
    sized = _sized_inputs(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = [torch.randn(30, 20) if isinstance(n.meta.get("example_value"), torch.Tensor) else 0 for n in placeholders]
    assert sized(tuple(args)) == 600
    torch._dynamo.reset()


def test_off_by_default_and_nothing_without_a_budget():
    assert compile_offload.config.verify_budget is False
    model, x = _model()
    assert _steps(model, x, steps=1, memory_budget=None, inner_compiler="eager") == []


@pytest.mark.inductor
def test_measures_the_inductor_compiled_step():
    """Under Inductor the measured step includes the buffers of the generated code; 64 KiB
    cannot hold the gradients, so the first step warns, once."""
    model, x = _model()
    with torch._inductor.config.patch(fx_graph_cache=False):
        messages = _steps(model, x, steps=2, memory_budget="64KiB", inner_compiler="inductor")
    assert len(messages) == 1, messages


@pytest.mark.inductor
def test_a_compiled_train_step_function_runs_the_measuring_hooks_untraced(caplog):
    """A whole train-step function compiled (loss.backward() inside: a graph break): the
    backward hooks that measure the step ran in frames Dynamo traced, which said it would
    ignore the profiler and could not trace time.perf_counter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 8))
    x = torch.randn(512, 32)

    def step(batch):
        loss = model(batch).square().mean()
        loss.backward()
        return loss.detach()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=compile_offload.offload_remat(memory_budget=1000, verify_budget=True))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad()
            compiled(x)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "perf_counter" in m or "will be ignored" in m], said
    assert [m for m in said if "verify_budget: the first compiled step measured" in m]


@pytest.mark.parametrize(("device", "measured"), [("cuda:1", "cuda:1"), ("cuda", "cuda:0")])
def test_a_graph_on_a_cuda_device_is_measured_on_that_device(device, measured, monkeypatch):
    """review30c F2: verify_budget and the plan trials read the current device's counters,
    not those of the graph's device (a model on cuda:1, the current device 0: nothing
    measured, no warning)."""
    from compile_offload.runtime.step_measure import StepMeasure

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert StepMeasure(torch.device(device)).device_or_current() == torch.device(measured)
