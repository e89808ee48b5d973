"""Per-segment checkpointing as a second start for the search, where the first finds no plan.

The greedy sequences start from torch's min-cut plan and recompute one saved storage at a
time. Per-block checkpointing is far from that start: it saves only each block's input and
recomputes the whole block in its backward, and no single move on the way lowers the peak
(a block's tensors free memory only once all of them are recomputed). So the search's
lowest plan for a ResNet (bottleneck blocks, BatchNorm; CPU, C++ kernels) measured 13.5 MiB
where eager per-block checkpointing measured 11.0; from this start, 11.7.

``segment_saved`` makes that plan from the graph alone. The forward's *narrow points* are
the tensors it computes whose storage is then the only one of the forward still to be read
(the residual stream between blocks, a ResNet block's output): cutting there splits the
forward into segments. Of each run of narrow points with no matmul, convolution or
attention between them (a norm, its activation, a pooling) the one with the fewest bytes
is a boundary. The plan saves the boundaries and, before the first and after the last (a
stem, a head), what the unconstrained plan saves; the backward recomputes each segment
from the boundary before it. What may never be recomputed (``JointAnalysis.ban``: random
ops, mutations) stays saved, and so do the forward's masks (``masks_kept``).

``segment_sequence`` is that plan and the greedy recompute moves from it; the solver also
walks the peak-ordered moves and the offload moves from it (``passes.solve.joint``,
``lowest_solution``), only where its own sequences found no plan within the budget (budget
0.0 asks for the lowest plan). The plan chosen is then the fastest of either that fits, or
the lower.

Limits: the narrow points are those of the graph as traced; a forward with fewer than two
segments between them (a U-Net's skip connections, a model reading one mask in every block,
keep two storages live everywhere between its ends) gets no second start. Every run's
boundary is one, not a chosen subset: checkpointing every other block is left to the moves
from it. The masks kept cost time on the CPU backend: the ResNet's plan ran 45.9 ms where
the model predicts 18.2 (28 ms with its masks recomputed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.fx as fx

from ..analyze import JointAnalysis, is_compute_intensive, tensor_value
from ..memory import recomputed_nodes
from .recompute import Prefix, Seconds, greedy_moves, prefixes


def narrow_points(a: JointAnalysis) -> list[fx.Node]:
    """The forward's narrow points, in order: forward nodes the outputs need after which the
    only storage of the forward still to be read (by the forward or the outputs) is their
    own. Parameters and inputs (``a.steady``) are not counted: they are always there."""
    _, order = a.fw_needed_by_outputs
    order = [n for n in order if n not in a.steady and tensor_value(n) is not None]
    position = {node: index for index, node in enumerate(order)}
    end = len(order)
    last_read = {}
    for index, node in enumerate(order):
        for arg in a.inputs[node]:
            if arg in position:
                last_read[arg] = index
    for output in a.fw_outputs:
        if output in position:
            last_read[output] = end
    live: dict[fx.Node, int] = {}  # storage root -> its nodes still to be read
    ending: dict[int, list[fx.Node]] = {}
    points = []
    for index, node in enumerate(order):
        if last_read.get(node, index) > index:
            root = a.roots.get(node, node)
            live[root] = live.get(root, 0) + 1
            ending.setdefault(last_read[node], []).append(node)
        for done in ending.pop(index, ()):
            root = a.roots.get(done, done)
            live[root] -= 1
            if not live[root]:
                del live[root]
        root = a.roots.get(node, node)
        if list(live) == [root] and a.bytes_of.get(root, 0) > 0 and node.op == "call_function":
            points.append(node)
    return points


def boundaries(a: JointAnalysis, points: Iterable[fx.Node]) -> list[fx.Node]:
    """One narrow point per run of them with no compute-intensive node between: the one of
    fewest bytes, the later on a tie."""
    _, order = a.fw_needed_by_outputs
    position = {node: index for index, node in enumerate(order)}
    points = sorted(points, key=position.__getitem__)
    heavy = [position[n] for n in order if is_compute_intensive(n)]
    chosen: list[fx.Node] = []
    run: list[fx.Node] = []
    for point in points:
        if run and any(position[run[-1]] < h <= position[point] for h in heavy):
            chosen.append(_smallest(a, run))
            run = []
        run.append(point)
    if run:
        chosen.append(_smallest(a, run))
    return chosen


def _smallest(a: JointAnalysis, run: list[fx.Node]) -> fx.Node:
    return min(reversed(run), key=a.storage_bytes)


def segment_saved(a: JointAnalysis, base_saved: Iterable[fx.Node]) -> list[fx.Node] | None:
    """What the forward saves with each segment between two ``boundaries`` recomputed in the
    backward from the boundary before it, as a ``checkpoint`` region around it would be: the
    boundaries, what ``base_saved`` saves outside the segments (before the first boundary,
    after the last), and whatever the recomputation would otherwise reach that may never be
    recomputed (``JointAnalysis.ban``). None with fewer than two segments (three boundaries):
    one segment is the whole forward recomputed, which the greedy's own moves reach."""
    cuts = boundaries(a, narrow_points(a))
    if len(cuts) < 3:
        return None
    _, order = a.fw_needed_by_outputs
    position = {node: index for index, node in enumerate(order)}
    first, last = position[cuts[0]], position[cuts[-1]]
    outside = [t for t in base_saved if not first < _place(a, a.roots.get(t, t), position) < last]
    saved = {*cuts, *outside}
    while True:  # (a tuple is reached only through its items, which are saved in its place)
        banned = [n for n in recomputed_nodes(a, saved) if n in a.ban and tensor_value(n) is not None]
        if not banned:
            return sorted(saved, key=a.position.__getitem__)
        saved.update(banned)


