"""Measured plan choice (``config.measured_plan_choice``), at compile time: the candidate
plans of one graph, each compiled by Inductor, whose code fits the budget.

The planner ranks plans with its cost model, which misses part of what the device does
(docs/benchmarks.md: the plan measured at budget 0.5 on a GPU ran 3.7-5% slower than
predicted). Near the plan it chose, other mixes of keep, recompute and offload may run
faster. The candidates, besides the plan the budget loop kept:

- the plan made a tenth of the plan range higher (the range from the minimum-memory plan's
  peak to the unconstrained plan's): predicted faster and over the budget, it runs only
  where its Inductor code fits the budget after all;
- the plan made a tenth of that range lower: more recomputation, predicted slower;
- where the kept plan offloads, the plan made under the same budget without offload;
- torch's own plan: the saved set ``torch.compile``'s partitioner chooses under the largest
  ``activation_memory_budget`` whose plan the memory model predicts within the budget
  (``passes.solve.torch_plan``; ``torch_rival``), so that at equal memory torch's choice is
  measured beside ours where it fits. Not where a checkpoint policy asks to offload (torch's
  plan would drop that).

Each is a full compile past the caches (``BudgetLoop.replan``); one whose scheduled peak
(its Inductor code) exceeds the budget (or the plan kept's, where that is over the budget:
``admitted_peak``) is dropped, and so is one whose decisions equal an
earlier candidate's; under a process group, one that another rank dropped is dropped too
(every rank runs the same schedule). With one candidate left nothing is measured. The steps that measure the
rest run in ``runtime/plan_trials.py``; when they have chosen, the choice becomes the
graph's plan (``Plan.measured_candidates``), the one ``explain``'s reports and
``verify_budget`` read, and is stored in the plan cache under the graph's own entry (with
``plan_cache_dir``), so that the next run compiles it without trials.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..passes.plan import Plan, format_bytes
from ..reporting import logs
from ..passes.cost import launches_kernel, node_seconds
from ..passes.solve.torch_plan import TorchPlans, fitting_fraction
from ..runtime import kernel_costs
from ..runtime.plan_trials import PlanTrials, Trial, agree_all, agree_on_costs, agree_on_names, process_group_ranks
from ..torch_api import guards
from . import ddp, graph_reports, plan_cache
from .device_profile import device_of, measuring_device, resolve_profile

log = logging.getLogger("compile_offload")

_warned_off: set[str] = set()


def warn_off(why: str, stacklevel: int = 3) -> None:
    """``measured_plan_choice`` is on and cannot act (``why``): one warning per reason and
    process, so that a knob that does nothing says so."""
    if why not in _warned_off:
        _warned_off.add(why)
        warnings.warn(f"compile_offload: measured_plan_choice is off {why}", stacklevel=stacklevel)

# How far from the kept plan the rivals are planned, as a share of the plan range.
RIVAL_STEP = 0.1
# The name the ranks agree on for the step that profiles the planner's plan.
PROFILE_STEP = "the profile step"


def applies(loop) -> bool:
    """Whether measured plan choice runs for the graph ``loop`` (a ``BudgetLoop``) compiled:
    the knob on, a training graph, sizes that do not change between calls, and one plan with
    decisions, its scheduled peak known, not a plan already chosen by measurement nor the
    unconstrained plan, nor one with its decisions (it recomputes and copies nothing: no rival
    is faster; an INFO line says so). Under a process group, where it runs on every rank compiling the graph (a plan
    served from one rank's plan cache, say, tries nothing there)."""
    if not loop.settings.measured_plan_choice or not graph_reports.trains(loop.example_inputs):
        return False
    name = loop.partitioner.graph_name
    if _dynamic(loop.example_inputs):
        warn_off("for graphs with dynamic sizes (steps of other sizes would not compare): they run the plan made "
                 "from the cost model")
        return False
    if _recompile_among_ranks():
        warn_off("for a frame Dynamo compiled again under a process group: only the first training compile of a "
                 "frame tries candidates, as a compile again may happen on one rank alone (a guard one rank's inputs "
                 "fail, such as an uneven last batch) and the trials' collectives would wait for ranks that never "
                 "join; it runs the plan made from the cost model")
        log.info("%s: measured plan choice is off for this graph: Dynamo compiled this frame again, under a "
                 "process group", name)
        return False
    plan = loop.results[0].plan if len(loop.results) == 1 else None
    here = bool(plan is not None and plan.decisions and plan.budget_bytes is not None
                and plan.scheduled_peak_bytes is not None and not plan.measured_candidates and not plan.unconstrained)
    why_not = _nothing_to_try(plan) if here else None
    if why_not is not None:
        log.info("%s: measured plan choice tries no candidates for this graph: %s", name, why_not)
        here = False
    everywhere = agree_all(here)  # every rank compiling this graph gets here: the same answer on all
    if here and not everywhere:
        log.info("%s: measured plan choice is off for this graph: on another rank its plan tries no candidates "
                 "(served from that rank's plan cache, say), and every rank runs the same trials", name)
    return everywhere


def _nothing_to_try(plan: Plan) -> str | None:
    """Why no candidate could beat ``plan`` by the choice's rule, or None."""
    if not plan.count("recompute") and not plan.count("offload"):
        return "its plan recomputes and copies nothing beyond torch.compile's own (no rival is faster)"
    return None


# Dynamo frame id -> its compile whose graphs try candidates under a process group (all the
# bucket graphs of one DDP compile share it)
_trying_compile: dict[int, int] = {}
# (Dynamo frame id, DDP bucket graph or 0) -> the trials that compile's graph runs under a
# process group (``in_step_with_trials``), as long as the graph lives
_running: weakref.WeakValueDictionary[tuple[int, int], PlanTrials] = weakref.WeakValueDictionary()
# Dynamo frame id -> the compile context of its first compile (``guards.frame_begun``)
_first_compile: dict[int, weakref.ref] = {}


def _recompile_among_ranks() -> bool:
    """Whether, while a process group of more than one rank runs, the graph comes from a later
    compile of a frame than the first that tried candidates (the trials agree across ranks,
    and a recompile may be one rank's alone). Compiles that try nothing (under ``no_grad``,
    before training) do not count: every rank may make those differently."""
    compiled = guards.compile_id()
    if compiled is None or process_group_ranks() < 2:
        return False
    frame, count = compiled
    first = _trying_compile.setdefault(frame, count)
    return count != first


def note_compile() -> None:
    """Called by the backend at each graph it compiles: a frame's first compile (after
    ``torch._dynamo.reset()`` frames are numbered from 0 again) forgets that frame number's
    compile that tried candidates."""
    if guards.frame_begun(_first_compile):
        frame = guards.compile_id()[0]
        _trying_compile.pop(frame, None)
        for key in [key for key in _running if key[0] == frame]:
            del _running[key]


def in_step_with_trials(compiled):
    """``compiled``, or, where it is a later compile of a frame whose first compile's trials
    still run under a process group (a guard this rank's inputs failed, such as an uneven last
    batch), ``compiled`` taking the trials' places in turn, unmeasured
    (``PlanTrials.run_other``): this rank then reaches the collectives that agree on the
    trials' figures at the step the other ranks do, where it would have left them waiting."""
    key = _graph_key()
    running = None if key is None else _running.get(key)
    if running is None or running.chosen is not None or guards.compile_id()[1] == _trying_compile.get(key[0]):
        return compiled

    def step(*args):
        return running.run_other(compiled, args)

    return step


def _graph_key() -> tuple[int, int] | None:
    compiled = guards.compile_id()
    return None if compiled is None else (compiled[0], ddp.bucket_index() or 0)


def _dynamic(example_inputs: Sequence[Any]) -> bool:
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape):
            return True
    return False


