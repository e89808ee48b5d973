"""Costs measured on the device: one profiled training step of a compiled graph, its kernels'
times given to the FX nodes they compute.

Measured plan choice (``runtime/plan_trials.py``) profiles one step of the planner's plan
with ``torch.profiler``. Inductor's generated code runs each kernel inside the compiled
graph's call (``## Call CompiledFxGraph ... ##``, one for the forward, one for the
backward): a generated kernel is an event of its own name (Triton's always; the C++
backend's with ``cpp.enable_kernel_profile``, which measured plan choice turns on), an
extern kernel an event of its op (``aten::mm``, ``compile_offload::offload``). The kernels Inductor scheduled were recorded
in the order it runs them (``inductor/kernels.py``), each with the FX nodes it computes;
``kernel_seconds`` pairs them with the events, in order, and fails (``ProfileMismatch``)
where the two do not line up. ``node_seconds`` then splits each kernel's time over its
nodes: an extern kernel's all to the node of its op, a generated kernel's in proportion to
what the cost model predicts for each of its nodes. A node recomputed in the backward keeps
the time it took where the forward computed it. The plan's own copies (``offload`` to the
host, ``reload`` back) give the host link's bandwidth as it ran beside the compute
(``link_bandwidths``): the bytes copied over the copies' time, each way.

The times are the device's: on CUDA the kernels' device time, on the CPU the kernels' own.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..inductor.kernels import GraphKernels, Kernel
from .memory_tracker import profiler_recording

log = logging.getLogger("compile_offload")

CALL_MARK = "## Call CompiledFxGraph"
MEASURED_COSTS_SCHEMA = "compile_offload.measured_costs/1"
# A profile whose paired kernels hold less of the graphs' kernel time than this is not trusted.
MIN_ATTRIBUTED = 0.5


class ProfileMismatch(Exception):
    """The profiled events do not line up with the kernels Inductor scheduled."""


@dataclass(frozen=True)
class Event:
    """One direct child of a compiled graph's call: a kernel or an op of the wrapper's."""

    name: str
    seconds: float


@dataclass
class MeasuredCosts:
    """Seconds per joint-graph node, measured on ``device`` (the planner's cost function
    where a node is listed; ``scale`` times the model's elsewhere)."""

    device: str
    seconds: dict[str, float]
    scale: float = 1.0  # measured over predicted, on the nodes measured
    # bytes/s of the plan's copies to the host and back, as they ran (None: no copy profiled)
    d2h_bandwidth: float | None = None
    h2d_bandwidth: float | None = None

    def digest(self) -> str:
        text = json.dumps([self.device, sorted(self.seconds.items()), self.scale, self.d2h_bandwidth,
                           self.h2d_bandwidth])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {"schema": MEASURED_COSTS_SCHEMA, "device": self.device, "seconds": self.seconds, "scale": self.scale,
                "d2h_bandwidth": self.d2h_bandwidth, "h2d_bandwidth": self.h2d_bandwidth}

    @classmethod
    def from_json(cls, data: dict) -> "MeasuredCosts":
        if not isinstance(data, dict) or data.get("schema") != MEASURED_COSTS_SCHEMA:
            raise ValueError("not a compile_offload measured-costs table")
        seconds, scale = data.get("seconds"), data.get("scale")
        if (not isinstance(seconds, dict) or not isinstance(scale, (int, float))
                or not all(isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in seconds.items())):
            raise ValueError("a measured-costs table with fields of the wrong type")
        rates = [data.get("d2h_bandwidth"), data.get("h2d_bandwidth")]
        if not all(rate is None or (isinstance(rate, (int, float)) and rate > 0) for rate in rates):
            raise ValueError("a measured-costs table with a bandwidth that is not a positive number")
        return cls(str(data.get("device")), {k: float(v) for k, v in seconds.items()}, float(scale),
                   *(None if rate is None else float(rate) for rate in rates))

    def priced_profile(self, profile):
        """``profile`` (a ``DeviceProfile``) with the link bandwidths measured, where measured."""
        import dataclasses

        changes = {name: rate for name, rate in (("d2h_bandwidth", self.d2h_bandwidth),
                                                 ("h2d_bandwidth", self.h2d_bandwidth)) if rate is not None}
        return dataclasses.replace(profile, **changes) if changes else profile

    def price(self, model: Callable) -> Callable:
        """The cost function: a node's measured seconds, else ``scale`` times ``model``'s."""
        table, scale = self.seconds, self.scale

        def seconds(node) -> float:
            measured = table.get(node.name)
            return measured if measured is not None else scale * model(node)

        return seconds


def compiled_calls(events: Iterable) -> list:
    """The compiled graphs' calls among ``events`` (a profiler's ``FunctionEvent``s), in order."""
    return [event for event in events if event.name.startswith(CALL_MARK)]


def children_of(call, cuda: bool) -> list[Event]:
    """The direct children of a compiled graph's call, in order, with their time (device time
    on CUDA): its kernels and the wrapper's ops."""
    children = sorted(call.cpu_children, key=lambda e: e.time_range.start)
    return [Event(e.name, (e.device_time_total if cuda else e.cpu_time_total) * 1e-6) for e in children]


def call_events(events: Iterable, cuda: bool) -> list[list[Event]]:
    """For each compiled graph's call among ``events``, in order: ``children_of`` it."""
    return [children_of(call, cuda) for call in compiled_calls(events)]


def kernel_seconds(graph: GraphKernels, events: Sequence[Event]) -> list[tuple[Kernel, float]]:
    """Each kernel of ``graph`` that runs something, with the time of its event. Events are
    taken in order: a generated kernel takes the next event that is not an op's (an op's is
    named ``namespace::op``), an extern kernel the next event of its op; other ops' events
    between them are the wrapper's own (allocations, copies) and are left out. Raises
    ``ProfileMismatch`` where a kernel finds no event or a generated kernel's event is left
    over."""
    pairs = []
    position = 0
    for kernel in graph.kernels:
        if not kernel.launch:
            continue
        while position < len(events) and not _matches(kernel, events[position]):
            if not _is_op(events[position]):
                raise ProfileMismatch(f"event {events[position].name!r} where kernel {kernel.name} "
                                      f"({kernel.launch} {kernel.extern_op}) was expected")
            position += 1
        if position == len(events):
            raise ProfileMismatch(f"no event for kernel {kernel.name} ({kernel.launch} {kernel.extern_op})")
        pairs.append((kernel, events[position].seconds))
        position += 1
    left = [e.name for e in events[position:] if not _is_op(e)]
    if left:
        raise ProfileMismatch(f"{len(left)} kernel events not scheduled in the record ({left[0]!r}, ...)")
    return pairs


def _is_op(event: Event) -> bool:
    return "::" in event.name


def _matches(kernel: Kernel, event: Event) -> bool:
    if kernel.launch == "extern":
        return _is_op(event) and (not kernel.extern_op or event.name.split("::")[-1] == kernel.extern_op)
    return not _is_op(event)


def node_seconds(pairs: Iterable[tuple[Kernel, float]], weight: Callable[[str], float | None]) -> dict[str, float]:
    """Each kernel's seconds split over the nodes it computes that ``weight`` knows (a
    node's predicted seconds; None: not a node of the graph planned): an extern kernel's
    all to its op's node where one is named so, a generated kernel's in proportion to the
    weights (evenly where all are 0). A node in several kernels sums its shares."""
    found: dict[str, float] = {}
    for kernel, seconds in pairs:
        known = {name: weight(name) for name in kernel.origins}
        known = {name: w for name, w in known.items() if w is not None}
        if not known:
            continue
        if kernel.launch == "extern" and kernel.extern_op:
            own = [name for name in known if name == kernel.extern_op or name.startswith(kernel.extern_op + "_")]
            if len(own) == 1:
                known = {own[0]: 1.0}
        total = sum(known.values())
        for name, w in known.items():
            share = w / total if total > 0 else 1.0 / len(known)
            found[name] = found.get(name, 0.0) + seconds * share
    return found


def measured_costs(forward: GraphKernels, backward: GraphKernels, calls: Sequence[Sequence[Event]],
                   model: Callable[[str], float | None], device: str) -> MeasuredCosts:
    """The table of one profiled step: ``calls`` (``call_events``) holds the forward's call
    then the backward's. ``model(name)``: the cost model's seconds for a joint-graph node,
    None for a name the joint graph does not have. Raises ``ProfileMismatch``."""
    if len(calls) != 2:
        raise ProfileMismatch(f"{len(calls)} compiled-graph calls profiled in the step, not a forward and a backward")
    forward_pairs = kernel_seconds(forward, calls[0])
    backward_pairs = kernel_seconds(backward, calls[1])
    kernel_total = sum(s for _, s in forward_pairs + backward_pairs)
    if kernel_total <= 0:
        raise ProfileMismatch("the profiled kernels took no time")
    backward_seconds, forward_seconds = node_seconds(backward_pairs, model), node_seconds(forward_pairs, model)
    # Both graphs' shares count towards lining up: a recomputed node's share of the backward's
    # kernels is time in nodes of the graph too (a plan recomputing 32 nodes of a small GPT had
    # only 20-28% left once its forward time replaced it, and the profile was refused).
    in_nodes = sum(backward_seconds.values()) + sum(forward_seconds.values())
    if in_nodes < MIN_ATTRIBUTED * kernel_total:
        raise ProfileMismatch(f"only {in_nodes / kernel_total:.0%} of the kernels' time is in nodes of the graph")
    seconds = {**backward_seconds, **forward_seconds}  # a recomputed node: its forward time
    attributed = sum(seconds.values())
    predicted = sum(model(name) or 0.0 for name in seconds)
    scale = attributed / predicted if predicted > 0 else 1.0
    d2h, h2d = link_bandwidths([(forward, forward_pairs), (backward, backward_pairs)])
    return MeasuredCosts(device, seconds, scale, d2h, h2d)


# The plan's copy ops (runtime/ops.py): what each moves, and which way.
COPY_OPS = {"offload": "d2h", "reload": "h2d"}


def link_bandwidths(graphs: Iterable[tuple[GraphKernels, Sequence[tuple[Kernel, float]]]]
                    ) -> tuple[float | None, float | None]:
    """(device to host, host to device) bytes per second of the plan's copies in the profiled
    step: each way, the bytes copied over the copies' time; None where none ran. An offload
    copies the buffer it reads, a reload the device buffer it writes."""
    moved = {"d2h": [0, 0.0], "h2d": [0, 0.0]}
    for graph, pairs in graphs:
        sizes = dict(graph.input_bytes)
        for kernel in graph.kernels:
            sizes.update((buffer.name, buffer.bytes) for buffer in kernel.allocates)
        for kernel, seconds in pairs:
            way = COPY_OPS.get(kernel.extern_op) if kernel.launch == "extern" else None
            if way is None or seconds <= 0:
                continue
            if way == "d2h":
                nbytes = sum(sizes.get(graph.aliases.get(name, name), 0) for name in kernel.reads)
            else:
                nbytes = sum(buffer.bytes for buffer in kernel.allocates)
            moved[way][0] += nbytes
            moved[way][1] += seconds
    return tuple(nbytes / seconds if nbytes > 0 and seconds > 0 else None
                 for nbytes, seconds in (moved["d2h"], moved["h2d"]))


class KernelProfile:
    """One step profiled for its kernels: the forward call and the compiled backward, each
    a profiler region of its own (as ``StepMeasure`` measures a CPU peak: the autograd
    engine restores the thread's profiler state when a backward ends). ``calls`` holds,
    once the backward has ended, the compiled graphs' calls (``call_events``)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.calls: list[list[Event]] = []
        self._region = None
        self.interrupted = False  # a profiler of someone else's recorded when the backward started

    def _open(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._region = torch.profiler.profile(activities=activities)
        self._region.__enter__()

    def _close(self) -> None:
        if self._region is None:
            return
        region, self._region = self._region, None
        region.__exit__(None, None, None)
        self.calls += call_events(region.events(), self.cuda)

    def forward(self, compiled: Callable, args):
        self._open()
        try:
            return compiled(*args)
        finally:
            self._close()

    def start_backward(self) -> None:
        if profiler_recording():
            self.interrupted = True
            return
        self._open()

    def end_backward(self) -> None:
        self._close()
