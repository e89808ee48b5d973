"""Put a plan's offloads into the partitioned graphs: copy, wait and reload nodes
(``passes.offload``) running the ops of ``compile_offload.ops``, placed where the transfer
model put them (``passes.schedule``)."""

from __future__ import annotations

import torch.fx as fx

from .ops import OFFLOAD_OPS
from .passes.offload import eligible_saved_tensors, insert_offloads
from .passes.plan import Plan
from .passes.schedule import place_offload_waits, place_reloads
from .passes.transfer import TransferPlan
from .settings import Settings


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
            raise RuntimeError(f"planned offload of {name} is not an eligible saved tensor of the forward graph")
    fw_gm, bw_gm = insert_offloads(fw_gm, bw_gm, names, OFFLOAD_OPS, num_fwd_outputs=num_fwd_outputs,
                                   prefetch_distance=0)
    fw_gm = place_offload_waits(fw_gm, {t.name: node.name for t, node in transfers.offload_wait_after.items()})
    bw_gm = place_reloads(bw_gm, {t.name: node.name for t, node in transfers.reload_before.items()})
    return fw_gm, bw_gm


def force_offload(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, plan: Plan, settings: Settings,
                  num_fwd_outputs: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``debug_force_offload``: offload every eligible saved tensor of the chosen plan."""
    if not (settings.offload and settings.debug_force_offload):
        return fw_gm, bw_gm
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