def with_trials(loop, compiled):
    """``compiled`` (the kept plan's code), or, where rivals fit, a ``PlanTrials`` running
    them all in the first steps and the fastest that fits from then on."""
    kept = loop.results[0]
    started = time.perf_counter()
    trials = [Trial("the planner's plan", compiled, kept.plan, kept)]
    for name, budget, changes in rivals(kept.plan, loop.settings):
        _add_rival(trials, kept, name, budget, loop.replan(budget, **changes))
    torch_plan = torch_rival(loop, kept)
    if torch_plan is not None:
        _add_rival(trials, kept, *torch_plan)
    on_profiled = _measured_cost_candidate(loop, trials)
    # Every rank must run the same schedule: a rival runs, and the profile step is taken,
    # where every rank has it.
    names = [t.name for t in trials] + ([PROFILE_STEP] if on_profiled is not None else [])
    common = agree_on_names(names)
    if len(common) < len(names):
        log.info("%s: measured plan choice: %s dropped, not kept on every rank", kept.plan.graph_name,
                 ", ".join(name for name in names if name not in common))
        trials[:] = [t for t in trials if t.name in common]  # in place: on_profiled compares with them
        on_profiled = on_profiled if PROFILE_STEP in common else None
    seconds = time.perf_counter() - started
    _report_kept(loop)
    if len(trials) == 1 and on_profiled is None:
        log.info("%s: measured plan choice: no other plan fits the budget in Inductor's code (%.1f s of compiles); "
                 "the planner's plan runs", kept.plan.graph_name, seconds)
        _adopt(loop, trials[0], 1, seconds, loop.cache_key)  # stored: the next run tries nothing
        return compiled
    if len(trials) == 1:
        log.info("%s: measured plan choice: no other plan fits the budget in Inductor's code (%.1f s of compiles); "
                 "the next training step profiles the planner's plan, and a plan priced from its kernels' times "
                 "joins where it differs", kept.plan.graph_name, seconds)
    else:
        profiling = "" if on_profiled is None else (", one more profiles the planner's plan for its kernels' times "
                                                    "(a plan priced from them may join, with steps of its own)")
        log.info("%s: measured plan choice: %d candidate plans compiled in %.1f s; the next %d training steps run "
                 "them in turn%s", kept.plan.graph_name, len(trials), seconds,
                 len(trials) * (loop.settings.measured_plan_steps + 1 + (device_of(loop.example_inputs).type != "cuda")),
                 profiling)

    def on_chosen(chosen: Trial, measured: list[Trial]) -> None:
        _adopt(loop, chosen, len(measured), seconds, loop.cache_key)

    running = PlanTrials(trials, kept.plan.budget_bytes, device_of(loop.example_inputs), kept.plan.graph_name,
                         loop.settings.measured_plan_steps, on_chosen, on_profiled)
    key = _graph_key()
    if key is not None and process_group_ranks() > 1:
        _running[key] = running
    return running


