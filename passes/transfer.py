"""Transfer model: when offloads and reloads run on the link, and what they expose.

Compute runs on the compute stream, one node after another, each taking the cost model's
time. Copies run on their own stream, and each direction of the link (device->host for
offloads, host->device for reloads) carries one copy at a time: copies in flight on one
direction queue behind each other in the order they were issued (a FIFO per direction).
The two directions overlap each other and compute.

Forward. An offload is issued right after its producer. The forward waits for it at the
first node, at or after the tensor's last forward use, by whose end the copy has finished
(at the last forward node when none has): the copy is hidden if compute covers it, and
the tensor's device memory is held until that wait. A copy that finishes after the
forward's compute stalls the forward's end.

Backward. Each reload must finish before the first backward node that reads the tensor
(its wait sits right before that node). Reloads are placed as late as possible while still
hidden: walking from the last first-use back, each reload ends at its first use or when
the next reload on the link begins, whichever is earlier, and is issued before the latest
node whose predicted start is no later than that. A reload issued later holds its device
memory for a shorter time; one issued earlier would only add to the peak. Without
prefetch (``prefetch=False``, a debugging switch) each reload is issued right before its
first use, and its whole copy is exposed. Where another user shares the link
(``DeviceProfile.shared_h2d_bytes``: FSDP2 uploading the next module's offloaded parameters
as the backward starts), the host->device direction is busy with its copy first, and the
reloads queue behind it; the shared copy's own time is not the plan's, only the delay it
causes the reloads.

The *exposed* time is what the compute stream spends waiting for copies; with the
launches of the copy and wait ops, it is all that offloading adds to a step.
``plan_transfers`` simulates it exactly along the predicted schedules; ``LinkEstimate``
gives the solver a cheap marginal estimate for one more offload.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch.fx as fx

from .analyze import JointAnalysis
from .cost import DeviceProfile, transfer_seconds
from .memory import PlanNodes, backward_order, forward_nodes_needed, recomputed_nodes
from .node_durations import schedule_durations

Seconds = Callable[[fx.Node], float]


# --- predicted schedules ------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """Nodes in execution order with their stall-free start times (seconds from the start
    of their pass); ``total`` is the pass's compute time."""

    nodes: tuple[fx.Node, ...]
    starts: tuple[float, ...]
    total: float

    @cached_property
    def index(self) -> dict[fx.Node, int]:
        """Node -> its position (built once: the solver asks for it per candidate move)."""
        return {node: i for i, node in enumerate(self.nodes)}

    def end(self, index: int) -> float:
        return self.starts[index + 1] if index + 1 < len(self.nodes) else self.total

    @cached_property
    def ends(self) -> tuple[float, ...]:
        """``end(i)`` for every node, non-decreasing (for binary searches)."""
        return (*self.starts[1:], self.total)


def timed(nodes: Iterable[fx.Node], seconds: Seconds) -> Schedule:
    """``nodes`` run back to back; only ``call_function`` nodes take time."""
    nodes = tuple(nodes)
    # Running sums, added in the same order as a loop would (so the same floats); with the
    # solver's table of durations, each node's term is one lookup (no frame per node).
    in_schedule = schedule_durations(seconds)
    terms = (map(in_schedule, nodes) if in_schedule is not None
             else (seconds(node) if node.op == "call_function" else 0.0 for node in nodes))
    starts = list(itertools.accumulate(terms, initial=0.0))
    total = starts.pop()
    return Schedule(nodes, tuple(starts), total)


def forward_schedule(a: JointAnalysis, saved: set[fx.Node], seconds: Seconds) -> Schedule:
    """The forward the plan runs (``passes.memory.forward_nodes_needed``)."""
    return timed(forward_nodes_needed(a, saved), seconds)


def backward_schedule(a: JointAnalysis, saved: set[fx.Node], seconds: Seconds) -> Schedule:
    """The backward the plan runs, recomputation just in time (``passes.memory.backward_order``)."""
    return timed(backward_order(a, recomputed_nodes(a, saved)), seconds)


