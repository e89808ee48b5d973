"""Keep Inductor from moving the copies the plan placed.

The plan issues each offload right after its producer, waits for it where the transfer
model says the copy has finished, and issues each reload a planned distance ahead of its
use (``passes.schedule``). Inductor's scheduler has passes that reorder nodes by their own
estimates: ``reorder_for_peak_memory`` (on by default) moves ``wait_offload`` up to its
``offload`` (the wait frees nothing, so waiting early looks as good as late) and sinks each
``reload`` to just before its ``wait_reload`` (a reload allocates). Either undoes the
overlap the plan was chosen for: on a GPU every copy would stall compute.

So a graph that contains our copy ops is compiled with those passes off; every other graph
(no offload, inference) keeps Inductor's defaults. The switch is per graph: the forward and
backward of one compile are compiled separately by ``inner_compile``, which this module
wraps. The config names are feature-detected here, in one place (torch 2.11 to 2.14 all
have them; a torch without one simply has nothing to turn off).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..runtime.ops import NAMESPACE

# Inductor scheduler passes that reorder nodes across our copies, and the value that
# keeps the graph's order. ``reorder_for_compute_comm_overlap`` is off by default; a user
# who turns it on for collectives would otherwise move our copies too.
_REORDERING_PASSES = {
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": False,
}


def order_keeping_patches() -> dict[str, Any]:
    """The ``torch._inductor.config`` patches that keep a graph's copy placement, for the
    names this torch has."""
    from ..torch_api.inductor import config as inductor_config

    return {name: value for name, value in _REORDERING_PASSES.items() if hasattr(inductor_config, name)}


def has_copy_ops(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` calls any of ``compile_offload``'s offload, reload or wait ops."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == NAMESPACE:
            return True
    return False


def keeping_copy_order(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """``inner_compile`` (Inductor's ``compile_fx_inner``), compiling graphs that contain
    copy ops with ``order_keeping_patches()``."""

    @functools.wraps(inner_compile)
    def compile_keeping_copy_order(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any):
        if not has_copy_ops(gm):
            return inner_compile(gm, *args, **kwargs)
        from ..torch_api.inductor import config as inductor_config

        with inductor_config.patch(order_keeping_patches()):
            return inner_compile(gm, *args, **kwargs)

    return compile_keeping_copy_order