def _measured_cost_candidate(loop, trials: list[Trial]):
    """``PlanTrials``' ``on_profiled``: from the profile of a step of the planner's plan, the
    plan made under the same budget with each node priced by its measured kernel time
    (``runtime/kernel_costs.py``), as one more candidate; the table is stored in the plan
    cache (with ``plan_cache_dir``), so that the graph's later plans on this device start
    from it. None where it cannot apply: the kept plan's kernels were not seen, it was
    already priced so, or the settings name a device profile (the model of another device)."""
    kept = loop.results[0]
    recorder = loop.kept_recorder
    device = measuring_device(loop.settings.device_profile, device_of(loop.example_inputs))
    if (recorder is None or recorder.forward() is None or recorder.backward() is None or kept.analysis is None
            or kept.plan.cost_source == "measured" or device is None):
        return None
    forward, backward = recorder.forward(), recorder.backward()
    joint_gm = kept.analysis.joint.gm
    profile = resolve_profile(loop.settings.device_profile, device_of(loop.example_inputs))
    nodes = {node.name: node for node in joint_gm.graph.nodes if launches_kernel(node)}

    def model(name: str) -> float | None:
        node = nodes.get(name)
        return None if node is None else node_seconds(node, profile)

    def on_profiled(calls) -> Trial | None:
        try:
            trial = candidate(calls)
            # Every rank must run the same schedule: the candidate joins where it joins on all
            # (a scheduled peak read with a workspace one rank could not measure may differ).
            return trial if agree_all(trial is not None) else None
        finally:
            _report_kept(loop)

    def candidate(calls) -> Trial | None:
        graph_name = kept.plan.graph_name
        costs = None  # calls None: this rank's profile step ran under the user's profiler, unmeasured
        try:
            if calls is not None:
                costs = kernel_costs.measured_costs(forward, backward, calls, model, device)
        except kernel_costs.ProfileMismatch as error:
            warnings.warn(f"compile_offload: {graph_name}: measured plan choice could not price the graph from its "
                          f"profiled kernels ({error}); its candidates stay planned from the cost model", stacklevel=3)
        costs = agree_on_costs(costs)
        if costs is None:
            return None
        if loop.settings.plan_cache_dir:
            plan_cache.store_measured_costs(joint_gm, loop.settings, costs)
        budget = kept.plan.planned_budget_bytes or kept.plan.budget_bytes
        started = time.perf_counter()
        attempt = loop.replan(budget, measured=costs)
        log.info("%s: measured plan choice: %d nodes priced from their kernels' times (x%.2f the model's on the "
                 "nodes measured); the plan made from them compiled in %.1f s", graph_name, len(costs.seconds),
                 costs.scale, time.perf_counter() - started)
        if attempt is None or attempt.plan.scheduled_peak_bytes is None:
            return None
        plan = attempt.plan
        if plan.scheduled_peak_bytes > admitted_peak(kept.plan):
            log.info("%s: measured plan choice: the plan from measured costs is dropped, its scheduled peak %s is "
                     "over %s", graph_name, format_bytes(plan.scheduled_peak_bytes),
                     format_bytes(admitted_peak(kept.plan)))
            return None
        if any(_same_decisions(plan, t.plan) for t in trials):
            log.info("%s: measured plan choice: the plan from measured costs makes the decisions of a candidate "
                     "already measured", graph_name)
            return None
        if budget != kept.plan.budget_bytes:
            plan.replanned_under(kept.plan.budget_bytes, budget)
        plan.budget_outcome = "kept"
        return Trial("planned from measured costs", attempt.compiled, plan, attempt.result)

    return on_profiled


