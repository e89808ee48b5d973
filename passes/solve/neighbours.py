"""Plans one step away from a plan: an undo or a swap, in the order of a cheap estimate.

The local searches after the greedy solver walk from its plan one step at a time:
``passes.solve.refine`` (faster plans that still fit), ``passes.solve.prune`` (plans no slower and no
higher) and ``passes.solve.lower_peak`` (lower plans below the greedy's lowest). They share these
steps:

- an *undo*: stop offloading one storage, or save again one storage of the unconstrained
  plan that the plan recomputes (dropping what was saved only to recompute it);
- a *swap*: save one storage of the unconstrained plan again while recomputing one other
  storage the plan keeps on the device.

Each step comes with its estimated saving in seconds (the recompute time of the storage
saved again, the stalls of the copies undone; for a swap, less the recompute time it adds),
which orders the steps (``key``; by default the largest saving first) and never decides:
every search evaluates the plans it takes with the solver's own evaluator. A plan is built
only when it is reached in that order, so a search that stops early builds few.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch.fx as fx

from ..analyze import JointAnalysis, tensor_value
from ..memory import recomputed_nodes
from .recompute import Candidate, Group, Prefix, storage_group, unread_saved

Order = Callable[[float], object]  # the estimated saving -> a sort key (smaller first)


def most_saved_first(saving: float) -> float:
    return -saving


class Estimates:
    """Cheap estimates of what a step saves, to order the options (never to decide)."""

    def __init__(self, a: JointAnalysis, seconds: Callable[[fx.Node], float]) -> None:
        self.a, self.seconds = a, seconds
        self.groups: dict[frozenset[fx.Node], Group | None] = {}
        self.recompute: dict[frozenset[fx.Node], float] = {}

    def group(self, members: Iterable[fx.Node]) -> Group | None:
        members = frozenset(members)
        if members not in self.groups:
            self.groups[members] = storage_group(self.a, members)
        return self.groups[members]

    def recompute_seconds(self, members: Iterable[fx.Node]) -> float:
        """The time of recomputing these tensors' storage from what it reads (kept: ``swaps``
        asks it of each storage once per pair)."""
        members = frozenset(members)
        if members not in self.recompute:
            group = self.group(members)
            self.recompute[members] = (0.0 if group is None else
                                       sum(self.seconds(n) for n in group.closure if n.op == "call_function"))
        return self.recompute[members]


def undos(a: JointAnalysis, plan: Candidate, base_saved: frozenset[fx.Node], estimate: Estimates,
          key: Order = most_saved_first) -> Iterator[tuple[float, Prefix]]:
    """(estimated saving, plan) for the plans one undo away from ``plan`` (one offload
    less, or one storage of the unconstrained plan saved again), ordered by ``key`` of the
    saving, then graph order."""
    stalls: dict[fx.Node, float] = {}
    for copy in plan.transfers.copies if plan.transfers else ():
        stalls[copy.tensor] = stalls.get(copy.tensor, 0.0) + copy.stall
    options: list[tuple[float, int, fx.Node, set[fx.Node] | None]] = []
    for tensor in plan.offloaded:
        options.append((stalls.get(tensor, 0.0), a.position[tensor], tensor, None))
    for root, members in unsaved_base_storages(a, plan, base_saved):
        options.append((estimate.recompute_seconds(members), a.position[root], root, members))
    for saving, _, tensor, members in sorted(options, key=lambda o: (key(o[0]), o[1])):
        if members is None:
            yield saving, Prefix(plan.saved, plan.offloaded - {tensor}, plan.moves)
        else:
            saved = unread_dropped(a, set(plan.saved) | members, base_saved)
            yield saving, Prefix(frozenset(saved), plan.offloaded & saved, plan.moves)


def swaps(a: JointAnalysis, plan: Candidate, base_saved: frozenset[fx.Node], estimate: Estimates,
          key: Order = most_saved_first) -> Iterator[tuple[float, Prefix]]:
    """(estimated net saving, plan) for the plans that save one storage of the
    unconstrained plan again while recomputing one other storage ``plan`` keeps on the
    device (recomputable without a banned node), ordered by ``key`` of the net saving,
    then graph order."""
    resaved = list(unsaved_base_storages(a, plan, base_saved))
    saved_roots: dict[fx.Node, set[fx.Node]] = {}
    for tensor in plan.saved:
        if tensor_value(tensor) is not None and tensor not in a.steady:
            saved_roots.setdefault(a.roots.get(tensor, tensor), set()).add(tensor)
    others = []
    for other, members in saved_roots.items():
        if members & plan.offloaded or estimate.group(members) is None:
            continue
        others.append((estimate.recompute_seconds(members), a.position[other], other, members))
    pairs = sorted(((estimate.recompute_seconds(members) - cost, a.position[root], a.position[other], root,
                     members, other, others_members)
                    for root, members in resaved for cost, _, other, others_members in others if other is not root),
                   key=lambda p: (key(p[0]), p[1], p[2]))
    for saving, _, _, root, members, other, others_members in pairs:
        group = estimate.group(others_members)
        swapped = (set(plan.saved) | members) - others_members
        swapped |= {s for s in group.sources if s not in group.closure}
        if any(n in a.ban for n in recomputed_nodes(a, swapped)):
            continue
        swapped = unread_dropped(a, swapped, base_saved - others_members)
        yield saving, Prefix(frozenset(swapped), plan.offloaded & swapped, plan.moves)


def unsaved_base_storages(a: JointAnalysis, plan: Candidate, base_saved: frozenset[fx.Node]):
    """(root, the unconstrained plan's saved tensors of it) for each storage the
    unconstrained plan saves and ``plan`` does not, in graph order."""
    saved_roots = {a.roots.get(t, t) for t in plan.saved}
    by_root: dict[fx.Node, set[fx.Node]] = {}
    for tensor in base_saved:
        if tensor_value(tensor) is not None and tensor not in a.steady:
            by_root.setdefault(a.roots.get(tensor, tensor), set()).add(tensor)
    for root in sorted(by_root, key=a.position.__getitem__):
        if root not in saved_roots:
            yield root, by_root[root]


def unread_dropped(a: JointAnalysis, saved: set[fx.Node], base_saved: frozenset[fx.Node]) -> set[fx.Node]:
    """``saved`` without the tensors that neither the backward nor what it recomputes
    reads any more (saved only so that something now saved could be recomputed). Tensors
    of the unconstrained plan stay."""
    while True:
        unread = {t for t in unread_saved(a, saved) - base_saved if tensor_value(t) is not None}
        if not unread:
            return saved
        saved -= unread


__all__ = ["Estimates", "most_saved_first", "swaps", "undos", "unread_dropped", "unsaved_base_storages"]
