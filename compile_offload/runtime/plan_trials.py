"""Measured plan choice, at run time: the first training steps of a graph run its candidate
plans in turn, and the fastest whose measured peak fits the budget runs from then on.

Every candidate is a complete compiled graph of the same step, so every trial step is a real
training step with the gradients eager would give; only its speed and memory differ. The
schedule is round-robin: one warm-up step per candidate (not counted); with ``on_profiled``,
one step of the planner's plan profiled for its kernels (``kernel_costs.KernelProfile``),
whose events ``on_profiled`` may turn into one more candidate (it joins with a warm-up of its
own); on the CPU one step each measured for its peak (the profiler it takes would spoil a
time), then ``steps`` timed steps each (on CUDA each timed step gives its peak too). A step is the compiled
forward and its compiled backward (``StepMeasure``). Among the candidates whose highest
peak is within the budget (``verify_budget.TOLERANCE``), a rival replaces the planner's plan
where its steps are faster beyond their noise (``choose``); where none fits,
the one with the lowest peak runs, with a warning.

Under ``torch.distributed`` every rank runs the same schedule and the ranks' figures are
gathered before the choice (each candidate's slowest time and highest peak over the ranks),
so all ranks choose the same plan; ``on_profiled`` callers agree on the measured costs the
same way (``agree_on_costs``). Steps run without grad, or while a profiler of the
user's records on the CPU, run the planner's plan and are not counted; nor is a step whose
backward has not run when the next one begins. Under a process group a step under the user's
profiler (often run on one rank only) still takes its place in the schedule, unmeasured, so
that every rank reaches the collectives that agree on the figures at the same step; so does a
step of code Dynamo compiled again for the graph on one rank while the trials run
(``run_other``).
"""

from __future__ import annotations

import logging
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..passes.plan import Plan, format_bytes
from .kernel_costs import KernelProfile, MeasuredCosts
from .memory_tracker import profiler_recording
from .step_measure import StepMeasure, compiled_backward_node, on_fake_tensors
from .verify_budget import TOLERANCE

log = logging.getLogger("compile_offload")


