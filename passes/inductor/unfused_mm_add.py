"""Keep each ``mm`` where the graph computes it, not inside a later ``add``.

Inductor's post-grad pattern ``addmm`` (``torch/_inductor/fx_passes/post_grad.py``, torch
2.11-2.14) turns ``add(mm(a, b), c)``, when the ``mm`` has no other user, into one
``addmm(c, a, b)`` placed where the ``add`` is (on CPU always; on GPUs unless every user of
the ``add`` is pointwise). The ``mm`` then runs late and its inputs live until the ``add``.
The plan's simulator runs the ``mm`` where the graph has it, so the program peaked above the
plan. Measured on the contract's GPT-2 (CPU, torch 2.13, 2026-11-26): its LM head is tied to
the token embedding, and the head's weight gradient is added to the embedding's gradient at
the very end of the backward; folded, the 512 KiB logits gradient and the final hidden
states stayed alive through the whole backward: the minimum-memory step measured 3.84 MiB
for a plan of 3.28, and the unconstrained step 7.57 MiB where 7.25 without the fold.

The ``add`` is written as the same sum in a form the pattern does not match,
``sub(c, mm, alpha=-1)``: ``c - (-1 * mm)`` rounds exactly as ``c + mm`` (negation is exact),
and Inductor fuses it with its neighbours as any pointwise op. What is lost is the bias-add
inside the matmul call: one pointwise pass over the ``mm``'s output.
"""

from __future__ import annotations

import torch
import torch.fx as fx

_aten = torch.ops.aten


def _foldable(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(mm, other)`` when ``node`` is an ``add`` Inductor would fold into an ``addmm``: a
    plain sum of an ``mm`` with no other user and a floating-point tensor."""
    if node.op != "call_function" or node.target is not _aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return None
    for mm, other in (node.args, node.args[::-1]):
        if (isinstance(mm, fx.Node) and mm.op == "call_function" and mm.target is _aten.mm.default
                and len(mm.users) == 1 and isinstance(other, fx.Node)):
            val = other.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
                return mm, other
    return None


def unfused_mm_add(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every ``add`` Inductor would fold into an ``addmm`` written as
    ``sub(other, mm, alpha=-1)`` (module docstring). Edits ``gm`` in place and returns it."""
    changed = False
    for node in list(gm.graph.nodes):
        found = _foldable(node)
        if found is None:
            continue
        mm, other = found
        with gm.graph.inserting_before(node):
            total = gm.graph.call_function(_aten.sub.Tensor, (other, mm), {"alpha": -1})
        total.meta.update(node.meta)
        node.replace_all_uses_with(total)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return gm
