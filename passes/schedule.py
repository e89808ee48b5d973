"""Scheduling passes over the partitioned backward graph."""

from __future__ import annotations

import torch.fx as fx


def just_in_time_order(nodes: list[fx.Node], deferred: set[fx.Node]) -> list[fx.Node]:
    """``nodes`` in their order, each deferred node moved right before its first user.

    Deferred nodes reachable only through other deferred nodes follow them in; deferred
    nodes nobody uses go before the output node.
    """
    order: list[fx.Node] = []
    emitted: set[fx.Node] = set()

    def emit(node: fx.Node) -> None:
        stack = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if current in emitted:
                continue
            if expanded:
                emitted.add(current)
                order.append(current)
                continue
            stack.append((current, True))
            for arg in reversed(current.all_input_nodes):
                if arg in deferred and arg not in emitted:
                    stack.append((arg, False))

    for node in nodes:
        if node in deferred:
            continue
        for arg in node.all_input_nodes:
            if arg in deferred and arg not in emitted:
                emit(arg)
        if node.op == "output":
            for leftover in (n for n in nodes if n in deferred and n not in emitted):
                emit(leftover)
        order.append(node)
        emitted.add(node)
    return order


def sink_recomputation(bw_gm: fx.GraphModule, recomputed: set[str]) -> fx.GraphModule:
    """Move each recomputed node right before its first user.

    The extracted backward lists recomputed forward nodes first (joint order), which would
    make every recomputed tensor live at once at the start of the backward and defeat the
    point of recomputing. Placing them just in time keeps their lifetimes short; this is
    the order ``passes.memory.backward_order`` simulates.
    """
    graph = bw_gm.graph
    nodes = list(graph.nodes)
    deferred = {n for n in nodes if n.name in recomputed and n.op == "call_function"}
    cursor = None
    for node in just_in_time_order(nodes, deferred):
        if cursor is not None and cursor.next is not node:
            cursor.append(node)
        cursor = node
    graph.lint()
    bw_gm.recompile()
    return bw_gm
