"""The scheduled peak: the plan's memory as the code Inductor generates holds it.

The planner's simulator (``passes/memory.py``) frees each tensor after its last reader in
the order the plan gives. Inductor then fuses nodes into kernels and plans its own buffers:

- a kernel's outputs are all allocated when it starts and what it reads stays alive until
  it ends, so a kernel that pulls a late consumer together with earlier work stretches
  lifetimes the plan did not count;
- an op returning a tuple (``convolution_backward``) allocates every part while it runs
  (``inductor_kernels`` charges the parts to it);
- a buffer freed by one kernel is kept for a later allocation of the same size and dtype
  (the wrapper's buffer reuse): it stays allocated from its last use until that allocation;
- a kernel may write its output into an input it is the last reader of (in-place reuse,
  saved tensors of the backward included), which saves an allocation;
- on the CPU, consecutive C++ kernels run as one call, and an extern op may hold a
  workspace while it runs (``inductor_kernels`` joins the calls and measures the workspaces);
- a saved tensor no backward kernel reads is held until the backward returns.

The last two are read from the wrapper Inductor generated (``GraphKernels.reuses``), and
reproduced only for a record without them. ``scheduled_program`` builds a program
(``passes.memory.Program``) from the kernels Inductor scheduled for the forward and the
backward graph (``inductor_kernels``): one step per kernel, one storage per physical
buffer. The forward's saved outputs are the backward's inputs. Its simulated peak is the
*scheduled peak*.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable, Iterator

from ..passes.memory import Program, Step, simulate
from ..passes.plan import Plan, format_bytes
from ..settings import Settings
from . import kernels as inductor_kernels
from .kernels import Buffer, GraphKernels, KernelRecorder

log = logging.getLogger("compile_offload")


def recorder_for(settings: Settings) -> KernelRecorder | None:
    """A recorder for a graph compiled under ``settings``: only with a budget (without one
    nothing is installed, and Inductor compiles exactly as ``torch.compile`` does) and on a
    torch that has the scheduler hook."""
    if not settings.has_budget:
        return None
    if not inductor_kernels.available():
        inductor_kernels.warn_unchecked("this torch's Inductor has no scheduler hook to read them from")
        return None
    return KernelRecorder()


@contextlib.contextmanager
def recording(recorder: KernelRecorder | None, patches: dict) -> Iterator[dict]:
    """``patches`` with ``recorder`` installed, the backward lowered during the compile;
    ``patches`` as they are without a recorder. Where the user installed a post-fusion pass
    of their own (Inductor has one slot), theirs stays and nothing is recorded."""
    from ..torch_api.inductor import config as inductor_config

    if recorder is None:
        yield patches
        return
    installed = patches.get("_post_fusion_custom_pass", inductor_config._post_fusion_custom_pass)
    if installed is not None:
        if not inductor_kernels.is_recording_pass(installed):
            inductor_kernels.warn_unchecked("a post-fusion pass of the user's holds Inductor's one hook for it")
        yield patches
        return
    with inductor_kernels.backward_lowered_at_compile():
        yield {**patches, **inductor_kernels.recording_patches(recorder)}


def note_scheduled_peak(plan: Plan, recorder: KernelRecorder) -> None:
    """Set ``plan.scheduled_peak_bytes`` from the kernels ``recorder`` saw (nothing unless it
    saw both graphs), and log it against the plan's own prediction (DEBUG: a graph's one
    INFO line is its plan's, emitted before Inductor lowers it)."""
    forward, backward = recorder.forward(), recorder.backward()
    if forward is None or backward is None or not plan.decisions:
        return
    recorder.read_reuses()
    plan.scheduled_peak_bytes = scheduled_peak(forward, backward)
    log.debug("%s: scheduled peak %s (predicted from Inductor's kernels; the plan predicted %s, budget %s)",
             plan.graph_name, format_bytes(plan.scheduled_peak_bytes), format_bytes(plan.predicted_peak_bytes),
             "none" if plan.budget_bytes is None else format_bytes(plan.budget_bytes))


