"""``config.verify_budget``: measure the first compiled step of a graph against its budget.

The plan keeps the budget in the planner's model of the program; the program that runs is
Inductor's, whose fusions can stretch buffer lifetimes beyond the plan (docs/design.md,
"Where the compiled peak exceeds the plan"). This closes the loop for the user: the first
call of each compiled graph is measured at the allocator, from the forward call to the end
of that graph's backward (hooks on the compiled autograd node), and one warning gives the
measured peak, the budget and the predicted peak when the measurement exceeds the budget
by more than ``TOLERANCE``. A graph with dynamic sizes serves every size with one plan, and
its first call is often not its largest (a short last batch compiled it): it is measured
again at the first call whose sized inputs hold more elements than any measured so far, up
to ``MAX_MEASURES`` times, and warns once. On the CPU the measure is a profiler of its own,
and profilers do not nest: a step run while another profiler records is not measured (one
warning says so), and the first step run outside one is.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .memory_tracker import profiler_recording
from .step_measure import StepMeasure, compiled_backward_node, on_fake_tensors
from ..passes.plan import Plan, format_bytes

TOLERANCE = 0.01  # the allocator may measure a little above the plan's exact bytes
MAX_MEASURES = 4  # steps of a graph with dynamic sizes measured, each at larger sizes than the last


def verify_first_step(compiled: Callable[..., Any], plan_of: Callable[[], Plan | None], device: torch.device,
                      graph_name: str, sized: Callable[[tuple], int] | None = None,
                      budget_per_call: bool = True) -> Callable[..., Any]:
    """``compiled`` (a Dynamo backend's result), measuring its first training step.
    ``plan_of()`` returns the graph's plan (known once the graph is compiled). ``sized(args)``,
    for a graph with dynamic sizes: the elements of a call's symbolically sized inputs; a
    step whose call holds more than every step measured before is measured too (the module
    docstring). A graph called
    again before the measured call's backward (a model calling it several times a step) is
    measured from its first call to that call's backward. A measured forward whose backward
    never runs (a pass whose output was dropped: a later call's backward ran first, and no
    call of this step is pending) is not a step: the next call is measured instead, and so is
    the next one after a step a profiler of yours interrupted. Where that happens twice in a
    row (each step's first call dropped: a target computed with grad on, then detached), a
    step is measured from the call that trained in the last one, by its place in the step.
    ``budget_per_call`` (``budget_scope="graph"``): where later calls trained while the
    measured one waited for its backward, each held its saved tensors beside the others',
    beyond what one call's budget bounds: one warning says so."""
    # pending: the measured step whose backward is awaited; passed: a later call's backward
    # ended while it waited (its own may never run), and trained: the first such call's place
    # in the step (0 is the measured call); calls: the calls since the step began; skip: how
    # many calls of a step run before the one measured (the calls before the one that trained
    # in a step whose measured call was dropped: a target computed with grad on, then detached)
    # measured: the steps measured (0 until the first ends); largest: the most elements a measured
    # call's sized inputs held; warned: a step was over; overlapping: the places of the later calls
    # whose backwards ended while the measured call's waited (their saved tensors were held with its)
    state: dict[str, Any] = {"done": False, "pending": None, "passed": False, "trained": None, "calls": 0,
                             "skip": 0, "drops": 0, "measured": 0, "largest": -1, "warned": False,
                             "overlapping": set()}

    def run(*args):
        plan = plan_of()
        if plan is None or plan.budget_bytes is None or not torch.is_grad_enabled() or on_fake_tensors(args):
            return compiled(*args)
        if state["done"]:
            if not _larger(state, sized, args):
                return compiled(*args)
            state["done"] = False  # a step at larger sizes: measured as the first was
        if device.type != "cuda" and profiler_recording():
            if not state.get("warned_profiler"):
                state["warned_profiler"] = True
                warnings.warn(f"compile_offload: {graph_name}: verify_budget did not measure this step: a "
                              "torch.profiler is recording, and the CPU measure is a profiler of its own, which "
                              "would end yours; the first step run outside a profiler is measured", stacklevel=2)
            return compiled(*args)
        pending = state["pending"]
        if pending is not None and not state["passed"]:  # called again within the measured step
            state["calls"] += 1
            place = state["calls"]
            outputs = compiled(*args)
            node = compiled_backward_node(outputs)
            if node is not None:
                node.register_hook(torch.compiler.disable(lambda *_: _trained(state, pending, place)))
            return outputs
        if pending is not None:  # its backward never ran: not a step
            pending.end_backward()
            state["pending"] = None
            # Dropped twice in a row: each step's first call is dropped (a target computed with
            # grad on, then detached), so a step is measured from the call that trained instead.
            state["drops"] += 1
            state["skip"], state["calls"] = (state["trained"] or 0) if state["drops"] > 1 else 0, 0
        state["passed"], state["trained"], state["overlapping"] = False, None, set()
        if state["calls"] < state["skip"]:  # a call before the one that trains: not measured
            state["calls"] += 1
            return compiled(*args)
        state["calls"] = 0
        if sized is not None:
            state["largest"] = max(state["largest"], sized(args))
        step = StepMeasure(device)
        outputs = step.forward(compiled, args)
        node = compiled_backward_node(outputs)
        if node is None:  # no backward to wait for: the forward alone is the step
            _measured(state, plan, step.peak_bytes(), graph_name)
            return outputs
        state["pending"] = step

        # The hooks run where the backward runs: inside a compiled train-step function too,
        # whose frames Dynamo would trace (the profiler, the clock) rather than run.
        @torch.compiler.disable
        def backward_started(*_):
            if state["pending"] is step:
                step.start_backward()

        @torch.compiler.disable
        def backward_done(*_):
            if state["pending"] is not step:  # dropped: another call began before this backward
                return
            state["pending"], state["drops"] = None, 0  # its own backward ran: no drop in a row
            step.end_backward()
            if budget_per_call and state["overlapping"] and not state.get("warned_calls"):
                state["warned_calls"] = True
                calls = len(state["overlapping"]) + 1
                warnings.warn(f"compile_offload: {graph_name}: verify_budget: the first step called this graph "
                              f"{calls} times before the backward of its first call (a shared block, a siamese "
                              "model, or identical layers compiled one by one, which share a graph): each call "
                              "holds its own saved tensors, and under budget_scope='graph' the memory budget bounds "
                              f"one call, so the step can hold about {calls}x this graph's peak; a byte budget "
                              "with budget_scope='step' bounds every call of the step together", stacklevel=2)
            if step.interrupted:  # a profiler opened between the forward and this backward: measure the next
                return
            _measured(state, plan_of(), step.peak_bytes(), graph_name)

        node.register_prehook(backward_started)
        node.register_hook(backward_done)
        return outputs

    return run


def _larger(state: dict[str, Any], sized: Callable[[tuple], int] | None, args: tuple) -> bool:
    """Whether a call of a graph whose steps were measured is one to measure: dynamic sizes,
    larger than any measured, with measures left."""
    return sized is not None and state["measured"] < MAX_MEASURES and sized(args) > state["largest"]


def _measured(state: dict[str, Any], plan: Plan | None, peak_bytes: int, graph_name: str) -> None:
    """A step's measure ended: warn where it is over, once a graph."""
    state["done"] = True
    state["measured"] += 1
    if not state["warned"]:
        which = "the first compiled step" if state["measured"] == 1 else "the first step at larger sizes"
        state["warned"] = warn_if_over_budget(plan, peak_bytes, graph_name, which)


def _trained(state: dict[str, Any], pending: Any, place: int) -> None:
    """A backward of the call at ``place`` in the step of ``pending`` ended."""
    if state["pending"] is pending:
        state["passed"] = True
        state["overlapping"].add(place)
        state["trained"] = place if state["trained"] is None else min(state["trained"], place)


def warn_if_over_budget(plan: Plan | None, measured_bytes: int, graph_name: str,
                        which: str = "the first compiled step") -> bool:
    """Warn (and return True) when ``measured_bytes``, measured in ``which`` step, exceeds the
    plan's budget by more than ``TOLERANCE``."""
    if plan is None or plan.budget_bytes is None or measured_bytes <= plan.budget_bytes * (1 + TOLERANCE):
        return False
    # memory_budget=0.0 asks for the minimum-memory plan: its budget is 0 bytes
    over = f"+{measured_bytes / plan.budget_bytes - 1:.1%}" if plan.budget_bytes else "a budget of 0"
    predicted = ("no plan: torch's partition ran" if plan.fallback is not None
                 else f"predicted peak {format_bytes(plan.predicted_peak_bytes)}")
    warnings.warn(
        f"compile_offload: {graph_name}: verify_budget: {which} measured "
        f"{format_bytes(measured_bytes)} at the allocator, above the memory budget "
        f"{format_bytes(plan.budget_bytes)} ({over}; {predicted}). "
        + _why_over(plan)
        + "docs/troubleshooting.md, 'When memory surprises you'",
        stacklevel=2,
    )
    return True


def _why_over(plan: Plan) -> str:
    """What the plan already said about the budget: the planner's verdict, and the budget
    loop's from the code Inductor generated (``Plan.meets_budget``)."""
    if plan.fallback is not None:
        return (f"The planner did not plan this graph ({plan.fallback}): torch's partition ran, and nothing "
                "bounded its peak. ")
    if plan.budget_bytes == 0:  # met by the minimum-memory plan it asks for (Plan.meets_budget)
        return "A budget of 0 asks for the minimum-memory plan, and no step fits in 0 bytes. "
    if not plan.meets_budget():
        if not plan.feasible and plan.time_limit_reached:
            return "The plan itself did not fit (plan_time_limit stopped the search before one within the budget). "
        if not plan.feasible:
            return "The plan itself did not fit (the budget is below the minimum it can reach). "
        return (f"No plan the budget loop compiled fit in Inductor's code (scheduled peak "
                f"{format_bytes(plan.scheduled_peak_bytes)}), as its warning said. ")
    if plan.device_profile == "cpu" and any(d.dtype in ("bfloat16", "float16") for d in plan.decisions):
        return ("The program that ran holds more than the plan predicts: on the CPU, ATen's bf16 and fp16 matmuls "
                "hold temporaries no plan counts, where the graph has them (docs/limitations.md); a lower budget "
                "leaves room for them. ")
    return ("The program that ran holds more than the plan predicts (docs/design.md, 'Where the compiled peak "
            "exceeds the plan'); a lower budget leaves room for it. ")
