"""One joint graph -> Plan + forward/backward graphs. Shared by the backend and ``explain``.

Planning only: what the user is told about the result (logs, dumps, traces) is the
caller's job (``partitioner.OffloadRematPartitioner``), and so is anything the runtime
needs (the pinned pool's limit is set by the backend).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import warnings
from collections.abc import Sequence

import torch.fx as fx

from . import plan_cache
from .collection_paused import collection_paused
from .device_profile import device_of, measuring_device, resolve_profile
from ..inductor.op_workspace import op_workspaces, uncounted_cuda_workspaces
from ..passes import compat, user_policy
from ..passes.analyze import UnsupportedGraph, analyze_joint, tensor_value
from ..passes.inductor.rules import KernelRules
from ..passes.build_plan import build_plan
from ..passes.cost import node_seconds
from ..passes.memory import fused_nodes
from ..passes.offload import eligible_for_offload
from ..passes.plan import Plan
from ..passes.rewrite import build_graphs
from ..passes.snapshot_mutated_inputs import snapshot_mutated_inputs, snapshots
from ..passes.progress import Progress
from ..passes.solve.refine import Refinement, refine_solution
from ..passes.solve.recompute import (Candidate, Solution, SolverError, lowest_peak, solve_exact,
                                      without_banned_recompute)
from ..passes.inductor.smaller_matmuls_first import smaller_matmuls_first
from ..passes.inductor.unfused_mm_add import unfused_mm_add
from ..passes.solve.torch_plan import torch_plan_solution
from ..passes.solve.joint import OffloadOptions, solve_joint
from .place_offloads import force_offload, insert_planned_offloads, planned_placement
from .result import BudgetError, PartitionResult
from ..runtime.kernel_costs import MeasuredCosts
from ..settings import Settings


PLANNED_AT_NOTE = "dynamic sizes planned at"


def plan_partition(
    joint_gm: fx.GraphModule,
    joint_inputs: Sequence[object],
    settings: Settings,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    graph_name: str = "graph",
    accelerator: bool | None = None,
    measured: MeasuredCosts | None = None,
) -> PartitionResult:
    """Plan and partition one joint graph under ``settings``.

    ``accelerator``: whether Inductor will generate an accelerator's (Triton) kernels for the
    graph rather than the C++ backend's, which decides how the memory model groups kernels
    (``analyze_joint``); None: the graph's device says (``explain`` passes True where host
    tensors stand in for a GPU's).

    ``measured``: node costs measured on the device (``runtime/kernel_costs.py``) to plan with
    in place of the cost model; under ``measured_plan_choice`` with a plan cache, those stored
    for this graph on this device are used when none are passed.

    A graph the planner is known not to handle (``UnsupportedGraph``) falls back to torch's
    min-cut partition (a correct plan) with one warning naming the reason; so does any other
    error when ``settings.suppress_errors`` is set, and otherwise it raises. Planning only: a
    budget below the minimum is reported by the caller (``budget_report.report_budget``).
    """
    # Under suppress_errors, the joint graph as AOTAutograd gave it: planning rewrites it in
    # place, and an error part-way would leave torch's partition a part-rewritten graph.
    given = copy.deepcopy(joint_gm) if settings.suppress_errors else None
    # Collections walking the whole heap were ~40% of planning (collection_paused.py).
    with collection_paused(), compat.planning_sizes(dict(settings.planning_sizes)):
        try:
            return _planned(joint_gm, joint_inputs, settings, num_fwd_outputs, static_lifetime_input_indices,
                            graph_name, accelerator, measured)
        except (BudgetError, SolverError):
            raise
        except Exception as error:
            if not (isinstance(error, UnsupportedGraph) or settings.suppress_errors):
                raise
            return _fallback(joint_gm if given is None else given, joint_inputs, settings, num_fwd_outputs,
                             static_lifetime_input_indices, graph_name, error)


def _planned(joint_gm: fx.GraphModule, joint_inputs: Sequence[object], settings: Settings, num_fwd_outputs: int,
             static_lifetime_input_indices: list[int] | None, graph_name: str, accelerator: bool | None,
             measured: MeasuredCosts | None) -> PartitionResult:
    """``plan_partition``'s plan, every step of it inside the caller's fallback."""
    started = time.perf_counter()
    policy_tags = user_policy.read_tags(joint_gm)  # before prepare_joint retags region boundaries
    # The order the plan holds to (Inductor's peak-memory reordering is off under a
    # budget): a gradient's smaller matmuls first, as that reordering would; and each add
    # Inductor would fold a matmul into, folded here or prevented (unfused_mm_add).
    joint_gm = unfused_mm_add(smaller_matmuls_first(joint_gm))
    _snapshot_mutated_inputs(joint_gm, graph_name)
    joint = compat.prepare_joint(joint_gm, num_fwd_outputs, static_lifetime_input_indices)
    device = device_of(tensor_value(n) for n in joint_gm.graph.nodes)
    profile = resolve_profile(settings.device_profile, device)
    if settings.shared_h2d_bytes:  # the link as this graph's reloads find it
        profile = dataclasses.replace(profile, shared_h2d_bytes=settings.shared_h2d_bytes)
    if not compat.has_backward(joint):
        fw_gm, bw_gm = compat.default_partition(joint, joint_inputs)
        plan = Plan.unplanned(feasible=True, budget_bytes=settings.budget_bytes, device_profile=profile.name,
                              solver=settings.solver, graph_name=graph_name,
                              why="no backward: torch's default partition")
        return PartitionResult(plan, fw_gm, bw_gm, None, None)
    # Costs stored for this graph and device are as much the graph's as its code: they do
    # not key the plan cache (the plan measured plan choice kept is found under the entry
    # it was planned under); costs passed in do (a candidate planned from them).
    keyed = measured is not None
    if measured is None:
        measured = _stored_costs(joint, settings, device)
    result = _solve_and_partition(joint, policy_tags, settings, profile, num_fwd_outputs, graph_name, started,
                                  accelerator, measured, keyed)
    note_uncounted_workspaces(result.plan, joint_gm.graph.nodes)
    return result


def _stored_costs(joint: compat.JointGraph, settings: Settings, device) -> MeasuredCosts | None:
    """Costs measured for this graph on this device in an earlier run (measured plan choice
    stores them in the plan cache), where the settings ask for measurement and a budget."""
    if not (settings.measured_plan_choice and settings.plan_cache_dir and settings.has_budget):
        return None
    name = measuring_device(settings.device_profile, device)
    return None if name is None else plan_cache.load_measured_costs(joint.gm, settings, name)


UNCOUNTED_WORKSPACE_NOTE = "not counted: the run-time workspace of each CUDA"
_warned_uncounted: set[tuple[str, ...]] = set()


def note_uncounted_workspaces(plan: Plan, nodes) -> None:
    """Name in ``plan.notes`` the CUDA ops whose workspace the plan does not count, as it was
    not measured on the GPU (``op_workspace.uncounted_cuda_workspaces``), and under a budget
    warn once per process for each set of them: the step's peak can exceed the budget by
    those workspaces."""
    kinds = tuple(uncounted_cuda_workspaces(nodes))
    if not kinds:
        return
    plan.notes.append(f"{UNCOUNTED_WORKSPACE_NOTE} {', '.join(kinds)} (sized by the library when it runs, and "
                      "not measured on the GPU while planning; one cuDNN convolution backward held 1.08 MiB at "
                      "16 channels, batch 8, 32x32, on an H200)")
    if plan.budget_bytes is not None and kinds not in _warned_uncounted:
        _warned_uncounted.add(kinds)
        warnings.warn(f"compile_offload: {plan.graph_name}: the plan does not count the workspace of each CUDA "
                      f"{', '.join(kinds)}, which the library sizes when it runs and which could not be measured "
                      "on the GPU while planning; the step's peak can exceed the memory budget by it "
                      "(config.verify_budget measures the first step against the budget)", stacklevel=4)


def _solve_and_partition(joint: compat.JointGraph, policy_tags, settings: Settings, profile, num_fwd_outputs: int,
                         graph_name: str, started: float, accelerator: bool | None = None,
                         measured: MeasuredCosts | None = None, keyed: bool = True) -> PartitionResult:
    inductor = settings.inner_compiler == "inductor"
    # Under a budget Inductor compiles with plan_order_fusion's rule: no horizontal fusion pulls.
    rules = KernelRules.of_compile(inductor, accelerator, fusion_pulls=not settings.has_budget)
    analysis = analyze_joint(joint, rules,
                             workspaces=lambda nodes: op_workspaces(nodes, inductor, measure=accelerator is not True))
    policy = user_policy.apply_policy(analysis, policy_tags)  # checkpoint policies: bans, a cost bias
    memo: dict[fx.Node, float] = {}
    # Under Inductor a pointwise op fused into its consumers costs no kernel of its own.
    fused = fused_nodes(analysis.position, set(analysis.fw_outputs) | set(analysis.bw_outputs)) if analysis.fusion else set()

    def modelled(node: fx.Node) -> float:
        return 0.0 if node in fused else node_seconds(node, profile)

    priced = modelled if measured is None else measured.price(modelled)

    def seconds(node: fx.Node) -> float:
        if node not in memo:
            memo[node] = priced(node)
        return memo[node]

    # The kernel rules decide the plan as much as the profile does: both key the plan cache,
    # and so do measured costs passed in (``keyed``).
    cache_profile = profile.to_dict() if accelerator is None else {**profile.to_dict(), "accelerator": accelerator}
    if measured is not None and keyed:
        cache_profile["measured_costs"] = measured.digest()
    if measured is not None:  # copies at the host link's speed as the profiled step's copies ran
        profile = measured.priced_profile(profile)
    key = None if settings.plan_cache_dir is None else plan_cache.cache_key(joint.gm, settings, cache_profile)
    if key is not None:
        cached = plan_cache.lookup(joint.gm, settings, cache_profile, analysis=analysis)
        if cached is not None:
            return plan_cache.rebuild(analysis, cached, settings, num_fwd_outputs, graph_name, seconds, profile, key)
    base_saved = without_banned_recompute(analysis, compat.min_cut_saved_values(joint))
    base_saved = user_policy.saved_offload_roots(analysis, policy, base_saved)

    offload = None
    # Planning for a CPU, "host memory" is the device's own memory: an offloaded copy frees
    # nothing (measured 3.20 MiB against a predicted 2.20 MiB for TinyGPT 2x d64 at budget
    # 0.75 on the CPU), so the solver only keeps or recomputes there. debug_force_offload
    # still offloads (tests of the runtime).
    if settings.offload and not settings.debug_force_offload and profile.name != "cpu":
        offload = OffloadOptions(profile, lambda node: eligible_for_offload(node)[0] and policy.may_offload(node),
                                 settings.prefetch)
    greedy_ran: list[str] = []  # why the greedy's plan runs under solver='exact' (it refused, or was beaten)
    progress = Progress(settings.plan_time_limit, graph_name, started)  # planning began at ``started``

    def solve(cost) -> Solution:
        exact = None
        if settings.solver == "exact" and not greedy_ran:
            try:
                exact = solve_exact(analysis, base_saved, cost, settings.budget_bytes,
                                    settings.exact_max_candidates, settings.budget_fraction, progress)
            except SolverError as error:
                greedy_ran.append(str(error))
                warnings.warn(f"compile_offload: {graph_name}: {error}; using the greedy solver", stacklevel=5)
        greedy = solve_joint(analysis, base_saved, cost, settings.budget_bytes, settings.budget_fraction, offload,
                             progress, lowest_start=settings.lowest_start)
        if exact is None:
            return greedy
        better = _the_better(exact, greedy)
        if better is greedy:
            greedy_ran.append("solver='exact': the greedy solver's plan was better than every plan the exact search "
                              "tried (it searches recomputation only, without per-segment checkpointing or offload)")
        return better

    refinement = None
    if settings.torch_fraction is not None:  # torch's own plan, measured beside the planner's (plan_choice.py)
        solution = torch_plan_solution(analysis, base_saved, seconds, settings.torch_fraction, settings.budget_bytes)
    else:
        solution = solve(seconds)
        if settings.solver == "refined":  # opt-in: it spends the slack the greedy leaves (design.md, "Refinement")
            unrefined = solution
            solution, refinement = refine_solution(analysis, solution, base_saved, seconds, offload, progress)
        if policy:  # checkpoint policies: PREFER_SAVE as a cost bias, *_CPU_OFFLOAD applied after solving
            preferring = solve(policy.biased(seconds)) if policy.bias else None
            solution = user_policy.follow_preferences(analysis, policy, solution, preferring, seconds, offload,
                                                      base_saved)
            if not settings.debug_force_offload:  # which offloads all it can anyway
                no_offload = ("offload=False" if not settings.offload
                              else "the cpu profile: host memory is the device's own")
                solution = user_policy.offload_tagged(analysis, policy, solution, seconds, offload, no_offload,
                                                      base_saved, graph_name)
    chosen = solution.chosen
    # Placing the planned copies recompiles the backward: once is enough.
    fw_gm, bw_gm = build_graphs(analysis, chosen.saved, recompile=not chosen.offloaded, offloaded=chosen.offloaded)
    fw_gm, bw_gm = insert_planned_offloads(fw_gm, bw_gm, chosen.offloaded, chosen.transfers, num_fwd_outputs)
    # what ran: the exact solver may have refused or lost; torch's plan is torch's partitioner's
    solver = "torch" if settings.torch_fraction is not None else "greedy" if greedy_ran else settings.solver
    plan = build_plan(analysis, solution, seconds, solver=solver, profile_name=profile.name,
                      graph_name=graph_name, solve_seconds=time.perf_counter() - started)
    user_policy.annotate(plan, policy, analysis, graph_name)
    if settings.torch_fraction is not None:
        plan.notes.append(f"torch's own plan: the saved set torch.compile's partitioner chooses under "
                          f"activation_memory_budget={settings.torch_fraction:g}")
    if measured is not None:
        plan.cost_source = "measured"
        links = [f"{way} {rate / 1e9:.1f} GB/s" for way, rate in (("to the host", measured.d2h_bandwidth),
                                                                   ("back", measured.h2d_bandwidth)) if rate]
        plan.notes.append(f"priced from kernel times measured on {measured.device} ({len(measured.seconds)} nodes; "
                          f"the cost model's times x{measured.scale:.2f} for the rest)"
                          + (f"; copies at the measured link speed, {', '.join(links)}" if links else ""))
    if (refinement is not None and refinement.plan is not unrefined.chosen
            and solution.chosen.saved == refinement.plan.saved):  # a checkpoint policy may prefer another plan
        plan.notes.append(_refinement_note(refinement, unrefined.chosen))
    plan.notes += [why for why in greedy_ran if why.startswith("solver='exact'")]
    if progress.out_of_time:
        plan.time_limit_reached = True
        plan.notes.append(f"plan_time_limit={settings.plan_time_limit:g} s reached: the best plan found by then")
    if settings.planning_sizes:
        sizes = ", ".join(f"{name}={size}" for name, size in settings.planning_sizes)
        plan.notes.append(f"{PLANNED_AT_NOTE} {sizes}: " + (
            "of the sizes this frame was compiled at, none covering the others, the one tried; the predicted peak "
            "is checked at the others" if settings.sizes_to_cover
            else "each the largest this frame was compiled at, above this call's"))
    fw_gm, bw_gm = force_offload(fw_gm, bw_gm, plan, settings, num_fwd_outputs,
                                 planned_placement(analysis, chosen.saved, seconds, profile, settings.prefetch))
    if key is not None and not progress.out_of_time:  # a complete search may do better
        plan_cache.store_under(key, settings, plan)
    return PartitionResult(plan, fw_gm, bw_gm, analysis, solution, cache_key=key)


def _the_better(exact: Solution, greedy: Solution) -> Solution:
    """The exact search tries every subset of the storages the greedy's recompute moves
    reach, not the greedy's per-segment checkpointing or offload: where the greedy's plan is
    better (it fits where the exact's does not, fits and is faster, or, where neither fits, is
    lower), the greedy's solution, with the lower of the two minimums."""
    if exact.feasible != greedy.feasible:
        better = exact if exact.feasible else greedy
    elif exact.feasible:
        better = exact if exact.chosen.extra_seconds <= greedy.chosen.extra_seconds else greedy
    else:
        better = exact if lowest_peak(exact.chosen) <= lowest_peak(greedy.chosen) else greedy
    better.minimum = min(exact.minimum, greedy.minimum, key=lowest_peak)
    return better