def masks_kept(a: JointAnalysis) -> JointAnalysis:
    """``a`` with the forward's masks (boolean values: a ReLU's ``x <= 0`` for its backward)
    banned from recomputation, for the plans made from per-segment checkpointing, which
    recompute whole blocks. A value recomputed in another fused kernel may differ from the
    forward's in its last bits; a mask recomputed from it then flips where the forward's
    input was that close to zero, and the gradient takes another path there. Found on a
    float32 ResNet (BatchNorm, then ReLU): one flipped element put the gradients 6e-4 off
    eager at the second step, 1.3e-4 off float64 where eager was 1.7e-7; with the masks
    saved from the forward, as eager recomputation makes them bit for bit, they agree. A
    mask costs one byte an element."""
    masks = {node: MASK for node in a.forward_side
             if node.op == "call_function" and node not in a.ban and _is_mask(node)}
    return dataclasses.replace(a, ban={**a.ban, **masks}) if masks else a


MASK = "a mask: recomputed, it may flip where the forward's input was within rounding of the threshold"


def _is_mask(node: fx.Node) -> bool:
    value = tensor_value(node)
    return value is not None and value.dtype == torch.bool


def _place(a: JointAnalysis, node: fx.Node, position: dict[fx.Node, int]) -> int:
    """``node``'s place in the forward: its own, or for a value the outputs do not need (a
    mask the backward reads) the latest place of what it is computed from; -1 for none."""
    if node in position:
        return position[node]
    places, stack, seen = [-1], [node], set()
    while stack:
        current = stack.pop()
        for arg in a.fw_inputs.get(current, ()):
            if arg in position:
                places.append(position[arg])
            elif arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return max(places)


def segment_sequence(a: JointAnalysis, base_saved: Iterable[fx.Node], seconds: Seconds) -> list[Prefix]:
    """The per-segment plan, then the plan after each greedy recompute move from it; empty
    where the forward has no segment or the plan is the unconstrained one. The plans carry
    the moves from the per-segment plan only: price them by their saved sets
    (``passes.solve.joint.Evaluator``), not by their moves."""
    base = frozenset(base_saved)
    saved = segment_saved(a, base)
    if saved is None or frozenset(saved) == base:
        return []
    start = Prefix(frozenset(saved), frozenset(), ())
    return [start, *prefixes(a, start, greedy_moves(a, saved, seconds))]
