"""Inductor's horizontal fusion, kept from running a kernel ahead of where the plan put it.

Inductor's scheduler fuses two kernels that only share a read (horizontal fusion) when they
are at most 64 scheduler nodes apart (``Scheduler.are_long_distant_nodes``). The fused
kernel runs at the first one's place, and whatever the second waits for runs before it
(``Scheduler.topological_sort_schedule``). A recomputation the plan put just before its use
can so run a layer early, its buffers held all the while. Measured (torch 2.11, CPU, the
budget contract's Hugging Face GPT-2 at its minimum-memory plan): the recomputed first
layer's ``exp`` shares the saved causal mask with the second layer's softmax backward, 58
scheduler nodes earlier; fused, the first layer's whole recomputation (embedding, layer norm,
query-key-value matmul, 512 KiB scores) ran a layer ahead, and the step measured 4.72 MiB
against the 3.28 MiB planned. With this rule it measures the plan's 3.28 MiB.

Under a memory budget every graph we compile goes through Inductor with the handler this
module installs (``keeping_plan_order``): ``can_fuse_horizontal`` answers as the handler it
wraps (Inductor's own, or the user's ``inductor_choices_class``) and also refuses a pair when
the later kernel waits for one the scheduler orders after the earlier kernel ends. The
planner models the same rule (``passes.inductor.kernel_local._without_pulls``, through
``JointAnalysis.fusion_pulls``). Without a budget Inductor fuses as ``torch.compile`` does.
Vertical fusion (a consumer with its producer) is left as it is.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch


def pulls_ahead(scheduler: Any, node1: Any, node2: Any) -> bool:
    """Whether fusing scheduler nodes ``node1`` and ``node2`` would run a kernel ahead of its
    place: the later one (by ``min_order``) has an ancestor outside it whose fused node the
    scheduler orders after the earlier one's last member."""
    early, late = sorted((node1, node2), key=lambda node: node.min_order)
    own = {node.get_name() for node in late.get_nodes()}
    fused = scheduler.name_to_fused_node
    for name in late.ancestors:
        if name in own:
            continue
        ancestor = fused.get(name)
        if ancestor is not None and ancestor.min_order > early.max_order:
            return True
    return False


class _KeepingPlanOrder:
    """Mixed in before the class of the choices handler it wraps."""

    def can_fuse_horizontal(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        return (super().can_fuse_horizontal(scheduler, node1, node2, shared_data_score)  # type: ignore[misc]
                and not pulls_ahead(scheduler, node1, node2))


_classes: dict[type, type] = {}


def plan_order_choices(prior: Any) -> Any:
    """``prior`` (an ``InductorChoices``), answering as before but for horizontal fusions
    that would pull a kernel ahead."""
    if isinstance(prior, _KeepingPlanOrder):
        return prior
    cls = type(prior)
    if cls not in _classes:
        _classes[cls] = type(f"KeepingPlanOrder{cls.__name__}", (_KeepingPlanOrder, cls), {})
    choices = copy.copy(prior)
    choices.__class__ = _classes[cls]
    return choices


def keeping_plan_order(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """``inner_compile`` (Inductor's ``compile_fx_inner``) with the choices handler of
    ``plan_order_choices`` installed while it runs (its scheduler reads ``V.choices``)."""

    @functools.wraps(inner_compile)
    def compile_keeping_plan_order(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any):
        from ..torch_api.inductor import V

        with V.set_choices_handler(plan_order_choices(V.choices)):
            return inner_compile(gm, *args, **kwargs)

    return compile_keeping_plan_order