@dataclass
class Trial:
    """One candidate plan, compiled, and what its steps measured."""

    name: str  # how it was made: "the planner's plan", "planned under 1.20 MiB", "offload off"
    compiled: Callable[..., Any]
    plan: Plan
    result: Any = None  # the PartitionResult the plan came with
    seconds: list[float] = field(default_factory=list)
    peak_bytes: int | None = None

    def median_seconds(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None

    def record_peak(self, peak: int) -> None:
        self.peak_bytes = peak if self.peak_bytes is None else max(self.peak_bytes, peak)


def fits(trial: Trial, budget_bytes: int) -> bool:
    return trial.peak_bytes is not None and trial.peak_bytes <= budget_bytes * (1 + TOLERANCE)


def choose(trials: list[Trial], budget_bytes: int) -> Trial:
    """The planner's plan (the first trial) unless a rival whose measured peak fits is faster
    beyond the noise of the measurement (``faster_beyond_noise``): then the fastest such
    rival (median step). Where the planner's plan does not fit, the fastest that fits; where
    none fits, the one with the lowest measured peak."""
    fitting = [t for t in trials if fits(t, budget_bytes) and t.seconds]
    if not fitting:
        measured = [t for t in trials if t.peak_bytes is not None]
        return min(measured, key=lambda t: t.peak_bytes) if measured else trials[0]
    fastest = min(fitting, key=lambda t: t.median_seconds())
    planner = trials[0]
    if planner in fitting and not faster_beyond_noise(fastest, planner):
        return planner
    return fastest


# A rival replaces the planner's plan only when its median step is faster by more than this share.
MIN_MARGIN = 0.01


def faster_beyond_noise(a: Trial, b: Trial) -> bool:
    """Whether ``a`` is faster than ``b`` beyond the noise of their steps: every step of ``a``
    faster than every step of ``b`` (the steps ran in turn, so drift reaches both alike), and
    its median faster by more than ``MIN_MARGIN``. Measured on two cores, a rival 5% faster by
    its median in three trial steps ran 5% slower in the steps after; its steps overlapped the
    planner's."""
    if a is b or not a.seconds or not b.seconds:
        return False
    return max(a.seconds) < min(b.seconds) and a.median_seconds() < b.median_seconds() * (1 - MIN_MARGIN)


def agree_across_ranks(trials: list[Trial], gather: Callable[[Any], list[Any]] | None = None) -> None:
    """Make every rank's figures the same: each trial's times become, step by step, the
    slowest rank's, and its peak the highest rank's. ``gather(obj)`` returns every rank's
    ``obj``; by default ``torch.distributed.all_gather_object`` where a process group of
    more than one rank runs, else nothing is gathered."""
    gather = gather or _process_group_gather()
    if gather is None:
        return
    everyone = gather([(t.seconds, t.peak_bytes) for t in trials])
    for index, trial in enumerate(trials):
        times = [rank[index][0] for rank in everyone]
        peaks = [rank[index][1] for rank in everyone if rank[index][1] is not None]
        steps = min(len(t) for t in times)
        trial.seconds = [max(t[step] for t in times) for step in range(steps)]
        trial.peak_bytes = max(peaks) if peaks else None


def agree_on_costs(costs: MeasuredCosts | None, gather: Callable[[Any], list[Any]] | None = None
                   ) -> MeasuredCosts | None:
    """The same measured costs on every rank, so that every rank plans the same candidate:
    each node's slowest time over the ranks; None where any rank has none (its profile did
    not line up). ``gather`` as in ``agree_across_ranks``."""
    gather = gather or _process_group_gather()
    if gather is None:
        return costs
    everyone = gather(None if costs is None else (costs.seconds, costs.scale))
    if any(rank is None for rank in everyone):
        return None
    names = set.intersection(*(set(seconds) for seconds, _ in everyone))
    return MeasuredCosts(costs.device, {name: max(seconds[name] for seconds, _ in everyone) for name in sorted(names)},
                         max(scale for _, scale in everyone))


def agree_on_names(names: list[str], gather: Callable[[Any], list[Any]] | None = None) -> list[str]:
    """``names`` in their order, less those missing on any rank: the candidates every rank
    compiled and kept (a scheduled peak read with a workspace one rank could not measure may
    keep a rival on one rank and drop it on another). ``gather`` as in ``agree_across_ranks``."""
    gather = gather or _process_group_gather()
    if gather is None:
        return list(names)
    common = set.intersection(*(set(rank) for rank in gather(list(names))))
    return [name for name in names if name in common]


def agree_all(flag: bool, gather: Callable[[Any], list[Any]] | None = None) -> bool:
    """Whether ``flag`` holds on every rank (on one process: ``flag``). ``gather`` as in
    ``agree_across_ranks``."""
    gather = gather or _process_group_gather()
    return flag if gather is None else all(gather(bool(flag)))


def process_group_ranks() -> int:
    """The ranks of the default process group; 1 without one."""
    distributed = torch.distributed
    return distributed.get_world_size() if distributed.is_available() and distributed.is_initialized() else 1


def _process_group_gather() -> Callable[[Any], list[Any]] | None:
    distributed = torch.distributed
    if process_group_ranks() < 2:
        return None

    def gather(obj):
        out = [None] * distributed.get_world_size()
        distributed.all_gather_object(out, obj)
        return out

    return gather


class PlanTrials:
    """The compiled graph during measured plan choice: a callable Dynamo runs in place of the
    compiled graph. ``on_chosen(trial, trials)`` is called once, when the choice is made."""

    def __init__(self, trials: list[Trial], budget_bytes: int, device: torch.device, graph_name: str,
                 steps: int, on_chosen: Callable[[Trial, list[Trial]], None],
                 on_profiled: Callable[[list], Trial | None] | None = None) -> None:
        self.trials, self.budget_bytes, self.device = trials, budget_bytes, device
        self.graph_name, self.on_chosen, self.on_profiled = graph_name, on_chosen, on_profiled
        self.steps = steps
        self.chosen: Trial | None = None
        self.schedule = [(i, "warmup") for i in range(len(trials))]
        if on_profiled is not None:  # the planner's plan, profiled for its kernels' times
            self.schedule.append((0, "profile"))
        self.schedule += self._measured_rounds()
        self.position = 0
        self._pending: StepMeasure | KernelProfile | _Unmeasured | None = None  # the step whose backward is awaited
        self._profiled: list | None = None  # the profile step's kernel events, until ``on_profiled`` has them
        self._profile_missed = False  # the profile step ran unmeasured: ``on_profiled`` gets None

    def _measured_rounds(self) -> list[tuple[int, str]]:
        count = range(len(self.trials))
        rounds = [(i, "peak") for i in count] if self.device.type != "cuda" else []
        return rounds + [(i, "time") for _ in range(self.steps) for i in count]

    def _take_profile(self) -> None:
        """Hand the profile step's events to ``on_profiled`` (None where that step ran
        unmeasured); a candidate it returns joins the trials: its warm-up next, then every
        candidate's measured rounds."""
        calls, self._profiled, self._profile_missed = self._profiled, None, False
        trial = self.on_profiled(calls)
        if trial is None:
            if len(self.trials) == 1:  # nothing to compare with: the planner's plan runs, unmeasured
                self.chosen = self.trials[0]
                log.info("%s: measured plan choice: no other candidate; the planner's plan runs", self.graph_name)
                self.on_chosen(self.chosen, self.trials)  # the choice is made (and stored: no trials next run)
            return
        self.trials.append(trial)
        self.schedule = self.schedule[:self.position] + [(len(self.trials) - 1, "warmup")] + self._measured_rounds()

    def __call__(self, *args):
        return self._step(args)

    def run_other(self, compiled: Callable[..., Any], args: tuple) -> Any:
        """A step of ``compiled``, code Dynamo compiled again for this graph on this rank alone
        (a guard its inputs failed) while the trials run: it takes the schedule's next place,
        unmeasured, so that this rank reaches the collectives that agree on the figures at the
        same step as the ranks still running the trials. A call in a step that has taken its
        place already (the trials' own graph ran in it: ``compiled`` is another graph of the
        frame, such as another layer of a model compiled per layer) and, once the trials have
        chosen, every call, simply runs ``compiled``."""
        return self._step(args, other=compiled)

    def _step(self, args: tuple, other: Callable[..., Any] | None = None) -> Any:
        if self.chosen is not None:
            return (other or self.chosen.compiled)(*args)
        if on_fake_tensors(args):  # not a step: the planner's plan, and the schedule untouched
            return (other or self.trials[0].compiled)(*args)
        if other is not None and self._pending is not None:  # this step has taken its place
            return other(*args)
        self._drop_unfinished()
        if self._profiled is not None or self._profile_missed:
            self._take_profile()
            if self.chosen is not None:
                return (other or self.chosen.compiled)(*args)
        index, kind = self.schedule[self.position]
        if not torch.is_grad_enabled():
            return (other or self.trials[0].compiled)(*args)
        if other is not None:
            trial, measure = None, _Unmeasured()
        elif (self.device.type != "cuda" or kind == "profile") and profiler_recording():
            if _process_group_gather() is None:
                return self.trials[0].compiled(*args)
            # The ranks' schedules stay in step: this one passes, unmeasured, on the planner's plan.
            trial, measure = self.trials[0], _Unmeasured()
        else:
            trial = self.trials[index]
            peak = kind == "peak" or (kind == "time" and self.device.type == "cuda")
            measure = KernelProfile(self.device) if kind == "profile" else StepMeasure(self.device, peak=peak)
        outputs = measure.forward(other or trial.compiled, args)
        node = compiled_backward_node(outputs)
        if node is None:  # nothing to wait for: not a training step; not counted
            measure.end_backward()
            return outputs
        self._pending = measure

        @torch.compiler.disable  # run, not traced, under a compiled train-step function
        def backward_started(*_):
            if self._pending is measure:
                measure.start_backward()

        @torch.compiler.disable  # run, not traced, under a compiled train-step function
        def backward_done(*_):
            if self._pending is not measure:  # dropped: another step began before this backward
                return
            measure.end_backward()
            self._pending = None
            unmeasured = isinstance(measure, _Unmeasured) or measure.interrupted
            if measure.interrupted and _process_group_gather() is None:
                return  # not counted: the step runs again
            if unmeasured:  # under a process group: its place in the schedule passes on every rank
                self._profile_missed = kind == "profile"
            elif kind == "profile":
                self._profiled = measure.calls
            else:
                if measure.peak:
                    trial.record_peak(measure.peak_bytes())
                if kind == "time":
                    trial.seconds.append(measure.seconds)
            self._step_done()

        node.register_prehook(backward_started)
        node.register_hook(backward_done)
        return outputs

    def _drop_unfinished(self) -> None:
        """A step whose backward has not run when the next step begins (an evaluation with grad
        on; two forwards before one backward): not counted, its measure closed, and its hooks,
        should its backward run later, ignored."""
        if self._pending is not None:
            self._pending.end_backward()
            self._pending = None

    def _step_done(self) -> None:
        self.position += 1
        if self.position == len(self.schedule):
            self._choose()

    def _choose(self) -> None:
        agree_across_ranks(self.trials)
        if not any(t.seconds or t.peak_bytes is not None for t in self.trials):
            # every trial step ran unmeasured (under the user's profiler): nothing to choose from,
            # nothing to store as measured; the planner's plan runs
            self.chosen, self.trials = self.trials[0], self.trials[:1]
            log.info("%s: measured plan choice: no trial step was measured (all ran under a profiler of yours); "
                     "the planner's plan runs", self.graph_name)
            return
        planner = self.trials[0]
        if not any(t.seconds for t in self.trials) and (planner.peak_bytes is None or fits(planner, self.budget_bytes)):
            # no timed step on every rank (one ran its steps unmeasured: new code, or under your
            # profiler): no speed to compare, nothing to store as measured; the planner's plan runs
            self.chosen, self.trials = planner, self.trials[:1]
            log.info("%s: measured plan choice: no candidate's steps were timed on every rank; the planner's plan "
                     "runs", self.graph_name)
            return
        chosen = choose(self.trials, self.budget_bytes)
        self.chosen = chosen
        log.info("%s: measured plan choice, %d candidates (budget %s):\n%s", self.graph_name, len(self.trials),
                 format_bytes(self.budget_bytes), table(self.trials, chosen, self.budget_bytes))
        if not fits(chosen, self.budget_bytes):
            warnings.warn(
                f"compile_offload: {self.graph_name}: measured plan choice: no candidate plan's measured peak fits "
                f"the memory budget {format_bytes(self.budget_bytes)}; running the lowest ({chosen.name}, "
                f"{'not measured' if chosen.peak_bytes is None else format_bytes(chosen.peak_bytes)})",
                stacklevel=2)
        self.on_chosen(chosen, self.trials)
        # Free the candidates' compiled code that will not run again.
        self.trials = [chosen]


class _Unmeasured:
    """A step that keeps its place in the schedule without being measured (``PlanTrials``)."""

    interrupted = False

    def forward(self, compiled: Callable[..., Any], args: tuple) -> Any:
        return compiled(*args)

    def start_backward(self) -> None:
        """Nothing to start: the step is not measured."""

    def end_backward(self) -> None:
        """Nothing to read: the step is not measured."""


def table(trials: list[Trial], chosen: Trial, budget_bytes: int) -> str:
    header = f"{'candidate':<34} {'keep/recompute/offload':>22} {'scheduled':>11} {'measured peak':>14} {'step ms':>9}"
    rows = [header]
    for trial in trials:
        plan = trial.plan
        mix = f"{plan.count('keep')}/{plan.count('recompute')}/{plan.count('offload')}"
        scheduled = "-" if plan.scheduled_peak_bytes is None else format_bytes(plan.scheduled_peak_bytes)
        peak = "-" if trial.peak_bytes is None else format_bytes(trial.peak_bytes)
        if trial.peak_bytes is not None and not fits(trial, budget_bytes):
            peak += " over"
        step = "-" if trial.median_seconds() is None else f"{trial.median_seconds() * 1e3:.3f}"
        mark = "  <- runs" if trial is chosen else ""
        rows.append(f"{trial.name[:34]:<34} {mix:>22} {scheduled:>11} {peak:>14} {step:>9}{mark}")
    return "\n".join(rows)
