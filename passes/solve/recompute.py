"""Budget -> which saved tensors to recompute in the backward (and from what).

Start from the unconstrained plan (torch.compile's default saved set). A *move* recomputes
one saved tensor in the backward instead of saving it; the tensors it is computed from are
saved in its place unless they are already saved or recomputed. The greedy solver applies,
one at a time, the move that frees the most bytes per second of recompute; this gives a
sequence of plans with falling saved bytes and rising step time. A budget picks the first
plan whose simulated peak (``passes.memory``) fits; the sequence is searched for it
(``search_sequences``: its peaks fall to its lowest plan, so a few simulations find it),
and without a budget nothing is simulated but the unconstrained plan. Choosing the first
fitting plan of one fixed sequence makes the result monotone: a smaller budget never gets
a larger predicted peak.

Both solvers share one skeleton: a ``Move`` applies itself to a ``PlanState``,
``prefixes`` turns a sequence of moves into candidate plans, and ``select`` picks among
the simulated candidates and explains the choice.

The exact solver enumerates every subset of candidate tensors (small graphs only) and
returns the fastest plan that fits, with the same tie-breaking, so it is monotone too.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch.fx as fx

from ..analyze import JointAnalysis, is_compute_intensive, tensor_value
from ..memory import (
    PlanNodes,
    Timeline,
    forward_nodes_needed,
    peak_bytes,
    plan_nodes,
    plan_program,
    recomputed_nodes,
    simulate,
)
from .peak_bound import PeakBound
from ..progress import Progress
from .search_sequence import count_within, fitting_around_lowest, lowest, probed_fit
from ..transfer import TransferPlan

Seconds = Callable[[fx.Node], float]


class SolverError(RuntimeError):
    pass


@dataclass
class PlanState:
    """A plan being built move by move: what the forward saves, what the backward
    recomputes, and which saved storages go to host memory."""

    saved: set[fx.Node]
    recomputed: set[fx.Node]
    offloaded: set[fx.Node] = field(default_factory=set)


@dataclass
class Move:
    """Recompute ``group`` in the backward, saving ``added`` in its place."""

    kind: ClassVar[str] = "recompute"

    group: "Group"
    added: tuple[fx.Node, ...]
    extra_seconds: float
    freed_bytes: int
    closure: frozenset[fx.Node] = frozenset()  # every node the move recomputes

    def apply(self, plan: PlanState) -> None:
        plan.saved.difference_update(self.group.members)
        plan.recomputed.update(self.closure)
        plan.saved.update(self.added)

    def touched(self) -> set[fx.Node]:
        """The nodes whose fate ``apply`` may change (saved or recomputed)."""
        return {*self.group.members, *self.closure, *self.added}


@dataclass
class OffloadMove(Move):
    """Copy ``group``'s storage (one storage-owning saved tensor) to host memory after its
    producer and reload it for the backward; nothing is recomputed."""

    kind: ClassVar[str] = "offload"

    def apply(self, plan: PlanState) -> None:
        plan.offloaded.add(self.group.root)

    def touched(self) -> set[fx.Node]:
        return set()  # what it changes is the offloaded set: ``RecomputeMoves.best``'s ``skip``


@dataclass
class Candidate:
    """One plan: what the forward saves, and what it predicts."""

    saved: frozenset[fx.Node]
    extra_seconds: float  # recompute and exposed transfer time added to the unconstrained plan
    peak_bytes: int
    timeline: Timeline | None = None
    moves: tuple[Move, ...] = ()
    offloaded: frozenset[fx.Node] = frozenset()  # saved storages copied to host memory
    transfers: TransferPlan | None = None


@dataclass
class Solution:
    chosen: Candidate
    baseline: Candidate
    minimum: Candidate  # the lowest-peak plan found
    budget_bytes: int | None
    feasible: bool
    recomputed: dict[fx.Node, str] = field(default_factory=dict)  # saved-by-default tensor -> reason
    added: dict[fx.Node, str] = field(default_factory=dict)  # newly saved tensor -> reason
    candidates_evaluated: int = 0
    offloaded: dict[fx.Node, str] = field(default_factory=dict)  # offloaded tensor -> how its copies run
    lowered_steps: int = 0  # steps below the greedy's lowest plan (``passes.solve.lower_peak``)
    from_segments: bool = False  # chosen from per-segment checkpointing (``passes.solve.segments``)
    # Where no plan fits and the search's two starts (the greedy's, per-segment checkpointing)
    # each gave a lowest plan: the predicted peak of the one not chosen (``joint.lowest_solution``).
    rival_peak_bytes: int | None = None


def without_banned_recompute(a: JointAnalysis, saved: Iterable[fx.Node]) -> list[fx.Node]:
    """``saved`` plus every banned node the backward would otherwise recompute.

    torch's min-cut saved set can recompute a read of an input that the forward mutates
    (pytorch/pytorch#197039); saving such nodes makes the starting plan correct. Banned
    nodes nothing reads are dropped (``unread_saved``): one added only for another added
    one, which a later addition saved (a policy's tag on every node of a decomposition:
    GELU's ``erf`` read only by its ``mul``), and one torch saves for its tag alone. The
    forward does not save them, and a plan that offloads one fails.
    """
    saved = list(saved)
    while True:
        banned = sorted((n for n in recomputed_nodes(a, set(saved)) if n in a.ban), key=a.position.__getitem__)
        if not banned:
            break
        saved.extend(banned)
    while True:
        unread = {n for n in unread_saved(a, saved) if n in a.ban}
        if not unread:
            return saved
        saved = [n for n in saved if n not in unread]


def unread_saved(a: JointAnalysis, saved: Iterable[fx.Node]) -> set[fx.Node]:
    """The tensors of ``saved`` that neither the backward nor what it recomputes reads (a
    policy's tag keeps a node of a decomposition, or a layer's output that only a residual
    add reads, in torch's saved set): the forward does not save them."""
    saved = set(saved)
    recomputed = recomputed_nodes(a, saved)
    read = {a.roots.get(arg, arg) for n in [*a.bw_nodes, *recomputed] for arg in a.inputs[n]}
    return {n for n in saved if n not in a.steady and n not in read and a.roots.get(n, n) not in read}


def compute_node(node: fx.Node) -> fx.Node:
    """The node that actually computes ``node`` (a getitem's multi-output parent)."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return node


@dataclass(frozen=True)
class Group:
    """Saved tensors sharing one storage, and the nodes that recompute that storage."""

    root: fx.Node
    members: frozenset[fx.Node]  # saved tensors whose storage is ``root``
    closure: frozenset[fx.Node]  # nodes to recompute: the root's producer and the views on the way
    sources: frozenset[fx.Node]  # what the closure reads from outside itself


def storage_group(a: JointAnalysis, members: Iterable[fx.Node]) -> Group | None:
    """The group for these saved tensors, or None when it cannot be recomputed."""
    members = frozenset(members)
    root = a.roots.get(next(iter(members)), next(iter(members)))
    if root in a.steady or root.op == "placeholder" or not a.is_forward(root):
        return None
    closure: set[fx.Node] = set()
    stack = list(members)
    while stack:
        node = stack.pop()
        if node in closure:
            continue
        closure.add(node)
        for arg in a.inputs[node]:
            if a.roots.get(arg, arg) is root and a.is_forward(arg):
                stack.append(arg)
    closure.add(root)
    closure.add(compute_node(root))
    if any(n in a.ban or n.op != "call_function" for n in closure):
        return None
    sources = frozenset(arg for n in closure for arg in a.inputs[n] if arg not in closure and a.is_forward(arg))
    return Group(root, members, frozenset(closure), sources)


def _groups(a: JointAnalysis, saved: Iterable[fx.Node], group_of=None) -> list[Group]:
    """The recomputable storage groups of ``saved``, in graph order. ``group_of(members)``:
    ``storage_group(a, members)``, or a memo of it."""
    group_of = group_of or (lambda members: storage_group(a, members))
    by_root: dict[fx.Node, list[fx.Node]] = {}
    for tensor in saved:
        if tensor_value(tensor) is not None and tensor not in a.steady:
            by_root.setdefault(a.roots.get(tensor, tensor), []).append(tensor)
    groups = [group_of(frozenset(members)) for members in by_root.values()]
    return sorted((g for g in groups if g is not None), key=lambda g: a.position[g.root])


# A move may recompute more than its own storage: walking back from its sources through
# tensors that are neither saved nor recomputed yet (a LayerNorm output is recomputed from
# the block input, not from a saved normalised copy of the same size). Two ways to stop:
# at the saved frontier, or also at compute-intensive nodes (matmuls), whose outputs are
# then saved. The walk is bounded so one move stays local.
MAX_EXTENSION = 48


def _extend(a: JointAnalysis, group: Group, saved: set, recomputed: set, stop_at_matmul: bool,
            looked_at: set | None = None):
    """(closure, added): the nodes the move recomputes and the tensors it must save.
    ``looked_at`` collects the nodes whose fate (saved, recomputed) the walk read."""
    closure = set(group.closure)
    added: set[fx.Node] = set()
    stack = list(group.sources)
    while stack:
        node = stack.pop()
        if looked_at is not None:
            looked_at.add(node)
        if node in closure or node in saved or node in recomputed or not a.is_forward(node):
            continue
        parent = compute_node(node)
        stop = (
            node in a.steady
            or node.op != "call_function"
            or node in a.ban
            or parent in a.ban
            or (stop_at_matmul and is_compute_intensive(parent))
            or len(closure) >= MAX_EXTENSION
        )
        if stop:
            added.add(node)
            continue
        closure.update((node, parent))
        stack.extend(a.inputs[parent])
        stack.extend(a.inputs[node])
    return frozenset(closure), tuple(sorted(added, key=a.position.__getitem__))


def greedy_moves(a: JointAnalysis, base_saved: Iterable[fx.Node], seconds: Seconds) -> Iterator[Move]:
    """The greedy sequence of recompute moves from ``base_saved``, most bytes freed per
    second of recompute first (ties: more bytes, then the earlier storage), each yielded
    as soon as chosen. Offload moves are mixed in by ``passes.solve.joint``."""
    saved = set(base_saved)
    plan = PlanState(saved, recomputed_nodes(a, saved))
    moves_of = RecomputeMoves(a, seconds)
    changed = None  # the first step compares with nothing
    while True:
        best = moves_of.best(plan.saved, plan.recomputed, changed=changed)
        if best is None:
            return
        best.apply(plan)
        changed = best.touched()
        yield best


def group_moves(a: JointAnalysis, group: Group, saved: set, recomputed: set, held: set, seconds: Seconds,
                looked_at: set | None = None) -> list[Move]:
    """The moves that recompute ``group`` and free bytes (``held``: the storages of
    ``saved``). ``looked_at`` collects the nodes whose fate the moves depend on: those
    the walks read, the group's closure (its recompute time counts what is not
    recomputed yet) and the storages of what the moves would save (freed only if not
    already held)."""
    freed = a.bytes_of.get(group.root, 0)
    moves = []
    for stop_at_matmul in (True, False):
        closure, added = _extend(a, group, saved, recomputed, stop_at_matmul, looked_at)
        added_roots = {a.roots.get(x, x) for x in added}
        if looked_at is not None:
            looked_at.update(group.closure, added_roots)
        # Not ``added_roots - held``: with ``held`` a dict's keys view (``RecomputeMoves``),
        # that difference iterates over all of ``held``, a pass over the saved set per move.
        gain = freed - sum(a.bytes_of.get(r, 0) for r in added_roots if r not in held)
        if gain > 0:
            moves.append(Move(group, added, _seconds_of(a, closure - recomputed, seconds), gain, closure))
    return moves


class RecomputeMoves:
    """Each way to recompute a saved storage that frees bytes (``group_moves``: stopping
    its recomputation at matmuls, saving their outputs, or going through them), for one
    plan after another along a greedy sequence. A step of the sequence changes the fate
    of a few nodes, so each storage's moves are kept until the fate of a node they depend
    on (``group_moves``'s ``looked_at``) changes, or of a tensor on its storage."""

    def __init__(self, a: JointAnalysis, seconds: Seconds) -> None:
        self.a, self.seconds = a, seconds
        # The plan the moves are worked out for (copies: ``_move_to`` updates them).
        self.saved: set[fx.Node] = set()
        self.recomputed: set[fx.Node] = set()
        self.moves: dict[fx.Node, tuple[Group, list[Move]]] = {}  # storage root -> its moves
        self.watchers: dict[fx.Node, set[fx.Node]] = {}  # node -> storages whose moves read its fate
        self.groups: dict[frozenset[fx.Node], Group | None] = {}  # saved tensors -> their storage group
        # The saved set's storages, kept up to date move by move (a pass over the saved set
        # at every step of a sequence was a quadratic term): what ``_groups`` lists.
        self.held_count: dict[fx.Node, int] = {}  # storage -> saved tensors on it
        self.members: dict[fx.Node, set[fx.Node]] = {}  # storage -> its saved (non-steady) tensors
        self.group_of_root: dict[fx.Node, Group] = {}  # recomputable storages -> their group
        self.order: list[tuple[int, fx.Node]] = []  # (position, root) of ``group_of_root``, sorted
        # ``best``: every storage's moves in a heap by ``move_key``, each entry valid while
        # its storage's moves are the ones last worked out (``version``).
        self.heap: list[tuple] = []
        self.version: dict[fx.Node, int] = {}
        self.stale: set[fx.Node] = set()  # storages whose moves must be worked out again

    def __call__(self, saved: set, recomputed: set, skip: set = frozenset()):
        """The moves under the plan saving ``saved`` and recomputing ``recomputed``,
        storages in graph order, leaving out those in ``skip``: the listing ``best`` is
        checked against."""
        self._move_to(saved, recomputed)
        held = self.held_count.keys()
        for _, root in self.order:
            if root not in skip:
                yield from self._group_moves(self.group_of_root[root], saved, recomputed, held)

    def best(self, saved: set, recomputed: set, skip: set = frozenset(), changed: set | None = None) -> Move | None:
        """``best_move`` of the moves ``__call__`` lists, kept in a heap: each step works
        out only the moves of the storages whose moves changed, instead of comparing every
        storage's moves again. Along one sequence ``skip`` may only grow (a skipped
        storage's moves are dropped). ``changed``: the nodes whose fate may differ from
        the plan of the last call (the last move's ``Move.touched``), when the caller
        knows them; otherwise the plans are compared whole (a pass over both sets at every
        step of a sequence was a quadratic term)."""
        self._move_to(saved, recomputed, changed)
        held = self.held_count.keys()
        for root in self.stale:
            group = self.group_of_root.get(root)
            if group is None:
                continue
            self.version[root] = version = self.version.get(root, 0) + 1
            for variant, move in enumerate(self._group_moves(group, saved, recomputed, held)):
                heapq.heappush(self.heap, (*move_key(self.a, move, variant), version, move))
        self.stale.clear()
        while self.heap:
            *_, version, move = self.heap[0]
            root = move.group.root
            if version == self.version.get(root) and root in self.group_of_root and root not in skip:
                return move
            heapq.heappop(self.heap)
        return None

    def _move_to(self, saved: set[fx.Node], recomputed: set[fx.Node], touched: set[fx.Node] | None = None) -> None:
        """Forget the moves that depend on a node whose fate changed (or on a storage one
        of whose saved tensors changed), and update the storages of the saved set.
        ``touched``: ``best``'s ``changed``."""
        roots = self.a.roots
        if touched is None:
            changed_saved = saved ^ self.saved
            changed_recomputed = recomputed ^ self.recomputed
        else:
            changed_saved = {n for n in touched if (n in saved) != (n in self.saved)}
            changed_recomputed = {n for n in touched if (n in recomputed) != (n in self.recomputed)}
        self.saved ^= changed_saved
        self.recomputed ^= changed_recomputed
        changed_roots = {roots.get(n, n) for n in changed_saved}
        changed = changed_saved | changed_recomputed | changed_roots
        for node in changed:
            for root in self.watchers.pop(node, ()):
                self.moves.pop(root, None)
                self.stale.add(root)
        for node in changed_saved:
            root = roots.get(node, node)
            counted = tensor_value(node) is not None and node not in self.a.steady
            if node in saved:
                self.held_count[root] = self.held_count.get(root, 0) + 1
                if counted:
                    self.members.setdefault(root, set()).add(node)
            else:
                self.held_count[root] -= 1
                if not self.held_count[root]:
                    del self.held_count[root]
                if counted:
                    self.members[root].discard(node)
        for root in changed_roots:
            if root in self.group_of_root:
                del self.group_of_root[root]
                self.order.pop(bisect.bisect_left(self.order, (self.a.position[root], root)))
            group = self._group_of(frozenset(self.members[root])) if self.members.get(root) else None
            if group is not None:
                self.group_of_root[root] = group
                bisect.insort(self.order, (self.a.position[root], root))  # positions are distinct
            self.stale.add(root)  # ``best`` voids its heap entries

    def _group_of(self, members: frozenset[fx.Node]) -> Group | None:
        if members not in self.groups:
            self.groups[members] = storage_group(self.a, members)
        return self.groups[members]

    def _group_moves(self, group: Group, saved: set, recomputed: set, held: set) -> list[Move]:
        cached = self.moves.get(group.root)
        if cached is not None and cached[0] == group:
            return cached[1]
        looked_at: set[fx.Node] = {group.root, *group.members}
        moves = group_moves(self.a, group, saved, recomputed, held, self.seconds, looked_at)
        self.moves[group.root] = (group, moves)
        for node in looked_at:
            self.watchers.setdefault(node, set()).add(group.root)
        return moves


def best_move(a: JointAnalysis, moves: Iterable[Move]) -> Move | None:
    """The move freeing the most bytes per second of its cost (ties: more bytes, then the
    earlier storage, then the first listed)."""
    best_key, best = None, None
    for move in moves:
        key = (move.freed_bytes / max(move.extra_seconds, 1e-12), move.freed_bytes, -a.position[move.group.root])
        if best_key is None or key > best_key:
            best_key, best = key, move
    return best


def move_key(a: JointAnalysis, move: Move, variant: int) -> tuple:
    """``best_move``'s order as a heap key (smallest first): ``variant`` is the move's index
    among its storage's moves, the first listed winning a tie."""
    return (-(move.freed_bytes / max(move.extra_seconds, 1e-12)), -move.freed_bytes, a.position[move.group.root],
            variant)


@dataclass(frozen=True)
class Prefix:
    """A candidate before simulation: what the plan after a prefix of moves saves and
    offloads, and the moves."""

    saved: frozenset[fx.Node]
    offloaded: frozenset[fx.Node]
    moves: tuple[Move, ...]


def prefixes(a: JointAnalysis, start: Prefix, moves: Iterable[Move], granularity: int = 0) -> Iterator[Prefix]:
    """The plan after each non-empty prefix of ``moves`` applied to ``start``, skipping
    prefixes that free fewer than ``granularity`` bytes (by the moves' estimates) beyond
    the previous one kept; the last prefix is always kept. Each is yielded as soon as it
    is known, so ``moves`` may be a generator."""
    saved = set(start.saved)
    plan = PlanState(saved, recomputed_nodes(a, saved), set(start.offloaded))
    applied: list[Move] = []
    pending = 0
    kept_last = False
    for move in moves:
        move.apply(plan)
        applied.append(move)
        pending += move.freed_bytes
        kept_last = pending >= granularity
        if kept_last:
            yield Prefix(frozenset(plan.saved), frozenset(plan.offloaded), start.moves + tuple(applied))
            pending = 0
    if applied and not kept_last:
        yield Prefix(frozenset(plan.saved), frozenset(plan.offloaded), start.moves + tuple(applied))


def evaluate(a: JointAnalysis, saved: Iterable[fx.Node], extra_seconds: float, moves=(),
             recomputed: set[fx.Node] | None = None, keep_timeline=False) -> Candidate:
    """Simulate one recompute-only plan; ``extra_seconds`` is its recompute time;
    ``recomputed``: ``recomputed_nodes(a, saved)``, when the caller has it."""
    saved = frozenset(saved)
    nodes = plan_nodes(a, set(saved), recomputed) if recomputed is not None else None
    program = plan_program(a, set(saved), fusion=a.fusion, nodes=nodes)
    timeline = simulate(program) if keep_timeline else None
    return Candidate(saved, extra_seconds, timeline.peak_bytes if timeline else peak_bytes(program), timeline,
                     tuple(moves))


def step_seconds(a: JointAnalysis, saved: Iterable[fx.Node], seconds: Seconds, nodes: PlanNodes | None = None) -> float:
    """Predicted time of one forward+backward under a plan (sum of per-node times).
    ``nodes``: ``passes.memory.plan_nodes(a, saved)``, when the caller has it."""
    if nodes is None:
        saved = set(saved)
        forward, recomputed = forward_nodes_needed(a, saved), recomputed_nodes(a, saved)
    else:
        forward, recomputed = nodes.forward, nodes.recomputed
    return _seconds_of(a, [*forward, *recomputed, *a.bw_nodes], seconds)


def _seconds_of(a: JointAnalysis, nodes: Iterable[fx.Node], seconds: Seconds) -> float:
    """Summed in graph order: a float sum over a set would depend on hash order and make
    tie-breaks (and so plans) differ from run to run."""
    # map and filter over C callables (``seconds`` is a table lookup in the solver): the same
    # additions in the same order as a generator with the filter, without a frame per node.
    return sum(map(seconds, filter(a.calls.__contains__, sorted(nodes, key=a.position.__getitem__))))


def pick(candidates: list[Candidate], budget: int | None) -> tuple[Candidate, bool]:
    """The fastest candidate whose peak fits (ties: lower peak, then earlier); else the
    lowest-peak one, reported infeasible."""
    if budget is None:
        return candidates[0], True
    fitting = [(c.extra_seconds, c.peak_bytes, i) for i, c in enumerate(candidates) if c.peak_bytes <= budget]
    if fitting:
        return candidates[min(fitting)[2]], True
    return min(candidates, key=lambda c: (c.peak_bytes, c.extra_seconds)), False


def solve_greedy(a: JointAnalysis, base_saved: list[fx.Node], seconds: Seconds, budget_bytes: int | None,
                 budget_fraction: float | None = None, progress: Progress | None = None,
                 complete: bool = False, more_moves: "MoreMoves | None" = None) -> Solution:
    """Recompute only: one candidate per prefix of the greedy sequence, the fastest that fits.

    Without a budget the unconstrained plan is the answer: nothing is searched. With one,
    the sequence is generated (moves only, no simulation) and searched for its first plan
    that fits (``search_sequences``): recompute time only grows along it, and its peaks
    fall to its lowest plan, so that is the fastest plan that fits, found in a few
    simulations. ``Solution.minimum`` is the lowest peak simulated. ``complete=True``
    simulates every plan (the reference the tests compare with, and the true minimum).
    ``more_moves``: a second sequence's moves, searched the same way (``solve_joint`` passes
    ``passes.solve.peak.peak_moves``)."""
    progress = progress or Progress()
    evaluate_plan = RecomputeEvaluator(a)
    start = Prefix(frozenset(base_saved), frozenset(), ())
    baseline = evaluate_plan(start)
    budget_bytes = resolve_budget(a, baseline, budget_bytes, budget_fraction)
    if budget_bytes is None and not complete:
        return select(a, [baseline], None, None, _with_timeline(a))
    # When the unconstrained plan fits, only plans as cheap can be chosen (for a lower peak).
    dearest = 0.0 if budget_bytes is not None and baseline.peak_bytes <= budget_bytes and not complete else None
    sequence, spent = [start], 0.0
    for plan in prefixes(a, start, greedy_moves(a, base_saved, seconds)):
        spent += plan.moves[-1].extra_seconds  # ``RecomputeEvaluator.price``, one move at a time
        if dearest is not None and spent > dearest:
            break
        sequence.append(plan)
        if not progress.step():
            break
    sequences = [sequence]
    alternatives: list[Prefix] = []  # plans the second sequence simulated on its way
    if more_moves is not None and dearest is None and not progress.out_of_time:  # (it simulates every move)
        more = prefixes(a, start, more_moves(a, base_saved, seconds, evaluate_plan, alternatives))
        sequences.append([start, *until_fitting(more, evaluate_plan, None if complete else budget_bytes)])
    if complete:
        candidates = [evaluate_plan(plan) for plan in unique_plans([plan for seq in sequences for plan in seq])]
    else:
        candidates = search_sequences(sequences, evaluate_plan, budget_bytes, progress)
    candidates += [evaluate_plan(plan) for plan in unique_plans(alternatives)]  # simulated already
    return select(a, candidates, budget_bytes, None, _with_timeline(a), evaluate_plan.results.values())


def until_fitting(plans: Iterable[Prefix], evaluate: "PlanEvaluator", budget_bytes: int | None) -> Iterator[Prefix]:
    """``plans`` up to the first whose simulated peak fits ``budget_bytes``, and the plans
    after it at its price (all of them where the budget is None). For a sequence that
    simulates each plan as it makes it (``passes.solve.peak.peak_moves``): prices rise
    along it, so no plan past those, nor any plan it would simulate on the way there, is
    cheaper; stopping there keeps the choice and skips the rest of the simulations (most of
    a small graph's solve). The plans at the same price lower the peak for nothing: the
    choice takes the lowest, and ``solver="refined"`` undoes paid moves from there."""
    fitting_price = None
    for plan in plans:
        candidate = evaluate(plan) if budget_bytes is not None else None
        if fitting_price is not None and candidate.extra_seconds > fitting_price:
            return
        yield plan
        if fitting_price is None and candidate is not None and candidate.peak_bytes <= budget_bytes:
            fitting_price = candidate.extra_seconds


# A sequence of moves from a saved set, made with the solve's evaluator (``passes.solve.peak``).
# ``(graph, saved set, seconds, evaluator, alternatives)``: the moves; every other plan it
# simulates is appended to ``alternatives`` (candidates too).
MoreMoves = Callable[[JointAnalysis, list[fx.Node], Seconds, "PlanEvaluator", list[Prefix]], Iterable[Move]]


class PlanEvaluator(Protocol):
    """What ``search_sequences`` reads of a plan: its price (extra seconds, and copies)
    without simulating it, and its simulated candidate; each computed once."""

    def price(self, plan: Prefix) -> tuple[float, TransferPlan | None]: ...

    def __call__(self, plan: Prefix) -> Candidate: ...

    def bound(self, plan: Prefix) -> int:
        """A lower bound of the plan's simulated peak, for much less than simulating it."""


class RecomputeEvaluator:
    """A ``PlanEvaluator`` for recompute-only plans: priced by their moves' recompute time."""

    def __init__(self, a: JointAnalysis) -> None:
        self.a = a
        self.results: dict[frozenset[fx.Node], Candidate] = {}
        self.recomputed = LastRecomputed(a)
        self.peak_bound = PeakBound(a, self.recomputed)

    def price(self, plan: Prefix) -> tuple[float, None]:
        # Summed move by move, in order: the sum the candidate reports, to the last bit.
        extra = 0.0
        for move in plan.moves:
            extra += move.extra_seconds
        return extra, None

    def __call__(self, plan: Prefix) -> Candidate:
        if plan.saved not in self.results:
            candidate = evaluate(self.a, plan.saved, self.price(plan)[0], plan.moves, self.recomputed(plan.saved))
            self.results[plan.saved] = candidate
            self.peak_bound.check(plan.saved, frozenset(), candidate.peak_bytes)
        return self.results[plan.saved]

    def bound(self, plan: Prefix) -> int:
        """``Evaluator.bound`` for recompute-only plans."""
        return self.peak_bound(plan.saved)


class LastRecomputed:
    """``recomputed_nodes`` of a saved set, kept for the last one asked: a search asks a
    plan's bound and then simulates it. (A bound method of the evaluator in its own
    ``PeakBound`` was a reference cycle: the evaluator and every plan it simulated were
    left for the cyclic collector, which then walked them all.)"""

    def __init__(self, a: JointAnalysis) -> None:
        self.a = a
        self.last: tuple[frozenset[fx.Node], set[fx.Node]] | None = None

    def __call__(self, saved: frozenset[fx.Node]) -> set[fx.Node]:
        if self.last is None or self.last[0] != saved:
            self.last = (saved, recomputed_nodes(self.a, set(saved)))
        return self.last[1]


def search_sequences(sequences: list[list[Prefix]], evaluate: "PlanEvaluator", budget_bytes: int | None,
                     progress: Progress | None = None) -> list[Candidate]:
    """The candidates ``passes.solve.recompute.pick`` chooses among, found by searching each sequence
    (each starting with the unconstrained plan or a branch point) instead of simulating
    every plan: along a sequence, prices rise and peaks fall to its lowest plan
    (``passes.solve.search_sequence``). From each sequence: its first plan that fits the budget
    (the cheapest of that sequence that fits) and the plans after it as cheap (for the
    tie-break on peak); where none fits, its lowest-peak plan. Returned in sequence order,
    the unconstrained plan first.

    In two rounds: first every sequence's probes (``probed_fit``); then, in the sequences
    where no probe fitted, the search around the lowest plan (``fitting_around_lowest``,
    most of a search's simulations). Each searches only the plans priced at most the
    cheapest fitting plan found so far (``count_within``): a dearer plan cannot be chosen,
    and where the first plan is dearer, the sequence is not searched at all. The choice is
    the one searching every sequence in full gives; ``Solution.minimum`` (the lowest peak
    simulated) may be higher. Where a mixed sequence's prices fall somewhere (each plan
    is priced on its own schedules), a fitting plan past the count can be passed over:
    a slower plan, never one over the budget.

    Once ``progress`` is out of time, only the first sequence (as far as it was
    generated) is searched: a few simulations, so that the plan returned is the best of
    the plans generated in time, not the unconstrained one."""
    fits = (lambda bytes_: bytes_ <= budget_bytes) if budget_bytes is not None else (lambda bytes_: False)
    price = lambda plan: evaluate.price(plan)[0]  # noqa: E731
    cheapest = None  # the price of the cheapest plan found that fits

    def choosable(sequence: list[Prefix]) -> int:
        """How many leading plans of ``sequence`` could be chosen: all, or those priced at
        most ``cheapest`` (prices rise along a sequence)."""
        if cheapest is None:
            return len(sequence)
        return count_within(lambda i: price(sequence[i]), len(sequence), cheapest)

    searched: list[tuple[list[Prefix], Callable[[int], int], Callable[[int], int], int | None]] = []
    for number, sequence in enumerate(sequences):
        if number and progress is not None and progress.out_of_time:
            break
        peak = (lambda seq: lambda i: evaluate(seq[i]).peak_bytes)(sequence)
        bound = (lambda seq: lambda i: evaluate.bound(seq[i]))(sequence)
        fit = probed_fit(peak, choosable(sequence), fits, bound=bound) if budget_bytes is not None else None
        if fit is not None and (cheapest is None or price(sequence[fit]) < cheapest):
            cheapest = price(sequence[fit])
        searched.append((sequence, peak, bound, fit))
    found: dict[tuple[frozenset, frozenset], Prefix] = {}
    for sequence, peak, bound, fit in searched:
        if fit is None:
            n = choosable(sequence)
            if n == 0:
                continue
            cut_short = n < len(sequence)
            fit = fitting_around_lowest(peak, n, fits, bound=bound, cut_short=cut_short)
            if fit is None:
                picked = [lowest(peak, n, bound=bound, cut_short=cut_short)]  # read by the search just made
            elif cheapest is None or price(sequence[fit]) < cheapest:
                cheapest = price(sequence[fit])
        if fit is not None:
            picked, fit_price = [fit], price(sequence[fit])
            while picked[-1] + 1 < len(sequence) and price(sequence[picked[-1] + 1]) <= fit_price:
                picked.append(picked[-1] + 1)
        for i in picked:
            found.setdefault((sequence[i].saved, sequence[i].offloaded), sequence[i])
    plans = unique_plans([sequences[0][0], *found.values()])
    return [evaluate(plan) for plan in plans]


def unique_plans(plans: list[Prefix]) -> list[Prefix]:
    """The first of each (saved, offloaded) pair, in order."""
    unique: dict[tuple[frozenset, frozenset], Prefix] = {}
    for plan in plans:
        unique.setdefault((plan.saved, plan.offloaded), plan)
    return list(unique.values())


def resolve_budget(a: JointAnalysis, baseline: Candidate, budget_bytes: int | None,
                    budget_fraction: float | None) -> int | None:
    if budget_bytes is None and budget_fraction is not None:
        return budget_of_fraction(a, baseline, budget_fraction)
    return budget_bytes


def _with_timeline(a: JointAnalysis) -> Callable[[Candidate], Candidate]:
    """A recompute-only candidate simulated again, keeping its timeline."""
    return lambda c: evaluate(a, c.saved, c.extra_seconds, c.moves, keep_timeline=True)


def exact_subsets(a: JointAnalysis, base_saved: list[fx.Node], seconds: Seconds, max_candidates: int,
                  progress: Progress | None = None) -> list[Candidate]:
    """Every valid plan that recomputes a subset of the storage groups saved by default
    (those simulated before ``progress`` runs out of time)."""
    progress = progress or Progress()
    pool = _groups(a, base_saved)
    if len(pool) > max_candidates:
        raise SolverError(
            f"the exact solver handles at most {max_candidates} candidate storages (exact_max_candidates); "
            f"this graph has {len(pool)}"
        )
    candidates = []
    progress.total = 2 ** len(pool)
    base_recomputed = recomputed_nodes(a, set(base_saved))
    for size in range(len(pool) + 1):
        for subset in itertools.combinations(pool, size):
            dropped = set().union(*(g.members for g in subset)) if subset else set()
            closures = set().union(*(g.closure for g in subset)) if subset else set()
            saved = set(base_saved) - dropped
            for group in subset:
                saved.update(x for x in group.sources if x not in closures and x not in base_recomputed)
            saved -= dropped
            recomputed = recomputed_nodes(a, saved)
            if any(n in a.ban for n in recomputed):
                continue
            extra = _seconds_of(a, recomputed - base_recomputed, seconds)
            candidates.append(evaluate(a, saved, extra))
            if not progress.step():
                return candidates
    return candidates


def solve_exact(a: JointAnalysis, base_saved: list[fx.Node], seconds: Seconds, budget_bytes: int | None,
                max_candidates: int, budget_fraction: float | None = None,
                progress: Progress | None = None) -> Solution:
    candidates = exact_subsets(a, base_saved, seconds, max_candidates, progress)
    # The unconstrained plan is the empty subset: first in the list.
    return select(a, candidates, budget_bytes, budget_fraction, _with_timeline(a))


def budget_of_fraction(a: JointAnalysis, baseline: Candidate, fraction: float) -> int:
    """A fraction budget in bytes: ``fraction`` of the activation memory the unconstrained
    plan (``baseline``) saves, on top of what the step needs besides it (transient buffers,
    gradients). So 1.0 is the unconstrained peak, 0.5 that peak less half the saved bytes,
    the same measure as torch's ``activation_memory_budget``; 0.0 asks for the
    minimum-memory plan and resolves to 0 bytes (below every plan)."""
    if fraction == 0.0:
        return 0
    saved_bytes = sum(a.storage_bytes(root) for root in {a.roots.get(t, t) for t in baseline.saved})
    return int(baseline.peak_bytes - (1.0 - fraction) * saved_bytes)


def lowest_peak(candidate: Candidate) -> tuple[int, float]:
    return candidate.peak_bytes, candidate.extra_seconds


def select(a: JointAnalysis, candidates: list[Candidate], budget_bytes: int | None, budget_fraction: float | None,
           with_timeline: Callable[[Candidate], Candidate], simulated: Iterable[Candidate] = ()) -> Solution:
    """The solution among simulated ``candidates`` (the unconstrained plan first): the
    fastest that fits the budget, else the lowest-peak one (``pick``), explained.
    ``with_timeline(candidate)``: the candidate simulated again, keeping its timeline
    (for the chosen and the unconstrained plan only). ``Solution.minimum`` is the
    lowest-peak plan of ``candidates`` and ``simulated`` (every plan the search read: a
    search that stops early still says how low the plans it saw went), and the plan
    chosen when none fits."""
    baseline = candidates[0]
    if budget_bytes is None and budget_fraction is not None:
        budget_bytes = budget_of_fraction(a, baseline, budget_fraction)
    chosen, feasible = pick(candidates, budget_bytes)
    minimum = min(itertools.chain(candidates, simulated), key=lowest_peak)
    if not feasible:  # the lowest-peak plan simulated (``pick``'s, unless a search passed a lower one)
        chosen = minimum
    chosen = with_timeline(chosen)
    baseline = with_timeline(baseline)
    solution = Solution(chosen, baseline, minimum, budget_bytes, feasible, candidates_evaluated=len(candidates))
    _explain(a, solution)
    return solution


def _explain(a: JointAnalysis, solution: Solution) -> None:
    """Attach a reason to every tensor whose fate differs from the unconstrained plan."""
    base, final = solution.baseline.saved, solution.chosen.saved
    recomputed = recomputed_nodes(a, set(final))
    for tensor in sorted(base - final, key=a.position.__getitem__):
        group = storage_group(a, [tensor])
        sources = sorted((x.name for x in group.sources), key=str) if group else []
        solution.recomputed[tensor] = f"recomputed from {', '.join(sources) or 'inputs'} to fit the budget"
    for tensor in sorted(final - base, key=a.position.__getitem__):
        users = sorted((n.name for n in tensor.users if n in recomputed), key=str)
        solution.added[tensor] = f"saved so that {', '.join(users) or 'others'} can be recomputed"
    solution.offloaded = offload_reasons(solution.chosen.transfers)


def offload_reasons(transfers: TransferPlan | None) -> dict[fx.Node, str]:
    """Why and how each offloaded tensor moves, for the plan's decision table."""
    if transfers is None:
        return {}
    reasons = {}
    for copy in transfers.copies:
        if copy.direction == "d2h":
            wait = transfers.offload_wait_after[copy.tensor].name
            hidden = "hidden" if copy.stall == 0 else f"{copy.stall * 1e3:.3f} ms exposed"
            reasons[copy.tensor] = f"offloaded to host memory (copy {hidden}, forward waits after {wait})"
    for copy in transfers.copies:
        if copy.direction == "h2d" and copy.tensor in reasons:
            before = transfers.reload_before[copy.tensor].name
            behind = transfers.hidden_behind_seconds[copy.tensor] * 1e3
            hidden = "hidden" if copy.stall == 0 else f"{copy.stall * 1e3:.3f} ms exposed"
            reasons[copy.tensor] += f"; reloaded from before {before}, behind {behind:.3f} ms of compute ({hidden})"
    return reasons