def _refinement_note(refinement: Refinement, unrefined: Candidate) -> str:
    """What refinement changed in the greedy's plan (``passes/solve/refine.py``), for ``Plan.notes``."""
    faster = (unrefined.extra_seconds - refinement.plan.extra_seconds) * 1e3
    steps = f"{refinement.undos} undo step{'s' * (refinement.undos != 1)}"
    if refinement.swaps:
        steps += f" and {refinement.swaps} swap{'s' * (refinement.swaps != 1)}"
    return (f"refined: {steps} after the greedy solver, predicted {faster:.3f} ms faster "
            f"({refinement.evaluated} plans evaluated)")


def _snapshot_mutated_inputs(joint_gm: fx.GraphModule, graph_name: str) -> None:
    """``passes.snapshot_mutated_inputs``, logged where it copies an input."""
    copied = snapshot_mutated_inputs(joint_gm)
    if copied:
        logging.getLogger("compile_offload").info(
            "%s: the backward reads %s, which the forward writes: it reads a copy made before the write "
            "(saved for the backward)", graph_name, ", ".join(copied))


def _fallback(joint_gm, joint_inputs, settings: Settings, num_fwd_outputs: int,
              static_lifetime_input_indices, graph_name: str, error: Exception) -> PartitionResult:
    """torch's min-cut partition for a graph the planner did not plan: correct, without the
    budget; said once it is built (a failure building it raises, not a promise of a fallback).
    Under ``strict_budget`` with a budget: ``BudgetError``, the budget could not be applied."""
    cause = f"{type(error).__name__}: {error}"
    raise_if_strict_fallback(graph_name, cause, settings)
    _snapshot_mutated_inputs(joint_gm, graph_name)
    copied = snapshots(joint_gm.graph)
    if copied:  # torch's partition would recompute the copies in the backward, after the write
        raise RuntimeError(
            f"compile_offload: {graph_name}: the planner could not handle this graph ({cause}), and torch's "
            f"partition, the fallback, would give wrong gradients: the backward reads {', '.join(copied)}, which "
            "the forward writes in place, through a copy Inductor removed as a no-op (a clone() taken before an "
            "in-place update; torch.compile's own backend is wrong the same way). Compile with "
            "inner_compiler='eager', which keeps the copy, or report the planner's error")
    joint = compat.prepare_joint(joint_gm, num_fwd_outputs, static_lifetime_input_indices)
    fw_gm, bw_gm = compat.default_partition(joint, joint_inputs)
    why = f"fallback: {error}; torch's partition ran"
    if settings.has_budget:
        why += f", without the memory budget {settings.describe_budget()}"
    plan = Plan.unplanned(feasible=not settings.has_budget, budget_bytes=settings.budget_bytes,
                          device_profile=settings.device_profile or "", solver=settings.solver, graph_name=graph_name,
                          why=why, fallback=cause)
    fw_gm, bw_gm = force_offload(fw_gm, bw_gm, plan, settings, num_fwd_outputs)
    warnings.warn(fallback_message(graph_name, cause), stacklevel=4)
    return PartitionResult(plan, fw_gm, bw_gm, None, None)


def fallback_message(graph_name: str, cause: str) -> str:
    """The warning for a graph torch partitioned in place of the planner (also replayed from a
    warm cache's record)."""
    return (f"compile_offload: {graph_name}: the planner could not handle this graph ({cause}); falling back to "
            "torch's default min-cut partition (correct, but the memory budget is not applied to this graph)")


def raise_if_strict_fallback(graph_name: str, cause: str, settings: Settings) -> None:
    """``strict_budget`` with a budget: a graph the planner could not handle cannot be held to
    it, so the compile raises ``BudgetError`` where the fallback would have run."""
    if settings.strict_budget and settings.has_budget:
        raise BudgetError(f"compile_offload: {graph_name}: the planner could not handle this graph ({cause}), so "
                          f"the memory budget {settings.describe_budget()} cannot be applied to it; strict_budget=True")