def plan_schedules(nodes: PlanNodes, seconds: Seconds) -> tuple[Schedule, Schedule]:
    """The forward and backward schedules of a saved set's nodes (``passes.memory.plan_nodes``)."""
    return timed(nodes.forward, seconds), timed(nodes.backward, seconds)


def last_forward_use(a: JointAnalysis, tensor: fx.Node, index: dict[fx.Node, int]) -> int:
    """Index in the forward schedule of the last forward node reading ``tensor``'s storage
    (the producer itself when none does)."""
    root = a.roots.get(tensor, tensor)
    last = index[tensor]
    stack, seen = [tensor], {tensor}
    while stack:  # readers of the tensor and of the views of it the forward makes
        node = stack.pop()
        for user in node.users:
            if user in index and user not in seen:
                seen.add(user)
                last = max(last, index[user])
                if a.roots.get(user, user) is root:
                    stack.append(user)
    return last


def first_backward_uses(a: JointAnalysis, backward: Schedule, tensors: Iterable[fx.Node]) -> dict[fx.Node, int]:
    """Index in the backward schedule of the first node reading each tensor's storage
    (tensors the backward never reads are left out)."""
    wanted = set(tensors)
    first: dict[fx.Node, int] = {}
    input_roots = a.input_roots
    for index, node in enumerate(backward.nodes):
        for base in input_roots[node]:
            if base in wanted and base not in first:
                first[base] = index
    return first


# --- the plan of copies ---------------------------------------------------------------------


@dataclass(frozen=True)
class Copy:
    """One copy on the link: issued after (d2h) or before (h2d) schedule node ``issue``,
    on the link from ``begin`` to ``end``, waited for at schedule node ``wait`` (after it
    for d2h, before it for h2d), where compute stalled for ``stall`` seconds."""

    tensor: fx.Node
    direction: str  # "d2h" or "h2d"
    issue: int
    begin: float
    end: float
    wait: int
    stall: float


@dataclass
class TransferPlan:
    """Where each copy of an offload decision set is issued and waited for, and what it exposes."""

    forward_exposed_seconds: float = 0.0
    backward_exposed_seconds: float = 0.0
    # Forward node after which the forward waits for each offload.
    offload_wait_after: dict[fx.Node, fx.Node] = field(default_factory=dict)
    # Backward node before which each reload is issued, and how many backward schedule
    # steps that is ahead of the first use (what ``passes.memory.plan_program`` takes).
    reload_before: dict[fx.Node, fx.Node] = field(default_factory=dict)
    reload_distance: dict[fx.Node, int] = field(default_factory=dict)
    # Predicted compute between each reload's issue and its first use.
    hidden_behind_seconds: dict[fx.Node, float] = field(default_factory=dict)
    copies: list[Copy] = field(default_factory=list)
    # The compute stream launches two ops per copy (the copy and its wait).
    launch_seconds: float = 0.0

    @property
    def exposed_seconds(self) -> float:
        """Compute stalls waiting for copies, forward plus backward."""
        return self.forward_exposed_seconds + self.backward_exposed_seconds

    @property
    def added_seconds(self) -> float:
        """What the copies add to a step: stalls and launches."""
        return self.exposed_seconds + self.launch_seconds


