"""One byte budget for the whole training step across graph breaks (``budget_scope="step"``).

Where Dynamo compiles a model into several graphs, each is planned on its own, and under
``budget_scope="graph"`` each gets the whole budget. Under ``"step"`` the budget B bounds the
step.

The rule, a bound: what a step has allocated above its start is, at any moment, what each
graph call of the step has allocated and still holds, and a call never holds more than its
graph's peak. So the step's peak is at most ``sum(c_k * P_k)`` over the graphs, ``c_k`` the
calls of graph k in one step (a block graph run for every layer is called once per layer)
and ``P_k`` its peak. The budget is split so that this sum is B, by what each graph can use:

- graph k can use from ``m_k`` (its minimum-memory plan's peak, as Inductor scheduled it) to
  ``u_k`` (its unconstrained plan's predicted peak);
- each gets ``B_k = m_k + f * (u_k - m_k)``, one share ``f`` of its range for all graphs:
  ``f = (B - sum(c_k m_k)) / sum(c_k (u_k - m_k))``; where every graph fits unconstrained
  (``f >= 1``) what is left is shared per call;
- where ``sum(c_k m_k)`` exceeds B, every graph keeps its minimum-memory plan, with one
  warning naming both figures.

When: a graph is first compiled (as the first step reaches it) at its minimum-memory plan,
the lowest the step can go while the graphs after it are unknown. A step ends when the
backward of every call made since the last time none was pending has run; the first step
that began after a graph was added is counted, and at its end the budget is split, and each
graph whose share changed is compiled again under it at its next call. Every step's calls
are counted: a step that calls a graph more often than the split counted (a data-dependent
number of layers, or a graph first called after the split) splits again at its end with
those calls. A graph added later (a recompile for new sizes) runs its minimum-memory plan,
and the next full step splits again; a graph not called in that step whose frame's later
compile was (a recompile that made a size dynamic: Dynamo tries a frame's latest code first)
is left out of the split until it is called again. A graph with dynamic sizes runs its share's plan at the
sizes of the call it was compiled again at, its minimum-memory plan at others, whose predicted
peak at each new size is checked against the graph's share (``dynamic_check.check_sizes``,
one warning). A call whose autograd graph was dropped before its backward (a check forward
with grad, a forward that raised) is not waited for, nor counted in the next step; one whose
backward has not run when a graph is called again after other calls' backwards ran (an output
the loss does not use, held) is given up on: the step ended with the last backward that ran.
A graph run again inside a backward (activation checkpointing's recompute) is part of the step
under way and counts as the call it recomputes. Graphs whose plan is torch's own partition (no prediction) are left out of the split,
with a warning: their memory is not bounded.

Memory outside the graphs is held back from B before the split:

- parameters gathered for the step (FSDP2 all-gathers a module's parameters before its graph
  runs and frees their storage after): graph inputs, so in no graph's peak. The most of them
  alive at once in the step counted (``GatheredParameters``) is held back.
- on CUDA, whatever else a measured step shows: the second step run wholly under the shares
  (the first may allocate once) is measured at the allocator; where it is over B by more than
  ``TOLERANCE``, the excess is held back too and the budget split again, at most
  ``MAX_CORRECTIONS`` times, then one warning names the measured peak. Under ``RELAX_BELOW``
  of B, the rest is given to the graphs once (the sum of peaks over-counts), and taken back if
  the next measured step is over B. On the CPU no step is measured (its measure is a profiler,
  which cannot stay open across several graphs and their backwards); where FSDP2 gathers
  parameters, one warning says its reduce-scattered gradients are not held back.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..passes.plan import Plan, format_bytes
from ..pipeline.result import BudgetError
from ..torch_api.utils import in_backward, queue_backward_callback, tree_leaves
from .memory_tracker import cuda_device, reads_cuda_peak, reset_cuda_peak
from .step_measure import compiled_backward_node, on_fake_tensors

log = logging.getLogger("compile_offload")

# A graph is compiled again only when its share moved by more than this part of it.
RESPLIT_TOLERANCE = 0.01


@dataclass(frozen=True)
class GraphNeed:
    """What the split needs of one graph: its calls in a step and its plan range."""

    name: str
    calls: int
    min_bytes: int
    max_bytes: int


def split_budget(budget_bytes: int, needs: list[GraphNeed]) -> tuple[dict[str, int], float]:
    """Each graph's byte budget (by name) and the share ``f`` of its range it got (module
    docstring); ``f < 0`` where even the minimum-memory plans exceed the budget (each graph
    then gets its minimum)."""
    floor = sum(n.calls * n.min_bytes for n in needs)
    room = sum(n.calls * max(0, n.max_bytes - n.min_bytes) for n in needs)
    calls = sum(n.calls for n in needs)
    if floor > budget_bytes:
        return {n.name: n.min_bytes for n in needs}, -1.0
    if room <= budget_bytes - floor:
        extra = (budget_bytes - floor - room) // max(1, calls)
        return {n.name: max(n.max_bytes, n.min_bytes) + extra for n in needs}, 1.0
    share = (budget_bytes - floor) / room
    return {n.name: n.min_bytes + int(share * max(0, n.max_bytes - n.min_bytes)) for n in needs}, share


def split_budget_over_steps(budget_bytes: int, needs: list[GraphNeed],
                            steps: Iterable[frozenset[tuple[str, int]]]) -> tuple[dict[str, int], float]:
    """``split_budget`` for graphs that do not all run in every step (a GAN's discriminator
    step and generator step; a module frozen in some steps, whose frame then runs another
    compile): ``steps`` holds each kind of step seen, as (graph name, calls) pairs. One share
    ``f`` for all graphs, the largest that keeps every kind of step within the budget; a
    graph counted in no kind of step (or without ``steps``) counts with ``needs``' calls in
    each."""
    by_name = {n.name: n for n in needs}
    kinds = [[GraphNeed(name, calls, by_name[name].min_bytes, by_name[name].max_bytes)
              for name, calls in sorted(step) if name in by_name] for step in steps]
    counted = {n.name for kind in kinds for n in kind}
    kinds = [kind + [n for n in needs if n.name not in counted] for kind in kinds if kind] or [needs]
    tightest = min((split_budget(budget_bytes, kind) for kind in kinds), key=lambda split: split[1])
    share = tightest[1]
    if share < 0:
        return {n.name: n.min_bytes for n in needs}, share
    if share < 1:
        return {n.name: n.min_bytes + int(share * max(0, n.max_bytes - n.min_bytes)) for n in needs}, share
    extra = min(split_budget(budget_bytes, kind)[0][kind[0].name] - max(kind[0].max_bytes, kind[0].min_bytes)
                for kind in kinds)  # every kind has room above its unconstrained plans: the least of it
    return {n.name: max(n.max_bytes, n.min_bytes) + extra for n in needs}, share


def minimum_parts(budget_bytes: int, needs: list[GraphNeed], floor: int) -> dict[str, int]:
    """Each graph's part of a budget below ``floor`` (what the minimum-memory plans need): its
    minimum scaled down by budget / floor. Its minimum-memory plan runs under it, and says it
    does not meet it."""
    return {n.name: n.min_bytes * budget_bytes // max(1, floor) for n in needs}


def step_floor(needs: list[GraphNeed], steps: Iterable[frozenset[tuple[str, int]]]) -> int:
    """The minimum-memory plans' bytes over the kind of step that needs the most."""
    by_name = {n.name: n for n in needs}
    floors = [sum(calls * by_name[name].min_bytes for name, calls in step if name in by_name) for step in steps]
    return max(floors, default=sum(n.calls * n.min_bytes for n in needs))


