"""The exact recompute-only optimum by branch and bound, for graphs past the exhaustive search.

``tools.solve_exhaustive`` evaluates every plan over a pool of storages (3^n); a 2-layer
GPT-2 has about 25 free storages, too many. This search decides the free storages one at a
time (save, then recompute) depth first, and drops a subtree whose lower bound on the
predicted time is no better than the best fitting plan found so far (the *incumbent*,
seeded by the caller with the greedy's). Recompute only: no offload.

**Why the bound is sound.** In a subtree, with saves ``D1`` decided and the storages ``U``
undecided, every plan saves a subset ``S`` of ``T = fixed | D1 | U``. A node recomputed
under ``T`` is recomputed under ``S``: the backward needs it (or a node recomputed under
``S`` needs it, by induction) and it is not saved in ``T``, so not in ``S``; so
``recomputed(T)`` is a subset of ``recomputed(S)``. Every plan's forward runs the nodes the
forward outputs and the always-saved tensors need (``forward_nodes_needed(fixed)``), and the
backward is the same in every plan. A plan's predicted time (``solve.step_seconds``: the
sum over its forward, recomputed and backward nodes) is therefore at least that of those
forward nodes, ``recomputed(T)``'s and the backward's, with non-negative node times. The
peak is not bounded (it is not monotone in the saved set: in-place reuse, recomputation
buffers), so it is simulated at the leaves only, and only for a plan faster than the
incumbent. When the search completes, its plan is the fastest that fits over the same
space as the exhaustive search's recompute-only plans (every subset of the pool's free
storages); when it runs out of time, the plan is the best found, and says so.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch.fx as fx

from compile_offload.passes.analyze import JointAnalysis
from compile_offload.passes.memory import forward_nodes_needed, recomputed_nodes
from compile_offload.passes.solve.recompute import Candidate, Seconds, _seconds_of, evaluate, step_seconds
from compile_offload.tools.solve_exhaustive import _members, _split_pool


@dataclass(frozen=True)
class BoundResult:
    plan: Candidate | None  # the fastest fitting plan found (None: none faster than the incumbent)
    complete: bool  # the whole space was searched: ``plan`` (or the incumbent) is the optimum
    nodes: int  # subtrees visited
    simulated: int  # leaves simulated


def branch_and_bound(a: JointAnalysis, base_saved: Iterable[fx.Node], seconds: Seconds, budget_bytes: int,
                     pool: Iterable[fx.Node], incumbent_seconds: float = float("inf"),
                     time_limit: float | None = None) -> BoundResult:
    """The fastest recompute-only plan over ``pool`` whose simulated peak fits
    ``budget_bytes`` and whose extra seconds (over ``base_saved``'s plan) are below
    ``incumbent_seconds`` (see the module doc)."""
    base_saved = list(base_saved)
    fixed, free = _split_pool(a, base_saved, pool)
    base_seconds = step_seconds(a, base_saved, seconds)
    always = (_seconds_of(a, forward_nodes_needed(a, set(fixed)), seconds) + _seconds_of(a, a.bw_nodes, seconds)
              - base_seconds)
    started = time.perf_counter()
    best: list = [incumbent_seconds, None]
    counts = [0, 0]
    out_of_time = [False]

    def bound(saved_roots: set[fx.Node]) -> float:
        most = set(fixed) | _members(a, base_saved, saved_roots)
        return always + _seconds_of(a, recomputed_nodes(a, most), seconds)

    def search(i: int, saved_roots: set[fx.Node]) -> None:
        if time_limit is not None and time.perf_counter() - started > time_limit:
            out_of_time[0] = True
            return
        counts[0] += 1
        if bound(saved_roots | set(free[i:])) >= best[0]:
            return
        if i == len(free):
            saved = set(fixed) | _members(a, base_saved, saved_roots)
            if any(n in a.ban for n in recomputed_nodes(a, saved)):
                return
            extra = step_seconds(a, saved, seconds) - base_seconds
            if extra < best[0]:
                counts[1] += 1
                candidate = evaluate(a, saved, extra)
                if candidate.peak_bytes <= budget_bytes:
                    best[0], best[1] = extra, candidate
            return
        search(i + 1, saved_roots | {free[i]})  # saving first finds fast plans early
        search(i + 1, saved_roots)

    search(0, set())
    return BoundResult(best[1], not out_of_time[0], counts[0], counts[1])


__all__ = ["BoundResult", "branch_and_bound"]