def _report_kept(loop) -> None:
    """The planner's plan back as its graph's latest plan and dump: each candidate compiled
    (``loop.replan``) reported itself as it was made, and until the trials choose one
    (``_adopt``) the planner's plan is the one the graph runs."""
    kept = loop.results[0]
    logs.remember(kept.plan)
    logs.dump(kept, loop.gm, loop.settings)


def rivals(plan: Plan, settings) -> list[tuple[str, int, dict]]:
    """(name, budget in bytes to plan under, other settings) of each rival to ``plan``."""
    span = max(plan.baseline_peak_bytes - plan.min_peak_bytes, 0)
    step = int(span * RIVAL_STEP)
    found = []
    if step > 0:
        higher = plan.predicted_peak_bytes + step
        if plan.predicted_peak_bytes < plan.baseline_peak_bytes:
            found.append((f"planned under {format_bytes(higher)}", higher, {}))
        lower = max(plan.predicted_peak_bytes - step, plan.min_peak_bytes)
        if lower < plan.predicted_peak_bytes:
            found.append((f"planned under {format_bytes(lower)}", lower, {}))
    if settings.offload and plan.count("offload"):
        found.append(("offload off", plan.budget_bytes, {"offload": False}))
    return found


def _add_rival(trials: list[Trial], kept, name: str, budget: int | None, attempt) -> None:
    """``attempt`` (a rival compiled, or None) joins ``trials`` where its scheduled peak fits
    the kept plan's budget and its decisions are new."""
    if attempt is None or attempt.plan.scheduled_peak_bytes is None:
        return
    plan = attempt.plan
    if plan.scheduled_peak_bytes > admitted_peak(kept.plan):
        log.debug("%s: measured plan choice: %s dropped, its scheduled peak %s is over %s",
                  kept.plan.graph_name, name, format_bytes(plan.scheduled_peak_bytes),
                  format_bytes(admitted_peak(kept.plan)))
        return
    if any(_same_decisions(plan, t.plan) for t in trials):
        return
    plan.replanned_under(kept.plan.budget_bytes, budget)
    plan.budget_outcome = "kept"
    trials.append(Trial(name, attempt.compiled, plan, attempt.result))