def need_of(name: str, plan: Plan | None, calls: int) -> GraphNeed | None:
    """A graph's need from its minimum-memory plan (the backend's first compile under
    ``budget_scope="step"``, at memory_budget 0.0): from that plan's peak (as Inductor
    scheduled it where known, else the lowest peak its search predicted) to its unconstrained
    predicted peak; a plan of ours with nothing to decide (its backward needs only the graph's
    inputs) needs its own peak; None for a graph without a plan of ours (torch's partition:
    nothing to plan or predict)."""
    if plan is None or plan.fallback is not None:
        return None
    if not plan.decisions:
        peak = max(plan.predicted_peak_bytes, plan.scheduled_peak_bytes or 0)
        return GraphNeed(name, calls, peak, peak) if peak else None
    # The code of the plan compiled at 0.0 is the lowest the graph reaches: the plan the budget
    # loop kept there may be the other search start's lowest, a re-plan, or the unconstrained
    # plan, lower in code than its predicted minimum.
    low = max(plan.min_peak_bytes, plan.scheduled_peak_bytes or 0)
    return GraphNeed(name, calls, low, max(low, plan.baseline_peak_bytes))


@dataclass
class _Graph:
    name: str
    compiled: Callable[..., Any]
    plan_of: Callable[[], Plan | None]
    # (its share, the arguments of the call it is compiled at) -> its code and plan
    recompile: Callable[[int, tuple], tuple[Callable[..., Any], Callable[[], Plan | None]]]
    calls: int = 0  # in the step being counted
    most_calls: int = 0  # in any step counted: the split counts a graph as often as it was ever called
    budget_bytes: int | None = None  # its share, once split
    pending: bool = False  # compile again under ``budget_bytes`` at the next call
    need: GraphNeed | None = None  # its range, read off its minimum-memory plan at the first split
    wrapper: Any = field(default=None, repr=False)
    # Dynamo's (frame, compile of that frame) it was compiled at; None outside Dynamo
    compile_id: tuple[int, int] | None = None
    left_out: bool = False  # left out of the last split as replaced by a later compile of its frame
    trained: bool = False  # called with a backward to run, once at least (a graph never is: a frozen teacher's)
    revived: bool = False  # called after being left out so: the later compile does not replace it
    # its first compile, at its minimum-memory plan: what a share at or below its minimum runs
    minimum: tuple[Callable[..., Any], Callable[[], Plan | None]] | None = field(default=None, repr=False)

    def superseded_by(self, other: "_Graph") -> bool:
        """Whether ``other``, called in the step counted where this graph was not, is a later
        compile of the same frame: Dynamo tries a frame's latest code first, so a recompile
        that made a size dynamic serves every call the earlier code did, which then never
        runs again (a frame recompiled for another reason, such as inputs that require grad,
        runs its earlier code again: that call brings it back into the split for good). A graph
        never called with a backward to run (a frozen teacher's, an evaluation's) replaced
        nothing: it is in no split, as it saves nothing."""
        return (not self.revived and self.trained and self.compile_id is not None and other.compile_id is not None
                and not self.calls and other.calls > 0
                and other.compile_id[0] == self.compile_id[0] and other.compile_id[1] > self.compile_id[1])


