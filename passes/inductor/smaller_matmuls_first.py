"""Order the backward's matmuls that read the same gradient smallest output first.

A linear layer's backward reads its output gradient ``g`` twice: ``g @ W`` (the input
gradient, activation-sized) and ``g.T @ x`` (the weight gradient, parameter-sized), and
autograd emits them in that order. Run the other way round, the weight gradient's matmul
frees the saved input ``x`` (it is often its last reader) before the activation-sized
buffer is allocated; at that kernel the live set is ``g, x, small`` then ``g, small, big``
instead of ``g, x, big`` then ``g, x, big, small``, never more. Inductor's peak-memory
reordering (``torch/_inductor/memory.py``) finds this order when it runs; under a budget
the backend turns it off so that the plan's order holds, so the plan makes this order
itself. Measured on the contract's MLP-mixer (CPU, torch 2.13): without a budget Inductor's
reordering took its step from 4.70 to 4.39 MiB, mostly by this move.

Only views move with a matmul (the permute of ``g`` the weight gradient reads); a matmul
whose other inputs are computed after the one it would pass stays where it is.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..analyze import allocation_bytes, is_tangent, is_view, tensor_value, view_base


def _is_mm(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.aten.mm.default


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes computed from the tangents (the backward's own values)."""
    found: set[fx.Node] = set()
    stack = [n for n in graph.nodes if is_tangent(n)]
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(node.users)
    return found


def _output_bytes(node: fx.Node) -> int:
    val = tensor_value(node)
    return 0 if val is None else allocation_bytes(val)


def _views_to_move(node: fx.Node, before: fx.Node, position: dict[fx.Node, float]) -> list[fx.Node] | None:
    """The inputs of ``node`` placed after ``before`` (through inputs of inputs), all views
    whose own inputs come before ``before``; None when another kind of node is among them."""
    moving: set[fx.Node] = set()
    stack = [arg for arg in node.all_input_nodes if position[arg] >= position[before]]
    while stack:
        arg = stack.pop()
        if arg in moving:
            continue
        if arg is before or not is_view(arg):
            return None
        moving.add(arg)
        stack.extend(a for a in arg.all_input_nodes if position[a] >= position[before])
    return sorted(moving, key=position.__getitem__)


def smaller_matmuls_first(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each backward ``mm`` before the earliest ``mm`` reading the same gradient (through
    views) whose output is larger, with the views it reads, when nothing else stands in the
    way. The graph computes the same values; only the order of independent kernels changes."""
    graph = gm.graph
    backward = _backward_nodes(graph)
    readers: dict[fx.Node, list[fx.Node]] = {}  # gradient -> the backward mms reading it
    for node in graph.nodes:
        if _is_mm(node) and node in backward:
            for base in dict.fromkeys(view_base(arg) for arg in node.all_input_nodes):
                if base in backward:
                    readers.setdefault(base, []).append(node)
    moved = False
    # Only compared, never counted: a moved node takes a fraction between its new neighbours,
    # so one numbering serves the whole pass (linear in the graph, not per move).
    position: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}
    for mms in readers.values():
        if len(mms) < 2:
            continue
        for mm in mms[1:]:
            larger = [other for other in mms if position[other] < position[mm]
                      and _output_bytes(other) > _output_bytes(mm)]
            if not larger:
                continue
            target = min(larger, key=position.__getitem__)
            views = _views_to_move(mm, target, position)
            if views is None:
                continue
            moving = [*views, mm]
            low, high = position[target.prev] if target.prev.op != "root" else -1.0, position[target]
            for index, node in enumerate(moving, start=1):
                target.prepend(node)
                position[node] = low + (high - low) * index / (len(moving) + 1)
            moved = True
    if moved:
        graph.lint()
        gm.recompile()
    return gm
