"""Transfer model: when offloads and reloads run on the copy engine, and what they expose.

Copies run on their own stream, one direction of the link at a time (each direction is
shared by every transfer in flight: a FIFO per direction). Compute runs on the compute
stream with per-node times from the cost model. An offload starts after its producer; the
forward waits for it after the tensor's last forward use. A reload starts ``distance``
backward steps before the first use, chosen as the latest step whose remaining compute
covers the copy; the backward waits for it right before the first use. A wait that finds
its copy unfinished stalls compute: that stall is the *exposed* transfer time, the only
time offload adds to a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch.fx as fx

from .analyze import JointAnalysis
from .cost import DeviceProfile, transfer_seconds
from .memory import backward_order, forward_nodes_needed, recomputed_nodes

Seconds = Callable[[fx.Node], float]


@dataclass
class TransferPlan:
    exposed_seconds: float = 0.0  # compute stalls waiting for copies, forward + backward
    reload_distance: dict[fx.Node, int] = field(default_factory=dict)  # backward steps ahead of first use
    hidden_behind_seconds: dict[fx.Node, float] = field(default_factory=dict)  # compute overlapping each reload


def plan_transfers(a: JointAnalysis, saved: set[fx.Node], offloaded: set[fx.Node], seconds: Seconds,
                   profile: DeviceProfile, prefetch: bool = True) -> TransferPlan:
    plan = TransferPlan()
    if not offloaded:
        return plan
    # Forward: offload after the producer, wait after the last forward use.
    forward = forward_nodes_needed(a, saved)
    position = {n: i for i, n in enumerate(forward)}
    last_use = {t: max((position[u] for u in t.users if u in position), default=position[t]) for t in offloaded}
    waits_at: dict[int, list[fx.Node]] = {}
    for tensor, index in last_use.items():
        waits_at.setdefault(index, []).append(tensor)
    now = link_free = 0.0
    done: dict[fx.Node, float] = {}
    for index, node in enumerate(forward):
        now += seconds(node)
        if node in offloaded:
            link_free = max(now, link_free) + transfer_seconds(a.bytes_of.get(node, 0), profile, "d2h")
            done[node] = link_free
        for tensor in waits_at.get(index, ()):
            if done[tensor] > now:
                plan.exposed_seconds += done[tensor] - now
                now = done[tensor]
    # Backward: reload ahead of the first use, far enough to hide the copy if possible.
    order = backward_order(a, recomputed_nodes(a, saved))
    first_use: dict[fx.Node, int] = {}
    for index, node in enumerate(order):
        for arg in node.all_input_nodes:
            base = a.roots.get(arg, arg)
            if base in offloaded:
                first_use.setdefault(base, index)
    step_seconds = [seconds(n) for n in order]
    starts_at: dict[int, list[fx.Node]] = {}
    for tensor, use in first_use.items():
        needed = transfer_seconds(a.bytes_of.get(tensor, 0), profile, "h2d")
        start, covered = use, 0.0
        while prefetch and start > 0 and covered < needed:
            start -= 1
            covered += step_seconds[start]
        plan.reload_distance[tensor] = use - start
        plan.hidden_behind_seconds[tensor] = covered
        starts_at.setdefault(start, []).append(tensor)
    now = link_free = 0.0
    done = {}
    waits_before: dict[int, list[fx.Node]] = {}
    for tensor, use in first_use.items():
        waits_before.setdefault(use, []).append(tensor)
    for index, node in enumerate(order):
        for tensor in sorted(starts_at.get(index, ()), key=first_use.__getitem__):
            link_free = max(now, link_free) + transfer_seconds(a.bytes_of.get(tensor, 0), profile, "h2d")
            done[tensor] = link_free
        for tensor in waits_before.get(index, ()):
            if done[tensor] > now:
                plan.exposed_seconds += done[tensor] - now
                now = done[tensor]
        now += step_seconds[index]
    return plan
