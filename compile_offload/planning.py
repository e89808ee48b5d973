"""One joint graph -> Plan + forward/backward graphs. Shared by the backend and ``explain``."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from .passes import compat
from .passes.analyze import JointAnalysis, analyze_joint, collective_source, tensor_value
from .passes.plan import Decision, Plan, format_bytes
from .passes.memory import fused_nodes
from .passes.rewrite import build_graphs
from .passes.offload import eligible_for_offload
from .passes.solve import (
    Solution,
    SolverError,
    compute_node,
    solve_exact,
    step_seconds,
    without_banned_recompute,
)
from .passes.progress import Progress
from .passes.solve_offload import OffloadOptions, solve_joint
from .passes.transfer import TransferPlan, plan_transfers

from . import plan_cache
from .settings import Settings

class BudgetError(ValueError):
    """The budget is below the minimum achievable peak and ``strict_budget`` is set."""


@dataclass
class PartitionResult:
    plan: Plan
    fw_gm: fx.GraphModule
    bw_gm: fx.GraphModule
    analysis: JointAnalysis | None
    solution: Solution | None


def graph_device(gm: fx.GraphModule) -> torch.device:
    for node in gm.graph.nodes:
        val = tensor_value(node)
        if val is not None and val.device.type != "cpu" and val.device.type != "meta":
            return val.device
    return torch.device("cpu")


def plan_partition(
    joint_gm: fx.GraphModule,
    joint_inputs: Sequence[object],
    settings: Settings,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    graph_name: str = "graph",
) -> PartitionResult:
    """Plan and partition one joint graph under ``settings``, and report it (logs, trace, dump)."""
    from .logs import emit

    result = _plan_partition(joint_gm, joint_inputs, settings, num_fwd_outputs=num_fwd_outputs,
                             static_lifetime_input_indices=static_lifetime_input_indices, graph_name=graph_name)
    emit(result, joint_gm, settings)
    return result


def _plan_partition(
    joint_gm: fx.GraphModule,
    joint_inputs: Sequence[object],
    settings: Settings,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    graph_name: str = "graph",
) -> PartitionResult:
    """Plan and partition one joint graph under ``settings``.

    A graph the planner cannot handle falls back to torch's min-cut partition (a correct
    plan) with one warning naming the reason; a budget error under ``strict_budget`` raises.
    """
    from .passes.cost import node_seconds

    from .device_profile import resolve_profile

    started = time.perf_counter()
    joint = compat.prepare_joint(joint_gm, num_fwd_outputs, static_lifetime_input_indices)
    profile = resolve_profile(settings.device_profile, graph_device(joint_gm))
    if not compat.has_backward(joint):
        fw_gm, bw_gm = compat.default_partition(joint, joint_inputs)
        plan = Plan(True, settings.budget_bytes, 0, 0.0, 0, 0.0, 0, device_profile=profile.name,
                    solver=settings.solver, graph_name=graph_name, notes=["no backward: torch's default partition"])
        return PartitionResult(plan, fw_gm, bw_gm, None, None)
    try:
        analysis = analyze_joint(joint, fusion=settings.inner_compiler == "inductor")
        memo: dict[fx.Node, float] = {}
        # Under Inductor a pointwise op fused into its consumers costs no kernel of its own.
        fused = fused_nodes(analysis.position, set(analysis.fw_outputs) | set(analysis.bw_outputs)) if analysis.fusion else set()

        def seconds(node: fx.Node) -> float:
            if node not in memo:
                memo[node] = 0.0 if node in fused else node_seconds(node, profile)
            return memo[node]

        if settings.plan_cache_dir is not None:
            cached = plan_cache.lookup(joint.gm, settings, profile.to_dict(), analysis=analysis)
            if cached is not None:
                from_cache = _rebuild_from_cache(analysis, cached, settings, num_fwd_outputs, graph_name, joint.gm,
                                                 seconds, profile)
                _report_budget(from_cache.plan, settings)  # a cached plan misses its budget as loudly
                return from_cache
        base_saved = without_banned_recompute(analysis, compat.min_cut_saved_values(joint))

        solution = None
        limit = settings.plan_time_limit
        progress = Progress(None if limit is None else max(0.0, limit - (time.perf_counter() - started)), graph_name)
        if settings.solver == "exact":
            try:
                solution = solve_exact(analysis, base_saved, seconds, settings.budget_bytes,
                                       settings.exact_max_candidates, settings.budget_fraction, progress)
            except SolverError as error:
                warnings.warn(f"compile_offload: {graph_name}: {error}; using the greedy solver", stacklevel=2)
        if solution is None:
            offload = None
            # Planning for a CPU, "host memory" is the device's own memory: an offloaded copy
            # frees nothing (AllocationTracker measured 3.20 MiB against a predicted 2.20 MiB
            # for TinyGPT 2x d64 at budget 0.75 on the CPU), so the solver only keeps or
            # recomputes there. debug_force_offload still offloads (tests of the runtime).
            if settings.offload and not settings.debug_force_offload and profile.name != "cpu":
                offload = OffloadOptions(profile, lambda node: eligible_for_offload(node)[0], settings.prefetch)
            solution = solve_joint(analysis, base_saved, seconds, settings.budget_bytes, settings.budget_fraction,
                                   offload, progress)
        fw_gm, bw_gm = build_graphs(analysis, inputs_for_their_views(analysis, solution.chosen.saved))
        chosen = solution.chosen
        fw_gm, bw_gm = _insert_planned_offloads(fw_gm, bw_gm, chosen.offloaded, chosen.transfers, settings,
                                                num_fwd_outputs)
    except (NotImplementedError, KeyError, AssertionError, TypeError, RuntimeError) as error:
        warnings.warn(
            f"compile_offload: {graph_name}: the planner could not handle this graph ({type(error).__name__}: "
            f"{error}); falling back to torch's default min-cut partition (correct, but the memory budget is "
            "not applied to this graph)",
            stacklevel=2,
        )
        joint = compat.prepare_joint(joint_gm, num_fwd_outputs, static_lifetime_input_indices)
        fw_gm, bw_gm = compat.default_partition(joint, joint_inputs)
        plan = Plan(False, settings.budget_bytes, 0, 0.0, 0, 0.0, 0, device_profile=profile.name,
                    solver=settings.solver, graph_name=graph_name, notes=[f"fallback: {error}"])
        fw_gm, bw_gm = _force_offload(fw_gm, bw_gm, plan, settings, num_fwd_outputs)
        return PartitionResult(plan, fw_gm, bw_gm, None, None)
    plan = make_plan(analysis, solution, seconds, settings, profile.name, graph_name,
                     time.perf_counter() - started)
    if progress.out_of_time:
        plan.notes.append(f"plan_time_limit={settings.plan_time_limit:g} s reached: the best plan found by then")
    fw_gm, bw_gm = _force_offload(fw_gm, bw_gm, plan, settings, num_fwd_outputs)
    _report_budget(plan, settings)
    if settings.plan_cache_dir is not None and not progress.out_of_time:  # a complete search may do better
        plan_cache.store(joint.gm, settings, profile.to_dict(), plan)
    return PartitionResult(plan, fw_gm, bw_gm, analysis, solution)


def _rebuild_from_cache(a: JointAnalysis, plan: Plan, settings: Settings, num_fwd_outputs: int,
                        graph_name: str, joint_gm: fx.GraphModule, seconds, profile) -> PartitionResult:
    """The graphs of a cached plan, without solving. The plan stores decisions only; where
    the copies go follows from them and the cost model (``passes.transfer``), as when solved."""
    by_name = {node.name: node for node in joint_gm.graph.nodes}
    saved = {by_name[name] for name in plan.saved}
    offloaded = {by_name[name] for name in plan.offloaded}
    fw_gm, bw_gm = build_graphs(a, inputs_for_their_views(a, saved))
    transfers = plan_transfers(a, saved, offloaded, seconds, profile, settings.prefetch) if offloaded else None
    fw_gm, bw_gm = _insert_planned_offloads(fw_gm, bw_gm, offloaded, transfers, settings, num_fwd_outputs)
    fw_gm, bw_gm = _force_offload(fw_gm, bw_gm, plan, settings, num_fwd_outputs)
    plan.graph_name = graph_name
    plan.notes.append("reused from the plan cache")
    return PartitionResult(plan, fw_gm, bw_gm, a, None)


def inputs_for_their_views(a: JointAnalysis, saved) -> set[fx.Node]:
    """``saved``, with each saved view of a graph input replaced by the input itself (the
    view is recomputed in the backward: free, and the same storage).

    Inductor returns a saved view of an input as ``reinterpret_tensor(input, ...)``, a new
    tensor without the input's version counter, so a user who mutates the input between
    forward and backward gets gradients of values the forward never saw, where eager raises
    (pytorch#197887). The input itself is returned as the very tensor the user passed, and
    autograd's saved-tensor check sees the mutation."""
    result = set()
    for node in saved:
        root, step = a.roots.get(node, node), node
        while step is not root and step not in a.ban and a.alias_parent.get(step) is not None:
            step = a.alias_parent[step]
        result.add(root if step is root and root is not node and root in a.steady else node)
    return result


def _insert_planned_offloads(fw_gm, bw_gm, offloaded, transfers: TransferPlan | None, settings: Settings,
                             num_fwd_outputs: int):
    """Offload the tensors the plan chose: copies inserted next to their producers and first
    uses, then each forward wait and backward reload moved where the transfer model put it."""
    if not offloaded:
        return fw_gm, bw_gm
    from .passes.offload import eligible_saved_tensors, insert_offloads
    from .passes.schedule import place_offload_waits, place_reloads

    from . import pinned_pool
    from .ops import OFFLOAD_OPS

    pinned_pool.set_limit(settings.pinned_pool_limit)
    eligible = set(eligible_saved_tensors(fw_gm, num_fwd_outputs))
    names = sorted(tensor.name for tensor in offloaded)
    for name in names:
        if name not in eligible:
            raise RuntimeError(f"planned offload of {name} is not an eligible saved tensor of the forward graph")
    fw_gm, bw_gm = insert_offloads(fw_gm, bw_gm, names, OFFLOAD_OPS, num_fwd_outputs=num_fwd_outputs,
                                   prefetch_distance=0)
    fw_gm = place_offload_waits(fw_gm, {t.name: node.name for t, node in transfers.offload_wait_after.items()})
    bw_gm = place_reloads(bw_gm, {t.name: node.name for t, node in transfers.reload_before.items()})
    return fw_gm, bw_gm


def _force_offload(fw_gm, bw_gm, plan: Plan, settings: Settings, num_fwd_outputs: int):
    """``debug_force_offload``: offload every eligible saved tensor of the chosen plan."""
    if not (settings.offload and settings.debug_force_offload):
        return fw_gm, bw_gm
    from .passes.offload import eligible_saved_tensors, insert_offloads

    from . import pinned_pool
    from .ops import OFFLOAD_OPS

    pinned_pool.set_limit(settings.pinned_pool_limit)
    names = eligible_saved_tensors(fw_gm, num_fwd_outputs)
    fw_gm, bw_gm = insert_offloads(fw_gm, bw_gm, names, OFFLOAD_OPS, num_fwd_outputs=num_fwd_outputs,
                                   prefetch_distance=1 if settings.prefetch else 0)
    offloaded = set(names)
    for decision in plan.decisions:
        if decision.name in offloaded:
            decision.decision = "offload"
            decision.reason = "debug_force_offload=True"
    plan.notes.append(f"debug_force_offload: {len(offloaded)} saved tensors offloaded")
    return fw_gm, bw_gm


def _report_budget(plan: Plan, settings: Settings) -> None:
    if plan.feasible or plan.budget_bytes is None:
        return
    message = (
        f"compile_offload: {plan.graph_name}: memory budget {format_bytes(plan.budget_bytes)} is below the minimum "
        f"this planner can reach ({format_bytes(plan.min_peak_bytes)}); using the minimum-memory plan "
        f"(predicted peak {format_bytes(plan.predicted_peak_bytes)})"
    )
    if settings.budget_fraction == 0.0:
        return  # asks for the minimum plan: nothing to warn about
    if settings.strict_budget:
        raise BudgetError(message + "; strict_budget=True")
    warnings.warn(message, stacklevel=3)


def make_plan(a: JointAnalysis, solution: Solution, seconds, settings: Settings, profile_name: str,
              graph_name: str, solve_seconds: float) -> Plan:
    decisions: list[Decision] = []
    base = solution.baseline.saved
    final = solution.chosen.saved
    counted_parents: set[fx.Node] = set()
    for tensor in sorted(base | final, key=a.position.__getitem__):
        val = tensor_value(tensor)
        if val is None or tensor in a.steady:
            continue
        if tensor in solution.chosen.offloaded:
            transfers = solution.chosen.transfers
            decision, reason = "offload", solution.offloaded[tensor]
            cost = sum(copy.stall for copy in transfers.copies if copy.tensor is tensor)
        elif tensor in solution.recomputed:
            parent = compute_node(tensor)
            cost = 0.0 if parent in counted_parents else seconds(parent)
            counted_parents.add(parent)
            decision, reason = "recompute", solution.recomputed[tensor]
        elif tensor in solution.added:
            decision, reason, cost = "keep", solution.added[tensor], 0.0
        else:
            decision, cost = "keep", 0.0
            reason = _keep_reason(a, tensor, settings, solution)
        decisions.append(Decision(
            name=tensor.name,
            shape=tuple(compat.size_hint(s) for s in val.shape),
            dtype=str(val.dtype).replace("torch.", ""),
            bytes=a.storage_bytes(tensor),
            decision=decision,
            reason=reason,
            cost_seconds=cost,
        ))
    baseline_seconds = step_seconds(a, base, seconds)
    transfers = solution.chosen.transfers
    exposed = transfers.exposed_seconds if transfers else 0.0
    notes = [f"offload: {len(solution.chosen.offloaded)} tensors, {exposed * 1e3:.3f} ms of copies not hidden"] if transfers else []
    order = a.position.__getitem__
    saved_names = [n.name for n in sorted(final, key=order)]
    offloaded = {n.name: transfers.reload_distance.get(n, 1) for n in sorted(solution.chosen.offloaded, key=order)}
    timeline = solution.chosen.timeline
    return Plan(
        saved=saved_names,
        offloaded=offloaded,
        timeline_bytes=list(timeline.live_bytes) if timeline else [],
        backward_start=timeline.backward_start if timeline else 0,
        feasible=solution.feasible,
        budget_bytes=solution.budget_bytes,
        predicted_peak_bytes=solution.chosen.peak_bytes,
        predicted_step_seconds=step_seconds(a, final, seconds) + (transfers.added_seconds if transfers else 0.0),
        baseline_peak_bytes=solution.baseline.peak_bytes,
        baseline_step_seconds=baseline_seconds,
        min_peak_bytes=solution.minimum.peak_bytes,
        decisions=decisions,
        device_profile=profile_name,
        solver=settings.solver,
        solve_seconds=solve_seconds,
        graph_name=graph_name,
        notes=notes,
    )


def _keep_reason(a: JointAnalysis, tensor: fx.Node, settings: Settings, solution: Solution) -> str:
    if solution.budget_bytes is None:
        return "no budget: unconstrained plan"
    ban = a.ban.get(compute_node(tensor)) or a.ban.get(tensor)
    if ban:
        return f"cannot be recomputed: {ban}"
    collective = collective_source(tensor)
    if collective is not None:  # e.g. a view of an all-gathered weight
        return f"output of the collective {collective.target}: never recomputed or offloaded"
    if solution.feasible:
        return "fits the budget"
    return "recomputing it would not lower the peak"
