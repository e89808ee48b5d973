"""Reuse saved plans across restarts (``config.plan_cache_dir``).

An entry is keyed by everything the plan depends on: the prepared joint graph (code,
shapes, dtypes, strides and checkpoint policy tags), the knobs that change decisions, the device profile, the torch
version and compile_offload's own source. Entries are never trusted blindly: one that
cannot be read or has fields of the wrong type (``Plan.load`` checks both) is corrupt; one
that names a tensor the graph does not have or, given the graph's analysis, would save a
backward value, recompute what must not be recomputed (a random op, a mutation) or offload
what cannot be offloaded is stale. Either is ignored with a warning and the graph is
planned again. The cache only saves solver time, so a file that cannot be written is a
warning too, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
import torch.fx as fx

from .fingerprint import source_hash
from ..passes.analyze import JointAnalysis
from ..passes.compat import size_hint
from ..passes.memory import recomputed_nodes
from ..passes.offload import eligible_for_offload
from ..passes.plan import Plan
from ..passes.rewrite import build_graphs
from ..passes.transfer import plan_transfers
from ..runtime.kernel_costs import MeasuredCosts
from .place_offloads import force_offload, insert_planned_offloads, planned_placement
from .result import PartitionResult
from ..settings import Settings

# The settings a plan depends on, besides the graph (planning sizes enter through its sizes) and
# the device profile (``shared_h2d_bytes`` through it): they key the cache.
_DECISION_KNOBS = ("budget_bytes", "budget_fraction", "offload", "prefetch", "debug_force_offload", "solver",
                   "exact_max_candidates", "inner_compiler", "measured_plan_choice", "lowest_start",
                   "torch_fraction", "torch_config")
# The settings that decide no plan (what is done with it, reported or measured), or reach the
# key another way: ``tests/test_plan_cache.py`` holds every field of ``Settings`` to one of the two.
_NOT_DECIDING = ("strict_budget", "dump_dir", "plan_cache_dir", "device_profile", "pinned_pool_limit",
                "suppress_errors", "plan_time_limit", "verify_budget", "measured_plan_steps", "budget_scope",
                "shared_h2d_bytes", "planning_sizes", "sizes_to_cover")


def cache_key(joint_gm: fx.GraphModule, settings: Settings, profile: dict) -> str:
    digest = _graph_digest(joint_gm)
    knobs = {knob: getattr(settings, knob) for knob in _DECISION_KNOBS}
    digest.update(json.dumps([knobs, profile, torch.__version__, source_hash()], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


def _graph_digest(joint_gm: fx.GraphModule):
    digest = hashlib.sha256()
    digest.update(joint_gm.code.encode())
    for node in joint_gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            # A symbolic size with the size it is planned at (a dynamic graph's plan is made for one).
            shape = tuple(s if isinstance(s, int) else f"{s}={size_hint(s)}" for s in val.shape)
            digest.update(f"{node.name}:{shape}:{val.stride()}:{val.dtype}:{val.device.type}".encode())
        policy = node.meta.get("recompute")  # checkpoint policies change decisions, not the code
        if policy is not None:
            digest.update(f"{node.name}:{getattr(policy, 'name', policy)}:{node.meta.get('ac_graph_id')}".encode())
    return digest


def _measured_path(joint_gm: fx.GraphModule, settings: Settings, device: str) -> Path:
    """The measured-costs table of a graph on a device: one per graph and device, whatever
    the budget (``runtime/kernel_costs.py``)."""
    digest = _graph_digest(joint_gm)
    digest.update(json.dumps([device, torch.__version__, source_hash()]).encode())
    return Path(settings.plan_cache_dir) / "measured_costs" / f"{digest.hexdigest()[:32]}.json"


def load_measured_costs(joint_gm: fx.GraphModule, settings: Settings, device: str) -> MeasuredCosts | None:
    """The costs measured for this graph on ``device``; None when there are none (a table that
    cannot be read is ignored with a warning: planning falls back to the cost model)."""
    path = _measured_path(joint_gm, settings, device)
    try:
        return MeasuredCosts.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        warnings.warn(f"compile_offload: ignoring the measured-costs table {path} ({error}); planning from the "
                      "cost model", stacklevel=2)
        return None


def store_measured_costs(joint_gm: fx.GraphModule, settings: Settings, costs: MeasuredCosts) -> None:
    path = _measured_path(joint_gm, settings, costs.device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(costs.to_json(), file)
        os.replace(temporary, path)
    except OSError as error:
        warnings.warn(f"compile_offload: could not write the measured-costs table {path} ({error}); the costs are "
                      "used but not cached", stacklevel=2)


def _path(settings: Settings, key: str) -> Path:
    return Path(settings.plan_cache_dir) / f"{key}.json"


def lookup(joint_gm: fx.GraphModule, settings: Settings, profile: dict,
           analysis: JointAnalysis | None = None) -> Plan | None:
    """The cached plan for this graph, or None (nothing cached, or an entry not to trust).

    Pass ``analysis`` (of ``joint_gm``) to also check that rebuilding the graphs from the
    entry is legal; without it only the entry's form and tensor names are checked.
    """
    path = _path(settings, cache_key(joint_gm, settings, profile))
    if not path.exists():
        return None
    try:
        plan = Plan.load(path)
    except ValueError as error:
        warnings.warn(f"compile_offload: ignoring corrupt plan cache entry {path} ({error}); planning again",
                      stacklevel=2)
        return None
    problem = _unknown_names(plan, joint_gm) or _other_budget(plan, settings)
    if problem is None:
        problem = _unchecked_empty(plan) if analysis is None else _illegal(plan, analysis, settings)
    if problem is not None:
        warnings.warn(f"compile_offload: ignoring stale plan cache entry {path} ({problem}); planning again",
                      stacklevel=2)
        return None
    return plan


def _unknown_names(plan: Plan, joint_gm: fx.GraphModule) -> str | None:
    names = {node.name for node in joint_gm.graph.nodes}
    missing = sorted((set(plan.saved) | set(plan.offloaded)) - names)
    return f"tensors not in this graph: {missing[:5]}" if missing else None


def _other_budget(plan: Plan, settings: Settings) -> str | None:
    """An entry made for another byte budget (or for a budget where none is set now, or none
    where one is): its decisions answer another question. A fraction's bytes follow from
    the plan's own baseline, so only its presence is checked."""
    if settings.budget_fraction is not None:
        return None if plan.budget_bytes is not None else "made without a budget"
    if plan.budget_bytes != settings.budget_bytes:
        made = "no budget" if plan.budget_bytes is None else f"a budget of {plan.budget_bytes} bytes"
        wanted = "no budget" if settings.budget_bytes is None else f"{settings.budget_bytes} bytes"
        return f"made for {made}, not {wanted}"
    return None


