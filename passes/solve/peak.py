"""A greedy sequence that simulates every move: small graphs only.

The greedy sequences of ``passes.solve.recompute`` and ``passes.solve.joint`` take moves by saved
bytes freed per second, without simulating them. That measures the peak only while the
peak is where every saved tensor is alive (the forward's end, in a deep stack). In a graph
of a block or two the peak is often in the backward, and a move that frees saved bytes can
leave it where it was or raise it (the tensor is recomputed next to the peak, an in-place
write into it is lost): on one GPT-2-small block the default greedy found a plan at 2 of 12
budgets of a sweep where the exhaustive optimum found one at all 12 (docs/benchmarks.md,
"Optimality").

This sequence takes, at each step, the recompute move that lowers the simulated peak the
most per second of added step time (ties: the larger drop, then the earlier storage),
simulating every move listed, and stops where no move lowers it. Every plan it simulates
on the way (each prefix with each listed move applied) is a candidate too
(``alternatives``): the move freeing the most per second can overshoot a budget at a price
a smaller drop avoids (on the GPT-2 block at 202.35 MiB the sequence's move reached 172.94
MiB for 0.042 ms where one to 196.91 MiB cost 0.025 ms), and these plans are already
simulated. Its peaks fall and its prices rise along it, as ``search_sequences`` needs; so a
solve makes it only up to its first plan under the budget and the plans at that plan's
price (``solve.until_fitting``: nothing after them is cheaper), and the choice stays
monotone in the budget. It costs about moves x
steps simulations, so it runs only where the first plan lists at most ``MAX_MOVES`` moves.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

import torch.fx as fx

from ..analyze import JointAnalysis
from ..memory import recomputed_nodes
from .recompute import Candidate, Move, PlanState, Prefix, RecomputeMoves, Seconds

# Moves listed for the first plan above which the sequence is not made. Each step simulates
# every move: a GPT-2-small block lists 12 moves and takes 156 simulations; two blocks list
# 48 and add about 0.1 s to a solve (2-core machine); four list 96 and added 2 s.
MAX_MOVES = 48


def peak_moves(a: JointAnalysis, base_saved: Iterable[fx.Node], seconds: Seconds,
               evaluate: Callable[[Prefix], Candidate], alternatives: list[Prefix] | None = None,
               max_moves: int | None = None) -> Iterator[Move]:
    """The moves of the sequence from ``base_saved``, each yielded as soon as chosen; none
    where the first plan lists more than ``max_moves`` (None: ``MAX_MOVES``). ``evaluate``:
    the solve's plan evaluator (a ``PlanEvaluator``), which caches what it simulates.
    ``alternatives``: where given, every plan simulated on the way is appended to it."""
    max_moves = MAX_MOVES if max_moves is None else max_moves
    saved = set(base_saved)
    plan = PlanState(saved, recomputed_nodes(a, saved))
    moves_of = RecomputeMoves(a, seconds)
    applied: tuple[Move, ...] = ()
    # Listed lazily: on a large graph the count stops at the limit, before most moves are worked out.
    listed = list(itertools.islice(moves_of(plan.saved, plan.recomputed), max_moves + 1))
    if len(listed) > max_moves:
        return
    current = evaluate(Prefix(frozenset(plan.saved), frozenset(), applied))
    while True:
        best_key, best = None, None
        for move in listed:
            trial = PlanState(set(plan.saved), set(plan.recomputed))
            move.apply(trial)
            prefix = Prefix(frozenset(trial.saved), frozenset(), (*applied, move))
            candidate = evaluate(prefix)
            if alternatives is not None:
                alternatives.append(prefix)
            drop = current.peak_bytes - candidate.peak_bytes
            if drop <= 0:
                continue
            added = max(candidate.extra_seconds - current.extra_seconds, 1e-12)
            key = (drop / added, drop, -a.position[move.group.root])
            if best_key is None or key > best_key:
                best_key, best = key, (move, trial, candidate)
        if best is None:
            return
        move, plan, current = best
        applied = (*applied, move)
        yield move
        listed = list(moves_of(plan.saved, plan.recomputed))
