"""Memory simulator: peak bytes and a timeline of live bytes over forward then backward.

A *program* is the sequence of steps one training step executes (forward nodes, then
backward nodes including recomputed and reloaded tensors). Each step allocates storages
and reads storages; a storage is freed right after its last reader, unless it must outlive
the step (user outputs, gradients). Parameters and inputs are steady state and never
counted. Views and aliases share their base's storage, so it is counted once.

``plan_program`` builds the program of the joint graph under a plan (what the solver
evaluates); the tests hold it against the program of the partitioned graphs as written
(``tests/graphs_program.py``).

``fusion=False`` models the graphs run as written (the eager inner compiler): every node's
output is a buffer. ``fusion=True`` models Inductor, which fuses a pointwise op into its
pointwise or reduction consumers (through views) unless its store-or-inline rule realizes
it (``analyze.fusable_nodes``): such an op allocates no buffer, and its consumers read its
inputs instead (which keeps those alive until the consumers run).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Container, Hashable, Iterable
from dataclasses import dataclass, field
from itertools import accumulate

import torch.fx as fx

from . import compat
from .analyze import (JointAnalysis, copy_candidates, copy_decisions, fusable_nodes, inlined_values, is_convolution,
                      is_pointwise, is_view, storage_roots, tensor_value, with_view_bases)
from .inductor.kernel_local import fused_kernel_order, kernel_groups
from .inductor.loop_ranges import cpu_graph
from .inductor.node_kinds import loads_inputs_in_loop


# Slots, no instance dict: the solver's passes read every step of each plan it simulates, and
# at 48 deep layers a program's steps with their dicts no longer stayed in the CPU cache
# between two simulations (design.md, "Planning time").
@dataclass(slots=True)
class Step:
    label: str
    allocates: list[tuple[Hashable, int]] = field(default_factory=list)
    reads: list[Hashable] = field(default_factory=list)
    kind: str = "compute"  # compute | recompute | offload | reload
    # Reads whose storage the step's one allocation may take over when the step is their
    # last reader (Inductor's in-place reuse, ``in_place_candidates``), first match wins.
    in_place: tuple[Hashable, ...] = ()
    # Its allocation is a buffer an ``ir.Scatter`` writes into (``index_put``, ``scatter``:
    # ``node_kinds.loads_inputs_in_loop``): Inductor's wrapper hands it on to no later buffer
    # inside a C++ call (``_reused_in_calls``), nor does a reader write into it in place.
    scattered: bool = False
    _storages: frozenset[Hashable] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def storages(self) -> frozenset[Hashable]:
        """Every key the step reads or allocates. Steps are kept across the plans a solve
        simulates (``StepBuilder``) and never edited, so this is worked out once per step,
        not once per plan (``_renamed`` asks it of every backward step of a plan)."""
        storages = self._storages
        if storages is None:
            storages = self._storages = frozenset(self.reads).union(key for key, _ in self.allocates)
        return storages


@dataclass
class Program:
    steps: list[Step]
    backward_start: int  # index of the first backward step
    outlives: set[Hashable]  # storages alive after the step (outputs, gradients)
    # Triton's kernels: the fused kernel each step runs in and its part there, (kernel,
    # part), or None for a kernel of its own. A storage the backward allocates is then
    # written in place by its last reader even where earlier kernels read it too, though
    # not where another part of its own kernel does (``_take_in_place``). None: the C++
    # kernels' rule.
    kernel_of_step: tuple[tuple[int, int] | None, ...] | None = None
    # The C++ kernels' calls: each step -> the last step of the call it runs in (itself
    # outside one). Inductor's C++ backend emits the kernels between two extern ops as one
    # call, allocating every buffer before it and freeing after it what its kernels read
    # last (``Scheduler._codegen`` flushes only before an extern op or a template): a
    # storage read last inside a call lives to the call's end (``cpp_call_ends``). None:
    # each storage is freed after its last reader (Triton's kernels, a partitioned graph).
    call_end: tuple[int, ...] | None = None


@dataclass
class Timeline:
    peak_bytes: int
    peak_index: int
    live_bytes: list[int]  # live bytes while each step runs (its inputs and outputs alive)
    labels: list[str]
    kinds: list[str]
    backward_start: int
    # What stays allocated between the forward's last step and the backward's first (the
    # saved tensors and the forward's outputs): every order of the two graphs' steps holds it.
    held_at_backward_start: int = 0
    # What is still allocated after the last step (what the step returns: the gradients, the
    # forward's outputs): every order of the steps holds it at the end.
    held_at_end: int = 0

    @property
    def peak_label(self) -> str:
        return self.labels[self.peak_index] if self.labels else ""


def simulate(program: Program) -> Timeline:
    """Live bytes of ``program``, step by step; the peak is the largest."""
    frees_after, storage_of = _frees_after(program)
    size: dict[Hashable, int] = {}
    live = 0
    live_bytes, labels, kinds = [], [], []
    held = 0
    for index, step in enumerate(program.steps):
        for key, nbytes in step.allocates:
            key = storage_of.get(key, key)
            if key not in size:
                size[key] = nbytes
                live += nbytes
        live_bytes.append(live)
        labels.append(step.label)
        kinds.append(step.kind)
        for key in frees_after.get(index, ()):
            live -= size.pop(key, 0)
        if index == program.backward_start - 1:
            held = live
    peak = max(live_bytes, default=0)
    return Timeline(peak, live_bytes.index(peak) if live_bytes else 0, live_bytes, labels, kinds, program.backward_start,
                    held, live)


def live_at(program: Program, index: int) -> dict[Hashable, tuple[int, str]]:
    """The storages alive while step ``index`` of ``program`` runs -> (their bytes, the label
    of the step that allocated them): the terms ``simulate`` sums there (``live_bytes[index]``).
    For reading a peak against a measurement, not for the solver's loops."""
    frees_after, storage_of = _frees_after(program)
    alive: dict[Hashable, tuple[int, str]] = {}
    for position, step in enumerate(program.steps[: index + 1]):
        for key, nbytes in step.allocates:
            alive.setdefault(storage_of.get(key, key), (nbytes, step.label))
        if position < index:
            for key in frees_after.get(position, ()):
                alive.pop(key, None)
    return alive