def plan_transfers(a: JointAnalysis, saved: set[fx.Node], offloaded: set[fx.Node], seconds: Seconds,
                   profile: DeviceProfile, prefetch: bool = True,
                   schedules: tuple[Schedule, Schedule] | None = None,
                   first_uses: dict[fx.Node, int] | None = None) -> TransferPlan:
    """Issue and wait positions of the copies for ``offloaded`` (storage-owning saved
    tensors) under the plan that saves ``saved``, and the stalls they cause.
    ``schedules``: the plan's (forward, backward) schedules, when the caller has them;
    ``first_uses``: ``first_backward_uses(a, backward, forward.index)`` for them (the
    solver keeps it per saved set), else the backward is walked for ``offloaded``."""
    plan = TransferPlan()
    if not offloaded:
        return plan
    forward, backward = schedules or (forward_schedule(a, saved, seconds), backward_schedule(a, saved, seconds))
    if first_uses is None or not all(t in forward.index for t in offloaded):
        first_uses = first_backward_uses(a, backward, offloaded)
    else:  # a tensor's first use does not depend on which others are looked for
        first_uses = {t: first_uses[t] for t in offloaded if t in first_uses}
    _plan_offloads(a, forward, offloaded, profile, plan)
    _plan_reloads(a, backward, offloaded, profile, prefetch, plan, first_uses)
    plan.launch_seconds = 2 * len(plan.copies) * profile.launch_overhead_seconds
    return plan


def _plan_offloads(a: JointAnalysis, forward: Schedule, offloaded: set[fx.Node], profile: DeviceProfile,
                   plan: TransferPlan) -> None:
    index = forward.index
    link_free = 0.0
    last = len(forward.nodes) - 1
    now = forward.total  # where the forward's end has got to, waiting for copies
    for tensor in sorted(offloaded, key=index.__getitem__):  # issue order: producer order
        issued = forward.end(index[tensor])
        begin = max(issued, link_free)
        end = link_free = begin + transfer_seconds(a.bytes_of.get(tensor, 0), profile, "d2h")
        # The first node from the last use on whose end is not before the copy's (the last
        # node when none): a binary search, the ends being non-decreasing (a scan was 40% of
        # planning deep-48 at 2 GiB).
        wait = last_forward_use(a, tensor, index)
        wait = bisect.bisect_left(forward.ends, end, wait, last) if wait < last else wait
        # Only waits after the last node can find their copy unfinished; they run in
        # issue order, which is the order the copies finish in.
        stall = max(0.0, end - now) if wait == last else 0.0
        now += stall
        plan.offload_wait_after[tensor] = forward.nodes[wait]
        plan.copies.append(Copy(tensor, "d2h", index[tensor], begin, end, wait, stall))
    plan.forward_exposed_seconds = now - forward.total


def _plan_reloads(a: JointAnalysis, backward: Schedule, offloaded: set[fx.Node], profile: DeviceProfile,
                  prefetch: bool, plan: TransferPlan, first_use: dict[fx.Node, int]) -> None:
    order = sorted(first_use, key=lambda t: (first_use[t], a.position[t]))
    duration = {t: transfer_seconds(a.bytes_of.get(t, 0), profile, "h2d") for t in order}
    if prefetch:
        issue = latest_hidden_issue(backward, [first_use[t] for t in order], [duration[t] for t in order])
    else:
        issue = [first_use[t] for t in order]
    for tensor, at in zip(order, issue):
        use = first_use[tensor]
        plan.reload_before[tensor] = backward.nodes[at]
        plan.reload_distance[tensor] = use - at
        plan.hidden_behind_seconds[tensor] = backward.starts[use] - backward.starts[at]
    plan.copies.extend(_simulate_reloads(backward, order, issue, [first_use[t] for t in order],
                                         [duration[t] for t in order], shared_h2d_seconds(profile)))
    plan.backward_exposed_seconds = sum(c.stall for c in plan.copies if c.direction == "h2d")


def latest_hidden_issue(schedule: Schedule, uses: Sequence[int], durations: Sequence[float]) -> list[int]:
    """Issue positions for copies that must finish before schedule nodes ``uses`` (sorted),
    one at a time on one link: as late as possible while still hidden.

    From the last copy back, each must end by its use's start and by the next copy's
    begin; it is issued before the latest node starting no later than its latest begin
    (node 0 when none does: it cannot be hidden and is issued as early as possible).
    Positions never decrease, so the link's FIFO order is the order of ``uses``.
    """
    issue = [0] * len(uses)
    next_begin = float("inf")
    for k in range(len(uses) - 1, -1, -1):
        latest_end = min(schedule.starts[uses[k]], next_begin)
        latest_begin = latest_end - durations[k]
        # The latest node i <= uses[k] with starts[i] <= latest_begin.
        at = bisect.bisect_right(schedule.starts, latest_begin, 0, uses[k] + 1) - 1
        issue[k] = max(at, 0)
        next_begin = latest_begin
    for k in range(1, len(issue)):  # ties at node 0 keep the FIFO in use order
        issue[k] = max(issue[k], issue[k - 1])
    return issue