# After a split, the second step run wholly under the shares is measured (where the device has a
# cheap whole-step measure: CUDA); a step over the budget by more than TOLERANCE takes its excess
# off the budget and splits again, at most this many times.
TOLERANCE = 0.01
MAX_CORRECTIONS = 2
# A first measured step under this part of the budget gives the rest to the graphs, once: the
# sum of peaks over-counts (graphs do not peak at once). If the step then measures over the
# budget, the split that measured within comes back.
RELAX_BELOW = 0.95
# Steps run wholly under new shares before one is measured: the first run of new code may
# allocate once (cuBLAS workspaces, autotuning), and verify_budget measures that step itself.
SETTLING_STEPS = 1


class CudaStepMeter:
    """A step's peak above its start at the CUDA caching allocator (its peak counter is reset
    at the start, as ``measure_peak`` and ``verify_budget`` do)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda_device = cuda_device(device)
        self.held_peak = 0  # the peak before a region measured within the step reset the counter
        self._start = 0

    def start(self) -> None:
        reset_cuda_peak(self.device)
        self.held_peak = 0
        self._start = torch.cuda.memory_allocated(self.device)
        reads_cuda_peak(self)

    def peak_bytes(self) -> int:
        return max(0, self.absolute_peak_bytes() - self._start)

    def absolute_peak_bytes(self) -> int:
        """The allocator's peak since ``start``, counting what was allocated before it."""
        torch.cuda.synchronize(self.device)
        return max(self.held_peak, torch.cuda.max_memory_allocated(self.device))

    def phase_peak_bytes(self) -> int:
        """As ``absolute_peak_bytes``, and the peak counter starts again: the next read
        gives the peak of what ran after this one (a step's optimizer step after its backward)."""
        peak = self.absolute_peak_bytes()
        reset_cuda_peak(self.device)
        self.held_peak = 0
        return peak


