"""The saved set as the rewrite saves it: one tensor per storage the backward may overwrite.

AOTAutograd donates to the backward every saved tensor whose storage no graph input or
output shares (``torch._functorch.config.donated_buffer``,
``collect_fw_donated_buffer_idxs``), and Inductor's backward may then write a kernel's
output into a donated buffer in place once the buffer's last reader has run
(``Scheduler.decide_inplace_update``). AOTAutograd checks a saved tensor against the
inputs and outputs only, not against the other saved tensors: when a plan saves a buffer
*and* a view of it, each is donated on its own, Inductor reuses the buffer when its own
reads are done, and later kernels read the view's overwritten data (wrong gradients, with
no error). So the forward never returns two aliases of one intermediate storage: a saved
view is recomputed from the saved tensor it views (a view costs no kernel and no memory:
the storage is the same), and views of one storage that none of them views are replaced
by that storage's own tensor.

Views of a graph input are not donated (they alias an input); each is replaced by the
input itself, for another reason: Inductor returns a saved view of an input as a new
tensor without the input's version counter, so a user who mutates the input between
forward and backward would get gradients of values the forward never saw where eager
raises (pytorch#197887); the input itself is the very tensor the user passed.

A view whose path to its base runs through a node that must not be recomputed (``a.ban``)
is kept as it is; should two such aliases of one intermediate storage remain, the graph
is not planned (``UnsupportedGraph``: torch's own partition, with one warning).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx as fx

from .analyze import MUST_SAVE_REASON, JointAnalysis, UnsupportedGraph


def saved_storages(a: JointAnalysis, saved: Iterable[fx.Node], offloaded: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """``saved`` with no two tensors sharing a donated storage (see the module's doc).

    ``offloaded``: tensors the forward copies to the host; they leave the device's saved
    set as host copies (their own storage) and are returned unchanged. A saved view of one
    is recomputed from its reloaded copy: saved as it is, it would keep the storage on the
    device beside the reloaded copy."""
    offloaded = set(offloaded)
    result: set[fx.Node] = set()
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in saved:
        if node in offloaded:
            result.add(node)
        elif offloaded and _view_path(a, node, offloaded) in offloaded:
            continue  # recomputed in the backward from the reloaded tensor it views
        else:
            groups.setdefault(a.roots.get(node, node), []).append(node)
    for root, members in groups.items():
        if root in a.steady:
            result.update(_input_for_its_view(a, node, root) for node in members)
        else:
            result.update(_one_per_storage(a, root, members))
    return result


def _view_path(a: JointAnalysis, node: fx.Node, stop: set[fx.Node]) -> fx.Node:
    """Where the walk from ``node`` up its views ends: the first node of ``stop`` met, or
    the last node that may be recomputed from its parent. A view banned only for a tag (a
    checkpoint policy's ``MUST_SAVE`` or ``MUST_CPU_OFFLOAD`` on ``split``, torch's
    ``MUST_SAVE`` on a region's boundary) is: the tensor it views, saved, holds it, and
    recomputing a view is free."""
    step = node
    while step not in stop or step is node:
        parent = a.alias_parent.get(step)
        if parent is None or (step in a.ban and not _tagged_only(a.ban[step])):
            return step
        step = parent
    return step


def _tagged_only(reason: str) -> bool:
    return reason == MUST_SAVE_REASON or reason.startswith("user policy ")


def _input_for_its_view(a: JointAnalysis, node: fx.Node, root: fx.Node) -> fx.Node:
    return root if _view_path(a, node, {root}) is root else node


def _one_per_storage(a: JointAnalysis, root: fx.Node, members: list[fx.Node]) -> list[fx.Node]:
    if len(members) == 1:
        return members
    group = set(members)
    # A member that views another member through views it is recomputed from.
    left = [node for node in members if _view_path(a, node, group - {node}) not in group - {node}]
    if len(left) == 1:
        return left
    # Sibling views (two slices of one buffer, say): their common storage instead.
    if all(_view_path(a, node, {root}) is root for node in left):
        return [root]
    names = ", ".join(sorted(node.name for node in left))
    raise UnsupportedGraph(
        f"the plan saves {names}, which share the storage of {root.name}, and they cannot be recomputed from one "
        "tensor: AOTAutograd would donate that storage to the backward twice, which may overwrite it while an "
        "alias is still read")


def views_by_base(a: JointAnalysis, nodes: Iterable[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """Each node that ``nodes`` view (through views of views) -> those of ``nodes`` viewing
    it, in graph order: one walk up each node's views."""
    found: dict[fx.Node, list[fx.Node]] = {}
    for node in sorted(nodes, key=a.position.__getitem__):
        base = a.alias_parent.get(node)
        while base is not None:
            found.setdefault(base, []).append(node)
            base = a.alias_parent.get(base)
    return found