def _frees_after(program: Program) -> tuple[dict[int, list[Hashable]], dict[Hashable, Hashable]]:
    """Step index -> the storages freed right after it: each after its last reader (or its
    first allocation when nothing reads it), except those that outlive the step; and the
    allocations written in place into another storage (``_in_place_storages``), which live
    as long as the last reader of either."""
    last_read: dict[Hashable, int] = {}
    for index, step in enumerate(program.steps):
        for key, _ in step.allocates:
            if key not in last_read:
                last_read[key] = index
        for key in step.reads:
            last_read[key] = index
    storage_of = _in_place_storages(program, last_read)
    if program.call_end is not None:
        first_size: dict[Hashable, tuple[int, int]] = {}
        for index, step in enumerate(program.steps):
            for key, nbytes in step.allocates:
                first_size.setdefault(key, (index, nbytes))
        storage_of = _reused_in_calls(program, last_read, storage_of, first_size)
    if storage_of:
        physical_last: dict[Hashable, int] = {}
        for key, index in last_read.items():
            physical = storage_of.get(key, key)
            physical_last[physical] = max(index, physical_last.get(physical, index))
        last_read = physical_last
        outlives = {storage_of.get(key, key) for key in program.outlives}
    else:
        outlives = program.outlives
    if program.call_end is not None:  # after the in-place choice, which follows the kernels' order
        call_end = program.call_end
        last_read = {key: call_end[index] for key, index in last_read.items()}
    frees_after: dict[int, list[Hashable]] = {}
    for key, index in last_read.items():
        if key not in outlives:
            if index in frees_after:
                frees_after[index].append(key)
            else:
                frees_after[index] = [key]
    return frees_after, storage_of


def peak_bytes(program: Program) -> int:
    """``simulate(program).peak_bytes`` without building the timeline: the solver simulates
    hundreds of plans of thousands of steps and reads only their peaks.

    The same result as ``simulate``'s walk (``tests/passes/test_memory.py`` pins the two
    together on random programs, odd ones included), in fewer passes over the steps: one
    gathers what ``_frees_after`` and ``_in_place_storages`` read (last readers, first
    sizes, backward readers, the steps that may write in place), and the live bytes are
    then a running sum of changes at the allocations and after the frees, not a walk
    over every step with a dict of sizes."""
    steps = program.steps
    backward_start = program.backward_start
    last_read: dict[Hashable, int] = {}
    first_size: dict[Hashable, tuple[int, int]] = {}  # key -> (index, bytes) of its first allocation
    readers: dict[Hashable, int] = {}  # reads by allocating backward steps (``_in_place_storages``)
    allocations: list[tuple[int, Hashable, int]] = []
    writes_in_place: list[int] = []
    for index, step in enumerate(steps):
        allocates = step.allocates
        if allocates:
            for key, nbytes in allocates:
                if key not in last_read:
                    last_read[key] = index
                if key not in first_size:
                    first_size[key] = (index, nbytes)
                allocations.append((index, key, nbytes))
            if index >= backward_start:
                for key in step.reads:
                    last_read[key] = index
                    readers[key] = readers.get(key, 0) + 1
            else:
                for key in step.reads:
                    last_read[key] = index
            if step.in_place and len(allocates) == 1:
                writes_in_place.append(index)
        else:
            for key in step.reads:
                last_read[key] = index
    outlives = program.outlives
    storage_of = _take_in_place(steps, writes_in_place, last_read, readers, first_size, outlives,
                                _SharedReads(program, writes_in_place) if program.kernel_of_step is not None else None)
    if program.call_end is not None:
        storage_of = _reused_in_calls(program, last_read, storage_of, first_size)
    if storage_of:  # ``_frees_after``: a storage lives until the last read of any key written into it
        physical_last: dict[Hashable, int] = {}
        for key, index in last_read.items():
            physical = storage_of.get(key, key)
            physical_last[physical] = max(index, physical_last.get(physical, index))
        last_read = physical_last
        outlives = {storage_of.get(key, key) for key in outlives}
    if program.call_end is not None:  # ``_frees_after``: a storage read in a call lives to its end
        call_end = program.call_end
        last_read = {key: call_end[index] for key, index in last_read.items()}
    # ``simulate`` adds a storage's bytes at an allocation when it is not live and takes
    # them off after its last read when it is: so its first allocation adds them until
    # then (for good when that read came before it, or the storage outlives the step),
    # and the first allocation after that read adds them again for good.
    change = [0] * (len(steps) + 1)
    freed_after: dict[Hashable, int | None] = {}  # storage -> its last read, None once live for good
    for index, key, nbytes in allocations:
        if storage_of:
            key = storage_of.get(key, key)
        if key not in freed_after:
            change[index] += nbytes
            last = last_read[key]
            if last >= index and key not in outlives:
                change[last + 1] -= nbytes
                freed_after[key] = last
            else:
                freed_after[key] = None
        else:
            last = freed_after[key]
            if last is not None and index > last:
                change[index] += nbytes
                freed_after[key] = None
    change.pop()
    return max(0, max(accumulate(change), default=0))


def _in_place_storages(program: Program, last_read: dict[Hashable, int]) -> dict[Hashable, Hashable]:
    """Allocation key -> the storage it takes over in place: a step's one allocation goes
    into the first of its ``in_place`` reads that the step reads last (no later step reads
    the storage, through any key already written into it) and that outlives nothing, of
    the same size. What Inductor's ``decide_inplace_update`` does for a kernel's output."""
    steps = program.steps
    writers = [index for index, step in enumerate(steps) if step.in_place and len(step.allocates) == 1]
    if not writers:
        return {}
    readers: dict[Hashable, int] = {}
    for step in steps[program.backward_start:]:
        if step.allocates:  # views and fused values: their consumers' steps read the data
            for key in step.reads:
                readers[key] = readers.get(key, 0) + 1
    first_size: dict[Hashable, tuple[int, int]] = {}
    for index, step in enumerate(steps):
        for key, nbytes in step.allocates:
            first_size.setdefault(key, (index, nbytes))
    return _take_in_place(steps, writers, last_read, readers, first_size, program.outlives,
                          _SharedReads(program, writers) if program.kernel_of_step is not None else None)


class _SharedReads:
    """What Triton's in-place rule reads (``Program.kernel_of_step``): the reads by
    allocating backward steps of the writers' candidates, per key and kernel and per key,
    kernel and part; counted at the first question (most programs ask none)."""

    def __init__(self, program: Program, writers: list[int]) -> None:
        self.program, self.writers = program, writers
        self.kernel_of_step: tuple[tuple[int, int] | None, ...] = program.kernel_of_step or ()
        self._readers: dict[tuple, int] | None = None

    def _count(self) -> dict[tuple, int]:
        steps, kernel_of_step = self.program.steps, self.kernel_of_step
        wanted = {key for index in self.writers for key in steps[index].in_place}
        counts: dict[tuple, int] = {}
        for index in range(self.program.backward_start, len(steps)):
            kernel_and_part, step = kernel_of_step[index], steps[index]
            if kernel_and_part is None or not step.allocates:
                continue
            for key in wanted.intersection(step.reads):
                counts[key, kernel_and_part[0]] = counts.get((key, kernel_and_part[0]), 0) + 1
                counts[key, kernel_and_part] = counts.get((key, kernel_and_part), 0) + 1
        return counts

    def allow(self, candidate: Hashable, first_allocated: int, index: int) -> bool:
        """Whether the step at ``index``, the last reader of ``candidate`` (first allocated
        at ``first_allocated``), may write into it though other steps read it: a storage
        the backward allocates, read in the writer's kernel by its own part alone (a part
        is a producer and its consumers: their reads have run when the writer runs, as
        Inductor counts an ancestor's use; another part's have not)."""
        if first_allocated < self.program.backward_start:
            return False  # a saved tensor: one reader only, as on the CPU
        kernel_and_part = self.kernel_of_step[index]
        if kernel_and_part is None:
            return True
        if self._readers is None:
            self._readers = self._count()
        readers = self._readers
        return readers.get((candidate, kernel_and_part[0]), 0) == readers.get((candidate, kernel_and_part), 0)


