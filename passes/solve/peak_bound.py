"""A lower bound of a plan's simulated peak, without simulating it.

Every storage the forward computes, the plan keeps on the device and the backward reads
(a backward node, or a node the plan recomputes: recomputation runs in the backward) is
alive when the backward starts: the forward allocated it and the backward has not read
it yet. So the peak the memory simulator
(``passes.memory.peak_bytes``) gives the plan is at least their bytes. The solver's
searches ask only whether a plan's peak fits a budget; where this bound does not fit,
the peak does not either, and the plan is not simulated (``passes.solve.search_sequence``).

Only storages the bound is sure of are counted: the storage of a saved tensor (not of a
view Inductor may copy, whose storage is then the copy, of other bytes), computed by
the forward (steady inputs are not counted by the simulator), not offloaded (its device
copy is freed during the forward), and read by a backward node or by a node the plan
recomputes (recomputation runs in the backward). Two such storages never share bytes:
an in-place write takes over a storage whose last read is the writing step, and these
are read after the forward.

The bound costs the plan's recomputed nodes (``passes.memory.recomputed_nodes``) and a
pass over its saved set: on deep-24/48 about a tenth of simulating the plan, and 76-98%
of its peak (``docs/design.md``, *Planning time*).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable

import torch.fx as fx

from ..analyze import JointAnalysis


def held_when_backward_starts(a: JointAnalysis, saved: Iterable[fx.Node], recomputed: Container[fx.Node],
                              offloaded: Container[fx.Node] = frozenset()) -> int:
    """Bytes of the saved storages alive when the backward starts, at least: a lower bound
    of the simulated peak of the plan saving ``saved``, recomputing ``recomputed``
    (``recomputed_nodes(a, saved)``) and offloading ``offloaded`` (see the module docstring)."""
    roots, readers, bytes_of = a.roots, a.bw_readers, a.bytes_of
    held = set()
    for tensor in saved:
        root = roots.get(tensor, tensor)
        if (root not in held and root not in offloaded and root not in a.steady and root.op == "call_function"
                and a.is_forward(root) and not _may_be_copied(a, tensor)
                and (tensor in readers or any(user in recomputed for user in tensor.users))):
            held.add(root)
    return sum(bytes_of.get(root, 0) for root in held)


def _may_be_copied(a: JointAnalysis, tensor: fx.Node) -> bool:
    """Whether ``tensor`` is, or views, a view Inductor may copy (``analyze.copy_decisions``):
    its storage is then the copy's, of other bytes."""
    while tensor is not None:
        if tensor in a.copy_candidates:
            return True
        tensor = a.alias_parent.get(tensor)
    return False


class PeakBound:
    """``held_when_backward_starts`` of the plans of one solve, each worked out once, and
    checked against every peak the solver simulates: once a bound comes out above a
    simulated peak (a graph these rules miss), it is 0 for the rest of the solve, so it
    rules out nothing. ``recomputed(saved)``: the plan's recomputed nodes (the caller's,
    which it keeps for the simulation)."""

    def __init__(self, a: JointAnalysis, recomputed: Callable[[frozenset[fx.Node]], Container[fx.Node]]) -> None:
        self.a, self.recomputed = a, recomputed
        self.bounds: dict[tuple[frozenset[fx.Node], frozenset[fx.Node]], int] = {}
        self.holds = True

    def __call__(self, saved: frozenset[fx.Node], offloaded: frozenset[fx.Node] = frozenset()) -> int:
        if not self.holds:
            return 0
        key = (saved, offloaded)
        if key not in self.bounds:
            self.bounds[key] = held_when_backward_starts(self.a, saved, self.recomputed(saved), offloaded)
        return self.bounds[key]

    def check(self, saved: frozenset[fx.Node], offloaded: frozenset[fx.Node], peak: int) -> None:
        """Record a simulated ``peak`` of the plan: one below its bound turns the bound off."""
        if self.holds and peak < self(saved, offloaded):
            self.holds = False
