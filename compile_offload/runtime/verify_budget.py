"""``config.verify_budget``: measure the first compiled step of a graph against its budget.

The plan keeps the budget in the planner's model of the program; the program that runs is
Inductor's, whose fusions can stretch buffer lifetimes beyond the plan (docs/design.md,
"Where the compiled peak exceeds the plan"). This closes the loop for the user: the first
call of each compiled graph is measured at the allocator, from the forward call to the end
of that graph's backward (hooks on the compiled autograd node), and one warning gives the
measured peak, the budget and the predicted peak when the measurement exceeds the budget
by more than ``TOLERANCE``. On the CPU the measure is a profiler of its own, and profilers
do not nest: a step run while another profiler records is not measured (one warning says
so), and the first step run outside one is.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .memory_tracker import AllocationLedger, measure_peak, profiler_recording
from ..passes.plan import Plan, format_bytes
from ..torch_api.utils import tree_leaves

TOLERANCE = 0.01  # the allocator may measure a little above the plan's exact bytes


def verify_first_step(compiled: Callable[..., Any], plan_of: Callable[[], Plan | None], device: torch.device,
                      graph_name: str) -> Callable[..., Any]:
    """``compiled`` (a Dynamo backend's result), measuring its first training step.
    ``plan_of()`` returns the graph's plan (known once the graph is compiled)."""
    state = {"done": False}

    def run(*args):
        plan = plan_of()
        if state["done"] or plan is None or plan.budget_bytes is None or not torch.is_grad_enabled():
            return compiled(*args)
        if device.type != "cuda" and profiler_recording():
            if not state.get("warned"):
                state["warned"] = True
                warnings.warn(f"compile_offload: {graph_name}: verify_budget did not measure this step: a "
                              "torch.profiler is recording, and the CPU measure is a profiler of its own, which "
                              "would end yours; the first step run outside a profiler is measured", stacklevel=2)
            return compiled(*args)
        state["done"] = True
        step = _StepMeasure(device)
        outputs = step.forward(compiled, args)
        node = _compiled_backward_node(outputs)
        if node is None:  # no backward to wait for: the forward alone is the step
            warn_if_over_budget(plan, step.peak_bytes(), graph_name)
            return outputs
        node.register_prehook(lambda *_: step.start_backward())

        def backward_done(*_):
            step.end_backward()
            if step.interrupted:  # a profiler opened between the forward and this backward
                return
            warn_if_over_budget(plan_of(), step.peak_bytes(), graph_name)

        node.register_hook(backward_done)
        return outputs

    return run


class _StepMeasure:
    """One step's peak: the forward call and the compiled backward, each its own region.

    On the CPU each is a profiler region of its own: the autograd engine restores the
    thread's profiler state when a backward ends, so a profiler opened in the forward and
    closed in a backward hook would stay enabled. ``AllocationLedger`` joins the two regions
    (the loss computed between them is not seen; memory freed there stays counted). On CUDA
    the caching allocator's peak counter spans both."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.ledger = AllocationLedger()
        self._region = None
        self._cuda_peak = None
        self.interrupted = False  # a profiler of someone else's recorded when the backward started

    def forward(self, compiled: Callable[..., Any], args) -> Any:
        if self.cuda:
            self._region = measure_peak(self.device_or_current())
            self._cuda_peak = self._region.__enter__()
            return compiled(*args)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            outputs = compiled(*args)
        self.ledger.add(prof)
        return outputs

    def device_or_current(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def start_backward(self) -> None:
        if not self.cuda:
            if profiler_recording():
                self.interrupted = True
                return
            self._region = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                  profile_memory=True)
            self._region.__enter__()

    def end_backward(self) -> None:
        if self._region is None:
            return
        self._region.__exit__(None, None, None)
        if not self.cuda:
            self.ledger.add(self._region)
        self._region = None

    def peak_bytes(self) -> int:
        if self.cuda:
            self.end_backward()
            return self._cuda_peak.peak_bytes
        return self.ledger.peak_bytes


def _compiled_backward_node(outputs: Any):
    """The autograd node of the compiled graph's backward among ``outputs``' grad_fns (an
    output that is a view has a view node in front of it)."""
    pending = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while pending:
        node = pending.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in type(node).__name__:
            return node
        if len(seen) < 16:
            pending.extend(next_node for next_node, _ in node.next_functions)
    return None


def warn_if_over_budget(plan: Plan | None, measured_bytes: int, graph_name: str) -> bool:
    """Warn (and return True) when ``measured_bytes`` exceeds the plan's budget by more than
    ``TOLERANCE``."""
    if plan is None or plan.budget_bytes is None or measured_bytes <= plan.budget_bytes * (1 + TOLERANCE):
        return False
    warnings.warn(
        f"compile_offload: {graph_name}: verify_budget: the first compiled step measured "
        f"{format_bytes(measured_bytes)} at the allocator, above the memory budget "
        f"{format_bytes(plan.budget_bytes)} (+{measured_bytes / plan.budget_bytes - 1:.1%}; predicted peak "
        f"{format_bytes(plan.predicted_peak_bytes)}). "
        + _why_over(plan)
        + "docs/troubleshooting.md, 'When memory surprises you'",
        stacklevel=2,
    )
    return True


def _why_over(plan: Plan) -> str:
    """What the plan already said about the budget: the planner's verdict, and the budget
    loop's from the code Inductor generated (``Plan.meets_budget``)."""
    if not plan.meets_budget():
        if not plan.feasible:
            return "The plan itself did not fit (the budget is below the minimum it can reach). "
        return (f"No plan the budget loop compiled fit in Inductor's code (scheduled peak "
                f"{format_bytes(plan.scheduled_peak_bytes)}), as its warning said. ")
    return ("The program that ran holds more than the plan predicts (docs/design.md, 'Where the compiled peak "
            "exceeds the plan'); a lower budget leaves room for it. ")