def _take_in_place(steps: list[Step], writers: list[int], last_read: dict[Hashable, int],
                   readers: dict[Hashable, int], first_size: dict[Hashable, tuple[int, int]],
                   outlives: Container[Hashable], shared: _SharedReads | None = None) -> dict[Hashable, Hashable]:
    """The in-place rule of ``_in_place_storages`` (and ``peak_bytes``, which gathers its
    inputs in its own pass): ``writers``, the steps with ``in_place`` candidates and one
    allocation, in order; ``readers``, reads per key by allocating backward steps;
    ``first_size``, each key's first allocation (step, bytes).

    Only a storage read by this one step is taken over: a kernel that reads it at more
    than one index (a reduction and a pointwise loop of the same fused kernel: measured,
    the Llama's saved RMSNorm inputs and MLP activations, each read by several backward
    steps, are never overwritten) cannot write into it, and which of several readers
    Inductor fuses together is not known here. With ``shared`` (Triton's kernels,
    ``Program.kernel_of_step``), a storage the backward allocates is taken over by its
    last reader whatever earlier kernels read it, as Inductor's ``decide_inplace_update``
    counts only the uses not yet run; not where a step of another part of the reader's
    own kernel reads it (a sibling, whose use has not run either: the gradients of a SiLU
    gate and of its up projection, one kernel, both read the gradient from above and
    neither writes into it; ``_SharedReads.allow``). Read from Inductor's CUDA kernels on fake tensors (torch 2.11, 2026-11-28): the
    Llama's recomputed up projection (352 KiB) is overwritten by the gate's gradient in
    the kernel that last reads it, although the recomputed SiLU product read it first;
    the planner put its minimum plan 11.5% over those kernels, and exactly on them with
    this rule. The C++ kernels of the same model do not (the CPU contract's Llama
    measured 12% over a plan made with it), so the CPU keeps the one-reader rule."""
    storage_of: dict[Hashable, Hashable] = {}
    last_of_storage: dict[Hashable, int] = {}
    for index in writers:
        step = steps[index]
        key, nbytes = step.allocates[0]
        if key in storage_of:
            continue
        for candidate in step.in_place:
            physical = storage_of.get(candidate, candidate)
            last = max(last_read.get(candidate, -1), last_of_storage.get(physical, -1))
            size = first_size.get(physical)  # its size as of this step: allocated by now
            if (last == index and physical not in outlives and candidate not in outlives
                    and (readers.get(candidate) == 1
                         or (shared is not None and size is not None and shared.allow(candidate, size[0], index)))):
                if size is not None and size[0] <= index and size[1] == nbytes:
                    storage_of[key] = physical
                    last_of_storage[physical] = max(last, last_read.get(key, index))
                    break
    return storage_of


def _reused_in_calls(program: Program, last_read: dict[Hashable, int], storage_of: dict[Hashable, Hashable],
                     first_size: dict[Hashable, tuple[int, int]]) -> dict[Hashable, Hashable]:
    """``storage_of`` (the in-place choices) with the C++ calls' buffer reuse added: inside
    a call (``Program.call_end``) a kernel's new buffer takes the storage of a buffer of the
    same bytes that an earlier kernel of the call read last, as the wrapper's memory plan
    does in kernel order (``AllocateLine.plan``: a freed buffer of the same reuse key),
    though the call frees nothing until it returns. Only storages the same graph allocated
    (not the backward's saved inputs) and that outlive nothing are reused. ``first_size``:
    each key's first allocation, (step, bytes).

    The wrapper takes a freed buffer only where that does not raise its own estimate of the
    graph's peak (``AllocateLine.should_reuse_buffer``): by the next kernel always, by a
    later one only if the bytes its estimate has live in between, plus the buffer, stay
    within that peak; the buffer then counts as live there for the next decision
    (``EfficientPeakEstimate``, which frees each buffer after its last reader and knows
    nothing of the calls: ``_wrapper_estimate``). Read from Inductor's code for the mixture
    of experts' backward under a budget (torch 2.13): one call whose six 128 KiB weight
    products and gradients, all live at the graph's estimated peak, reuse nothing, where
    taking every freed buffer put the plan 37% under that code."""
    call_end, steps, outlives = program.call_end, program.steps, program.outlives
    storage_of = dict(storage_of)
    # Physical storage -> the last step reading it through any key mapped to it.
    physical_last: dict[Hashable, int] = {}
    for key, index in last_read.items():
        physical = storage_of.get(key, key)
        physical_last[physical] = max(index, physical_last.get(physical, index))
    backward_start = program.backward_start
    estimate = _wrapper_estimate(program, physical_last, storage_of, first_size)
    peak_of = (max(estimate[:backward_start], default=0), max(estimate[backward_start:], default=0))
    start = 0
    while start < len(steps):
        end = call_end[start]
        if end == start:
            start += 1
            continue
        graph_start = backward_start if start >= backward_start else 0
        pool: dict[int, list[Hashable]] = {}  # bytes -> storages free for reuse
        entering: dict[int, list[tuple[int, Hashable]]] = {}  # step -> (bytes, storage) freed after it
        for index in range(start, end + 1):
            for key, nbytes in steps[index].allocates:
                if first_size[key][0] != index or key in storage_of or key in outlives:
                    continue  # not a new buffer, or one written in place
                free = pool.get(nbytes)
                physical = _reusable(free, index, nbytes, steps, estimate, peak_of[index >= backward_start],
                                     physical_last) if free else None
                if physical is not None:
                    free.pop()
                    storage_of[key] = physical
                    last = max(physical_last.get(physical, index), last_read.get(key, index))
                    physical_last[physical] = last
                    if last < end:
                        entering.setdefault(last, []).append((nbytes, physical))
                elif not steps[index].scattered:
                    last = last_read.get(key, index)
                    if last < end:
                        entering.setdefault(last, []).append((nbytes, key))
            # Storages allocated by this graph before the call and read last here enter the pool too.
            for key in steps[index].reads:
                physical = storage_of.get(key, key)
                first = first_size.get(physical)
                if (first is not None and graph_start <= first[0] < start and index < end
                        and physical_last.get(physical) == index and physical not in outlives
                        and not steps[first[0]].scattered):
                    entering.setdefault(index, []).append((first[1], physical))
            for nbytes, physical in entering.pop(index, ()):
                if physical_last.get(physical, -1) <= index:
                    pool.setdefault(nbytes, []).append(physical)
        start = end + 1
    return storage_of


