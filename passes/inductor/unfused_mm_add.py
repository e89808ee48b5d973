"""Each ``add`` Inductor would fold into an ``addmm``: folded here where that costs nothing,
written so that it is not folded where it would hold memory.

Inductor's post-grad pattern ``addmm`` (``torch/_inductor/fx_passes/post_grad.py``, torch
2.11-2.14) turns ``add(mm(a, b), c)``, when the ``mm`` has no other user and ``c`` has its
dtype and a shape it expands from, into one ``addmm(c, a, b)`` placed where the ``add`` is
(on CPU always; on GPUs unless every user of the ``add`` is pointwise). The ``mm`` then runs
late. The plan must see that, both ways:

- **Harmful folds are prevented.** Where the ``mm``'s inputs would otherwise be freed before
  the ``add`` while something else is allocated, the fold keeps them alive; it is harmful
  where they outweigh the ``mm``'s output, which the fold spares until the ``add``. Measured on
  the contract's GPT-2 (CPU, torch 2.13): its LM head is tied to the token embedding, and the
  head's weight gradient is added to the embedding's gradient at the very end of the
  backward; folded, the 512 KiB logits gradient and the final hidden states stayed alive
  through the whole backward (the minimum-memory step measured 3.84 MiB for a plan of 3.28).
  The ``add`` is written as the same sum in a form the pattern does not match,
  ``sub(c, mm, alpha=-1)``: ``c - (-1 * mm)`` rounds exactly as ``c + mm`` (negation is
  exact), and Inductor fuses it with its neighbours as any pointwise op.
- **Harmless folds are made here**, as ``addmm(c, a, b)`` where the ``add`` is, so that the
  simulator runs the kernel Inductor runs. This pass's first version prevented every fold;
  without a budget a 16-step RNN cell then measured 7.67 MB against ``torch.compile``'s
  1.98 MB on the CPU: its weights' gradients, sums over the steps of adds each next to its
  ``mm``, became one pointwise chain Inductor inlines into kernels reading many ``mm``
  outputs at once. An ``add`` whose other operand is a ``sub`` this pass wrote is folded even
  where that holds more: the ``addmm`` ends such a chain.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import compat
from ..analyze import allocated_bytes, storage_roots
from .node_kinds import is_view, tensor_value

_aten = torch.ops.aten


def _pointwise_use(node: fx.Node) -> bool:
    """Inductor's ``is_pointwise_use``: an op tagged pointwise, or a view or ``getitem`` all
    of whose users are."""
    if node.op != "call_function" or not (isinstance(node.target, compat.OpOverload) or node.target is operator.getitem):
        return False
    if node.target is operator.getitem or is_view(node):
        return all(_pointwise_use(user) for user in node.users)
    return torch.Tag.pointwise in node.target.tags


def _foldings(node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """The ``(mm, other)`` pairs Inductor's pattern would fold ``node`` by: ``node`` a plain
    ``add`` of an ``mm`` with no other user and a tensor of its dtype and a shape that expands
    to the ``mm``'s, and (on a GPU) some user of ``node`` not pointwise."""
    if node.op != "call_function" or node.target is not _aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return []
    total = tensor_value(node)
    if total is None or (total.device.type != "cpu" and all(_pointwise_use(user) for user in node.users)):
        return []
    found = []
    for mm, other in (node.args[::-1], node.args):  # Inductor tries add(other, mm) first
        if not (isinstance(mm, fx.Node) and mm.op == "call_function" and mm.target is _aten.mm.default
                and len(mm.users) == 1 and isinstance(other, fx.Node) and other is not mm):
            continue
        c, a, b = tensor_value(other), tensor_value(mm.args[0]), tensor_value(mm.args[1])
        if (c is not None and a is not None and b is not None and c.dtype == a.dtype == b.dtype
                and _expands_to(c.shape, (a.shape[0], b.shape[1]))):
            found.append((mm, other))
    return found


def _expands_to(shape, target) -> bool:
    """Whether ``shape`` broadcasts to ``target``, as far as is known without a guard (an
    unbacked size has no value to compare: not known, so not matched)."""
    if len(shape) > len(target):
        return False
    return all(statically_known_true(size == 1) or statically_known_true(size == full)
               for size, full in zip(reversed(shape), reversed(target)))


def _last_reads(graph: fx.Graph, roots: dict[fx.Node, fx.Node], order: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Each storage's last reader, in graph order (over the storage's views and aliases)."""
    last: dict[fx.Node, int] = {}
    for node in graph.nodes:
        for read in node.all_input_nodes:
            root = roots.get(read, read)
            last[root] = max(last.get(root, -1), order[node])
    return last


def _allocations_before(nodes: list[fx.Node], roots: dict[fx.Node, fx.Node]) -> list[int]:
    """``counts[i]``: how many of ``nodes[:i]`` allocate, so that whether any node in
    ``nodes[i:j]`` allocates is ``counts[j] > counts[i]``."""
    counts = [0]
    for node in nodes:
        counts.append(counts[-1] + (allocated_bytes(node, roots) > 0))
    return counts


def _fold_holds_more(mm: fx.Node, add: fx.Node, order: dict[fx.Node, int], roots: dict[fx.Node, fx.Node],
                     last: dict[fx.Node, int], allocations: list[int]) -> bool:
    """Whether running ``mm`` where ``add`` is holds more than it saves: the inputs it keeps
    alive past their last reader while other buffers are allocated before ``add`` (graph
    inputs are held by the caller anyway) outweigh the ``mm``'s own output, which the fold
    no longer allocates until ``add``."""
    held = 0
    for root in {roots.get(read, read) for read in mm.all_input_nodes}:
        end = last.get(root, order[mm])
        if root.op != "placeholder" and end < order[add] and allocations[order[add]] > allocations[end + 1]:
            held += allocated_bytes(root, roots)
    return held > allocated_bytes(mm, roots)


def unfused_mm_add(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every ``add`` Inductor would fold into an ``addmm`` either folded (where
    the fold holds nothing) or written as ``sub(other, mm, alpha=-1)`` (module docstring).
    Edits ``gm`` in place and returns it."""
    nodes = list(gm.graph.nodes)
    if not any(_foldings(node) for node in nodes):
        return gm
    order = {node: index for index, node in enumerate(nodes)}
    roots = storage_roots(gm.graph)
    last = _last_reads(gm.graph, roots, order)
    allocations = _allocations_before(nodes, roots)
    written: set[fx.Node] = set()
    changed = False
    for node in nodes:
        foldings = _foldings(node)
        if not foldings:
            continue
        harmless = [(mm, other) for mm, other in foldings
                    if other in written or not _fold_holds_more(mm, node, order, roots, last, allocations)]
        mm, other = (harmless or foldings)[0]
        with gm.graph.inserting_before(node):
            if harmless:
                total = gm.graph.call_function(_aten.addmm.default, (other, *mm.args))
            else:
                total = gm.graph.call_function(_aten.sub.Tensor, (other, mm), {"alpha": -1})
                written.add(total)
        total.meta.update(node.meta)
        node.replace_all_uses_with(total)
        gm.graph.erase_node(node)
        if harmless:
            gm.graph.erase_node(mm)
        changed = True
    if changed:
        gm.recompile()
    return gm