def shared_h2d_seconds(profile: DeviceProfile) -> float:
    """How long the host->device link is busy with another user's copy as the backward starts."""
    return transfer_seconds(profile.shared_h2d_bytes, profile, "h2d")


def _simulate_reloads(backward: Schedule, order: list[fx.Node], issue: list[int], uses: list[int],
                      durations: list[float], link_busy: float = 0.0) -> list[Copy]:
    """Run the backward with the reloads issued at ``issue``, the link busy until
    ``link_busy``; stalls delay later compute."""
    issued_at: dict[int, list[int]] = {}
    waited_at: dict[int, list[int]] = {}
    for k, (at, use) in enumerate(zip(issue, uses)):
        issued_at.setdefault(at, []).append(k)
        waited_at.setdefault(use, []).append(k)
    begin, end, stall = [0.0] * len(order), [0.0] * len(order), [0.0] * len(order)
    now, link_free = 0.0, link_busy
    starts = backward.starts
    ends = (*starts[1:], backward.total)  # backward.end(i), without a call per node
    for i in range(len(backward.nodes)):
        if i in issued_at:
            for k in issued_at[i]:
                begin[k] = max(now, link_free)
                end[k] = link_free = begin[k] + durations[k]
        if i in waited_at:
            for k in waited_at[i]:
                stall[k] = max(0.0, end[k] - now)
                now += stall[k]
        now += ends[i] - starts[i]
    return [Copy(t, "h2d", issue[k], begin[k], end[k], uses[k], stall[k]) for k, t in enumerate(order)]


# --- marginal cost of one more offload, for ranking the solver's moves ----------------------