def _wrapper_estimate(program: Program, physical_last: dict[Hashable, int], storage_of: dict[Hashable, Hashable],
                      first_size: dict[Hashable, tuple[int, int]]) -> list[int]:
    """Live bytes at each step as Inductor's wrapper estimates them before it plans its
    reuses (``EfficientPeakEstimate``): each storage (after the in-place choices) from its
    first allocation to its last reader, or to its graph's end where it outlives the step."""
    steps, backward_start = program.steps, program.backward_start
    change = [0] * (len(steps) + 1)
    outlives = {storage_of.get(key, key) for key in program.outlives}
    for physical, (first, nbytes) in first_size.items():
        if not nbytes or storage_of.get(physical, physical) is not physical:
            continue  # written into another storage: counted with it
        end = len(steps) - 1 if first >= backward_start else backward_start - 1
        last = end if physical in outlives else physical_last.get(physical, first)
        change[first] += nbytes
        change[max(first, last) + 1] -= nbytes
    change.pop()
    return list(accumulate(change))


def _reusable(free: list[Hashable], index: int, nbytes: int, steps: list[Step], estimate: list[int], peak: int,
              physical_last: dict[Hashable, int]) -> Hashable | None:
    """The latest of the freed storages ``free`` (the wrapper's pool is a stack), where the
    wrapper hands it to the buffer allocated at step ``index`` (``_reused_in_calls``),
    counting it live in between in ``estimate``; None where it keeps it for later."""
    physical = free[-1]
    last = physical_last.get(physical, index)
    between = range(last + 1, index)
    if any(steps[i].allocates for i in between):  # not the next kernel: only under the estimated peak
        if nbytes + max(estimate[i] for i in between) > peak:
            return None
        for i in between:
            estimate[i] += nbytes
    return physical


def layout_copy_key(node: fx.Node) -> Hashable:
    """The storage of Inductor's channels-last copy of steady ``node`` (``analyze.layout_copies``)."""
    return ("channels-last", node)


def fused_nodes(nodes: Iterable[fx.Node], kept: set[fx.Node]) -> set[fx.Node]:
    """Pointwise nodes Inductor fuses into all their consumers (no buffer of their own)."""
    kept = with_view_bases(kept)
    return {n for n in fusable_nodes(nodes) if n not in kept}


def _backward_fusion(graph: fx.Graph) -> tuple[set[fx.Node], dict[fx.Node, fx.Node]]:
    """A backward graph's fused nodes and storage roots under Inductor, with the views it
    copies (``analyze.copy_decisions``; no backward value is kept past its graph but the
    gradients, which the output consumes and so are never inlined)."""
    fusable = fusable_nodes(graph.nodes, lambda node: True)
    copies, fused = copy_decisions(copy_candidates(graph.nodes, fusable), set(fusable), _inlined_loads)
    return fused | _kernel_local(graph, fusable), storage_roots(graph, copies)


def _kernel_local(graph: fx.Graph, fusable: frozenset[fx.Node]) -> frozenset[fx.Node]:
    """A partitioned graph's values Inductor keeps inside one kernel (``passes.inductor.kernel_local``);
    ``fusable``: its ``fusable_nodes``."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    inlined = inlined_values(graph.nodes, fusable)
    return kernel_groups(graph.nodes, inlined, position, lambda node: node.op == "placeholder",
                         cpu=cpu_graph(graph.nodes)).local


def _is_host_copy(node: fx.Node) -> bool:
    """An offload's result lives in host memory (see ``passes.offload``)."""
    return node.meta.get("offload", {}).get("role") == "offload"


def _all_input_nodes(node: fx.Node) -> list[fx.Node]:
    return node.all_input_nodes


def _reads(node: fx.Node, key, fused: set[fx.Node], skip, inputs=_all_input_nodes,
           memo: dict | None = None) -> list[Hashable]:
    """Keys ``node``'s step reads; a fused input is replaced by what it reads. ``memo``
    (one per ``fused`` and ``skip``) keeps each fused node's expansion across calls."""
    args = inputs(node)
    if not fused or not any(arg in fused for arg in args):  # the common case, kept fast
        return [key(arg) for arg in args if not skip(arg)]
    memo = {} if memo is None else memo
    read: dict[fx.Node, None] = {}
    for arg in args:
        if skip(arg):
            continue
        if arg in fused:
            read.update(dict.fromkeys(_fused_reads(arg, fused, skip, inputs, memo)))
        else:
            read[arg] = None
    return [key(arg) for arg in read]


def _fused_reads(node: fx.Node, fused: set[fx.Node], skip, inputs, memo: dict) -> tuple[fx.Node, ...]:
    """The unfused nodes a fused ``node`` reads, through other fused nodes."""
    stack = [node]
    while stack:  # post-order without recursion: fused chains can be long
        current = stack[-1]
        pending = [arg for arg in inputs(current) if arg in fused and arg not in memo and not skip(arg)]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        if current in memo:
            continue
        read: dict[fx.Node, None] = {}
        for arg in inputs(current):
            if skip(arg):
                continue
            if arg in fused:
                read.update(dict.fromkeys(memo[arg]))
            else:
                read[arg] = None
        memo[current] = tuple(read)
    return memo[node]


def _inlined_loads(node: fx.Node, fused: set[fx.Node]) -> tuple[fx.Node, ...]:
    """What ``node``'s body loads with the ``fused`` values inlined into it (for
    ``analyze.copy_decisions``, whose ``fused`` changes as it decides: no memo kept)."""
    return _fused_reads(node, fused, lambda arg: False, _all_input_nodes, {})


def _layout_fixed_by(user: fx.Node) -> bool:
    """A consumer for which Inductor lays its input out its own way (channels-last for the
    CPU's mkldnn convolution, ``GraphLowering.run_node``): the value is then not written at
    the index its inputs are read at, so not in place (measured on conv+BN: the loss
    gradient feeding ``convolution_backward`` gets a fresh channels-last buffer)."""
    return is_convolution(user)


