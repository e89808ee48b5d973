"""Plan -> forward and backward GraphModules."""

from __future__ import annotations

import torch.fx as fx

from . import compat
from .analyze import JointAnalysis
from .memory import recomputed_nodes
from .saved_storages import saved_storages
from .schedule import sink_recomputation


def backward_inputs(a: JointAnalysis, recomputed: set[fx.Node]) -> set[fx.Node]:
    """Inputs (parameters, user inputs) that recomputation or the backward reads: the
    backward sees only what the forward saves, so they are saved too (they cost no memory)."""
    readers = [*recomputed, *a.bw_nodes]
    return {arg for n in readers for arg in n.all_input_nodes if arg in a.steady}


def build_graphs(a: JointAnalysis, saved: set[fx.Node], recompile: bool = True,
                 offloaded: set[fx.Node] = frozenset()) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward saving ``saved``, one tensor per storage (``saved_storages``: a saved view is
    recomputed from the tensor it views); backward recomputing the rest just in time.
    ``offloaded``: those of ``saved`` the caller copies to the host. ``recompile=False``: the
    caller edits the backward again and recompiles it after."""
    saved = saved_storages(a, saved, offloaded)
    recomputed = recomputed_nodes(a, set(saved))
    ordered = sorted(set(saved) | backward_inputs(a, recomputed), key=a.position.__getitem__)
    fw_gm, bw_gm = compat.extract_forward_backward(a.joint, ordered)
    recomputed = {n.name for n in recomputed}
    bw_gm = sink_recomputation(bw_gm, recomputed, recompile)
    return fw_gm, bw_gm