def _unchecked_empty(plan: Plan) -> str | None:
    # Saving nothing means recomputing every forward value the backward reads; without the
    # analysis nothing shows that is legal, so such an entry is not trusted.
    return "saves no tensors" if not plan.saved else None


def _illegal(plan: Plan, a: JointAnalysis, settings: Settings) -> str | None:
    """Why building the graphs from this entry would be wrong, if it would.

    The solver never saves a backward value, never leaves a node it must not recompute
    (a random op, a mutation) to the backward, and offloads only saved tensors eligible for
    it; an entry breaking any of these did not come from the solver for this graph.
    """
    unknown = _unknown_names(plan, a.joint.gm)
    if unknown is not None:
        return unknown
    by_name = {node.name: node for node in a.joint.gm.graph.nodes}
    saved = {by_name[name] for name in plan.saved}
    backward = sorted(node.name for node in saved if not a.is_forward(node))
    if backward:
        return f"saves backward values: {backward[:5]}"
    banned = sorted(node.name for node in recomputed_nodes(a, saved) if node in a.ban)
    if banned:
        return f"would recompute {banned[:5]} ({a.ban[by_name[banned[0]]]})"
    if plan.offloaded and not settings.offload:
        return "offloads tensors but offload is disabled"
    not_saved = sorted(set(plan.offloaded) - set(plan.saved))
    if not_saved:
        return f"offloads tensors it does not save: {not_saved[:5]}"
    ineligible = sorted(name for name in plan.offloaded if not eligible_for_offload(by_name[name])[0])
    if ineligible:
        return f"offloads {ineligible[0]} ({eligible_for_offload(by_name[ineligible[0]])[1]})"
    return None


def store(joint_gm: fx.GraphModule, settings: Settings, profile: dict, plan: Plan) -> None:
    """Save ``plan`` for this graph; a failure to write is a warning (the cache only saves time)."""
    store_under(cache_key(joint_gm, settings, profile), settings, plan)


def store_under(key: str, settings: Settings, plan: Plan) -> None:
    """Save ``plan`` as the entry ``key`` (``PartitionResult.cache_key``: the key its graph
    was planned under), as ``store`` does."""
    path = _path(settings, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A temporary file of this process's own, then an atomic rename: ranks sharing one
        # cache folder never read half a file nor interleave their writes.
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        os.close(handle)
        try:
            plan.save(temporary)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except OSError as error:
        warnings.warn(f"compile_offload: could not write the plan cache entry {path} ({error}); "
                      "the plan is used but not cached", stacklevel=2)


def rebuild(a: JointAnalysis, plan: Plan, settings: Settings, num_fwd_outputs: int, graph_name: str,
            seconds, profile, key: str | None = None) -> PartitionResult:
    """The graphs of a cached plan, without solving. The plan stores decisions only; where
    the copies go follows from them and the cost model (``passes.transfer``), as when solved."""
    by_name = {node.name: node for node in a.joint.gm.graph.nodes}
    saved = {by_name[name] for name in plan.saved}
    offloaded = {by_name[name] for name in plan.offloaded}
    fw_gm, bw_gm = build_graphs(a, saved, offloaded=offloaded)
    transfers = plan_transfers(a, saved, offloaded, seconds, profile, settings.prefetch) if offloaded else None
    fw_gm, bw_gm = insert_planned_offloads(fw_gm, bw_gm, offloaded, transfers, num_fwd_outputs)
    fw_gm, bw_gm = force_offload(fw_gm, bw_gm, plan, settings, num_fwd_outputs,
                                 planned_placement(a, saved, seconds, profile, settings.prefetch))
    plan.graph_name = graph_name
    plan.notes.append("reused from the plan cache")
    return PartitionResult(plan, fw_gm, bw_gm, a, None, cache_key=key)