def in_place_candidates(node: fx.Node, nbytes: int, key, fused, skip, inputs, memo: dict,
                        storage_bytes, is_saved: Callable[[Hashable], bool]) -> tuple[Hashable, ...]:
    """The reads whose storage ``node``'s output may take over in place, as Inductor's
    ``Scheduler.decide_inplace_update`` does when the node is their last user: the node is a
    pointwise op Inductor generates (not an extern call), the read is a buffer of the same
    dtype and the same storage size (``can_match_buffer_size``), read directly or through
    the inlined values the node fuses (the kernel reads it at the node's own index). Graph
    inputs (``skip``: parameters, user inputs) are never overwritten; saved tensors are, in
    the backward (AOTAutograd donates them); the callers keep only those (reuse into other
    buffers is not modelled: design.md, "Memory simulator"). Empty when Inductor would not
    (``compat.inductor_writes_in_place``); without saved tensors (``is_saved(key)``) where
    AOTAutograd does not donate them (``compat.inductor_overwrites_saved``). A view that
    allocates (``nbytes``) is one Inductor copies (``analyze.copy_decisions``): its copy is
    a pointwise kernel too."""
    if not ((is_pointwise(node) or is_view(node)) and compat.inductor_writes_in_place()):
        return ()
    donated = compat.inductor_overwrites_saved()
    out = tensor_value(node)
    if out is None or any(_layout_fixed_by(user) for user in node.users):
        return ()
    found: dict[Hashable, None] = {}
    for arg in inputs(node):
        if skip(arg):
            continue
        for read in (_fused_reads(arg, fused, skip, inputs, memo) if arg in fused else (arg,)):
            val = tensor_value(read)
            if loads_inputs_in_loop(read):
                continue  # a buffer an ``ir.Scatter`` mutated: its reader writes a new one
            if val is not None and val.dtype == out.dtype and storage_bytes(read) == nbytes:
                read_key = key(read)
                if donated or not is_saved(read_key):
                    found[read_key] = None
    return tuple(found)


# --- programs from the joint graph and a plan --------------------------------------------


def forward_nodes_needed(a: JointAnalysis, saved: Iterable[fx.Node]) -> list[fx.Node]:
    """Forward nodes that must run to produce the user outputs and the saved tensors.

    What the outputs need is the same for every saved set (``a.fw_needed_by_outputs``) and
    closed under inputs, so only what the saved tensors need beyond it is walked: in a
    training step nearly every saved tensor feeds the loss, and that walk is empty."""
    by_outputs, in_order = a.fw_needed_by_outputs
    needed: set[fx.Node] = set()  # beyond ``by_outputs``
    stack = [node for node in saved if node not in by_outputs]
    fw_inputs, forward_side = a.fw_inputs, a.forward_side  # ``a.is_forward``, without a call per node
    while stack:
        node = stack.pop()
        if node in needed or node in by_outputs or node not in forward_side:
            continue
        needed.add(node)
        stack.extend(fw_inputs[node])
    if not needed:
        return list(in_order)
    return [n for n in a.fw_nodes if n in by_outputs or n in needed]


def recomputed_nodes(a: JointAnalysis, saved: set[fx.Node]) -> set[fx.Node]:
    """Forward nodes the backward needs but the forward does not save: they are recomputed."""
    recomputed: set[fx.Node] = set()
    stack = list(a.bw_reads)  # the forward-side inputs of the backward nodes
    fw_inputs, steady = a.fw_inputs, a.steady
    while stack:
        node = stack.pop()
        if node in saved or node in recomputed or node in steady:
            continue
        recomputed.add(node)
        stack.extend(fw_inputs[node])
    return recomputed


def backward_order(a: JointAnalysis, recomputed: set[fx.Node]) -> list[fx.Node]:
    """Backward nodes in joint order, each recomputed node placed right before its first
    backward user (how ``passes.schedule.sink_recomputation`` orders the real graph):
    ``just_in_time_order(a.bw_nodes, recomputed, a.inputs.__getitem__)``, then each kernel
    Inductor fuses run as one (``kernel_local.fused_kernel_order``).

    Only the backward nodes that read a recomputed node can have one placed before them
    (``a.bw_readers``), so the backward is copied in slices between those; the order is
    the same (``tests/passes/test_plan_walks.py``)."""
    bw = a.bw_nodes
    readers = sorted({i for node in recomputed for i in a.bw_readers.get(node, ())})
    if not readers:
        return _as_kernels(a, list(bw))
    fw_inputs = a.fw_inputs
    order: list[fx.Node] = []
    emitted: set[fx.Node] = set()
    expanded: set[fx.Node] = set()  # nodes whose pending inputs were pushed above them
    copied = 0  # bw[:copied] are in ``order``
    for index in readers:
        node = bw[index]
        for arg in fw_inputs[node]:
            if arg in recomputed and arg not in emitted:
                if copied < index:
                    order.extend(bw[copied:index])
                    copied = index
                # ``emit_after_inputs(arg, recomputed, emitted, fw_inputs.__getitem__, order)``
                # inline (a call per recomputed input was a tenth of a deep solve). A node
                # on top again after its pending inputs were pushed has them all emitted
                # (the graph is acyclic), so it is emitted without listing them again.
                stack = [arg]
                while stack:
                    current = stack[-1]
                    if current in emitted:
                        stack.pop()
                    elif current in expanded:
                        stack.pop()
                        emitted.add(current)
                        order.append(current)
                    else:
                        pending = [x for x in fw_inputs[current] if x in recomputed and x not in emitted]
                        if pending:
                            expanded.add(current)
                            pending.reverse()  # the first input on top: emitted first
                            stack.extend(pending)
                        else:
                            stack.pop()
                            emitted.add(current)
                            order.append(current)
    order.extend(bw[copied:])
    return _as_kernels(a, order)


def _as_kernels(a: JointAnalysis, order: list[fx.Node]) -> list[fx.Node]:
    """``order`` with the nodes Inductor fuses into one kernel run as one (``a.kernels``)."""
    return (fused_kernel_order(order, a.kernels, a.inputs.__getitem__, a.kernel_cycles, a.kernel_runs,
                               split=a.triton_kernels, parts=None if a.fusion_pulls else a.kernel_parts,
                               inlined=a.kernel_inlined)
            if a.kernels else order)


@dataclass(frozen=True)
class PlanNodes:
    """The nodes a step runs under a saved set: derived from the saved set alone, so every
    plan with that saved set shares them, whatever it offloads."""

    forward: list[fx.Node]  # ``forward_nodes_needed``
    recomputed: set[fx.Node]  # ``recomputed_nodes``
    backward: list[fx.Node]  # ``backward_order``: recomputation just in time


def plan_nodes(a: JointAnalysis, saved: set[fx.Node], recomputed: set[fx.Node] | None = None) -> PlanNodes:
    """The nodes the step runs when the forward saves ``saved``; ``recomputed``:
    ``recomputed_nodes(a, saved)``, when the caller has it."""
    recomputed = recomputed_nodes(a, saved) if recomputed is None else recomputed
    return PlanNodes(forward_nodes_needed(a, saved), recomputed, backward_order(a, recomputed))


@dataclass(frozen=True)
class ComputeSteps:
    """A saved set's program without copies: the step of each node the forward and the
    backward run (None for steady-state nodes, which allocate nothing). What offloading
    changes is added by ``plan_program``: copy steps, and reloaded storages' keys."""

    forward: list[tuple[fx.Node, Step | None]]
    backward: list[tuple[fx.Node, Step | None]]


