"""Undo the greedy's moves that a budget does not need: a local search after the solver.

The greedy joint solver orders its moves by bytes freed per second, and a budget picks a
prefix of that order; a move taken early can free bytes away from the peak (the peak sits
elsewhere, e.g. in the backward), so every fitting prefix pays for it. The exhaustive
search (``passes.solve_exhaustive``) showed this on a GPT-2 block: the greedy recomputed
the MLP's first matmul and its GELU at budgets where the optimum keeps them, 9-12% slower
at the same peak.

``refine`` starts from a plan that fits and repeatedly applies the best *undo*: stop
offloading one storage, or save again one storage of the unconstrained plan that the plan
recomputes (dropping what was saved only to recompute it). Each candidate is evaluated
exactly (the same evaluator as the solver); the fastest one that still fits replaces the
plan while it is faster. The result fits the same budget and is never slower.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx as fx

from .analyze import JointAnalysis, tensor_value
from .memory import recomputed_nodes
from .solve import Candidate, storage_group
from .solve_offload import Evaluator, Prefix

MAX_ROUNDS = 200


def refine(a: JointAnalysis, plan: Candidate, base_saved: Iterable[fx.Node], budget_bytes: int,
           evaluate: Evaluator, swaps: bool = False) -> Candidate:
    """The plan after undoing, one at a time, the moves ``budget_bytes`` does not need
    (``plan`` itself when none can be undone, or when it does not fit). ``swaps``: also
    try each undo together with recomputing one other storage the plan saves (quadratic
    in the number of storages per round: for small graphs)."""
    base_saved = frozenset(base_saved)
    if plan.peak_bytes > budget_bytes:
        return plan
    current = plan
    for _ in range(MAX_ROUNDS):
        best = None
        for option in _undos(a, current, base_saved, swaps):
            candidate = evaluate(option)
            if candidate.peak_bytes > budget_bytes or candidate.extra_seconds >= current.extra_seconds:
                continue
            if best is None or (candidate.extra_seconds, candidate.peak_bytes) < (best.extra_seconds, best.peak_bytes):
                best = candidate
        if best is None:
            return current
        current = best
    return current


def _undos(a: JointAnalysis, plan: Candidate, base_saved: frozenset[fx.Node], swaps: bool = False):
    """Plans one undo away from ``plan``: one offload less, or one storage of the
    unconstrained plan saved again (with ``swaps``, also while recomputing one other)."""
    for tensor in sorted(plan.offloaded, key=a.position.__getitem__):
        yield Prefix(plan.saved, plan.offloaded - {tensor}, plan.moves)
    saved_roots = {a.roots.get(t, t) for t in plan.saved}
    by_root: dict[fx.Node, set[fx.Node]] = {}
    for tensor in base_saved:
        if tensor_value(tensor) is not None and tensor not in a.steady:
            by_root.setdefault(a.roots.get(tensor, tensor), set()).add(tensor)
    for root in sorted(by_root, key=a.position.__getitem__):
        if root in saved_roots:
            continue
        resaved = set(plan.saved) | by_root[root]
        saved = _unread_dropped(a, resaved, base_saved)
        yield Prefix(frozenset(saved), plan.offloaded & saved, plan.moves)
        if not swaps:
            continue
        for other in sorted(saved_roots - {root}, key=a.position.__getitem__):
            members = {t for t in resaved if a.roots.get(t, t) is other}
            group = storage_group(a, members) if members else None
            if group is None or members & plan.offloaded:
                continue
            swapped = (resaved - members) | {s for s in group.sources if s not in group.closure}
            if any(n in a.ban for n in recomputed_nodes(a, swapped)):
                continue
            swapped = _unread_dropped(a, swapped, base_saved - members)
            yield Prefix(frozenset(swapped), plan.offloaded & swapped, plan.moves)


def _unread_dropped(a: JointAnalysis, saved: set[fx.Node], base_saved: frozenset[fx.Node]) -> set[fx.Node]:
    """``saved`` without the tensors that neither the backward nor what it recomputes
    reads any more (saved only so that something now saved could be recomputed). Tensors
    of the unconstrained plan stay."""
    while True:
        recomputed = recomputed_nodes(a, saved)
        read = {a.roots.get(arg, arg) for n in [*a.bw_nodes, *recomputed] for arg in a.inputs[n]}
        unread = {t for t in saved - base_saved
                  if tensor_value(t) is not None and t not in a.steady and a.roots.get(t, t) not in read
                  and t not in read}
        if not unread:
            return saved
        saved -= unread


__all__ = ["refine"]
