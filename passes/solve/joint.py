"""Budget -> keep, recompute or offload each saved tensor.

Extends the greedy recompute solver (``passes.solve.recompute``) with *offload moves*: an eligible
saved storage is copied to host memory after its producer and reloaded before its first
backward use, which frees its device memory in between (``passes.transfer`` says when the
copies run and what they expose; ``passes.memory`` simulates the peak with them, the
device copy counted until the forward waits for it and the reload from its issue).

A mixed greedy sequence takes, at each step, the move with the most freed bytes per second
of marginal predicted step time: a recompute move costs its recompute time, an offload
move the stall it adds (``transfer.LinkEstimate``: zero while compute hides the copy,
growing once the link is saturated, since each direction carries one copy at a time) and
the launches of its copy and wait ops. Hidden offloads therefore come first, until the
forward's compute can hide no more bytes; then recompute and exposed copies compete.

Which tensors are worth offloading depends on what is already recomputed, so mixed
sequences start from several plans of the recompute-only sequence: its first plan, its
first plan below each eighth of the unconstrained peak, and its lowest-peak plan (past
which the recompute greedy only raises the peak, recomputing the residual stream block by
block, while offloading what that plan saves lowers it). The recompute-only sequence is
a candidate set too, so enabling offload never predicts a slower plan.

Every prefix of every sequence is a candidate plan. A budget picks the fastest candidate
that fits, else the lowest-peak one (``passes.solve.recompute.pick``). Along a sequence prices rise
and peaks fall to its lowest plan, so the fastest plan of a sequence that fits is its
first plan that fits: each sequence is searched for it (``passes.solve.search_sequence``, a few
simulations per sequence instead of one per plan), and so are the branch points. Plans
are priced and simulated only when a search reads them, and offload moves are costed on
schedules derived again only as recompute time accumulates (``OffloadCosts``). The candidate set does not depend
on the budget, and where peaks fall and then rise along every sequence the search finds
the plan simulating every candidate would, so a smaller budget never gets a larger
predicted peak (monotone); ``complete=True`` simulates every candidate (the reference).
Where no candidate fits, the lowest is lowered further one step at a time, never to a
faster plan (``passes.solve.lower_peak``).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

import torch.fx as fx

from ..analyze import JointAnalysis, tensor_value
from ..cost import DeviceProfile
from ..memory import PlanNodes, StepBuilder, peak_bytes, plan_nodes, plan_program, recomputed_nodes, simulate
from .lower_peak import lowered_solution
from ..node_durations import node_durations
from .peak_bound import PeakBound
from .recompute import (
    Candidate,
    Group,
    Move,
    OffloadMove,
    PlanState,
    Prefix,
    RecomputeMoves,
    Seconds,
    Solution,
    best_move,
    greedy_moves,
    lowest_peak,
    move_key,
    prefixes,
    unique_plans,
    resolve_budget,
    search_sequences,
    select,
    solve_greedy,
    step_seconds,
    until_fitting,
)
from ..progress import Progress
from .search_sequence import first_fitting, lowest
from .peak import peak_moves
from .segments import masks_kept, segment_sequence
from ..transfer import LinkEstimate, Schedule, TransferPlan, first_backward_uses, plan_schedules, plan_transfers


@dataclass(frozen=True)
class OffloadOptions:
    """Let the solver offload saved storages as well as recompute them."""

    profile: DeviceProfile
    eligible: Callable[[fx.Node], bool]  # may this storage-owning tensor be offloaded?
    prefetch: bool = True


# Candidate plans closer than this fraction of the unconstrained peak in freed bytes are
# merged (the later one kept): it bounds the number of simulations on large graphs while
# leaving every budget a plan within that fraction of the best.
EVALUATION_GRANULARITY = 1 / 512
# Mixed sequences branch off the recompute-only one at this many levels of its peak.
BRANCHES = 8
# How many nodes the saved sets ``SavedSetCache`` keeps may hold in all (a few hundred MB).
# The memory simulation revisits saved sets in price order, not in the order they were
# made: a fixed 16 of them made GPT-8 at 0.5 derive 349 saved sets' nodes for 227
# distinct ones; with this, each is derived once.
SAVED_SET_NODES = 3_000_000
# Offload moves along a mixed sequence are costed on schedules derived again once the
# recompute time added since exceeds this fraction of a step (``OffloadCosts``). The
# estimate only orders the moves: 0.01, 0.02, 0.04, 0.05 and never (1.0) chose the same
# plans at the 30 budgets of the GPT-8 and deep-24 sweeps and at 0.8-0.2 of 13 small
# models' peaks (h100, 2026-11-29); 0.05 derives them a fifth as often as 0.01 did
# (deep-48 planning 13% faster).
LINK_REFRESH = 0.05


def solve_joint(a: JointAnalysis, base_saved: list[fx.Node], seconds: Seconds, budget_bytes: int | None,
                budget_fraction: float | None = None, offload: OffloadOptions | None = None,
                progress: Progress | None = None, complete: bool = False, lowest_start: str | None = None) -> Solution:
    """Keep, recompute or offload each saved tensor so the simulated peak fits the budget
    at the least predicted step time. ``offload=None`` is recompute only
    (``passes.solve.recompute.solve_greedy``).

    Without a budget the unconstrained plan is the answer: nothing is searched. With one,
    the sequences of candidate plans are generated, then searched (``search_sequences``):
    only the plans a search reads are priced and simulated. ``Solution.minimum`` is the
    lowest peak simulated. ``complete=True`` simulates every plan (the reference the tests
    compare with). ``lowest_start``: where nothing fits, which start's lowest plan to return
    (``lowest_solution``)."""
    progress = progress or Progress()
    seconds = node_durations(seconds)  # the same values, looked up: every saved set sums them
    if offload is None:
        solution = solve_greedy(a, base_saved, seconds, budget_bytes, budget_fraction, progress, complete, peak_moves)
        if solution.feasible or solution.budget_bytes is None:
            return solution
        evaluate = Evaluator(a, seconds, None, base_saved)  # recompute only: no plan has copies
        return lowest_solution(a, solution, base_saved, seconds, evaluate, progress, complete,
                               lowest_start=lowest_start)
    saved_sets = SavedSetCache(a, seconds)
    evaluate = Evaluator(a, seconds, offload, base_saved, saved_sets)
    with_timeline = evaluate.with_timeline
    start = Prefix(frozenset(base_saved), frozenset(), ())
    baseline = evaluate(start)
    budget_bytes = resolve_budget(a, baseline, budget_bytes, budget_fraction)
    if budget_bytes is None and not complete:
        return select(a, [baseline], None, None, with_timeline)
    # Recompute only, every prefix a candidate (those of ``solve_greedy``: offload never
    # predicts a slower plan), and mixed sequences branching off it. Plans are priced and
    # simulated only when a search asks for them.
    recompute = [start]
    for plan in prefixes(a, start, greedy_moves(a, base_saved, seconds)):
        recompute.append(plan)
        if not progress.step():
            break
    # Small graphs: the sequence that simulates every move (passes.solve.peak). Its lowest plan
    # is a branch point too: offloading what it saves lowers its peak further. Not made when
    # the unconstrained plan fits: none of its plans is faster (the byte sequences stay).
    fits = budget_bytes is not None and baseline.peak_bytes <= budget_bytes and not complete
    alternatives: list[Prefix] = []  # every other plan the peak-ordered sequence simulated: candidates too
    peak = [] if fits or progress.out_of_time else [start, *until_fitting(
        prefixes(a, start, peak_moves(a, base_saved, seconds, evaluate, alternatives)), evaluate,
        None if complete else budget_bytes)]
    granularity = int(EVALUATION_GRANULARITY * baseline.peak_bytes)
    offloadable_now = Offloadable(a, offload.eligible)  # each tensor's eligibility once per solve
    sequences = [recompute]
    branches = branch_points(recompute, evaluate, BRANCHES, search=not complete)
    # (Where the sequence stopped at a plan that fits, offloading from it only costs more.)
    if (len(peak) > 1 and all(branch.saved != peak[-1].saved for branch in branches)
            and (complete or evaluate(peak[-1]).peak_bytes > budget_bytes)):
        branches.append(peak[-1])
    for branch in branches:
        if progress.out_of_time:
            break
        sequence = [branch]
        for plan in prefixes(a, branch, mixed_moves(a, branch.saved, seconds, offload, saved_sets,
                                                    offloadable_now), granularity):
            sequence.append(plan)
            if not progress.step():
                break
        sequences.append(sequence)
    if len(peak) > 1:
        sequences.append(peak)
    if complete:
        candidates = [evaluate(plan) for plan in unique_plans([plan for sequence in sequences for plan in sequence])]
    else:
        candidates = search_sequences(sequences, evaluate, budget_bytes, progress)
    candidates += [evaluate(plan) for plan in unique_plans(alternatives)]  # simulated already
    solution = select(a, candidates, budget_bytes, None, with_timeline, evaluate.results.values())

    def offloading_from(analysis: JointAnalysis, branch: Prefix) -> list[Prefix]:
        return [branch, *prefixes(analysis, branch, mixed_moves(analysis, branch.saved, seconds, offload, saved_sets,
                                                                offloadable_now), granularity)]

    return lowest_solution(a, solution, base_saved, seconds, evaluate, progress, complete, offloading_from,
                           lowest_start)


# Which start's lowest plan ``lowest_solution`` returns where nothing fits: the model's choice
# (None), the greedy's, or per-segment checkpointing's.
LOWEST_STARTS = (None, "greedy", "segments")


def lowest_solution(a: JointAnalysis, solution: Solution, base_saved: list[fx.Node], seconds: Seconds,
                    evaluate: "Evaluator", progress: Progress, complete: bool,
                    offloading_from: Callable[[JointAnalysis, Prefix], list[Prefix]] | None = None,
                    lowest_start: str | None = None) -> Solution:
    """``solution`` where it fits its budget. Where nothing fitted, the lowest plan found is
    lowered step by step where it can be (``lower_peak``), and so is the lowest plan of
    per-segment checkpointing (``passes.solve.segments``: that plan, the greedy moves from it
    and, with ``offloading_from``, the mixed sequence from it): the faster of the two where
    both fit, the one that fits, else the lower. (Both are looked at whenever the greedy's
    sequences met nothing, also where the lowering alone meets the budget: so a lower budget
    never gets a faster plan.)

    Where neither fits and the two differ, the model's lower one is returned with the other's
    predicted peak (``Solution.rival_peak_bytes``): the model ranks these plans less surely
    than Inductor's code does, so the budget loop may compile both and keep the lower.
    ``lowest_start`` (``"greedy"`` or ``"segments"``) returns that start's lowest plan instead
    of the model's choice (the greedy's where there are no segments)."""
    if lowest_start not in LOWEST_STARTS:
        raise ValueError(f"lowest_solution: lowest_start={lowest_start!r}; accepted: {LOWEST_STARTS}")
    budget_bytes = solution.budget_bytes
    if solution.feasible or budget_bytes is None:
        return solution
    lowered = lowered_solution(a, solution, base_saved, evaluate, evaluate.with_timeline, progress)
    if progress.out_of_time:
        return lowered
    kept = masks_kept(a)  # the plans from it recompute no mask (``segments.masks_kept``)
    sequence = segment_sequence(kept, base_saved, seconds)
    if not sequence:
        return lowered
    start = sequence[0]
    alternatives: list[Prefix] = []  # every plan the peak-ordered sequence simulated
    peak = [start, *until_fitting(prefixes(kept, start, peak_moves(kept, start.saved, seconds, evaluate, alternatives)),
                                  evaluate, None if complete else budget_bytes)]
    sequences = [sequence, peak] + ([offloading_from(kept, start)] if offloading_from is not None else [])
    if complete:
        found = [evaluate(plan) for plan in unique_plans([plan for s in sequences for plan in s])]
    else:
        found = search_sequences(sequences, evaluate, budget_bytes, progress)
    found += [evaluate(plan) for plan in unique_plans(alternatives)]  # simulated already
    segments = select(a, [solution.baseline, *found], budget_bytes, None, evaluate.with_timeline)
    if not segments.feasible:
        segments = lowered_solution(kept, segments, base_saved, evaluate, evaluate.with_timeline, progress)
    if segments.feasible and lowered.feasible:
        better = segments.chosen.extra_seconds < lowered.chosen.extra_seconds
    else:
        better = segments.feasible or (not lowered.feasible and segments.chosen.peak_bytes < lowered.chosen.peak_bytes)
    if lowest_start is not None and not segments.feasible and not lowered.feasible:
        better = lowest_start == "segments"
    segments.candidates_evaluated += lowered.candidates_evaluated
    segments.from_segments = True
    chosen, rival = (segments, lowered) if better else (lowered, segments)
    same = (chosen.chosen.saved, chosen.chosen.offloaded) == (rival.chosen.saved, rival.chosen.offloaded)
    if not chosen.feasible and not rival.feasible and not same:
        chosen.rival_peak_bytes = rival.chosen.peak_bytes
    return chosen


def branch_points(sequence: list[Prefix], evaluate: "Evaluator", levels: int, search: bool = True) -> list[Prefix]:
    """Where mixed sequences start: the recompute-only sequence's first plan, its first
    plan below each of ``levels`` evenly spaced fractions of the first plan's peak, and its
    lowest-peak plan. Which tensors are worth offloading depends on what is already
    recomputed, so the mix is tried from several depths of recomputation. Each point is
    found by a search (``passes.solve.search_sequence``), or with ``search=False`` by simulating
    the whole sequence (the complete search's reference)."""
    n = len(sequence)
    peak = lambda i: evaluate(sequence[i]).peak_bytes  # noqa: E731
    bound = lambda i: evaluate.bound(sequence[i])  # noqa: E731
    order = lambda i: (lowest_peak(evaluate(sequence[i])), i)  # noqa: E731
    first = peak(0)
    points = [sequence[0]]
    for level in range(levels - 1, 0, -1):
        below = lambda bytes_: bytes_ < level / levels * first  # noqa: E731
        if search:
            found = first_fitting(peak, n, below, bound=bound)
        else:
            found = next((i for i in range(n) if below(peak(i))), None)
        points.append(None if found is None else sequence[found])
    least_first = lambda i: (bound(i), -math.inf)  # noqa: E731  a lower bound of ``order(i)[0]``
    points.append(sequence[lowest(lambda i: order(i)[0], n, bound=least_first) if search else min(range(n), key=order)])
    distinct = {id(plan): plan for plan in points if plan is not None}
    return list(distinct.values())


# --- the mixed greedy sequence ---------------------------------------------------------------


def offloadable(a: JointAnalysis, saved: Iterable[fx.Node], offloaded: set[fx.Node], eligible) -> list[fx.Node]:
    """Saved tensors that may be offloaded, in graph order: each owns its storage and is the
    only saved tensor on it (a saved view would keep reading the device storage), is
    computed by the forward (not a parameter or input), is not (an alias of) a user output
    (which stays on the device anyway), allocates bytes, and passes ``eligible`` (the
    insertion pass's rules: ``passes.offload.eligible_for_offload``)."""
    by_root: dict[fx.Node, list[fx.Node]] = {}
    for tensor in saved:
        if tensor_value(tensor) is not None:
            by_root.setdefault(a.roots.get(tensor, tensor), []).append(tensor)
    outputs = {a.roots.get(o, o) for o in a.fw_outputs}
    result = []
    for root, members in by_root.items():
        if members != [root] or root in offloaded or root in outputs or root in a.steady:
            continue
        if root.op != "call_function" or not a.is_forward(root) or a.bytes_of.get(root, 0) <= 0:
            continue
        if eligible(root):
            result.append(root)
    return sorted(result, key=a.position.__getitem__)


class Offloadable:
    """``offloadable(a, saved, offloaded, eligible)`` for one saved set after another: what
    depends on a tensor alone (its storage, and whether that storage may ever be
    offloaded: ``eligible`` and the rest of ``offloadable``'s rules) is worked out once per
    tensor for the whole solve, so each step only counts the saved tensors per storage."""

    def __init__(self, a: JointAnalysis, eligible: Callable[[fx.Node], bool]) -> None:
        self.a, self.eligible = a, eligible
        self.outputs = {a.roots.get(o, o) for o in a.fw_outputs}
        self.root: dict[fx.Node, fx.Node | None] = {}  # tensor -> its storage (None: not a tensor)
        self.may: dict[fx.Node, bool] = {}  # storage -> offloadable when it is the only saved tensor on it

    def __call__(self, saved: Iterable[fx.Node], offloaded: set[fx.Node]) -> list[fx.Node]:
        saved = saved if isinstance(saved, (set, frozenset)) else set(saved)
        count: dict[fx.Node, int] = {}
        for tensor in saved:
            root = self.storage(tensor)
            if root is not None:
                count[root] = count.get(root, 0) + 1
        result = [root for root, n in count.items()
                  if n == 1 and root in saved and self.storage(root) is root and root not in offloaded
                  and self.may_offload(root)]
        return sorted(result, key=self.a.position.__getitem__)

    def storage(self, tensor: fx.Node) -> fx.Node | None:
        """The storage ``tensor`` is on (None: not a tensor)."""
        if tensor not in self.root:
            self.root[tensor] = self.a.roots.get(tensor, tensor) if tensor_value(tensor) is not None else None
        return self.root[tensor]

    def may_offload(self, root: fx.Node) -> bool:
        """Whether storage ``root`` may be offloaded when it is the only saved tensor on it."""
        if root not in self.may:
            a = self.a
            self.may[root] = bool(
                root not in self.outputs and root not in a.steady and root.op == "call_function"
                and a.is_forward(root) and a.bytes_of.get(root, 0) > 0 and self.eligible(root))
        return self.may[root]


def mixed_moves(a: JointAnalysis, base_saved: Iterable[fx.Node], seconds: Seconds, offload: OffloadOptions,
                saved_sets: "SavedSetCache | None" = None, candidates: Offloadable | None = None) -> Iterator[Move]:
    """The greedy sequence of recompute and offload moves from ``base_saved``, most freed
    bytes per second of marginal cost first (ties: more bytes, then the earlier tensor),
    each yielded as soon as chosen. An offload move's cost (its ``extra_seconds``) is its
    estimated exposed and launch time. ``candidates``: an ``Offloadable`` for
    ``offload.eligible``, shared by the sequences of one solve."""
    saved_sets = saved_sets or SavedSetCache(a, seconds)
    candidates = candidates or Offloadable(a, offload.eligible)
    saved = set(base_saved)
    plan = PlanState(saved, recomputed_nodes(a, saved))
    moves_of = RecomputeMoves(a, seconds)
    offload_costs = OffloadCosts(a, offload, saved_sets, plan.saved, candidates)
    changed = None  # the first step compares with nothing
    while True:
        recompute = moves_of.best(plan.saved, plan.recomputed, skip=plan.offloaded, changed=changed)
        offload = offload_costs.best(plan.saved, plan.offloaded, changed)
        best = best_move(a, [move for move in (recompute, offload) if move])
        if best is None:
            return
        best.apply(plan)
        changed = best.touched()
        offload_costs.moved(best)
        yield best


class OffloadCosts:
    """The offload moves along one mixed sequence: each offloadable storage costs the
    exposed seconds it adds, estimated against the copies already planned (zero until the
    link saturates), and its launches (``transfer.LinkEstimate``).

    The estimate needs the plan's schedules, and deriving a saved set's schedules is a
    pass over the whole graph; nearly every step of a sequence changes the saved set, so
    deriving them at every step made generating a sequence quadratic in depth. A recompute
    move shifts the schedules by no more than its recompute time, so the schedules of an
    earlier saved set of the sequence are kept until the recompute time added since
    exceeds ``LINK_REFRESH`` of that plan's step time, or until an offload candidate is a
    tensor they do not schedule; and each move's cost is kept until the schedules or the
    offloaded set change (a new *generation*). The estimate only orders the moves: every
    plan's price is worked out on its own schedules (``Evaluator.price``).

    ``best`` keeps the offloadable storages up to date from the tensors whose fate changed
    and the moves in a heap, so a step costs what changed, not a pass over the saved set.
    A move costed in an earlier generation is costed again only when it reaches the top
    (a lazy greedy): the choice is ``best_move``'s when a copy's cost never falls as copies
    are added, as one more copy only makes the link busier; the tests compare the two at
    every step of a sequence, and the 16-layer sweep's plans did not change."""

    def __init__(self, a: JointAnalysis, offload: OffloadOptions, saved_sets: "SavedSetCache",
                 saved: set[fx.Node], offloadable: Offloadable | None = None) -> None:
        self.a, self.offload = a, offload
        self.offloadable = offloadable or Offloadable(a, offload.eligible)
        self.saved_sets, self.saved = saved_sets, saved  # ``saved``: the sequence's live saved set
        self.facts = saved_sets(saved)
        self.drift = 0.0  # recompute seconds added since ``facts`` were derived
        self.estimated_for: tuple | None = None  # (facts, how many offloaded) of the generation
        self.generation = 0
        self.kept: dict[fx.Node, OffloadMove] = {}  # this generation's moves
        # ``best``'s state: the offloadable storages now, and this generation's moves in a heap.
        self.seen_saved: set[fx.Node] = set()  # a copy, updated by ``_track``
        self.seen_offloaded: set[fx.Node] = set()
        self.count: dict[fx.Node, int] = {}  # storage -> saved tensors on it
        self.current: set[fx.Node] = set()
        self.heap: list[tuple] = []
        self.pushed: set[fx.Node] = set()  # storages with a live entry of this generation

    def moved(self, move: Move) -> None:
        if move.kind == "recompute":
            self.drift += move.extra_seconds

    def moves(self, candidates: list[fx.Node], offloaded: set[fx.Node]) -> list[OffloadMove]:
        """An offload move for each of ``candidates`` (``Offloadable``), given ``offloaded``
        (which only grows along a sequence): the listing ``best`` is checked against."""
        if not candidates:
            return []
        self._estimate(candidates, offloaded)
        return [self._move(tensor) for tensor in candidates]

    def best(self, saved: set[fx.Node], offloaded: set[fx.Node], changed: set[fx.Node] | None = None
             ) -> OffloadMove | None:
        """``best_move`` of ``moves(Offloadable(saved, offloaded), offloaded)``, with the
        lazy re-costing described above. ``changed``: as ``RecomputeMoves.best``'s."""
        joined = self._track(saved, offloaded, changed)
        if not self.current:
            return None
        self._estimate(joined, offloaded)
        for tensor in self.current - self.pushed:
            self._push(tensor)
        while self.heap:
            *_, generation, move = heapq.heappop(self.heap)
            root = move.group.root
            if root not in self.current:
                self.pushed.discard(root)
            elif generation == self.generation:
                heapq.heappush(self.heap, (*move_key(self.a, move, 0), generation, move))
                return move
            else:  # costed in an earlier generation: cost it again, then compare
                self._push(root)
        return None

    def _push(self, tensor: fx.Node) -> None:
        move = self._move(tensor)
        heapq.heappush(self.heap, (*move_key(self.a, move, 0), self.generation, move))
        self.pushed.add(tensor)

    def _track(self, saved: set[fx.Node], offloaded: set[fx.Node], touched: set[fx.Node] | None = None) -> set[fx.Node]:
        """Update the offloadable storages (``Offloadable``'s rule) from what changed
        (``touched``: ``best``'s ``changed``); returns the storages that became offloadable."""
        off = self.offloadable
        if touched is None:
            flipped = saved ^ self.seen_saved
        else:
            flipped = {node for node in touched if (node in saved) != (node in self.seen_saved)}
        self.seen_saved ^= flipped
        dirty = set()
        for node in flipped:
            root = off.storage(node)
            if root is not None:
                self.count[root] = self.count.get(root, 0) + (1 if node in saved else -1)
                dirty.add(root)
        if len(offloaded) != len(self.seen_offloaded):
            dirty |= offloaded - self.seen_offloaded
            self.seen_offloaded = set(offloaded)
        joined = set()
        for root in dirty:
            if (self.count.get(root) == 1 and root in saved and off.storage(root) is root
                    and root not in offloaded and off.may_offload(root)):
                if root not in self.current:
                    self.current.add(root)
                    joined.add(root)
            else:
                self.current.discard(root)
        return joined

    def _estimate(self, candidates: Iterable[fx.Node], offloaded: set[fx.Node]) -> None:
        """The link estimate for this step: a new generation when the schedules were derived
        again or the offloaded set changed."""
        stale = self.drift > LINK_REFRESH * self.facts.step_seconds
        if stale or (any(t not in self.facts.first_uses for t in candidates) and self.facts.saved != self.saved):
            self.facts, self.drift = self.saved_sets(self.saved), 0.0
        if self.estimated_for is None or self.estimated_for[0] is not self.facts or self.estimated_for[1] != len(offloaded):
            forward, backward = self.facts.schedules
            self.link = LinkEstimate(self.a, forward, backward, offloaded, self.offload.profile,
                                     self.offload.prefetch, self.facts.first_uses)
            self.estimated_for = (self.facts, len(offloaded))
            self.generation += 1
            self.kept = {}

    def _move(self, tensor: fx.Node) -> OffloadMove:
        move = self.kept.get(tensor)
        if move is None:
            added = sum(max(0.0, seconds) for seconds in self.link.marginal(tensor)) + self.link.launch_seconds(tensor)
            subject = Group(tensor, frozenset({tensor}), frozenset(), frozenset())  # nothing recomputed
            move = self.kept[tensor] = OffloadMove(subject, (), added, self.a.bytes_of[tensor])
        return move


class SavedSetCache:
    """What the solver derives from a saved set alone: the nodes the step runs
    (``passes.memory.plan_nodes``), their schedules and the predicted step time. Offload
    moves leave the saved set as it is, so consecutive plans along a mixed sequence share
    it; the most recently used ``capacity`` saved sets are kept (each holds a few lists as
    long as the graph, so by default as many as make ``SAVED_SET_NODES`` nodes in all)."""

    def __init__(self, a: JointAnalysis, seconds: Seconds, capacity: int | None = None) -> None:
        self.a, self.seconds = a, seconds
        self.capacity = capacity or max(16, SAVED_SET_NODES // max(1, len(a.position)))
        self.facts: OrderedDict[frozenset, SavedSetFacts] = OrderedDict()

    def __call__(self, saved: Iterable[fx.Node]) -> "SavedSetFacts":
        key = frozenset(saved)
        if key in self.facts:
            self.facts.move_to_end(key)
        else:
            self.facts[key] = SavedSetFacts(self.a, key, self.seconds)
            if len(self.facts) > self.capacity:
                self.facts.popitem(last=False)
        return self.facts[key]


class SavedSetFacts:
    """One saved set's nodes, schedules and step time, each computed when first asked for."""

    def __init__(self, a: JointAnalysis, saved: frozenset[fx.Node], seconds: Seconds) -> None:
        self.a, self.saved, self.seconds = a, saved, seconds

    @cached_property
    def recomputed(self) -> set[fx.Node]:
        return recomputed_nodes(self.a, set(self.saved))

    @cached_property
    def nodes(self) -> PlanNodes:
        return plan_nodes(self.a, set(self.saved), self.recomputed)

    @cached_property
    def schedules(self) -> tuple[Schedule, Schedule]:
        return plan_schedules(self.nodes, self.seconds)

    @cached_property
    def first_uses(self) -> dict[fx.Node, int]:
        """Each forward node's first use in the backward schedule (``LinkEstimate``'s)."""
        forward, backward = self.schedules
        return first_backward_uses(self.a, backward, forward.index)

    @cached_property
    def step_seconds(self) -> float:
        return step_seconds(self.a, self.saved, self.seconds, self.nodes)


# --- candidates ------------------------------------------------------------------------------


class Evaluator:
    """Simulates plans against the unconstrained one (``base_saved``): copies
    (``passes.transfer``), then the memory timeline; each distinct plan once. A plan's
    extra seconds are its predicted step time (``passes.solve.recompute.step_seconds``: compute and
    recompute) beyond the unconstrained plan's, plus what its copies add (stalls and
    launches: ``TransferPlan.added_seconds``)."""

    def __init__(self, a: JointAnalysis, seconds: Seconds, offload: OffloadOptions | None,
                 base_saved: Iterable[fx.Node], saved_sets: SavedSetCache | None = None) -> None:
        self.a, self.seconds, self.offload = a, seconds, offload
        self.saved_sets = saved_sets or SavedSetCache(a, seconds)
        self.steps = StepBuilder(a, a.fusion)  # plans are simulated in sequence order
        self.base_seconds = self.saved_sets(base_saved).step_seconds
        self.results: dict[tuple[frozenset, frozenset], Candidate] = {}
        self.prices: dict[tuple[frozenset, frozenset], tuple[float, TransferPlan | None]] = {}
        # Not a lambda reading ``self``: a cycle through the evaluator would keep it, its
        # cache of saved sets and every plan it simulated until a collection walks them all.
        saved_sets = self.saved_sets
        self.peak_bound = PeakBound(a, lambda saved: saved_sets(saved).recomputed)

    def with_timeline(self, plan: Candidate) -> Candidate:
        """``plan`` simulated again, keeping its timeline (for the plans a solution reports)."""
        return self(Prefix(plan.saved, plan.offloaded, plan.moves), keep_timeline=True)

    def bound(self, plan: Prefix) -> int:
        """A lower bound of the plan's simulated peak (``passes.solve.peak_bound.PeakBound``)."""
        return self.peak_bound(plan.saved, plan.offloaded)

    def simulated(self, plan: Prefix) -> bool:
        return (plan.saved, plan.offloaded) in self.results

    def price(self, plan: Prefix) -> tuple[float, TransferPlan | None]:
        """(extra seconds, copies) of a plan, without simulating its memory."""
        key = (plan.saved, plan.offloaded)
        if key not in self.prices:
            facts = self.saved_sets(plan.saved)
            transfers = (plan_transfers(self.a, set(plan.saved), set(plan.offloaded), self.seconds,
                                        self.offload.profile, self.offload.prefetch, facts.schedules,
                                        facts.first_uses)
                         if plan.offloaded else None)
            copies = transfers.added_seconds if transfers else 0.0
            self.prices[key] = (facts.step_seconds - self.base_seconds + copies, transfers)
        return self.prices[key]

    def __call__(self, plan: Prefix, keep_timeline: bool = False) -> Candidate:
        key = (plan.saved, plan.offloaded)
        if key in self.results and not keep_timeline:
            return self.results[key]
        extra, transfers = self.price(plan)
        facts = self.saved_sets(plan.saved)
        program = plan_program(
            self.a, set(plan.saved), set(plan.offloaded), fusion=self.a.fusion,
            reload_distance=transfers.reload_distance if transfers else None,
            offload_wait_after=transfers.offload_wait_after if transfers else None,
            computed=self.steps(plan.saved, facts.nodes),
            # The reloads' first uses, kept per saved set (derived for the copies' price).
            first_uses=facts.first_uses if plan.offloaded else None,
            first_uses_of=facts.schedules[0].index if plan.offloaded else (),
        )
        timeline = simulate(program) if keep_timeline else None  # the search reads peaks only
        candidate = Candidate(plan.saved, extra, timeline.peak_bytes if timeline else peak_bytes(program),
                              timeline, plan.moves, plan.offloaded, transfers)
        self.peak_bound.check(plan.saved, plan.offloaded, candidate.peak_bytes)
        self.results.setdefault(key, candidate)
        return candidate