def compute_steps(a: JointAnalysis, saved: set[fx.Node], fusion: bool = False,
                  nodes: PlanNodes | None = None) -> ComputeSteps:
    """The steps of the nodes run when the forward saves ``saved`` and keeps all of it on
    the device. ``nodes``: ``plan_nodes(a, saved)``, when the caller has it."""
    return StepBuilder(a, fusion)(saved, nodes or plan_nodes(a, saved))


class StepBuilder:
    """``compute_steps`` for one saved set after another, keeping each node's step until
    the fate of a node it depends on changes.

    A node's step depends only on whether a few nodes are saved or recomputed: whether it
    and the pointwise nodes it may read through are fused (a saved node keeps its
    buffer), and which storage each tensor it reads resolves to (the view chains of what
    it reads: saved, recomputed or neither). Consecutive plans of a greedy sequence
    differ by one move, so most steps carry over; the solver simulates hundreds of plans
    of thousands of nodes each."""

    def __init__(self, a: JointAnalysis, fusion: bool) -> None:
        self.a, self.fusion = a, fusion
        self.saved: frozenset[fx.Node] = frozenset()
        self.recomputed: frozenset[fx.Node] = frozenset()
        self.fused: frozenset[fx.Node] = frozenset()
        self.copies: frozenset[fx.Node] = frozenset()  # the views Inductor copies (``analyze.copy_decisions``)
        self._copy_of = _views_of_copies(a)
        self.forward_steps: dict[fx.Node, Step | None] = {}
        self.backward_steps: dict[fx.Node, Step | None] = {}
        self.memo: dict[fx.Node, tuple[fx.Node, ...]] = {}  # fused node -> what it reads
        self._dependents: dict[fx.Node, list[fx.Node]] | None = None
        self._last: tuple[frozenset[fx.Node], PlanNodes, ComputeSteps] | None = None  # the last call's

    def __call__(self, saved: Iterable[fx.Node], nodes: PlanNodes) -> ComputeSteps:
        saved = frozenset(saved)
        if self._last is not None and self._last[1] is nodes and self._last[0] == saved:
            # Plans that only offload differently follow one another along a mixed
            # sequence: the same saved set and nodes give the same steps (never edited).
            return self._last[2]
        self._move_to(saved, frozenset(nodes.recomputed))
        kept_forward, kept_backward = self.forward_steps, self.backward_steps  # most nodes: a lookup
        for node in [node for node in nodes.forward if node not in kept_forward]:
            self._forward_step(node)
        for node in [node for node in nodes.backward if node not in kept_backward]:
            self._backward_step(node)
        # Every step is kept now: pair them through C callables, not a frame per node.
        computed = ComputeSteps(list(zip(nodes.forward, map(kept_forward.__getitem__, nodes.forward))),
                                list(zip(nodes.backward, map(kept_backward.__getitem__, nodes.backward))))
        self._last = (saved, nodes, computed)
        return computed

    def _move_to(self, saved: frozenset[fx.Node], recomputed: frozenset[fx.Node]) -> None:
        """Forget the steps that depend on a node whose fate differs from the last plan's."""
        kept = with_view_bases(saved | set(self.a.fw_outputs) | set(self.a.bw_outputs))
        fused = self.a.fusable - kept if self.fusion else frozenset()
        copies = self.copies
        if self.a.copy_candidates and self.fusion:
            # Which views Inductor copies, and which values it then realizes instead of
            # inlining (``analyze.copy_decisions``): they depend on what else is inlined.
            copies, realized = copy_decisions(self.a.copy_candidates, set(fused), _inlined_loads)
            fused = frozenset(realized)
        if self.fusion:
            fused |= self.a.kernel_local - kept
        if self.forward_steps or self.backward_steps:
            changed = (saved ^ self.saved) | (recomputed ^ self.recomputed)
            for view in copies ^ self.copies:  # the view's storage, and its value's
                changed |= {view, self.a.copy_candidates[view]}
            dependents = self.dependents()
            for node in changed:
                for dependent in dependents.get(node, ()):
                    self.forward_steps.pop(dependent, None)
                    self.backward_steps.pop(dependent, None)
        self.saved, self.recomputed, self.copies = saved, recomputed, copies
        self.fused = fused
        self.memo = {}

    def dependents(self) -> dict[fx.Node, list[fx.Node]]:
        """Node -> the nodes whose steps depend on its fate (``step_dependencies``)."""
        if self._dependents is None:
            self._dependents = {}
            for node in self.a.position:
                for dependency in step_dependencies(self.a, node, self.fusion):
                    self._dependents.setdefault(dependency, []).append(node)
        return self._dependents

    def _forward_step(self, node: fx.Node) -> Step | None:
        if node not in self.forward_steps:
            self.forward_steps[node] = None if node in self.a.steady else self._step(node, self._root)
        return self.forward_steps[node]

    def _backward_step(self, node: fx.Node) -> Step | None:
        if node not in self.backward_steps:
            step = None
            if node not in self.a.steady:
                kind = "recompute" if node in self.recomputed else "compute"
                step = self._step(node, self._backward_key, kind)
            self.backward_steps[node] = step
        return self.backward_steps[node]

    def _step(self, node: fx.Node, key, kind: str = "compute") -> Step:
        a = self.a
        if node in self.copies:
            nbytes = a.copy_bytes[node]
        else:
            nbytes = 0 if node in self.fused else a.bytes_of.get(node, 0)
        allocates = [(key(node), nbytes)] if nbytes else []
        allocates += self._held_while_running(node, key)
        reads = self._op_reads(node, key)
        parent = _tuple_op(node)
        if parent is not None:
            # A tuple-returning op allocates every output (its getitems' steps) while its
            # inputs, and what it holds while it runs, are held: those steps read them too.
            # Else an input whose last use is the op was freed before the outputs appeared
            # (an attention backward's three gradients, 0.375 MiB of a Llama's 3.63 MiB peak
            # on CUDA).
            reads += self._op_reads(parent, key)
            reads += [held for held, _ in self._held_while_running(parent, key)]
        in_place = ()
        if nbytes and self.fusion and key == self._backward_key:
            in_place = in_place_candidates(node, nbytes, key, self.fused, a.steady.__contains__,
                                           a.inputs.__getitem__, self.memo, a.storage_bytes, self._is_saved_key)
        return Step(node.name, allocates, reads, kind=kind, in_place=in_place,
                    scattered=bool(nbytes) and loads_inputs_in_loop(node))

    def _held_while_running(self, node: fx.Node, key) -> list[tuple[Hashable, int]]:
        """The storages ``node``'s op holds while it runs beyond its outputs, with their
        bytes: its workspace (``workspace_key``) and, where this plan has the graph compute
        its broadcast attention bias, Inductor's whole copy of it (``bias_copy_key``)."""
        held = []
        if node in self.a.workspace_bytes:
            held.append((workspace_key(node), self.a.workspace_bytes[node]))
        if self._copies_bias(node, key):
            held.append((bias_copy_key(node), self.a.bias_copies[node][1]))
        return held

    def _copies_bias(self, node: fx.Node, key) -> bool:
        """Whether Inductor copies ``node``'s broadcast attention bias whole
        (``analyze.bias_copies``): where the graph running ``node`` computes the bias's
        base, rather than receiving it (a primal input; in the backward, a saved tensor or
        a view of one)."""
        if node not in self.a.bias_copies:
            return False
        current = self.a.bias_copies[node][0]
        while True:
            if key == self._backward_key and current in self.saved:
                return False
            parent = self.a.alias_parent[current]
            if parent is None:
                return current not in self.a.steady
            current = parent

    def _op_reads(self, node: fx.Node, key) -> list[Hashable]:
        """The storages ``node``'s step reads: its inputs' (through what is fused), and a
        convolution's channels-last copies of steady inputs."""
        a = self.a
        reads = _reads(node, key, self.fused, a.steady.__contains__, a.inputs.__getitem__, self.memo)
        if a.layout_copies and is_convolution(node):
            reads += [layout_copy_key(arg) for arg in a.inputs[node] if arg in a.layout_copies]
        return reads

    def _root(self, node: fx.Node) -> Hashable:
        copy = self._copy_of.get(node)
        if copy is not None and copy in self.copies:
            return copy
        return self.a.roots.get(node, node)

    def _is_saved_key(self, key: Hashable) -> bool:
        """A backward read of a forward storage (``_backward_key`` of a saved tensor); a
        recomputed one is keyed ``("recomputed", node)``."""
        return isinstance(key, fx.Node) and key in self.a.forward_side

    def _backward_key(self, node: fx.Node) -> Hashable:
        # Walk the view chain towards the storage: a saved tensor (or a view of one) reads
        # the forward's storage even when its base is also recomputed for other users.
        current = node
        while True:
            if current in self.saved:
                return self.a.roots.get(current, current)
            if current in self.copies:  # a backward value's copy: its own storage
                return current
            parent = self.a.alias_parent[current]
            if parent is None:
                return ("recomputed", current) if current in self.recomputed else current
            current = parent


