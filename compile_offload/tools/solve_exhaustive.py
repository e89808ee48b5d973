"""The exact keep / recompute / offload optimum of a small graph, by exhaustive search.

The greedy joint solver (``passes.solve.joint.solve_joint``) builds its candidate plans
move by move; nothing there says how far its choice is from the best plan under the same
model. This module enumerates plans instead and evaluates every one with the same
evaluator the joint solver uses (``solve_offload.Evaluator``: the memory simulator with
copies placed by the transfer model, and the predicted step time), so the fastest plan
that fits a budget here is the optimum of that model over the enumerated space.

The space: a *pool* of storages (the ones the unconstrained plan saves and every storage
the caller adds, normally every storage a greedy move ever saves, see
``greedy_pool``). A plan saves any subset of the pool (plus what the unconstrained plan
saves that cannot be recomputed at all); everything else the backward needs is recomputed
from what is saved (``memory.recomputed_nodes``), which must contain no banned node; and
any subset of the saved storages that may be offloaded (``solve_offload.offloadable``) is
offloaded. Plans that save a storage nothing in the backward reads are skipped: such a
plan has the same step time as the one without that storage and no lower peak. So the
search is exact over every keep / recompute / offload assignment of the pool's storages:
3^n plans at most for n storages, which is why it is for small graphs only
(``max_plans``). Storages outside the pool (tensors no greedy move would save) are the
one restriction against the unrestricted problem.

Imported functions of ``solve``, ``solve_offload`` and ``memory`` are used as they are;
this file changes nothing in them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch.fx as fx

from ..passes.analyze import JointAnalysis, tensor_value
from ..passes.memory import recomputed_nodes
from ..passes.solve.recompute import Candidate, Seconds, SolverError, greedy_moves, pick, storage_group
from ..passes.solve.joint import Evaluator, OffloadOptions, Prefix, mixed_moves, offloadable

DEFAULT_MAX_PLANS = 100_000


def greedy_pool(a: JointAnalysis, base_saved: Iterable[fx.Node], seconds: Seconds,
                offload: OffloadOptions | None = None) -> set[fx.Node]:
    """The storages the unconstrained plan saves and every storage a greedy move (recompute
    only, and mixed with offload when ``offload`` is given) saves in their place."""
    base_saved = list(base_saved)
    tensors = set(base_saved)
    for move in greedy_moves(a, base_saved, seconds):
        tensors.update(move.added)
    if offload is not None:
        for move in mixed_moves(a, base_saved, seconds, offload):
            tensors.update(move.added)
    return {a.roots.get(t, t) for t in tensors if tensor_value(t) is not None}


def exhaustive_candidates(a: JointAnalysis, base_saved: Iterable[fx.Node], seconds: Seconds,
                          offload: OffloadOptions | None, pool: Iterable[fx.Node],
                          max_plans: int = DEFAULT_MAX_PLANS) -> list[Candidate]:
    """Every valid plan over ``pool`` (see the module doc), evaluated; the unconstrained
    plan first. Raises ``SolverError`` when the space has more than ``max_plans`` plans."""
    base_saved = list(base_saved)
    fixed, free = _split_pool(a, base_saved, pool)
    if 2 ** len(free) > max_plans:
        raise SolverError(f"exhaustive search: {len(free)} free storages are too many for max_plans={max_plans}")
    evaluate = Evaluator(a, seconds, offload, base_saved) if offload is not None else _RecomputeEvaluator(a, seconds, base_saved)
    eligible = offload.eligible if offload is not None else None
    candidates = [evaluate(Prefix(frozenset(base_saved), frozenset(), ()))]
    evaluated = 0
    seen = {(frozenset(base_saved), frozenset())}
    read_by_backward = {arg for n in a.bw_nodes for arg in a.inputs[n] if a.is_forward(arg)}
    for size in range(len(free) + 1):
        for chosen in itertools.combinations(free, size):
            saved = fixed | _members(a, base_saved, chosen)
            recomputed = recomputed_nodes(a, saved)
            if any(n in a.ban for n in recomputed):
                continue
            if not _all_read(a, saved, recomputed, read_by_backward):
                continue  # dominated by the plan without the unread storage
            offloadable_now = offloadable(a, saved, set(), eligible) if eligible is not None else []
            for count in range(len(offloadable_now) + 1):
                for offloaded in itertools.combinations(offloadable_now, count):
                    evaluated += 1
                    if evaluated > max_plans:
                        raise SolverError(f"exhaustive search: more than max_plans={max_plans} plans")
                    plan = Prefix(frozenset(saved), frozenset(offloaded), ())
                    if (plan.saved, plan.offloaded) not in seen:
                        seen.add((plan.saved, plan.offloaded))
                        candidates.append(evaluate(plan))
    return candidates


def solve_exhaustive(a: JointAnalysis, base_saved: Iterable[fx.Node], seconds: Seconds, budget_bytes: int | None,
                     offload: OffloadOptions | None, pool: Iterable[fx.Node],
                     max_plans: int = DEFAULT_MAX_PLANS) -> tuple[Candidate, bool]:
    """(the fastest plan whose predicted peak fits ``budget_bytes``, whether one fits);
    when none fits, the lowest-peak plan (the tie-breaking of ``solve.pick``)."""
    return pick(exhaustive_candidates(a, base_saved, seconds, offload, pool, max_plans), budget_bytes)


def _split_pool(a: JointAnalysis, base_saved: list[fx.Node], pool: Iterable[fx.Node]):
    """(saved tensors every plan keeps, the storages a plan may save or not, in graph
    order). Saved tensors of the unconstrained plan that cannot be recomputed (inputs,
    banned nodes, symbolic ints) are always kept."""
    fixed = set()
    for tensor in base_saved:
        if tensor_value(tensor) is None or tensor in a.steady or storage_group(a, [tensor]) is None:
            fixed.add(tensor)
    fixed_roots = {a.roots.get(t, t) for t in fixed}
    free = sorted({a.roots.get(t, t) for t in pool} - fixed_roots - set(a.steady), key=a.position.__getitem__)
    return fixed, free


def _members(a: JointAnalysis, base_saved: list[fx.Node], roots: Iterable[fx.Node]) -> set[fx.Node]:
    """The tensors a plan saves for these storages: the unconstrained plan's saved views of
    them where it saves views, else the storage itself."""
    roots = set(roots)
    members = {t for t in base_saved if a.roots.get(t, t) in roots}
    members |= roots - {a.roots.get(t, t) for t in members}
    return members


def _all_read(a: JointAnalysis, saved: set[fx.Node], recomputed: set[fx.Node], read_by_backward: set[fx.Node]) -> bool:
    """Does the backward (its own nodes or what it recomputes) read every saved storage?"""
    read = {a.roots.get(t, t) for t in read_by_backward}
    for node in recomputed:
        read.update(a.roots.get(arg, arg) for arg in a.inputs[node])
    return all(a.roots.get(t, t) in read for t in saved if tensor_value(t) is not None and t not in a.steady)


class _RecomputeEvaluator:
    """``Evaluator`` without offload: recompute-only plans (``passes.solve.recompute.evaluate``)."""

    def __init__(self, a: JointAnalysis, seconds: Seconds, base_saved: list[fx.Node]) -> None:
        from ..passes.solve.recompute import step_seconds

        self.a, self.seconds, self.step_seconds = a, seconds, step_seconds
        self.base_seconds = step_seconds(a, base_saved, seconds)

    def __call__(self, plan: Prefix) -> Candidate:
        from ..passes.solve.recompute import evaluate

        extra = self.step_seconds(self.a, plan.saved, self.seconds) - self.base_seconds
        return evaluate(self.a, plan.saved, extra)


__all__ = ["DEFAULT_MAX_PLANS", "exhaustive_candidates", "greedy_pool", "pick", "solve_exhaustive"]
