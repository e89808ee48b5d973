"""Put a plan's offloads into the partitioned graphs: copy, wait and reload nodes
(``passes.offload``) running the ops of ``compile_offload.runtime.ops``, placed where the transfer
model put them (``passes.schedule``)."""

from __future__ import annotations

import torch.fx as fx

from ..runtime.ops import OFFLOAD_OPS
from ..passes.offload import eligible_saved_tensors, insert_offloads
from ..passes.plan import Plan
from ..passes.schedule import place_offload_waits, place_reloads
from ..passes.analyze import JointAnalysis, UnsupportedGraph
from ..passes.transfer import TransferPlan, plan_transfers
from ..settings import Settings


def insert_planned_offloads(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, offloaded, transfers: TransferPlan | None,
                            num_fwd_outputs: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Offload the tensors the plan chose: copies inserted next to their producers and first
    uses, then each forward wait and backward reload moved where the transfer model put it."""
    if not offloaded:
        return fw_gm, bw_gm
    eligible = set(eligible_saved_tensors(fw_gm, num_fwd_outputs))
    names = sorted(tensor.name for tensor in offloaded)
    for name in names:
        if name not in eligible:
            # a planning error: torch's partition runs instead, said once (planning.plan_partition)
            raise UnsupportedGraph(f"planned offload of {name} is not an eligible saved tensor of the forward graph")
    # Not recompiled here: placing the waits and reloads edits both graphs again, and recompiles them.
    fw_gm, bw_gm = insert_offloads(fw_gm, bw_gm, names, OFFLOAD_OPS, num_fwd_outputs=num_fwd_outputs,
                                   prefetch_distance=0, recompile=False)
    fw_gm = place_offload_waits(fw_gm, {t.name: node.name for t, node in transfers.offload_wait_after.items()})
    bw_gm = place_reloads(bw_gm, {t.name: node.name for t, node in transfers.reload_before.items()})
    return fw_gm, bw_gm


def force_offload(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, plan: Plan, settings: Settings,
                  num_fwd_outputs: int, transfers_for=None) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``debug_force_offload``: offload every eligible saved tensor of the chosen plan.

    ``transfers_for(names)`` (from ``planned_placement``): the offloaded joint nodes and
    their ``TransferPlan``; with it the copies are placed as a planned offload's would be
    (waits and prefetch distances of the transfer model under the configured profile), so a
    CPU run exercises the placement a GPU run gets. Without it (the fallback partition,
    which has no analysis) each reload goes one node ahead of its use."""
    if not (settings.offload and settings.debug_force_offload):
        return fw_gm, bw_gm
    # A saved tensor the backward takes under no name of its own (AOTAutograd's saved
    # RNG state of a checkpointed dropout) has nothing to reload into: it stays.
    received = {node.name for node in bw_gm.graph.nodes if node.op == "placeholder"}
    names = [name for name in eligible_saved_tensors(fw_gm, num_fwd_outputs) if name in received]
    if not names:  # nothing left to force (a plan from the plan cache offloads them already)
        return fw_gm, bw_gm
    placed = transfers_for(names) if transfers_for is not None else None
    if placed is not None:
        tensors, transfers = placed
        fw_gm, bw_gm = insert_planned_offloads(fw_gm, bw_gm, tensors, transfers, num_fwd_outputs)
        distances = {node.name: transfers.reload_distance.get(node, 1) for node in tensors}
    else:
        distance = 1 if settings.prefetch else 0
        fw_gm, bw_gm = insert_offloads(fw_gm, bw_gm, names, OFFLOAD_OPS, num_fwd_outputs=num_fwd_outputs,
                                       prefetch_distance=distance)
        distances = dict.fromkeys(names, distance)
    offloaded = set(names)
    for decision in plan.decisions:
        if decision.name in offloaded:
            decision.decision = "offload"
            decision.reason = "debug_force_offload=True"
    # the decisions and Plan.offloaded agree (the predicted peak and step stay the plan's before forcing)
    plan.offloaded = {**plan.offloaded, **{name: distances[name] for name in names}}
    plan.notes.append(f"debug_force_offload: {len(offloaded)} saved tensors offloaded (the predicted peak and step "
                      "time are the plan's before they were)")
    return fw_gm, bw_gm


def planned_placement(a: JointAnalysis, saved, seconds, profile, prefetch: bool):
    """For ``force_offload``: saved tensor names -> (their joint nodes, the transfer
    model's placement of their copies under the plan that saves ``saved``), or None when
    a name is not a joint node (the forced copies are then placed without the model)."""
    by_name = {node.name: node for node in a.position}

    def transfers_for(names):
        if not all(name in by_name for name in names):
            return None
        tensors = {by_name[name] for name in names}
        return tensors, plan_transfers(a, set(saved), tensors, seconds, profile, prefetch)

    return transfers_for