def admitted_peak(kept: Plan) -> int:
    """The scheduled peak a candidate may have: the budget, or where the plan kept is over it
    (a budget below every plan), the plan kept's own: a candidate that peaks no higher is
    measured, and where none fits the budget the lowest measured peak runs."""
    return max(kept.budget_bytes, kept.scheduled_peak_bytes or 0)


# How many times torch's plan is planned again at a lower fraction where its Inductor code
# peaked over the budget (as the budget loop plans its own again, ``budget_loop.py``).
TORCH_REPLANS = 2


def torch_rival(loop, kept) -> tuple[str, int, Any] | None:
    """(name, budget, compiled attempt) of torch's own plan (``passes.solve.torch_plan``) at the
    largest ``activation_memory_budget`` whose Inductor code fits the kept plan's budget: the
    fraction the memory model predicts within the budget; where the code peaked over it, the
    next fraction down predicted under that plan's own prediction less the excess (at most
    ``TORCH_REPLANS`` times). None where no fraction fits, the graph has no analysis (torch's
    own partition ran), or a checkpoint policy asks to offload (torch's plan offloads nothing)."""
    budget = kept.plan.budget_bytes
    if budget is None or kept.analysis is None or _offload_tagged(kept.analysis):
        return None
    target, below, plans = budget, 1.0, TorchPlans(kept.analysis)
    for _ in range(TORCH_REPLANS + 1):
        try:
            fraction = fitting_fraction(plans, target, below=below)
        except Exception as error:  # noqa: BLE001  a rival is optional: torch's knapsack may refuse a graph
            log.info("%s: measured plan choice: torch's plan is not a candidate (its partitioner's knapsack raised "
                     "%s: %s)", kept.plan.graph_name, type(error).__name__, error)
            return None
        if fraction is None:
            return None
        attempt = loop.replan(budget, torch_fraction=fraction)
        name = f"torch's plan, budget {fraction:g}"
        if attempt is None or attempt.plan.scheduled_peak_bytes is None:
            return None
        over = attempt.plan.scheduled_peak_bytes - budget
        if over <= 0:
            # its figures against the planner's: the lowest peak the planner reached stays its own
            attempt.plan.min_peak_bytes = min(attempt.plan.min_peak_bytes, kept.plan.min_peak_bytes)
            return name, budget, attempt
        log.debug("%s: measured plan choice: %s peaks %s over the budget in Inductor's code; planned again lower",
                  kept.plan.graph_name, name, format_bytes(over))
        target, below = attempt.plan.predicted_peak_bytes - over, fraction
    return None


def _offload_tagged(analysis) -> bool:
    """Whether a checkpoint policy tags a node of the graph for offload (``*_CPU_OFFLOAD``)."""
    return any(str(getattr(node.meta.get("recompute"), "name", "")).endswith("CPU_OFFLOAD")
               for node in analysis.joint.gm.graph.nodes)


def _same_decisions(a: Plan, b: Plan) -> bool:
    return set(a.saved) == set(b.saved) and a.offloaded == b.offloaded


def _adopt(loop, chosen: Trial, measured: int, compile_seconds: float, cache_key: str | None) -> None:
    """The measured choice becomes the graph's plan: in the loop's results (``verify_budget``
    and ``explain`` read the last), the logs, and the plan cache under ``cache_key``, the
    entry of the graph as the user compiled it (a rival's own entry is that of the budget
    it was planned under)."""
    plan = chosen.plan
    plan.measured_candidates = measured
    plan.measured_choice = chosen.name
    plan.measured_step_seconds = chosen.median_seconds()
    plan.measured_peak_bytes = chosen.peak_bytes
    plan.notes.append(f"measured plan choice: the fastest of {measured} candidate plans that fits the budget "
                      f"({chosen.name}); {compile_seconds:.1f} s of extra compiles" if measured > 1 else
                      f"measured plan choice: no other candidate (none fits the budget in Inductor's code with other "
                      f"decisions); {compile_seconds:.1f} s of extra compiles, nothing timed")
    if chosen.result is not None:
        loop.results[:] = [chosen.result]
        logs.dump(chosen.result, loop.gm, loop.settings)
    logs.remember(plan)
    if cache_key is not None:
        plan_cache.store_under(cache_key, loop.settings, plan)