def scheduled_program(forward: GraphKernels, backward: GraphKernels | None) -> Program:
    """Forward kernels, then (if known) backward kernels, as one program.

    Forward inputs are steady state (parameters, the batch). A forward output that the
    backward receives (same name) is one storage across both graphs; other forward outputs
    (the user's) outlive the step, as do the backward's outputs (gradients).

    Where the record has the wrapper's reuses (``GraphKernels.reuses``), each buffer takes
    the memory the generated code gives it. Otherwise the rules are reproduced: Inductor's
    wrapper hands a freed buffer to a later allocation only when that does not raise its
    own estimate of the graph's peak (``AllocateLine.should_reuse_buffer``): the next
    kernel may always take it, a later one only if the bytes live in between plus the
    buffer stay under the peak. That estimate is taken here from the program without such
    reuse (Inductor's own counts less, so this holds fewer buffers than it does).
    """
    if all(graph.reuses is not None for graph in (forward, backward) if graph is not None):
        return _program(forward, backward, None)  # the generated code's reuses: no estimate to take
    without_reuse = _program(forward, backward, None)
    return _program(forward, backward, list(simulate(without_reuse).live_bytes))


def _program(forward: GraphKernels, backward: GraphKernels | None, live: list[int] | None) -> Program:
    fw_storage: dict[str, Hashable | None] = {name: None for name in forward.input_names}
    steps = _graph_steps(forward, "fw", fw_storage, live, 0)
    backward_start = len(steps)
    received = set(backward.input_names) if backward is not None else set()
    saved: dict[str, Hashable | None] = {}  # backward input name -> the forward storage it is (None: steady)
    user_outputs = set()
    for fx_name, buffer in zip(forward.output_names, forward.output_buffers):
        key = fw_storage.get(forward.aliases.get(buffer, buffer)) if buffer is not None else None
        if fx_name in received:
            saved[fx_name] = key
        elif key is not None:
            user_outputs.add(key)
    outlives = set(user_outputs)
    if backward is None:  # backward not lowered: the saved tensors are alive at the end of the forward
        return Program(steps, backward_start, outlives | (set(saved.values()) - {None}))
    bw_storage: dict[str, Hashable | None] = {}
    tangents = []
    for name in backward.input_names:
        if name in saved:
            bw_storage[name] = saved[name]
        else:  # a tangent (or an input the forward did not return): its own storage
            bw_storage[name] = ("bw", name)
            tangents.append((("bw", name), backward.input_bytes.get(name, 0)))
    steps.append(Step("backward inputs", [t for t in tangents if t[1]], []))
    steps += _graph_steps(backward, "bw", bw_storage, live, len(steps))
    # A saved tensor no backward kernel reads (``avg_pool2d_backward`` takes its input for
    # its shape alone) has no last use, so the generated code frees it when it returns.
    read = {key for step in steps[backward_start:] for key in step.reads}
    unread = [key for key in dict.fromkeys(bw_storage[name] for name in backward.input_names)
              if key is not None and key not in read]
    if unread:
        steps.append(Step("backward returns", [], unread))
    outlives |= {bw_storage.get(backward.aliases.get(name, name)) for name in backward.output_buffers
                 if name is not None} - {None}
    return Program(steps, backward_start, outlives)