class LinkEstimate:
    """Exposed seconds added by offloading one more tensor, given those already offloaded.

    Forward: copies released at their producers' ends, one at a time in release order; the
    last finishes at ``max_i(release_i + durations from i on)``, and what passes the
    forward's end is exposed (exactly ``plan_transfers``'s forward stall). Backward: copies
    due at their first uses, all released at the backward's start; no issue order exposes
    less than ``max_i(durations due by use_i - use_i)`` (the maximum lateness of the
    earliest-deadline-first order), and ``plan_transfers`` exposes some time exactly when
    that is positive. Both maxima are kept as prefix and suffix maxima over the sorted
    copies, so one more copy costs a binary search. A link shared at the backward's start
    (``shared_h2d_seconds``) moves every due time that much earlier.
    """

    def __init__(self, a: JointAnalysis, forward: Schedule, backward: Schedule, offloaded: Iterable[fx.Node],
                 profile: DeviceProfile, prefetch: bool = True, first_use: dict[fx.Node, int] | None = None) -> None:
        """``first_use``: ``first_backward_uses(a, backward, forward.index)``, when the
        caller keeps it (it depends on the schedules alone)."""
        self.a, self.profile, self.prefetch = a, profile, prefetch
        self.link_busy = shared_h2d_seconds(profile)
        self.forward, self.backward = forward, backward
        self.forward_index = forward.index
        offloaded = [t for t in offloaded if t in self.forward_index]
        self.first_use = first_backward_uses(a, backward, self.forward_index) if first_use is None else first_use
        self.d2h = self._release_queue([(self._release(t), self._d2h(t)) for t in offloaded])
        self.h2d = self._deadline_queue([(self._due(t), self._h2d(t)) for t in offloaded if t in self.first_use])
        self.forward_exposed = max(0.0, self.d2h.makespan - forward.total)
        self.backward_exposed = max(0.0, self.h2d.lateness)

    def _d2h(self, tensor: fx.Node) -> float:
        return transfer_seconds(self.a.bytes_of.get(tensor, 0), self.profile, "d2h")

    def _h2d(self, tensor: fx.Node) -> float:
        return transfer_seconds(self.a.bytes_of.get(tensor, 0), self.profile, "h2d")

    def _release(self, tensor: fx.Node) -> float:
        return self.forward.end(self.forward_index[tensor])

    def _due(self, tensor: fx.Node) -> float:
        return self.backward.starts[self.first_use[tensor]] - self.link_busy

    @staticmethod
    def _release_queue(copies: list[tuple[float, float]]) -> "_Queue":
        """Sorted by release; key_i = release_i + durations from i on; makespan = max key."""
        copies.sort()
        suffix = list(itertools.accumulate(reversed([d for _, d in copies])))[::-1] + [0.0]
        keys = [r + suffix[i] for i, (r, _) in enumerate(copies)]
        return _Queue([r for r, _ in copies], keys, suffix)

    @staticmethod
    def _deadline_queue(copies: list[tuple[float, float]]) -> "_Queue":
        """Sorted by due time; key_i = durations due by i - due_i; lateness = max key."""
        copies.sort()
        prefix = list(itertools.accumulate(d for _, d in copies))
        keys = [prefix[i] - due for i, (due, _) in enumerate(copies)]
        return _Queue([due for due, _ in copies], keys, [0.0, *prefix])

    def marginal(self, tensor: fx.Node) -> tuple[float, float]:
        """(forward, backward) exposed seconds added by also offloading ``tensor`` (the
        launches of its copies and waits not included: ``launch_seconds``)."""
        if tensor not in self.forward_index:
            return 0.0, 0.0
        d2h = self._d2h(tensor)
        makespan = self.d2h.with_release(self._release(tensor), d2h)
        forward = max(0.0, makespan - self.forward.total) - self.forward_exposed
        if tensor not in self.first_use:
            return forward, 0.0
        h2d = self._h2d(tensor)
        if not self.prefetch:  # issued at its use: the whole copy waits, plus the queue
            return forward, h2d
        lateness = self.h2d.with_deadline(self._due(tensor), h2d)
        return forward, max(0.0, lateness) - self.backward_exposed

    def launch_seconds(self, tensor: fx.Node) -> float:
        """The compute stream's time to launch the tensor's copies and waits."""
        copies = 2 if tensor in self.first_use else 1
        return 2 * copies * self.profile.launch_overhead_seconds


class _Queue:
    """Copies sorted by ``times``, each with a key; prefix and suffix maxima of the keys."""

    def __init__(self, times: list[float], keys: list[float], sums: list[float]) -> None:
        self.times, self.keys, self.sums = times, keys, sums
        self.prefix_max = list(itertools.accumulate(keys, max))
        self.suffix_max = list(itertools.accumulate(reversed(keys), max))[::-1]

    @property
    def makespan(self) -> float:
        return max(self.keys, default=float("-inf"))

    lateness = makespan

    def _split(self, time: float) -> tuple[float, float, int]:
        j = bisect.bisect_right(self.times, time)
        before = self.prefix_max[j - 1] if j > 0 else float("-inf")
        after = self.suffix_max[j] if j < len(self.keys) else float("-inf")
        return before, after, j

    def with_release(self, release: float, duration: float) -> float:
        """Makespan with one more copy released at ``release`` (after equal releases):
        copies released earlier finish ``duration`` later; later ones are unaffected."""
        before, after, j = self._split(release)
        return max(before + duration, release + duration + self.sums[j], after)

    def with_deadline(self, due: float, duration: float) -> float:
        """Lateness with one more copy due at ``due`` (after equal due times): copies due
        later finish ``duration`` later; earlier ones are unaffected."""
        before, after, j = self._split(due)
        return max(before, self.sums[j] + duration - due, after + duration)
