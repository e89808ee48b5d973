"""A solved joint graph -> the printable ``Plan``: one decision per saved tensor, with its
reason and cost, and the predicted figures."""

from __future__ import annotations

import torch.fx as fx

from . import compat
from .analyze import JointAnalysis, UnsupportedGraph, collective_source, tensor_value
from .memory import recomputed_nodes
from .plan import Decision, Plan
from .saved_storages import saved_storages, views_by_base
from .solve.recompute import Seconds, Solution, compute_node, step_seconds, unread_saved


def build_plan(a: JointAnalysis, solution: Solution, seconds: Seconds, *, solver: str, profile_name: str,
               graph_name: str, solve_seconds: float) -> Plan:
    decisions: list[Decision] = []
    base = solution.baseline.saved
    final = solution.chosen.saved
    offloaded = solution.chosen.offloaded
    # The rows describe what the forward saves: one tensor per storage (``saved_storages``),
    # the solver's saved views of a storage shown as that storage's tensor.
    base_stored, stored = _stored(a, base), _stored(a, final, offloaded)
    recomputed = recomputed_nodes(a, set(stored))
    # A tensor of the plan the backward does not read (a per-segment plan's last cut, the
    # model's output) is not saved by the forward: no row (its bytes stay in the peak).
    unread = unread_saved(a, stored) - offloaded
    counted_parents: set[fx.Node] = set()
    base_views, final_views = views_by_base(a, base), views_by_base(a, final)
    for tensor in sorted((base_stored - unread_saved(a, base_stored)) | stored, key=a.position.__getitem__):
        val = tensor_value(tensor)
        if val is None or tensor in a.steady or tensor in unread:
            continue
        if tensor in offloaded:
            transfers = solution.chosen.transfers
            decision, reason = "offload", solution.offloaded.get(tensor, "offloaded")
            cost = sum(copy.stall for copy in transfers.copies if copy.tensor is tensor) if transfers else 0.0
        elif tensor not in stored:
            if tensor not in recomputed:  # replaced by a tensor the backward reads instead (its storage's)
                continue
            parent = compute_node(tensor)
            cost = 0.0 if parent in counted_parents else seconds(parent)
            counted_parents.add(parent)
            decision, reason = "recompute", _reason(solution.recomputed, [tensor, *base_views.get(tensor, ())],
                                                    "recomputed in the backward")
        elif tensor not in final:  # the storage of saved views
            views = final_views.get(tensor, [])
            decision, cost = "keep", 0.0
            reason = f"holds the saved views {', '.join(v.name for v in views)} (a storage is saved once)"
        elif tensor in solution.added:
            decision, reason, cost = "keep", solution.added[tensor], 0.0
        else:
            decision, reason, cost = "keep", keep_reason(a, tensor, solution), 0.0
        decisions.append(Decision(
            name=tensor.name,
            shape=tuple(compat.size_hint(s) for s in val.shape),
            dtype=str(val.dtype).replace("torch.", ""),
            bytes=a.storage_bytes(tensor),
            decision=decision,
            reason=reason,
            cost_seconds=cost,
        ))
    transfers = solution.chosen.transfers
    exposed = transfers.exposed_seconds if transfers else 0.0
    notes = [f"offload: {len(solution.chosen.offloaded)} tensors, {exposed * 1e3:.3f} ms of copies not hidden"] if transfers else []
    if solution.lowered_steps:
        notes.append(f"lowered: {solution.lowered_steps} step{'s' * (solution.lowered_steps != 1)} below the "
                     "greedy's lowest plan (passes/solve/lower_peak.py)")
    if solution.from_segments:
        notes.append("from per-segment checkpointing: the greedy's plans did not fit, so the search started again "
                      "from the forward cut where one tensor is live, each segment recomputed from the cut before it "
                      "(passes/solve/segments.py)")
    order = a.position.__getitem__
    timeline = solution.chosen.timeline
    unread_by_solver = unread_saved(a, final)
    return Plan(
        saved=[n.name for n in sorted(final, key=order)
               if n in a.steady or (tensor_value(n) is not None and n not in unread_by_solver)],
        offloaded={n.name: transfers.reload_distance.get(n, 1) for n in sorted(solution.chosen.offloaded, key=order)},
        timeline_bytes=list(timeline.live_bytes) if timeline else [],
        backward_start=timeline.backward_start if timeline else 0,
        feasible=solution.feasible,
        budget_bytes=solution.budget_bytes,
        predicted_peak_bytes=solution.chosen.peak_bytes,
        predicted_step_seconds=step_seconds(a, stored, seconds) + (transfers.added_seconds if transfers else 0.0),
        baseline_peak_bytes=solution.baseline.peak_bytes,
        baseline_step_seconds=step_seconds(a, base_stored, seconds),
        baseline_held_bytes=(max(solution.baseline.timeline.held_at_backward_start,
                                 solution.baseline.timeline.held_at_end)
                             if solution.baseline.timeline else None),
        min_peak_bytes=solution.minimum.peak_bytes,
        decisions=decisions,
        device_profile=profile_name,
        solver=solver,
        solve_seconds=solve_seconds,
        graph_name=graph_name,
        notes=notes,
        lowest_start=(None if solution.rival_peak_bytes is None
                      else "segments" if solution.from_segments else "greedy"),
        rival_peak_bytes=solution.rival_peak_bytes,
    )


def _stored(a: JointAnalysis, saved: frozenset[fx.Node], offloaded: frozenset[fx.Node] = frozenset()) -> set[fx.Node]:
    """What the forward saves for ``saved`` (``saved_storages``); ``saved`` itself where the
    graph cannot be planned so (the backend falls back, and says why)."""
    try:
        return saved_storages(a, saved, offloaded)
    except UnsupportedGraph:
        return set(saved)


def _reason(reasons: dict[fx.Node, str], members: list[fx.Node], default: str) -> str:
    return next((reasons[node] for node in members if node in reasons), default)


def keep_reason(a: JointAnalysis, tensor: fx.Node, solution: Solution) -> str:
    """Why a tensor the unconstrained plan saves is still kept."""
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