def _graph_steps(graph: GraphKernels, side: str, storage: dict[str, Hashable | None], live: list[int] | None,
                 offset: int) -> list[Step]:
    """One step per kernel of ``graph`` (program steps ``offset`` on); ``storage`` (graph
    inputs -> storage key, None for steady state) is filled with every buffer's storage.
    ``live``: live bytes per program step without buffer reuse (None: no reuse), raised
    in place where a reuse holds a freed buffer."""
    def resolve(name: str) -> str:
        while name in graph.aliases:
            name = graph.aliases[name]
        return name

    outputs = {resolve(name) for name in graph.output_buffers if name is not None}
    last_read: dict[str, int] = {}
    for index, kernel in enumerate(graph.kernels):
        for name in kernel.reads:
            last_read[resolve(name)] = index
    inputs = set(graph.input_names)
    donated = set(graph.donated)
    reuse_key: dict[str, str | None] = {}
    pool: dict[str, list[tuple[Hashable, int]]] = {}  # freed buffers by reuse key: (storage, freed after step)
    reuse = _Reuse(live, offset, len(graph.kernels)) if live is not None else None
    steps = []
    for index, kernel in enumerate(graph.kernels):
        taken: set[str] = set()  # reads an output of this kernel took over in place
        allocates = []
        for buffer in _reused_first(kernel.allocates, graph.reuses):
            reuse_key[buffer.name] = buffer.reuse_key
            if graph.reuses is not None:  # what the generated code does: no rule to reproduce
                reused = graph.reuses.get(buffer.name)
                if reused is not None and storage.get(resolve(reused)) is not None:
                    storage[buffer.name] = storage[resolve(reused)]
                else:
                    storage[buffer.name] = (side, buffer.name)
                    if buffer.bytes:
                        allocates.append((storage[buffer.name], buffer.bytes))
                continue
            takeable = [name for name in map(resolve, kernel.in_place.get(buffer.name, ()))
                        if name not in taken and last_read.get(name) == index and name not in outputs
                        and (name not in inputs or name in donated) and storage.get(name) is not None]
            key, fresh, took = _storage_for(buffer, takeable, reuse_key, storage, graph.input_bytes, side)
            if fresh and reuse is not None and pool.get(buffer.reuse_key or ""):
                freed, after = pool[buffer.reuse_key].pop()
                if reuse.allows(after, offset + index, buffer.bytes):
                    key, fresh = freed, False
                else:  # Inductor puts it back and allocates
                    pool[buffer.reuse_key].append((freed, after))
            storage[buffer.name] = key
            taken |= {took} - {None}
            if fresh and buffer.bytes:
                allocates.append((key, buffer.bytes))
        reads = [storage[name] for name in map(resolve, kernel.reads) if storage.get(name) is not None]
        steps.append(Step(kernel.name, allocates, reads))
        for name in [*map(resolve, kernel.reads), *(b.name for b in kernel.allocates)]:
            if last_read.get(name, index) != index or name in outputs or name in inputs or name in taken:
                continue
            if reuse_key.get(name) and storage.get(name) is not None:
                pool.setdefault(reuse_key[name], []).append((storage[name], offset + index))
    return steps


def _reused_first(buffers: list[Buffer], reuses: dict[str, str] | None) -> list[Buffer]:
    """``buffers`` (one kernel's) with each buffer after the one of them whose memory it is
    written into (``buf6 = buf5; del buf5  # reuse``: an in-place update inside the kernel),
    so that the memory is known when the buffer takes it."""
    if not reuses:
        return buffers
    names = {buffer.name for buffer in buffers}
    ordered: list[Buffer] = []
    placed: set[str] = set()
    pending = list(buffers)
    while pending:
        waiting = []
        for buffer in pending:
            source = reuses.get(buffer.name)
            if source in names and source not in placed and source != buffer.name:
                waiting.append(buffer)
            else:
                ordered.append(buffer)
                placed.add(buffer.name)
        if len(waiting) == len(pending):  # a cycle, never generated: the order as it was
            return ordered + waiting
        pending = waiting
    return ordered


def _storage_for(buffer: Buffer, takeable: list[str], reuse_key: dict, storage: dict,
                 input_bytes: dict[str, int], side: str) -> tuple[Hashable, bool, str | None]:
    """The storage ``buffer`` is written into (an input it takes over in place, or its own),
    whether it is a new allocation, and the read it took over (None: none)."""
    if buffer.reuse_key is not None:
        for name in takeable:  # in-place: an input of the same size and dtype dying here
            same = reuse_key.get(name) == buffer.reuse_key if name in reuse_key else input_bytes.get(name) == buffer.bytes
            if same:
                return storage[name], False, name
    return (side, buffer.name), True, None


class _Reuse:
    """Inductor's rule for handing a freed buffer to a later allocation, over its estimate
    of live bytes per step (``live``, raised as reuses hold buffers)."""

    def __init__(self, live: list[int], offset: int, count: int) -> None:
        self.live = live
        self.peak = max(live[offset:offset + count], default=0)

    def allows(self, freed_after: int, at: int, nbytes: int) -> bool:
        if freed_after + 1 == at:
            return True
        between = range(freed_after + 1, at)
        if nbytes + max((self.live[i] for i in between), default=0) > self.peak:
            return False
        for i in between:
            self.live[i] += nbytes
        return True


def scheduled_peak(forward: GraphKernels, backward: GraphKernels | None) -> int:
    return simulate(scheduled_program(forward, backward)).peak_bytes
