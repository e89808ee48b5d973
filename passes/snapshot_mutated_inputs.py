"""A backward that reads an input the forward writes reads a copy made before the write.

In AOTAutograd's joint graph an input the forward mutates keeps its old value throughout:
the write is a ``copy_`` at the end. Once partitioned, the forward writes the input in
place, and a backward that reads the input itself (or a view of it) sees the new value.
That happens where the user's snapshot was removed: Inductor's joint-graph passes drop a
``clone`` of an input as a no-op (``old = buf.clone(); buf.add_(1); y = x * old``: the
backward of ``x * old`` then reads ``buf``), and torch's own partition is wrong the same way.
Each such input gets one ``clone`` before anything runs, the backward's reads of it and of
its views are redirected to the clone and to the same views of it, and the clone is tagged
``MUST_SAVE``: the backward needs the old value, so it is saved (kept or offloaded), never
recomputed from the input. Inputs the backward writes as well are left as they are.

Limit: torch's min-cut partition puts a node no forward output needs in the backward, tag or
not, so it would recompute the copy there, after the write. The planner's partition keeps
it in the forward; where the planner falls back to torch's, the graph is refused instead
(``snapshots`` names them).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .analyze import is_tangent, mutated_inputs, storage_roots


SNAPSHOT_OF = "compile_offload_snapshot_of"  # a snapshot node's meta: the input it copies


def snapshot_mutated_inputs(gm: fx.GraphModule) -> list[str]:
    """Rewrite ``gm`` (a joint graph) as the module docstring says; the names of the inputs
    snapshotted."""
    graph = gm.graph
    backward = _backward_nodes(graph)
    roots = storage_roots(graph)
    written_forward = mutated_inputs(graph, roots, lambda node: node not in backward)
    written_backward = mutated_inputs(graph, roots, backward.__contains__, outputs=False)
    snapshotted = []
    for placeholder in sorted(written_forward - written_backward, key=list(graph.nodes).index):
        reads = [(reader, value) for reader in graph.nodes if reader in backward and reader.op != "output"
                 for value in reader.all_input_nodes if roots.get(value, value) is placeholder]
        if not reads:
            continue
        rebased = {placeholder: _snapshot(graph, placeholder)}
        for reader, value in reads:
            reader.replace_input_with(value, _rebased(graph, value, rebased, roots))
        snapshotted.append(placeholder.name)
    if snapshotted:
        gm.recompile()
    return snapshotted


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that depend on a tangent (the backward's), the output node included."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and is_tangent(node)) or any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    return backward


def _snapshot(graph: fx.Graph, placeholder: fx.Node) -> fx.Node:
    last_input = [node for node in graph.nodes if node.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        snapshot = graph.call_function(torch.ops.aten.clone.default, (placeholder,))
    snapshot.meta["val"] = torch.ops.aten.clone.default(placeholder.meta["val"])
    snapshot.meta["recompute"] = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    snapshot.meta[SNAPSHOT_OF] = placeholder.name
    return snapshot


def snapshots(graph: fx.Graph) -> list[str]:
    """The inputs ``graph`` holds a snapshot of (made by ``snapshot_mutated_inputs``)."""
    return [node.meta[SNAPSHOT_OF] for node in graph.nodes if SNAPSHOT_OF in node.meta]


def _rebased(graph: fx.Graph, node: fx.Node, rebased: dict[fx.Node, fx.Node],
             roots: dict[fx.Node, fx.Node]) -> fx.Node:
    """``node`` (the input, or a view of it) made from the snapshot instead: the same chain
    of views, each placed after the one it copies."""
    if node not in rebased:
        root = roots[node]

        def of_snapshot(arg: fx.Node) -> fx.Node:
            return _rebased(graph, arg, rebased, roots) if roots.get(arg) is root else arg

        args, kwargs = fx.node.map_arg(node.args, of_snapshot), fx.node.map_arg(node.kwargs, of_snapshot)
        with graph.inserting_after(node):
            copy = graph.call_function(node.target, args, kwargs)
        value_of = lambda arg: arg.meta["val"]  # noqa: E731
        copy.meta["val"] = node.target(*fx.node.map_arg(args, value_of), **fx.node.map_arg(kwargs, value_of))
        rebased[node] = copy
    return rebased[node]
