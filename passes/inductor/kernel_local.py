"""The kernels Inductor fuses realized nodes into: which buffers vanish, and in what order they run.

The simulator (``passes.memory``) runs one step per FX node and gives every realized value a
buffer. Inductor's scheduler then fuses realized nodes into kernels, and two things follow
that the plan must know (measured on the contract's GPT-2 and Llama, CPU, torch 2.13,
2026-11-26):

- **Buffers that vanish.** Inductor realizes some pointwise values although every consumer
  could inline them: one read by several consumers whose body is costly to repeat
  (``analyze._realized_anyway``: a heavy op such as ``tanh`` on CPU, or many loads), and
  every random draw (``inductor_random``'s lowering calls ``realize()``). If the value and
  all its readers land in one kernel, the buffer is written and read inside it only, and
  code generation removes it (``Kernel.remove_kernel_local_buffers`` in
  ``torch/_inductor/codegen/common.py``, torch 2.11-2.14). The GPT-2's recomputed GELU
  ``tanh`` (512 KiB) and its dropouts' random draws (128-512 KiB) get no buffer in the
  generated code; the simulator gave each one and predicted its unconstrained step 0.41 MiB
  high.
- **Kernels run as one.** Inductor sorts fused kernels by their first member and then moves
  up whatever a later member waits for (``Scheduler.fuse_nodes_once``,
  ``topological_sort_schedule``). The Llama's recomputed SiLU and its derivative are one
  kernel: their six 352 KiB outputs are allocated together, after the input gradient's
  matmul the derivative waits for; the simulator ran them apart and predicted its 0.6 step
  0.24 MiB low once the vanishing buffers were counted.

``kernel_groups`` puts realized pointwise nodes, reductions (``var_mean`` too: two results
of one Welford loop, read through ``getitem``) and random draws of the same
number of elements into one kernel when one reads the other (through the values inlined
into it) or both read one buffer, each merge kept only if no member then waits on another
through a node outside the kernel (an extern matmul between them: the scheduler will not
fuse a node with something it waits for). What waits on the kernel is what reads its members
or a value computed from them; a value merely inlined into a member is computed again by each
of its readers, so its other readers do not wait for the kernel (measured on torch's own
0.5-budget plan of a 4-layer decoder, CPU bf16, 2026-11-26: each layer norm recomputed in the
backward is one kernel with its gradient's row sums, although the residual stream inlined
into it also feeds the attention's matmuls). A value is kernel-local when every reader is in its
kernel and pointwise over as many elements: a reduction reader runs its own loop nest on the
CPU and the value is stored between them, even inside one fused kernel (measured: a ``tanh``
read by a row sum and a product keeps its buffer). ``fused_kernel_order`` runs each kernel as
one in the backward's order.

On the CPU the kernel's loops must also line up (``passes.inductor.loop_ranges``: a pointwise node
joins a reduction's kernel only over the reduction's kept ranges followed by its reduced
ones): the GPT-2's attention-dropout draw, one flat range, keeps its buffer beside the
softmax backward's kernel. When ``fused_kernel_order`` finds a cycle, the kernel run apart
is the one the cycle is joined around (in at one member, out at another it does not lead to
inside the kernel), not one it merely passes through.

Under a memory budget Inductor's horizontal fusion may not run a kernel ahead of its place
(``compile_offload.inductor.plan_order_fusion``): ``kernel_groups`` names the parts of each kernel
(what its consumer-with-producer merges joined) and ``fused_kernel_order`` joins them only
where the later part waits for nothing placed after the earlier ones end.

Approximations: Inductor fuses pairs in the order of its scores, round after round; here
merges are tried in graph order, and a one-range node that Inductor first fuses with a
pointwise node of more ranges (and so re-shapes to them) is still kept out of a reduction's
kernel. Inductor's further limits (``max_fusion_size``, its peak-memory veto) are not
followed; in a joint graph the walk for a waiting member does not go from the forward side
into the backward (every backward value depends on the whole forward through the loss, but
the backward reads the forward's results from saved tensors), so a plan that recomputes an
extern op on such a path is not seen until ``fused_kernel_order`` meets the cycle. The budget loop's scheduled peak, read from the
kernels Inductor generated, sees what this misses.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from .. import compat
from .loop_ranges import fits_cpu_kernel, loop_ranges
from .node_kinds import fuses_into, is_pointwise, is_view, loads_inputs_in_loop, tensor_value


def is_random_draw(node: fx.Node) -> bool:
    """Inductor's random number op (put in place of the user's random ops by its joint-graph
    pass ``replace_random``), which its lowering realizes."""
    random = getattr(torch.ops.prims, "inductor_random", None)  # registered by torch._inductor
    return node.op == "call_function" and random is not None and node.target is random.default


def is_generated_kernel(node: fx.Node) -> bool:
    """A node Inductor lowers to a kernel it generates (pointwise, a reduction, a random
    draw, a scatter loading its values), not a call of an extern op (a matmul, attention,
    a fallback): the nodes a C++ call runs (``passes.memory.in_cpp_call``)."""
    return fuses_into(node) or loads_inputs_in_loop(node) or is_random_draw(node)


def has_tensor_outputs(node: fx.Node) -> bool:
    """Whether ``node`` returns a tuple of tensors (``var_mean``: Inductor lowers both
    results as one Welford reduction, its ``getitem`` users only name them)."""
    val = node.meta.get("val")
    return isinstance(val, (tuple, list)) and bool(val) and all(isinstance(v, torch.Tensor) for v in val)


def _names_output(node: fx.Node) -> bool:
    """A ``getitem`` of a node returning several tensors: no loop of its own."""
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and has_tensor_outputs(node.args[0]))


def realized_nodes(nodes: Iterable[fx.Node], inlined: frozenset[fx.Node]) -> list[fx.Node]:
    """The nodes that may share a kernel (``kernel_groups``' members): realized pointwise
    nodes, reductions (``var_mean`` too) and random draws, in the order given."""
    return [n for n in nodes if n.op == "call_function" and n not in inlined and not is_view(n)
            and (tensor_value(n) is not None or has_tensor_outputs(n)) and (fuses_into(n) or is_random_draw(n))]


def _numel(node: fx.Node) -> int | None:
    """Elements of ``node``'s value (a symbolic size by its hint: no guard is added)."""
    val = tensor_value(node)
    return None if val is None else math.prod(compat.size_hint(s) for s in val.shape)


def _group(value: fx.Node, inlined: frozenset[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]] | None:
    """The inlined chain from ``value`` (``inlined`` nodes and views) and its readers, or
    None when some reader would not let its buffer go: not pointwise over as many elements
    (a reduction, an extern op, the graph's output)."""
    size = _numel(value)
    chain: set[fx.Node] = set()
    readers: set[fx.Node] = set()
    stack = list(value.users)
    while stack:
        user = stack.pop()
        if user in chain or user in readers:
            continue
        if user in inlined or is_view(user):
            chain.add(user)
            stack.extend(user.users)
            continue
        # A reduction reader keeps the buffer on CPU: its loop nest is another than the
        # value's, and the value is stored between them even inside one fused kernel.
        if user.op != "call_function" or not is_pointwise(user) or _numel(user) != size:
            return None
        readers.add(user)
    return (chain, readers) if readers else None


def _reached_around(group: set[fx.Node], members: Iterable[fx.Node], position: dict[fx.Node, int],
                    forward: Callable[[fx.Node], bool], depth: dict[fx.Node, int]) -> bool:
    """Whether a node of ``group`` depends on another through a node outside it (a cycle
    the scheduler will not fuse). ``group``: the kernel's realized ``members`` with the
    values inlined into them. Walks from the consumers outside it of what the kernel
    computes (its members and the inlined values that read them: an inlined value that
    reads no member is computed again by each kernel that reads it, and its other readers
    do not wait for this one), up to the last group member's position (topological order:
    nothing later reaches back). From a ``forward``-side node only forward-side nodes are
    followed, up to the last forward-side member: the backward reads the forward's results
    from saved tensors. ``depth``: each node's longest path from the graph's inputs (a node
    reaches only deeper ones), which stops the walk below the deepest member it may reach:
    a kernel joining a weight's cast with the first layer's normalization otherwise walks
    the whole forward (a millisecond per merge, quadratic in depth over a stack)."""
    last = max(position[n] for n in group)
    last_forward = max((position[n] for n in group if forward(n)), default=-1)
    deepest = max(depth[n] for n in group)
    deepest_forward = max((depth[n] for n in group if forward(n)), default=-1)
    computed = set(members)
    for node in sorted(group - computed, key=position.__getitem__):
        if any(arg in computed for arg in node.all_input_nodes):
            computed.add(node)
    outside = [u for n in computed for u in n.users if u not in group]
    seen: set[fx.Node] = set()
    while outside:
        node = outside.pop()
        if node in seen:
            continue
        seen.add(node)
        bound, deeper = (last_forward, deepest_forward) if forward(node) else (last, deepest)
        if position.get(node, bound + 1) > bound or depth[node] >= deeper:
            continue
        for user in node.users:
            if forward(node) and not forward(user):
                continue
            if user in group:
                return True
            outside.append(user)
    return False


FUSION_DISTANCE = 64  # Inductor's limit on horizontal fusion, in scheduler nodes (torch 2.11-2.14)


@dataclass(frozen=True)
class KernelGroups:
    """Which realized nodes Inductor's scheduler runs as one kernel, as far as modelled."""

    kernels: tuple[frozenset[fx.Node], ...]  # each with the inlined values its members read through
    local: frozenset[fx.Node]  # realized values whose every reader is in their kernel: no buffer
    # Kernel -> its parts, where it joins more than one: each part put together from
    # producers and their consumers (vertical fusion), the parts joined only by the buffers
    # they read (horizontal fusion; ``_without_pulls``), each with its inlined values.
    parts: dict[frozenset[fx.Node], tuple[frozenset[fx.Node], ...]] = field(default_factory=dict)
    # The values no kernel stores (``inlined``, views): what waits on one waits on its inputs.
    inlined: frozenset[fx.Node] = frozenset()


def _size(node: fx.Node) -> int | None:
    """The elements a kernel iterates over to compute ``node``: its own, or a reduction's input's."""
    if is_pointwise(node) or is_random_draw(node):
        return _numel(node)
    return max((_numel(arg) or 0) for arg in node.all_input_nodes) if node.all_input_nodes else None


def kernel_groups(nodes: Iterable[fx.Node], inlined: frozenset[fx.Node], position: dict[fx.Node, int],
                  steady: Callable[[fx.Node], bool] = lambda node: False,
                  forward: Callable[[fx.Node], bool] = lambda node: False, cpu: bool = False) -> KernelGroups:
    """The kernels Inductor's scheduler fuses realized nodes into, and the values whose
    buffers it then removes (module docstring). Realized pointwise nodes, reductions and
    random draws iterating over as many elements are put together when one reads the other
    (through the values inlined into it) or both read the same buffer (not a graph input:
    parameters are shared by far-apart nodes), each merge kept only if no member then depends
    on another through a node outside the kernel (``_reached_around``). ``inlined``: the
    values Inductor inlines (``analyze.inlined_values``). ``forward(node)``: forward side of
    a joint graph (always False for one graph). ``cpu``: the C++ backend's kernels, whose
    loops must line up (``loop_ranges.fits_cpu_kernel``)."""
    nodes = list(nodes)
    realized = realized_nodes(nodes, inlined)
    is_realized = set(realized)
    size = {n: _size(n) for n in realized}
    loads: dict[fx.Node, list[fx.Node]] = {}
    through: dict[fx.Node, set[fx.Node]] = {}  # the inlined values and views a node reads through
    for node in realized:
        found, walked, stack = set(), set(), list(node.all_input_nodes)
        while stack:
            arg = stack.pop()
            if arg in walked:
                continue
            if arg in inlined or is_view(arg) or _names_output(arg):
                walked.add(arg)
                stack.extend(arg.all_input_nodes)
            else:
                found.add(arg)
        # in graph order: which merge is tried first decides between conflicting ones
        loads[node], through[node] = sorted(found, key=position.__getitem__), walked
    kernel_of = {n: frozenset((n,)) for n in realized}
    ranges = {n: loop_ranges(n, inlined) for n in realized} if cpu else {}
    depth: dict[fx.Node, int] = {}  # longest path from the inputs, for ``_reached_around``
    for node in sorted(position, key=position.__getitem__):
        depth[node] = 1 + max((depth.get(arg, 0) for arg in node.all_input_nodes), default=0)

    refused: set[frozenset[fx.Node]] = set()  # joins found to close a cycle: the same kernels again

    def merge(one: fx.Node, other: fx.Node) -> None:
        if kernel_of[one] is kernel_of[other] or size[one] != size[other] or size[one] is None:
            return
        joined = kernel_of[one] | kernel_of[other]
        if joined in refused or (cpu and not fits_cpu_kernel([ranges[n] for n in joined])):
            return
        with_chains = set(joined).union(*(through[n] for n in joined))
        if _reached_around(with_chains, joined, position, forward, depth):
            refused.add(joined)
            return
        for member in joined:
            kernel_of[member] = joined

    for node in realized:  # a consumer with its producer
        for arg in loads[node]:
            if arg in is_realized:
                merge(arg, node)
    vertical = dict(kernel_of)  # the parts: what the merges of nodes sharing a read join
    readers: dict[fx.Node, list[fx.Node]] = {}
    for node in realized:  # nodes reading one buffer
        for arg in loads[node]:
            if not steady(arg):
                readers.setdefault(arg, []).append(node)
    for group in readers.values():
        for one, other in zip(group, group[1:]):
            # Inductor fuses two nodes that only share a read when they are at most 64 nodes
            # apart (``Scheduler.are_long_distant_nodes``). Joint positions say how far apart
            # two backward nodes run; a forward-side node may run in the backward, recomputed
            # next to what reads it, wherever the joint graph has it.
            if not (forward(one) or forward(other)) and position[other] - position[one] > FUSION_DISTANCE:
                continue
            merge(one, other)
    kernels = {id(k): k for k in kernel_of.values() if len(k) > 1}
    with_chains = [kernel | _own_chains(kernel, through) for kernel in kernels.values()]
    parts = {}
    for kernel, whole in zip(kernels.values(), with_chains):
        joined = {id(vertical[member]): vertical[member] for member in kernel}
        if len(joined) > 1:
            parts[whole] = _parts_with_chains(list(joined.values()), whole, through, position)
    local = set()
    for value in realized:
        if not (is_pointwise(value) or is_random_draw(value)):
            continue  # a reduction's result is read by another loop nest: stored (measured on CPU)
        grouped = _group(value, inlined)
        if grouped is not None and grouped[1] <= kernel_of[value] and len(kernel_of[value]) > 1:
            local.add(value)
    return KernelGroups(tuple(with_chains), frozenset(local), parts,
                        frozenset(inlined).union(n for n in nodes if is_view(n) or _names_output(n)))


def _parts_with_chains(parts: list[frozenset[fx.Node]], kernel: frozenset[fx.Node],
                       through: dict[fx.Node, set[fx.Node]], position: dict[fx.Node, int]) -> tuple[frozenset[fx.Node], ...]:
    """``parts`` (realized members), each with the inlined values of ``kernel`` its members
    read through; one that several parts read goes with the first part (it runs with the
    first of the kernels that compute it)."""
    parts = sorted(parts, key=lambda part: min(map(position.__getitem__, part)))
    taken: set[fx.Node] = set()
    result = []
    for part in parts:
        chains = {value for member in part for value in through[member] if value in kernel} - taken
        taken |= chains
        result.append(part | chains)
    return tuple(result)


def _own_chains(kernel: frozenset[fx.Node], through: dict[fx.Node, set[fx.Node]]) -> set[fx.Node]:
    """The inlined values ``kernel``'s members read through that nothing outside it reads.
    A value inlined also into a node outside the kernel (the ``full`` of zeros that every
    layer's attention mask in the contract's GPT-2 reads) is computed again in that node's
    kernel: listed with this kernel, the outside node would wait for all of it, and plans
    that recompute the other layers would see cycles the scheduler does not have (measured:
    the GPT-2's minimum-memory plan measures 3.45 MiB when they are listed, 3.28 MiB when
    not, both as predicted)."""
    chains = set().union(*(through[n] for n in kernel))
    changed = True
    while changed:  # a value read by a dropped one is read from outside too
        inside = kernel | chains
        dropped = {value for value in chains if any(user not in inside for user in value.users)}
        chains -= dropped
        changed = bool(dropped)
    return chains


# Runs of kernels kept per graph (``fused_kernel_order``'s ``runs``) before the memo is emptied.
MAX_KEPT_RUNS = 100_000


def fused_kernel_order(order: list[fx.Node], groups: Iterable[Iterable[fx.Node]],
                       inputs: Callable[[fx.Node], Iterable[fx.Node]], cycles: dict | None = None,
                       runs: dict | None = None, split: bool = False,
                       parts: dict | None = None, inlined: frozenset[fx.Node] = frozenset()) -> list[fx.Node]:
    """``order`` with each group's nodes run together, as Inductor's scheduler runs a fused
    kernel: kernels are taken by their first member's place (it sorts fused nodes by their
    first member, ``min_order``), and what a kernel waits for is run just before it
    (``Scheduler.topological_sort_schedule``, a depth-first walk over what each node waits
    for). Measured on the contract's GPT-2: the recomputed GELU's kernel computes the GELU
    output for the weight gradient's matmul where the plan put it, and with it the GELU's
    derivative, which waits for the input gradient's matmul: that matmul runs earlier and
    its output lives longer. A group whose members wait on one another through a node
    outside it (a cycle: the scheduler would not have fused them) runs as separate nodes.
    Linear in the nodes and their inputs, and a walk per cycle met; ``cycles`` keeps which
    kernel each cycle runs apart, for the next order over the same graph.

    Nothing moves across the edge of a run of overlapping kernels (a kernel runs at its
    first member, and what it waits for lies before its last), so each run is ordered
    alone. ``runs`` keeps each run's order by its nodes and kernels: the solver orders the
    backward of hundreds of saved sets, and plans along a sequence differ in a few layers,
    so most runs come back unchanged (``tests/passes/test_plan_walks.py`` checks the result
    is the same).

    ``split`` (Triton's kernels): a cycle runs apart only the members that wait on it (the
    ones it leaves the kernel from, and what depends on them inside it); the rest stays one
    kernel, as Inductor fuses every pair that closes no cycle. Read from Inductor's CUDA
    kernels for torch's budget-0.0 plans (``benchmarks/cuda_schedule.py``): a recomputed
    layer norm and the backward's fp32 normalized input run as one kernel at the start of
    the backward, the norm's gradient reductions later, and the H100 peaks follow. Without
    it (the C++ backend's kernels, measured on the CPU contract) the whole kernel runs
    apart: the split predicts a transformer's minimum plan at 2.52 MiB where it measures 1.95.

    ``parts`` (``KernelGroups.parts``; ``inlined``: ``KernelGroups.inlined``): Inductor's
    horizontal fusion refuses to run a kernel ahead of its place
    (``compile_offload.inductor.plan_order_fusion``, under a memory budget), so the parts of a kernel
    that only share a read stay apart where joining them would (``_without_pulls``)."""
    groups = list(groups)
    if not groups:
        return order
    position = dict(zip(order, range(len(order))))
    kernels = []
    with_parts: list[tuple[int, tuple[frozenset[fx.Node], ...]]] = []  # (index in kernels, its parts)
    taken: set[fx.Node] = set()  # a value inlined into two kernels' nodes runs with the first
    present_in_order, at = position.__contains__, position.__getitem__  # C callables: a frame per node was most of it
    for group in groups:
        members = group if taken.isdisjoint(group) else [n for n in group if n not in taken]
        present = _from_first_realized(tuple(sorted(filter(present_in_order, members), key=at)), inlined)
        if len(present) > 1:
            if parts and group in parts:
                with_parts.append((len(kernels), parts[group]))
            kernels.append(present)
            taken.update(present)
    if with_parts:
        kernels = [kernel for kernel in (_from_first_realized(kernel, inlined) for kernel in
                                         _without_pulls(kernels, with_parts, position, inputs, inlined))
                   if len(kernel) > 1]
    cycles = {} if cycles is None else cycles
    if runs is None:
        return _as_kernels(order, kernels, inputs, position, cycles, split)
    if len(runs) > MAX_KEPT_RUNS:
        runs.clear()
    kernels.sort(key=lambda kernel: position[kernel[0]])
    result: list[fx.Node] = []
    copied = 0  # order[:copied] is in ``result``
    first = 0
    while first < len(kernels):
        start, end = position[kernels[first][0]], position[kernels[first][-1]]
        last = first + 1
        while last < len(kernels) and position[kernels[last][0]] <= end:
            end = max(end, position[kernels[last][-1]])
            last += 1
        result.extend(order[copied:start])
        nodes, run_kernels = tuple(order[start:end + 1]), tuple(kernels[first:last])
        key = (nodes, run_kernels)
        ordered = runs.get(key)
        if ordered is None:
            # Positions within the run: what it reads from before it has run, as in the whole order.
            ordered = runs[key] = _as_kernels(list(nodes), list(run_kernels), inputs,
                                              {node: index for index, node in enumerate(nodes)}, cycles, split)
        result.extend(ordered)
        copied, first = end + 1, last
    result.extend(order[copied:])
    return result


def _from_first_realized(kernel: tuple[fx.Node, ...], inlined: frozenset[fx.Node]) -> tuple[fx.Node, ...]:
    """``kernel`` (in order) from its first realized member on: a kernel runs where its
    first scheduler node is (``min_order``), and an inlined value has none; placed before
    it, the value runs where the order has it (it allocates nothing; its readers read its
    inputs). Kept, it ran the kernel early: a recomputed SiLU's gradient kernel, whose
    first inlined product reads the recomputed up projection, ran before two matmuls the
    graph and Inductor put first (a gated MLP on Triton's kernels, 2026-11-28)."""
    for index, node in enumerate(kernel):
        if node not in inlined:
            return kernel[index:]
    return ()


def _without_pulls(kernels: list[tuple[fx.Node, ...]], with_parts: list[tuple[int, tuple[frozenset[fx.Node], ...]]],
                   position: dict[fx.Node, int], inputs: Callable[[fx.Node], Iterable[fx.Node]],
                   inlined: frozenset[fx.Node]) -> list[tuple[fx.Node, ...]]:
    """``kernels`` with each of ``with_parts`` (index, parts) joined as Inductor's scheduler
    joins the parts when a horizontal fusion may not pull a kernel ahead
    (``compile_offload.inductor.plan_order_fusion``): in the order of their first members, each part
    joins the first kernel made so far that it would not pull, else starts one. A part
    pulls when it waits, outside itself, for a node the order has after that kernel's last
    member that is neither inlined nor in a kernel starting by then (the scheduler orders a
    fused kernel by its first member, ``min_order``, and runs what it waits for before it).
    Members and ends are the scheduler's nodes: the realized ones. The inlined values a
    kernel computes are no node of their own (a recomputed sigmoid that two gradients
    read sits where the graph has it, after the first gradient; counted, it made the
    first's kernel end late enough for the second to join it); a part of such values alone
    runs with the first kernel."""
    def realized(nodes) -> list[fx.Node]:
        return [n for n in nodes if n not in inlined]

    start: dict[fx.Node, int] = {}
    for kernel in kernels:
        first = position[(realized(kernel) or kernel)[0]]
        for member in kernel:
            start[member] = first
    result = list(kernels)
    for index, parts in with_parts:
        present = set(kernels[index])
        ordered = [tuple(sorted((n for n in part if n in present), key=position.__getitem__)) for part in parts]
        values_only = [n for part in ordered if not realized(part) for n in part]
        ordered = sorted((part for part in ordered if realized(part)), key=lambda part: position[realized(part)[0]])
        joined: list[list[fx.Node]] = []
        for part in ordered:
            for kernel in joined:
                if not _pulls(part, position[realized(kernel)[-1]], position, inputs, inlined, start):
                    kernel.extend(part)
                    kernel.sort(key=position.__getitem__)
                    break
            else:
                joined.append(list(part))
        if len(joined) > 1:
            joined[0] = sorted(joined[0] + values_only, key=position.__getitem__)
            result[index] = ()
            result.extend(tuple(kernel) for kernel in joined if len(kernel) > 1)
    return [kernel for kernel in result if kernel]


def _pulls(part: tuple[fx.Node, ...], end: int, position: dict[fx.Node, int],
           inputs: Callable[[fx.Node], Iterable[fx.Node]], inlined: frozenset[fx.Node],
           start: dict[fx.Node, int]) -> bool:
    """Whether ``part`` waits for a node placed after ``end`` that would have to run ahead
    (``_without_pulls``). Walks up from its inputs through nodes after ``end`` only (the
    order is topological: nothing before ``end`` depends on one after it)."""
    own = set(part)
    stack = [arg for member in part for arg in inputs(member) if arg not in own]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        at = position.get(node)
        if at is None or at <= end or node in seen or node in own:
            continue
        seen.add(node)
        if node in inlined or start.get(node, end + 1) <= end:
            stack.extend(inputs(node))  # no kernel of its own, or one placed by then: what it waits for
            continue
        return True
    return False


class _Cycle(Exception):
    def __init__(self, kernel: tuple[fx.Node, ...], key: tuple) -> None:
        self.kernel, self.key = kernel, key  # ``key``: the cycle, as ``cycles`` keeps it


def _run_apart(kernel_of: dict, kernel: tuple[fx.Node, ...], waiting: frozenset[fx.Node], split: bool) -> None:
    """Take ``kernel`` out of ``kernel_of``; with ``split``, its members not ``waiting`` on
    the cycle stay one kernel, where that kernel is smaller than each of theirs was.

    Otherwise the whole kernel runs apart: a "rest" no smaller than its members' kernels
    changes nothing (or grows one back), so the walk would meet the same cycle again, for
    ever. Met on an unrolled GRU planned for Triton's kernels (``allow_rnn``): a kernel the
    cycle was kept for had been split already, nothing of it waited on the cycle, and the
    planner hung."""
    before = {member: kernel_of.pop(member, None) for member in kernel}
    rest = tuple(member for member in kernel if member not in waiting) if split else ()
    if len(rest) < 2:
        return
    kernels_before = {before[member] for member in rest}  # each distinct kernel once
    if None not in kernels_before and all(len(k) > len(rest) and set(rest) <= set(k) for k in kernels_before):
        for member in rest:
            kernel_of[member] = rest


def _as_kernels(order: list[fx.Node], kernels: list[tuple[fx.Node, ...]],
                inputs: Callable[[fx.Node], Iterable[fx.Node]], position: dict[fx.Node, int],
                cycles: dict, split: bool = False) -> list[fx.Node]:
    kernel_of = {node: kernel for kernel in kernels for node in kernel}
    result: list[fx.Node] = []
    emitted: set[fx.Node] = set()
    for node in order:
        if node in emitted:
            continue
        if node not in kernel_of:
            # Nothing moves later than the order has it (a kernel runs at its first member,
            # what it waits for is moved up), so what this node reads has run.
            result.append(node)
            emitted.add(node)
            continue
        while node not in emitted:
            mark = len(result)
            try:
                _emit(kernel_of.get(node, (node,)), kernel_of, inputs, position, result, emitted, cycles, split)
            except _Cycle as cycle:  # undo this walk, run that kernel's nodes apart, walk again
                emitted.difference_update(result[mark:])
                del result[mark:]
                _run_apart(kernel_of, cycle.kernel, cycles[cycle.key][1], split)
    return result


def _emit(start: tuple[fx.Node, ...], kernel_of: dict, inputs, position: dict[fx.Node, int],
          result: list[fx.Node], emitted: set[fx.Node], cycles: dict, split: bool = False) -> None:
    """Append ``start`` to ``result``, what it waits for first (depth first, earliest first).

    A cycle runs a kernel apart (its members leave ``kernel_of``) and the walk goes back to
    where that kernel was first pushed: up to there it never met the kernel, so walking
    again from ``start`` would repeat it step for step. (Walking again from ``start`` made
    a backward whose recomputed layer norms close a cycle per layer quadratic in depth.)
    ``_Cycle`` is raised only when the kernel is ``start`` itself."""
    stack = [start]
    waiting: set[fx.Node] = set()  # first members of the units whose inputs are on the stack
    expanded: list[fx.Node] = []  # ``waiting`` in the order it was filled
    # Kernel (first member) -> the walk's state before the expansion that first pushed it:
    # (len(expanded), len(result), len(stack)).
    pushed_by: dict[fx.Node, tuple[int, int, int]] = {}
    unit_of = kernel_of.get
    while stack:
        unit = stack[-1]
        if unit[0] in emitted:
            stack.pop()
            continue
        if unit[0] not in waiting:
            before = (len(expanded), len(result), len(stack))
            waiting.add(unit[0])
            expanded.append(unit[0])
            needed = {}
            for member in unit:
                for arg in inputs(member):
                    if arg in position and arg not in emitted:
                        other = unit_of(arg)
                        if other is None:
                            needed[arg] = (arg,)
                        elif other is not unit:
                            needed[other[0]] = other
            if not needed:
                continue
            for first in (sorted(needed, key=position.__getitem__, reverse=True) if len(needed) > 1 else needed):
                if first in waiting:  # the units on the walk from ``first`` to here wait for themselves
                    path = [u for u in stack if u[0] in waiting]
                    cycle = tuple(path[[u[0] for u in path].index(first):])
                    if cycle not in cycles:  # the answer depends on the cycle's units alone
                        cycles[cycle] = _joined_around(list(cycle), inputs)
                    kernel, waiting_on_it = cycles[cycle]
                    if kernel is None:
                        raise AssertionError("fused_kernel_order: the order given is not topological")
                    if kernel[0] not in pushed_by:
                        raise _Cycle(kernel, cycle)
                    _run_apart(kernel_of, kernel, waiting_on_it, split)
                    n_expanded, n_result, n_stack = pushed_by[kernel[0]]
                    waiting.difference_update(expanded[n_expanded:])
                    del expanded[n_expanded:]
                    emitted.difference_update(result[n_result:])
                    del result[n_result:]
                    del stack[n_stack:]
                    pushed_by = {k: v for k, v in pushed_by.items() if v[0] < n_expanded}
                    break
                stack.append(needed[first])
                if len(needed[first]) > 1 and first not in pushed_by:
                    pushed_by[first] = before
            continue
        stack.pop()
        result.extend(unit)
        emitted.update(unit)


def _joined_around(cycle: list[tuple[fx.Node, ...]], inputs) -> tuple[tuple[fx.Node, ...] | None, frozenset[fx.Node]]:
    """The kernel of a cycle of units (each waits for the next, the last for the first)
    that Inductor would not have fused: the cycle leaves it from a member that waits for
    the next unit and comes back into a member the previous unit waits for, and no path
    inside the kernel leads from the one to the other, so the path runs through nodes
    outside it (the scheduler's "intermediate nodes between node1 & node2"). A kernel the
    cycle only passes through, in at a member and out at one that depends on it, is
    sound. Measured on the contract's GPT-2: a layer-norm kernel joining the forward's
    normalization, recomputed in the backward, with its gradient's reductions closes a
    cycle through the attention kernel of the same layer, which Inductor fuses. With it,
    the members that wait on the cycle: those it leaves from and what depends on them
    inside the kernel (all of them where no kernel is found so)."""
    for index, unit in enumerate(cycle):
        if len(unit) == 1:
            continue
        members = set(unit)
        after, before = cycle[(index + 1) % len(cycle)], cycle[index - 1]
        leaving = [m for m in unit if any(arg in after for arg in inputs(m))]  # wait for the next unit
        entered = {arg for m in before for arg in inputs(m) if arg in members}  # waited for by the previous one
        reached, stack = set(leaving), list(leaving)
        while stack:  # members that depend on a leaving member, inside the kernel
            for user in stack.pop().users:
                if user in members and user not in reached:
                    reached.add(user)
                    stack.append(user)
        if not (entered & reached):
            return unit, frozenset(reached)
    unit = next((unit for unit in cycle if len(unit) > 1), None)
    return unit, frozenset(unit or ())
