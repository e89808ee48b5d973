"""Scheduling passes over the partitioned backward graph."""

from __future__ import annotations

import torch.fx as fx


def just_in_time_order(nodes: list[fx.Node], deferred: set[fx.Node], inputs=None) -> list[fx.Node]:
    """``nodes`` in their order, each deferred node moved right before its first user.

    Deferred nodes reachable only through other deferred nodes follow them in; deferred
    nodes nobody uses go before the output node. ``inputs(node)``: its input nodes
    (default ``node.all_input_nodes``; the solver passes a precomputed table).
    """
    inputs = inputs or (lambda node: node.all_input_nodes)
    order: list[fx.Node] = []
    emitted: set[fx.Node] = set()

    for node in nodes:
        if node in deferred:
            continue
        for arg in inputs(node):
            if arg in deferred and arg not in emitted:
                emit_after_inputs(arg, deferred, emitted, inputs, order)
        if node.op == "output":
            for leftover in (n for n in nodes if n in deferred and n not in emitted):
                emit_after_inputs(leftover, deferred, emitted, inputs, order)
        order.append(node)
        emitted.add(node)
    return order


def sink_recomputation(bw_gm: fx.GraphModule, recomputed: set[str], recompile: bool = True) -> fx.GraphModule:
    """Move each recomputed node right before its first user.

    The extracted backward lists recomputed forward nodes first (joint order), which would
    make every recomputed tensor live at once at the start of the backward and defeat the
    point of recomputing. Placing them just in time keeps their lifetimes short; this is
    the order ``passes.memory.backward_order`` simulates. ``recompile=False``: the caller
    edits the graph again and recompiles it (generating a deep graph's code takes a while).
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
    if recompile:
        bw_gm.recompile()
    return bw_gm


# --- copies: where the forward waits for offloads, where the backward issues reloads -------


def _transfer_nodes(graph: fx.Graph) -> dict[tuple[str, str], fx.Node]:
    """(role, saved tensor name) -> the node ``passes.offload.insert_offloads`` inserted with
    that role for that tensor: one pass over the graph, not one per tensor (a deep plan
    offloads hundreds)."""
    found = {}
    for node in graph.nodes:
        meta = node.meta.get("offload")
        if meta is not None:
            found.setdefault((meta.get("role"), meta.get("tensor")), node)
    return found


def place_offload_waits(fw_gm: fx.GraphModule, wait_after: dict[str, str]) -> fx.GraphModule:
    """Move the forward's wait for each offloaded tensor (``wait_after``: saved tensor name
    -> forward node name) right after that node, when it comes later than where the wait
    is (its last forward use): the forward then waits only once compute has covered the
    copy, and the tensor's device memory is held until then (what
    ``passes.transfer.plan_transfers`` predicts and ``passes.memory.plan_program`` counts).
    Names the graph lacks are left where they are."""
    from .offload import ROLE_WAIT_OFFLOAD

    graph = fw_gm.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    by_name = {node.name: node for node in graph.nodes}
    transfers = _transfer_nodes(graph)
    for tensor, anchor_name in wait_after.items():
        wait, anchor = transfers.get((ROLE_WAIT_OFFLOAD, tensor)), by_name.get(anchor_name)
        if wait is None or anchor is None or anchor.op == "output" or position[anchor] <= position[wait]:
            continue
        if any(position[user] <= position[anchor] for user in wait.users):
            continue  # something reads the saved value before the anchor: keep the wait ahead of it
        anchor.append(wait)
    graph.lint()
    fw_gm.recompile()
    return fw_gm


def place_reloads(bw_gm: fx.GraphModule, reload_before: dict[str, str]) -> fx.GraphModule:
    """Move each reload (``reload_before``: saved tensor name -> backward node name) right
    before that node, never after its wait nor among the placeholders. Reloads are placed
    in the order given, so reloads before one node are issued in that order (the link's
    order in ``passes.transfer``). With ``config.prefetch=False`` the planner names each
    tensor's first use, so its reload is issued right before it. Names the graph lacks
    are left where they are."""
    from .offload import ROLE_RELOAD, ROLE_WAIT_RELOAD

    graph = bw_gm.graph
    by_name = {node.name: node for node in graph.nodes}
    # Reloads named before a placeholder go before the first node that is neither a
    # placeholder nor a reload (a fixed point, so they keep the order given).
    first_compute = next(n for n in graph.nodes
                         if n.op != "placeholder" and n.meta.get("offload", {}).get("role") != ROLE_RELOAD)
    transfers = _transfer_nodes(graph)
    # Only reloads move, so the order of every other node stays as numbered here.
    position = {node: i for i, node in enumerate(graph.nodes)}
    for tensor, anchor_name in reload_before.items():
        reload, wait = transfers.get((ROLE_RELOAD, tensor)), transfers.get((ROLE_WAIT_RELOAD, tensor))
        anchor = by_name.get(anchor_name)
        if reload is None or wait is None or anchor is None:
            continue
        if anchor.op == "placeholder":
            anchor = first_compute
        if anchor.meta.get("offload", {}).get("role") == ROLE_RELOAD:  # a reload moved already
            position = {node: i for i, node in enumerate(graph.nodes)}
        if position[anchor] > position[wait]:
            anchor = wait
        anchor.prepend(reload)
    graph.lint()
    bw_gm.recompile()
    return bw_gm


def emit_after_inputs(node: fx.Node, deferred: set[fx.Node], emitted: set[fx.Node], inputs,
                      order: list[fx.Node]) -> None:
    """Append ``node`` to ``order`` after the deferred nodes it reads (``inputs(node)``) that
    are not yet emitted: depth first, inputs in order. ``emitted`` is updated.

    A node waits on the stack while it has inputs left to emit and is emitted when it has
    none (most nodes at once: the solver orders every saved set's backward this way)."""
    stack = [node]
    while stack:
        current = stack[-1]
        if current in emitted:
            stack.pop()
            continue
        pending = [arg for arg in inputs(current) if arg in deferred and arg not in emitted]
        if pending:
            pending.reverse()  # the first input on top: emitted first
            stack.extend(pending)
            continue
        stack.pop()
        emitted.add(current)
        order.append(current)