def workspace_key(node: fx.Node) -> Hashable:
    """The storage of what ``node`` holds while it runs (``JointAnalysis.workspace_bytes``):
    allocated by its step and read by its outputs' steps, so it lives until the last of
    them (the measured peak of the op is its outputs and this, together)."""
    return ("workspace", node.name)


def bias_copy_key(node: fx.Node) -> Hashable:
    """The storage of Inductor's whole copy of attention kernel ``node``'s broadcast bias
    (``analyze.bias_copies``): allocated by its step and read by its outputs' steps, as a
    workspace is."""
    return ("bias copy", node.name)


def _views_of_copies(a: JointAnalysis) -> dict[fx.Node, fx.Node]:
    """Each view Inductor may copy (``a.copy_candidates``), and each view of it, to that
    view: their storage is the copy's when it is made."""
    found = {}
    for view in a.copy_candidates:
        stack = [view]
        while stack:
            current = stack.pop()
            if current not in found:
                found[current] = view
                stack.extend(user for user in current.users if is_view(user))
    return found


def step_dependencies(a: JointAnalysis, node: fx.Node, fusion: bool) -> set[fx.Node]:
    """The nodes whose fate (saved or not, recomputed or not) ``node``'s step reads: with
    fusion, the fusable nodes it may read through (``fused`` is ``a.fusable`` less the
    saved ones), and the view chains of the node and of everything those read, which
    ``StepBuilder._backward_key`` walks."""
    through = {node}
    if fusion:
        stack = [node]
        while stack:
            for arg in a.inputs[stack.pop()]:
                if (arg in a.fusable or arg in a.kernel_local) and arg not in through:
                    through.add(arg)
                    stack.append(arg)
    # A view of a fused node that becomes kept keeps the node's buffer (``with_view_bases``).
    stack = [user for n in through for user in n.users if is_view(user)] if fusion else []
    dependencies = set(through)
    while stack:
        view = stack.pop()
        if view not in dependencies:
            dependencies.add(view)
            stack.extend(user for user in view.users if is_view(user))
    for current in [node, *(arg for n in through for arg in a.inputs[n])]:
        while current is not None:
            dependencies.add(current)
            current = a.alias_parent[current]
    parent = _tuple_op(node)
    if parent is not None:  # its step reads what the op reads (StepBuilder._step)
        dependencies |= step_dependencies(a, parent, fusion)
    return dependencies


def _tuple_op(node: fx.Node) -> fx.Node | None:
    """The tuple-returning op a ``getitem`` node takes one output of (not a view op's:
    those outputs are views, allocated by nobody); None for any other node."""
    parent = node.args[0] if node.op == "call_function" and node.target is operator.getitem else None
    if isinstance(parent, fx.Node) and parent.op == "call_function" and not is_view(parent):
        return parent
    return None