class StepBudget:
    """The graphs one backend compiled under one byte budget, and the split between them.
    ``meter`` measures a whole step's peak (``CudaStepMeter``; None where the device has no
    cheap measure: the CPU's is a profiler, which a step spanning several graphs and their
    backwards cannot hold open)."""

    def __init__(self, budget_bytes: int, meter: Any = None, strict: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.meter = meter
        self.strict = strict  # strict_budget: minimum-memory plans over the budget raise ``BudgetError``
        self.measuring = False  # the step under way is measured
        self.to_check = False  # a step wholly under the shares is still to be measured
        self.settling = 0  # steps wholly under the shares still to run before the one measured
        self.corrections = 0
        self.relaxations = 0
        self.relaxed_from: int | None = None  # measured_excess before the relaxation being measured
        self.last_share = -1.0  # the share of their ranges the graphs got at the last split
        self.gathered_bytes = 0  # FSDP2's gathered parameters, the most held at once in the step counted
        self.measured_excess = 0  # taken off the budget after a measured step exceeded it
        self._needs: list[GraphNeed] = []
        self._steps: set[frozenset[tuple[str, int]]] = set()  # each kind of step split for: its graphs' calls
        self._graphs: list[weakref.ref] = []  # of each graph's wrapper: a graph Dynamo dropped drops out
        # the calls (by number) whose backward has not run, each to its backward node: a call
        # whose autograd graph was dropped (a check forward, an exception) is in flight no more
        self._in_flight: dict[int, weakref.ref] = {}
        self._calls_made = 0
        self._backward_since_call = False  # a call's backward ran since the last graph call
        self.state = "wait"  # "wait" for a step to begin, "count" its calls, "done" once split
        self.splits = 0
        self.gathered = GatheredParameters()  # of the step being counted
        self._warned: set[str] = set()

    def graphs(self) -> list[_Graph]:
        return [wrapper.graph for wrapper in (ref() for ref in self._graphs) if wrapper is not None]

    def add(self, name: str, compiled: Callable[..., Any], plan_of: Callable[[], Plan | None],
            recompile: Callable[[int, tuple], tuple[Callable[..., Any], Callable[[], Plan | None]]],
            compile_id: tuple[int, int] | None = None) -> Callable[..., Any]:
        """``compiled`` (the graph at its minimum-memory plan) wrapped: its calls are counted,
        and it is compiled again with ``recompile(budget_bytes, args)`` at its first call once
        its share is known (``args``: that call's arguments). ``compile_id``: Dynamo's
        (frame, compile of that frame) of the graph."""
        graph = _Graph(name, compiled, plan_of, recompile, compile_id=compile_id, minimum=(compiled, plan_of))
        budget = self

        def run(*args):
            if on_fake_tensors(args):  # DDPOptimizer runs each bucket graph on fake tensors while compiling
                return graph.compiled(*args)
            if graph.pending and graph.need is not None and graph.budget_bytes <= graph.need.min_bytes:
                # No plan made under its minimum peaks lower than the minimum-memory plan it was
                # first compiled at (a re-plan under that figure may peak a few KiB over it).
                graph.pending = False
                log.info("%s: budget_scope='step': its share of the step's budget, %s, is at or below its minimum: "
                         "it runs its minimum-memory plan", graph.name, format_bytes(graph.budget_bytes))
                graph.compiled, graph.plan_of = graph.minimum[0], _under_share(graph.minimum[1], graph.budget_bytes)
                budget._new_code()
            if graph.pending:
                graph.pending = False
                log.info("%s: budget_scope='step': compiling this graph again under its share of the step's "
                         "budget, %s", graph.name, format_bytes(graph.budget_bytes))
                budget._new_code()
                try:
                    graph.compiled, graph.plan_of = graph.recompile(graph.budget_bytes, args)
                except Exception as error:  # the plan it runs is correct: keep it, and say so
                    if isinstance(error, BudgetError) and budget.strict:
                        raise
                    warnings.warn(f"compile_offload: {graph.name}: budget_scope='step': compiling this graph under "
                                  f"its share {format_bytes(graph.budget_bytes)} failed ({type(error).__name__}: "
                                  f"{error}); it keeps the plan it runs", stacklevel=2)
                    # measured (verify_budget) against its share, not the budget the plan was made under
                    graph.plan_of = _under_share(graph.plan_of, graph.budget_bytes)
            # A call inside a backward (activation checkpointing's recompute) is part of the step
            # under way, and its backward is not run: it neither begins a step nor is waited for.
            recompute = in_backward()
            if not recompute:
                budget._step_may_begin()
                budget._backward_since_call = False
            if budget.state == "count":
                budget.gathered.see(args)
            outputs = graph.compiled(*args)
            node = compiled_backward_node(outputs)
            if node is not None and not recompute:  # a recompute stands for the call it recomputes
                budget._calls_made += 1
                call = budget._calls_made
                budget._in_flight[call] = weakref.ref(node)
                graph.calls += 1
                graph.trained = True
                if graph.left_out:  # not replaced by its frame's later compile after all: never left out again
                    graph.left_out, graph.revived = False, True
                if budget.state == "count":
                    node.register_prehook(_untraced(budget.gathered.sample))
                node.register_hook(_untraced(budget._backward_done, call))
            return outputs

        run.graph = graph
        # The plan the graph runs under its share (None before: ``verify_budget`` then waits, as
        # the minimum-memory plan's budget is not the step's).
        run.graph_plan_of = lambda: graph.plan_of() if graph.budget_bytes is not None and not graph.pending else None
        graph.wrapper = weakref.ref(run)
        self._graphs.append(weakref.ref(run))
        if self.state == "done":  # a graph after the split: split again after the next full step
            self.state = "wait"
            log.info("%s: budget_scope='step': a graph compiled after the budget was split runs its minimum-memory "
                     "plan; the next full step splits the budget again", name)
        return run

    @property
    def reserved(self) -> int:
        """Bytes of the budget held back from the graphs' split: FSDP2's gathered parameters,
        and what a measured step was over."""
        return self.gathered_bytes + self.measured_excess

    @property
    def outstanding(self) -> int:
        """Calls whose backward has not run, whose autograd graph is alive (and that were not
        given up on)."""
        self._in_flight = {call: node for call, node in self._in_flight.items() if node() is not None}
        return len(self._in_flight)

    def _step_may_begin(self) -> None:
        if self.outstanding and self._backward_since_call:
            self._end_step_without(self.outstanding)
        if self.outstanding:
            return
        for graph in self.graphs():  # a step begins: its calls are counted, split or not
            graph.calls = 0
        if self.state in ("wait", "count"):  # "count": the step begun had no backward (its graph dropped)
            self.state = "count"
            self.gathered = GatheredParameters()
        elif self.state == "done" and self.to_check and self.meter is not None:
            if self.settling:  # new code's first run: one-time workspaces, verify_budget's own measure
                self.settling -= 1
                return
            self.to_check, self.measuring = False, True
            self.meter.start()

    def _new_code(self) -> None:
        """A graph changes its code under a new share: the step under way does not measure the
        split (another step will), and its new code's first run is still to settle. A graph
        still waiting to change (its share given, not called since: a frame Dynamo compiled
        again for other sizes) keeps no step from being measured."""
        self.settling = SETTLING_STEPS
        if self.measuring:
            self.measuring, self.to_check = False, True

    def _end_step_without(self, abandoned: int) -> None:
        """A graph call begins after backwards have run while other calls' backwards have not:
        those never will within the step (a forward whose output the loss does not use, a
        forward run with grad outside training), and the step ended with the last backward
        that ran. It is counted or measured as ended there; the calls left are given up on."""
        log.info("budget_scope='step': %d graph call(s) of the last step had no backward by the time the next "
                 "step began (outputs outside the loss, or a forward outside training): not waited for",
                 abandoned)
        self._in_flight.clear()
        if self.state == "count":
            self.state = "done"
            self._split()
        elif self._called_more():
            self.measuring = False
            self._split()
        elif self.measuring:
            self.measuring = False
            self._checked(self.meter.peak_bytes())

    def _backward_done(self, call: int) -> None:
        if call not in self._in_flight:  # given up on, or its backward ran before (retain_graph)
            return
        del self._in_flight[call]
        self._backward_since_call = True
        if self.state == "count":
            self.gathered.sample()
        if self.outstanding:
            return
        # At the end of the backward, not in it: FSDP2 frees the last module's gathered
        # parameters (and reduce-scatters its gradients) in a callback queued at its start.
        if self.state == "count":
            self.state = "done"
            _after_backward(self._split)
        elif self._called_more():
            self.measuring = False  # a step of more calls than the split counted: not its measure
            _after_backward(self._split)
        elif self.measuring:
            self.measuring = False
            _after_backward(lambda: self._checked(self.meter.peak_bytes()))

    def _called_more(self) -> bool:
        """Whether, after the split, a step called a graph more often than any step counted
        before (a data-dependent number of layers), called one the split left out (first
        called after it), or called graphs together that the split counted in different kinds
        of step: then the budget is split again, with the calls of this step (INFO line)."""
        more = [graph for graph in self.graphs() if self.state == "done" and graph.most_calls < graph.calls]
        for graph in more:
            log.info("%s: budget_scope='step': called %d time(s) in a step, where the split counted %d: the budget is "
                     "split again", graph.name, graph.calls, graph.most_calls)
        if more or self.state != "done":
            return bool(more)
        # graphs split for in different kinds of step, now called in one: a kind not yet bounded
        this_step = {graph.name: graph.calls for graph in self.graphs() if graph.calls}
        covered = any(all(dict(step).get(name, 0) >= calls for name, calls in this_step.items()) for step in self._steps)
        if this_step and not covered:
            log.info("budget_scope='step': a step called %s together, which no step the split counted did: the "
                     "budget is split again", ", ".join(sorted(this_step)))
        return bool(this_step) and not covered

    def _checked(self, peak: int) -> None:
        """The first step under the shares measured ``peak``: within the budget, done (well
        under it, once, the rest is given to the graphs and measured again); over it, its excess
        is taken off the budget and the graphs split it again (after a relaxation: the split
        that measured within comes back)."""
        budget = self.budget_bytes
        if peak > budget * (1 + TOLERANCE) and self.relaxed_from is not None:
            log.info("budget_scope='step': with the room given to the graphs the step measured %s, over the budget "
                     "%s: back to the split that measured within it", format_bytes(peak), format_bytes(budget))
            self.measured_excess, self.relaxed_from = self.relaxed_from, None
            self._share(self._needs)
            self.to_check = False  # measured already
            return
        if peak <= budget * (1 + TOLERANCE):
            if peak < RELAX_BELOW * budget and not self.relaxations and 0 <= self.last_share < 1:
                self.relaxations += 1
                self.relaxed_from = self.measured_excess
                self.measured_excess -= budget - peak
                log.info("budget_scope='step': the step measured under the split took %s at the allocator, %s under "
                         "the budget %s: the graphs share that too, and the next step is measured again",
                         format_bytes(peak), format_bytes(budget - peak), format_bytes(budget))
                self._share(self._needs)
                return
            self.relaxed_from = None
            log.info("budget_scope='step': the step measured under the split took %s at the allocator, within the "
                     "budget %s", format_bytes(peak), format_bytes(budget))
            return
        if self.corrections < MAX_CORRECTIONS and self.reserved < self.budget_bytes:
            self.corrections += 1
            self.measured_excess += peak - self.budget_bytes
            log.info("budget_scope='step': the step measured %s at the allocator, over the budget %s: %s more is held "
                     "back from the graphs (memory outside them) and the budget split again", format_bytes(peak),
                     format_bytes(self.budget_bytes), format_bytes(peak - self.budget_bytes))
            self._share(self._needs)
            return
        warnings.warn(f"compile_offload: budget_scope='step': the step measured {format_bytes(peak)} at the allocator, "
                      f"above the memory budget {format_bytes(self.budget_bytes)} "
                      f"(+{peak / self.budget_bytes - 1:.1%}) "
                      f"after {self.corrections} correction(s) of the split; memory outside the compiled graphs "
                      "(FSDP2's gathered parameters and gradients, a loss outside them) is in no graph's plan",
                      stacklevel=2)

    def _split(self) -> None:
        graphs = self.graphs()
        this_step = frozenset((graph.name, graph.calls) for graph in graphs if graph.calls)
        if this_step:
            self._steps.add(this_step)
        needs, left_out = [], []
        for graph in graphs:
            if any(graph.superseded_by(other) for other in graphs):
                log.info("%s: budget_scope='step': left out of the split: a later compile of its frame runs in its "
                         "place", graph.name)
                graph.most_calls = 0  # called again, it is counted again
                graph.left_out = True
                continue
            graph.most_calls = max(graph.most_calls, graph.calls)
            if not graph.most_calls:  # never called in a step counted
                continue
            need = need_of(graph.name, graph.plan_of(), graph.most_calls)
            if need is None:
                left_out.append(graph.name)
                continue
            # The first need is its minimum-memory plan's; a plan under a share knows only the
            # lowest peak its own search simulated, not the minimum.
            graph.need = need if graph.need is None else GraphNeed(graph.name, need.calls, graph.need.min_bytes,
                                                                   graph.need.max_bytes)
            needs.append(graph.need)
        if left_out and tuple(left_out) not in self._warned:
            self._warned.add(tuple(left_out))
            warnings.warn(f"compile_offload: budget_scope='step': {', '.join(left_out)} ran torch's own partition "
                          "(no plan of ours): its memory is outside the split of the step's budget", stacklevel=2)
        if not needs:
            return
        # a split after a step not counted (more calls) sampled no gathered parameters: keep the last figure
        self.gathered_bytes = max(self.gathered_bytes, self.gathered.most_held())
        if self.gathered_bytes and self.meter is None and "gradients" not in self._warned:
            self._warned.add("gradients")
            warnings.warn(f"compile_offload: budget_scope='step': parameters gathered outside the graphs (FSDP2, "
                          f"{format_bytes(self.gathered_bytes)} at most at once) are held back from the split of "
                          f"the budget, but not the gradients FSDP2 reduce-scatters outside them (up to "
                          f"{format_bytes(self.gathered.total())} unsharded), and on this device the step is not "
                          "measured: it may exceed the budget by up to that much", stacklevel=2)
        self.gathered = GatheredParameters()  # holds the parameters: let them go
        self._needs = needs
        self._share(needs)

    def _share(self, needs: list[GraphNeed]) -> None:
        """Split what the reserve leaves of the budget between ``needs``; mark each graph whose
        share moved to compile again, and the next step wholly under the shares to be measured."""
        graphs = self.graphs()
        shares, share = split_budget_over_steps(max(0, self.budget_bytes - self.reserved), needs, self._steps)
        self.splits += 1
        self.last_share = share
        rows = "\n".join(f"  {n.name}: {n.calls} call(s), minimum {format_bytes(n.min_bytes)}, unconstrained "
                         f"{format_bytes(n.max_bytes)} -> {format_bytes(shares[n.name])}" for n in needs)
        held = "".join(f", {how} {format_bytes(n)} {what}" for how, n, what in (
            ("less", self.gathered_bytes, "of parameters gathered outside the graphs (FSDP2)"),
            ("less", self.measured_excess, "a measured step was over"),
            ("plus", -self.measured_excess, "a measured step was under")) if n > 0)
        log.info("budget_scope='step': the step's budget %s%s split over %d graph(s) (%s of each one's range):\n%s",
                 format_bytes(self.budget_bytes), held, len(needs), "none" if share < 0 else f"{min(share, 1.0):.0%}",
                 rows)
        if share < 0:
            floor = step_floor(needs, self._steps)
            plus = "".join(f" plus {format_bytes(n)} {what}" for n, what in (
                (self.gathered_bytes, "of parameters gathered outside the graphs (FSDP2: the most it held at once)"),
                (self.measured_excess, "outside the graphs (a measured step was over by that)")) if n > 0)
            message = (f"compile_offload: budget_scope='step': the graphs' minimum-memory plans need "
                       f"{format_bytes(floor)} over a step ({len(needs)} graphs, their calls counted){plus}, above "
                       f"the memory budget {format_bytes(self.budget_bytes)}")
            if self.strict:
                raise BudgetError(f"{message}; strict_budget=True")
            if message not in self._warned:  # a split again with the same figures (a graph added) says nothing new
                self._warned.add(message)
                warnings.warn(f"{message}; each keeps its minimum-memory plan", stacklevel=2)
            parts = minimum_parts(max(0, self.budget_bytes - self.reserved), needs, floor)
            for graph in graphs:
                if graph.name in parts:
                    graph.budget_bytes, graph.pending = parts[graph.name], True
            return
        by_name = {graph.name: graph for graph in graphs}
        for name, share_bytes in shares.items():
            graph = by_name[name]
            if graph.budget_bytes is not None and abs(share_bytes - graph.budget_bytes) <= RESPLIT_TOLERANCE * graph.budget_bytes:
                continue
            graph.budget_bytes = share_bytes
            graph.pending = True
        self.to_check, self.settling = True, SETTLING_STEPS


class GatheredParameters:
    """Parameters the graphs of a step take as inputs that are gathered for the step and freed
    within it (FSDP2: all-gathered before a module's forward and backward, their storage
    resized to 0 after), and the most of them alive at once.

    Such parameters are in no graph's peak: they are graph inputs. Parameters that live
    across steps (a model without FSDP2, or FSDP2's sharded ones) are not gathered and count
    for nothing here. Which are gathered is known only at the step's end (their storage is
    empty then), so each sample (a graph call's start, each backward's start and end) records
    how much of every parameter seen so far is allocated, and ``most_held`` keeps the samples'
    sums over the gathered ones. A parameter gathered before any graph has taken it (FSDP2's
    root module, gathered for the whole step, first read by the last graph of the forward) is
    counted from that graph's call on: in the backward, where every graph's peak is, it is."""

    def __init__(self) -> None:
        self._seen: dict[int, torch.Tensor] = {}
        self._samples: list[dict[int, int]] = []

    def see(self, args: tuple) -> None:
        for arg in tree_leaves(args):
            if isinstance(arg, torch.nn.Parameter):
                self._seen.setdefault(id(arg), arg)
        self.sample()

    def sample(self) -> None:
        if self._seen:
            self._samples.append({key: _storage_bytes(tensor) for key, tensor in self._seen.items()})

    def total(self) -> int:
        """Bytes of every gathered parameter, each counted once."""
        return sum(max((sample.get(key, 0) for sample in self._samples), default=0) for key in self._gathered())

    def _gathered(self) -> set[int]:
        return {key for key, tensor in self._seen.items() if _storage_bytes(tensor) == 0}

    def most_held(self) -> int:
        gathered = self._gathered()
        return max((sum(n for key, n in sample.items() if key in gathered) for sample in self._samples), default=0)


def _under_share(plan_of: Callable[[], Plan | None], share: int) -> Callable[[], Plan | None]:
    """``plan_of``'s plan (the minimum-memory one, made at memory_budget 0.0) as the plan run
    under ``share``: its budget is the share, which ``verify_budget`` measures the step against."""
    def under() -> Plan | None:
        plan = plan_of()
        if plan is None:
            return None
        return dataclasses.replace(plan, budget_bytes=share, feasible=plan.predicted_peak_bytes <= share)

    return under


def _after_backward(callback: Callable[[], None]) -> None:
    callback = torch.compiler.disable(callback)  # run, not traced, under a compiled train-step function
    if not queue_backward_callback(callback):  # not inside a backward: now
        callback()


def _untraced(function: Callable[..., None], *args: Any) -> Callable[..., None]:
    """A backward hook calling ``function(*args)``, which Dynamo runs rather than traces when
    the backward runs inside a compiled train-step function."""
    return torch.compiler.disable(lambda *_: function(*args))


def _storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()



_budgets: "weakref.WeakKeyDictionary[Any, dict[int, StepBudget]]" = weakref.WeakKeyDictionary()


def step_budget_for(owner: Any, budget_bytes: int, device: torch.device | None = None,
                    strict: bool = False) -> StepBudget:
    """The ``StepBudget`` of the graphs ``owner`` (a backend) compiles under ``budget_bytes``;
    on a CUDA ``device`` it measures the first step under each split; ``strict``
    (``strict_budget``, as the last graph added was compiled with it): a budget below the
    graphs' minimum-memory plans raises ``BudgetError`` at the end of the step counted."""
    per_budget = _budgets.setdefault(owner, {})
    if budget_bytes not in per_budget:
        meter = CudaStepMeter(device) if device is not None and device.type == "cuda" else None
        per_budget[budget_bytes] = StepBudget(budget_bytes, meter)
    per_budget[budget_bytes].strict = strict
    return per_budget[budget_bytes]