def plan_program(
    a: JointAnalysis,
    saved: set[fx.Node],
    offloaded: set[fx.Node] = frozenset(),
    prefetch_distance: int = 1,
    fusion: bool = False,
    reload_distance: dict[fx.Node, int] | None = None,
    offload_wait_after: dict[fx.Node, fx.Node] | None = None,
    nodes: PlanNodes | None = None,
    computed: ComputeSteps | None = None,
    first_uses: dict[fx.Node, int] | None = None,
    first_uses_of: Container[fx.Node] = (),
) -> Program:
    """The program the partitioned graphs run when the forward saves ``saved`` (of which
    ``offloaded`` go to host memory) and the backward recomputes the rest. Each reload
    starts ``reload_distance[tensor]`` backward steps before its first use (default
    ``prefetch_distance``). The forward waits for an offload after its last forward use,
    or after forward node ``offload_wait_after[tensor]`` (a later one): the device copy
    stays alive until then. ``nodes`` (``plan_nodes``) and ``computed``
    (``compute_steps``, with the same ``fusion``): what the caller already has for ``saved``.
    ``first_uses``: each tensor of ``first_uses_of`` (those looked for) -> the index in
    ``computed.backward`` of the first step whose inputs' storages include it, for tensors
    the backward reads (``transfer.first_backward_uses``; the solver keeps it per saved
    set), so the backward is not walked for the reloads' first uses."""
    computed = computed or compute_steps(a, saved, fusion, nodes)
    root = a.roots.get
    waits_after: dict[fx.Node, list[fx.Node]] = {}
    for tensor, anchor in (offload_wait_after or {}).items():
        if tensor in offloaded:
            waits_after.setdefault(anchor, []).append(tensor)
    # Inductor's channels-last copies of steady convolution inputs, made when the forward starts.
    steps: list[Step] = [Step("channels-last copies", [(layout_copy_key(n), nbytes) for n, nbytes in a.layout_copies.items()])
                         ] if a.layout_copies else []
    cpp_calls = a.fusion and not a.triton_kernels  # C++ kernels: a call's frees wait for its end
    forward_kinds: list[bool | None] = [False] * len(steps)  # ``in_cpp_call`` of each forward step
    if not offloaded and not waits_after:  # recompute-only plans: the steps as they are
        steps += [step for _, step in computed.forward if step is not None]
        if cpp_calls:
            generated = a.generated_kernels
            forward_kinds += [in_cpp_call(node, step, generated) for node, step in computed.forward if step is not None]
    else:
        copied = offloaded | waits_after.keys()  # the nodes a copy step follows
        for node, step in computed.forward:
            if step is not None:
                steps.append(step)
                forward_kinds.append(cpp_calls and in_cpp_call(node, step, a.generated_kernels))
            if node in copied:
                if step is not None and node in offloaded:
                    steps.append(Step(f"offload {node.name}", [], [root(node, node)], kind="offload"))
                    forward_kinds.append(False)
                for tensor in waits_after.get(node, ()):
                    steps.append(Step(f"wait_offload {tensor.name}", [], [root(tensor, tensor)], kind="offload"))
                    forward_kinds.append(False)
    backward_start = len(steps)
    # What the backward reads: the kept saved tensors' storages, reloaded copies of the
    # offloaded ones (only storage-owning tensors are offloaded) and recomputed tensors.
    kept_roots = {root(s, s) for s in saved if s not in offloaded} if offloaded else ()
    reloaded = {s: ("reload", s) for s in offloaded if s not in kept_roots}
    kernel_index = a.kernel_index if a.triton_kernels else None
    if not reloaded:  # nothing renamed, no reload step
        steps += [step for _, step in computed.backward if step is not None]
        outlives = {root(n, n) for n in a.fw_outputs} | {root(n, n) for n in a.bw_outputs}
        kernels = None if kernel_index is None else (
            (None,) * backward_start + _kernel_runs([kernel_index.get(n) for n, step in computed.backward
                                                     if step is not None]))
        calls = None
        if cpp_calls:
            generated = a.generated_kernels
            calls = cpp_call_ends(forward_kinds + [in_cpp_call(n, step, generated) for n, step in computed.backward
                                                   if step is not None], backward_start)
        return Program(steps, backward_start, outlives, kernels, calls)
    input_roots = a.input_roots  # the roots of ``a.inputs[node]``, each once
    first_use: dict[fx.Node, int] = {}
    if first_uses is not None and all(t in first_uses_of for t in reloaded):
        # The walk below, read off the caller's table: in the order the walk meets them
        # (first use, then the order the user reads them in).
        backward = computed.backward
        met = sorted((t for t in reloaded if t in first_uses),
                     key=lambda t: (first_uses[t], input_roots[backward[first_uses[t]][0]].index(t)))
        first_use = {t: first_uses[t] for t in met}
    else:
        for index, (node, _) in enumerate(computed.backward):
            for base in input_roots[node]:
                if base in reloaded:
                    first_use.setdefault(base, index)
    reload_at: dict[int, list[fx.Node]] = {}
    for node, index in first_use.items():
        distance = (reload_distance or {}).get(node, prefetch_distance)
        reload_at.setdefault(max(0, index - distance), []).append(node)
    untouched = reloaded.keys().isdisjoint  # ``_renamed``'s test, inline: most steps read no reloaded key
    kernels: list[tuple[int, int] | None] | None = None if kernel_index is None else [None] * backward_start
    kinds = forward_kinds
    for index, (node, step) in enumerate(computed.backward):
        if index in reload_at:
            for tensor in reload_at[index]:
                steps.append(Step(f"reload {tensor.name}", [(reloaded[tensor], a.bytes_of.get(tensor, 0))],
                                  kind="reload"))
                kinds.append(False)
                if kernels is not None:
                    kernels.append(None)
        if step is not None:
            steps.append(step if untouched(step.storages) else _renamed(step, reloaded))
            kinds.append(cpp_calls and in_cpp_call(node, step, a.generated_kernels))
            if kernels is not None:
                kernels.append(kernel_index.get(node))
    outlives = {root(n, n) for n in a.fw_outputs} | {root(n, n) for n in a.bw_outputs}
    return Program(steps, backward_start, outlives,
                   None if kernels is None else tuple(kernels[:backward_start]) + _kernel_runs(kernels[backward_start:]),
                   cpp_call_ends(kinds, backward_start) if cpp_calls else None)


def in_cpp_call(node: fx.Node, step: Step, generated: Container[fx.Node]) -> bool | None:
    """Whether ``node``'s step is a kernel Inductor's C++ backend generates (True: it
    joins the call being emitted), an extern op (False: the call ends before it), or no
    kernel at all (None: a view, a value inlined into its consumers, a tuple op's element).
    ``generated``: the nodes ``kernel_local.is_generated_kernel`` holds for
    (``JointAnalysis.generated_kernels``). Ops not known to be generated count as extern: a
    call cut short frees earlier, as before the calls were followed."""
    is_kernel = node in generated
    if not step.allocates:
        return None if is_kernel or is_view(node) or node.target is operator.getitem else False
    return is_kernel or is_view(node)  # an allocating view: the copy Inductor makes of it


def cpp_call_ends(kinds: list[bool | None], backward_start: int) -> tuple[int, ...]:
    """``Program.call_end`` from each step's ``in_cpp_call``: a call is the run of steps
    from a kernel to the last kernel before the next extern op (or the graph's end; the
    forward and backward are two graphs), steps of no kernel included."""
    ends = list(range(len(kinds)))
    start = last = None  # the open call's first kernel and its last so far
    for index, kind in enumerate([*kinds, False]):  # the graph's end closes the last call
        if index == backward_start or kind is False:
            if start is not None:
                ends[start:last + 1] = [last] * (last + 1 - start)
            start = last = None
        if kind:
            start = index if start is None else start
            last = index
    return tuple(ends)


def _kernel_runs(groups: list[tuple[int, int] | None]) -> tuple[tuple[int, int] | None, ...]:
    """Each step's kernel and part (``Program.kernel_of_step``) from its kernel group and
    part (``JointAnalysis.kernel_index``): a kernel is a run of consecutive steps of one
    group. A kernel runs as one, its members together (``kernel_local.fused_kernel_order``);
    members of a group the plan's order splits (a cycle, a pull refused) run apart, with
    other steps between them."""
    runs: list[tuple[int, int] | None] = []
    run = -1
    previous = None
    for group in groups:
        if group is None:
            runs.append(None)
        else:
            if previous is None or group[0] != previous[0]:
                run += 1
            runs.append((run, group[1]))
        previous = group
    return tuple(runs)


def _renamed(step: Step, keys: dict[Hashable, Hashable]) -> Step:
    """``step`` with its storage keys renamed by ``keys`` (the step itself when none is)."""
    if keys.keys().isdisjoint(step.storages):
        return step
    allocates = [(keys.get(key, key), nbytes) for key, nbytes in step.allocates]
    return Step(step.label, allocates, [keys.get(key, key) for key in step.reads], step.kind, scattered=step.scattered)
