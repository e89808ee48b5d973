"""What Inductor will run: its fused kernels, in order, with the buffers each allocates and reads.

A read-only hook on Inductor's scheduler (``torch._inductor.config._post_fusion_custom_pass``,
run once per lowered graph right after fusion) records, for the forward and the backward
graph of one compile, the scheduler nodes in order: the buffers each kernel writes that
outlive it (allocated when it starts), the buffers and graph inputs it reads (freed after
the last kernel that reads them), and which graph outputs are which buffers. It returns the
node list unchanged and touches no node, so the generated code is the one Inductor makes
without it (``tests/test_budget_loop.py`` compares the code). It also keeps the graph's
wrapper, whose memory plan Inductor makes after the hook: once the compile has returned,
``KernelRecorder.read_reuses`` reads which buffer the generated code writes into which
memory (``ReuseLine``) and lets the wrapper go. ``budget_loop.py`` turns a record into a
program for ``passes.memory.simulate``.

A record names the graph's outputs as the graph handed to Inductor did
(``naming_outputs_before_passes``, which wraps the inner compile): ``budget_loop`` matches
the forward's saved outputs to the backward's inputs by name, and Inductor's passes rename
some outputs of the forward (its noop removal replaces an output that is an ``aten.alias`` by
what it aliases) but none of the backward's inputs, compiled apart.

Every private Inductor API this project reads about kernels is used here and only here,
feature-detected: on a torch without the hook, ``recording`` records nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .op_workspace import (
    CUDA_WORKSPACES,
    MEASURED_CUDA_OPS,
    MEASURED_OPS,
    cuda_workspace,
    measured_cuda_workspace,
    measured_workspace,
)
from ..passes import compat
from ..torch_api import functorch, inductor

log = logging.getLogger("compile_offload")


@dataclass(frozen=True)
class Buffer:
    """A buffer a kernel writes that outlives it."""

    name: str
    bytes: int  # 0 for a buffer off the budgeted device (an offload's pinned host copy) or with no memory of its own
    reuse_key: str | None  # Inductor's wrapper may hand it a freed buffer with the same key; None: the op allocates


@dataclass
class Kernel:
    """One scheduler node (a fused kernel, an extern call, a fallback op)."""

    name: str
    allocates: list[Buffer] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)  # buffers and graph inputs it reads
    in_place: dict[str, list[str]] = field(default_factory=dict)  # output -> reads whose memory it may take over
    origins: list[str] = field(default_factory=list)  # the FX nodes it computes
    # What the generated code runs for it, as a profiler sees it: "fused" (a kernel Inductor
    # generated, or a template), "extern" (an aten op it calls, named by its op, ``extern_op``),
    # "" (nothing: a no-op node, or the parts of an extern op's tuple output).
    launch: str = "fused"
    extern_op: str = ""


@dataclass
class GraphKernels:
    """One lowered graph: its kernels in order, its inputs and outputs by name."""

    is_backward: bool
    kernels: list[Kernel]
    input_names: list[str]  # graph inputs (placeholders), in order
    output_buffers: list[str | None]  # per graph output: the buffer or input it is (None: not a tensor buffer)
    output_names: list[str | None]  # per graph output: the FX node's name (a saved tensor's name in the backward)
    aliases: dict[str, str] = field(default_factory=dict)  # a name for another buffer's memory -> that buffer
    donated: list[str] = field(default_factory=list)  # inputs the graph may overwrite (saved tensors)
    input_bytes: dict[str, int] = field(default_factory=dict)
    # What the generated code does with memory, read from Inductor's wrapper once it has planned
    # it (``read_reuses``): buffer -> the buffer or input whose memory it is written into (in-place
    # and the wrapper's pool alike). None: not read (a hand-built record, or a torch we cannot read).
    reuses: dict[str, str] | None = None
    wrapper: _Held | None = field(default=None, repr=False, compare=False)  # Inductor's wrapper until read
    # Buffers only their own kernel reads: no memory of their own, unless the generated code
    # allocates them anyway (``read_reuses``). Buffer name -> (kernel index, the buffer).
    kernel_local: dict[str, tuple[int, Buffer]] = field(default_factory=dict, repr=False, compare=False)
    # The kernels each call of the generated code runs, where a call runs several (Inductor's
    # C++ kernel groups, ``_calls``): joined into one kernel by ``read_reuses``. None: one each.
    calls: list[list[int]] | None = field(default=None, repr=False, compare=False)


class _Held:
    """A reference Inductor's config must not copy: it deep-copies its settings (the
    recording pass, so the records, among them) when it reads them, and pickles them into
    its cache key; a wrapper holds fake tensors and cycles, which can be neither. A copy
    shares the reference; a pickle holds nothing (the key must not depend on it)."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value

    def __deepcopy__(self, memo) -> _Held:
        return self

    def __reduce__(self):
        return _Held, (None,)


_warned_unchecked: set[str] = set()


def warn_unchecked(why: str) -> None:
    """Say once per reason and process that Inductor's code is not checked against the budget."""
    if why in _warned_unchecked:
        return
    _warned_unchecked.add(why)
    warnings.warn(f"compile_offload: the kernels Inductor generates are not read ({why}): plans are checked "
                  "against the memory budget by the planner's prediction only (config.verify_budget=True measures "
                  "the first step)", stacklevel=3)


class KernelRecorder:
    """Collects the ``GraphKernels`` of every graph lowered while it is installed."""

    def __init__(self) -> None:
        self.graphs: list[GraphKernels] = []
        self.hooked = False  # the scheduler hook recorded the graph being scheduled (``recording_reordered``)

    def record(self, nodes: list) -> None:
        try:
            self.graphs.append(_graph_kernels(nodes))
        except Exception as error:  # a scheduler we cannot read: no record, never a failed compile
            log.debug("compile_offload: could not read Inductor's kernels", exc_info=True)
            warn_unchecked(f"reading them failed: {type(error).__name__}: {error}")
            return
        self.hooked = True

    def read_reuses(self) -> None:
        """Read, for every recorded graph, the memory decisions of the code Inductor generated
        (after its compile: the wrapper plans memory after the scheduler hook has run), and let
        go of the wrapper: which buffer reuses which memory, and which of the buffers only
        their own kernel reads the code allocates all the same. Inductor's C++ kernels keep
        such a buffer in memory where its writer and its readers run in different loop nests
        of the kernel (measured: a bf16 softmax's fp32 ``exp``, written beside the row maximum
        and read by the row sum over merged loops, a buffer twice the size of the attention
        scores alive while the kernel runs); they are charged to that kernel, freed when it ends.
        Then the kernels one call of the generated code runs are joined into one (``_calls``)."""
        for graph in self.graphs:
            if graph.wrapper is not None:
                graph.reuses = _wrapper_reuses(graph.wrapper.value)
                allocated = _wrapper_allocations(graph.wrapper.value)
                for name, (index, buffer) in graph.kernel_local.items():
                    if name in allocated:
                        graph.kernels[index].allocates.append(buffer)
                graph.wrapper = None
            graph.kernel_local = {}
            if graph.calls is not None:
                graph.kernels = [_joined([graph.kernels[index] for index in call]) for call in graph.calls]
                graph.calls = None

    def forward(self) -> GraphKernels | None:
        return next((g for g in self.graphs if not g.is_backward), None)

    def backward(self) -> GraphKernels | None:
        return next((g for g in self.graphs if g.is_backward), None)


def available() -> bool:
    """Whether this torch has the scheduler hook and lowers the backward at compile time on request."""
    return hasattr(inductor.config, "_post_fusion_custom_pass") and hasattr(
        functorch.config, "force_non_lazy_backward_lowering")


class _RecordingPass(inductor.scheduler_pass_base()):  # type: ignore[misc]
    """The hook itself: records, returns ``nodes`` as given."""

    def __init__(self, recorder: KernelRecorder) -> None:
        self.recorder = recorder

    def __call__(self, nodes: list) -> list:
        self.recorder.record(nodes)
        return nodes

    def uuid(self):  # changes no code: nothing for Inductor's cache key to tell apart
        return "compile_offload.KernelRecorder"


def recording_patches(recorder: KernelRecorder) -> dict:
    """Inductor config patches that install ``recorder`` (for ``compile_fx``'s config_patches)."""
    return {"_post_fusion_custom_pass": _RecordingPass(recorder)}


def is_recording_pass(installed: object) -> bool:
    """Whether Inductor's post-fusion pass ``installed`` is a recorder's, not the user's."""
    return isinstance(installed, _RecordingPass)


def served_from_cache(recorder: KernelRecorder | None, patches: dict) -> bool:
    """Whether a compile under ``patches`` with ``recorder`` installed in them saw no kernels
    of its forward or its backward: Inductor's FX graph cache served the code, and the
    scheduler (where the recorder sits) never ran. False where nothing was installed."""
    installed = patches.get("_post_fusion_custom_pass")
    if recorder is None or not isinstance(installed, _RecordingPass) or installed.recorder is not recorder:
        return False
    return recorder.forward() is None or recorder.backward() is None


@contextlib.contextmanager
def recording_reordered(recorder: KernelRecorder) -> Iterator[None]:
    """While it lasts, a graph ``recorder`` records is recorded again in the order Inductor's
    peak-memory reordering leaves its kernels. That pass (``reorder_for_peak_memory``, on by
    default: a budget turns it off, ``inductor_compile.inductor_config_patches``) runs after the
    post-fusion hook the recorder sits on, so without this the record of a graph compiled
    with it on is in the order before it. Wrapped where the scheduler imports it from,
    ``torch._inductor.memory`` (torch 2.11 to 2.14)."""
    from unittest import mock

    inductor_memory = inductor.memory()
    reorder = inductor_memory.reorder_for_peak_memory

    def reordered(nodes, *args, **kwargs):
        hooked, recorder.hooked = recorder.hooked, False
        nodes = reorder(nodes, *args, **kwargs)
        if hooked:  # this graph's record, taken before the pass: taken again
            recorder.graphs.pop()
            recorder.record(nodes)
            recorder.hooked = False
        return nodes

    with mock.patch.object(inductor_memory, "reorder_for_peak_memory", reordered):
        yield


# The output names of the graph the innermost ``naming_outputs_before_passes`` compile was
# given, before Inductor's passes ran on it (None: outside one).
_names_before_passes: contextvars.ContextVar[list[str | None] | None] = contextvars.ContextVar(
    "compile_offload_output_names_before_passes", default=None)


def naming_outputs_before_passes(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """``inner_compile`` (Inductor's ``compile_fx_inner``), whose recorded graph names its
    outputs as the graph it was given does, before Inductor's passes (post-grad noop removal
    among them) rewrite it: the names the other graph of the compile knows them by. The
    record is read after those passes, so the names are taken here, where the graph arrives
    first, and given to it by position (the passes replace outputs, never add or drop one)."""

    @functools.wraps(inner_compile)
    def compile_naming_outputs(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any):
        token = _names_before_passes.set(_fx_output_names(gm.graph))
        try:
            return inner_compile(gm, *args, **kwargs)
        finally:
            _names_before_passes.reset(token)

    return compile_naming_outputs


@contextlib.contextmanager
def backward_lowered_at_compile() -> Iterator[None]:
    """AOTAutograd lowers the backward during the compile (not at the first backward), so its
    kernels are known when the compile returns. It changes when, not what, Inductor compiles."""
    with functorch.config.patch(force_non_lazy_backward_lowering=True):
        yield


# --- reading the scheduler (private Inductor IR) ----------------------------------------


def _graph_kernels(nodes: list) -> GraphKernels:
    graph = inductor.V.graph
    owner = {}  # scheduler node name (also of nodes inside a fused one) -> index of its kernel
    for index, node in enumerate(nodes):
        for sub in node.get_nodes():
            owner[sub.get_name()] = index
    device = budget_device(getattr(graph, "device_types", ()))
    output_buffers = [_buffer_name(out) for out in graph.graph_outputs]
    outputs = {name for name in output_buffers if name is not None}
    aliases = _mutation_renames()
    kernels = []
    kernel_local: dict[str, tuple[int, Buffer]] = {}
    for index, node in enumerate(nodes):
        allocates = []
        for buf in node.get_outputs():
            name = buf.get_name()
            base = _view_base(buf)
            if base is not None:
                aliases[name] = base
            if name in aliases:  # an in-place write or a view: another buffer's memory
                continue
            if name in outputs or any(_user_index(user, owner) != index for user in buf.users):
                made_by = _multi_output_parent(node, owner)
                if made_by is not None and made_by < index:
                    kernels[made_by].allocates.append(_allocation(buf, device, graph.sizevars))
                else:
                    allocates.append(_allocation(buf, device, graph.sizevars))
            else:  # read inside its kernel only: a buffer if the generated code allocates it
                kernel_local[name] = (index, _allocation(buf, device, graph.sizevars))
        allocates += _workspaces(node, device)
        reads = list(dict.fromkeys(dep.name for dep in node.read_writes.reads))  # Inductor's order: in-place picks the first
        origins = sorted({o.name for sub in node.get_nodes() for o in _origins(sub)})
        kernels.append(Kernel(node.get_name(), allocates, reads, _in_place_reads(node, index, owner), origins,
                              *_launch(node)))
    donated = [name for name, value in getattr(graph, "graph_inputs_original", {}).items()
               if type(value).__name__ == "DonatedBuffer"]
    return GraphKernels(bool(getattr(graph, "is_backward", False)), kernels, list(graph.graph_input_names),
                        output_buffers, _output_names(graph), aliases, donated, _input_bytes(graph, device),
                        wrapper=_Held(getattr(graph, "wrapper_code", None)), kernel_local=kernel_local,
                        calls=_calls(nodes) if device == "cpu" else None)


def _calls(nodes: list) -> list[list[int]] | None:
    """The kernels (indices of ``nodes``) each call of the generated code runs, where some
    call runs several; None where every kernel is its own call.

    Inductor's C++ backend does not call a fused kernel when it generates it: it gathers
    consecutive kernels into one function (``CppScheduling``'s ``KernelGroup``) and the
    scheduler emits the call, and frees what the group's kernels read last, when it flushes:
    before an extern op or a template (each runs and frees on its own), on a change of device,
    and at the end (``Scheduler._codegen``; also past 500 arguments, not followed here). So
    every buffer the group writes is allocated before the call and everything it frees
    goes after it: for memory the group is one kernel (measured, torch 2.13: a causal
    attention's masked softmax, its fp32 ``exp`` and the clone of ``v`` for the next matmul,
    three scheduler nodes, run as one function; the two outputs allocated while the ``exp``
    is alive, 32% over the nodes apart on a bf16 decoder). Triton's kernels are each called
    and freed after as they are generated."""
    if getattr(inductor.config, "cpu_backend", "cpp") != "cpp":
        return None
    calls: list[list[int]] = []
    run: list[int] = []
    device = None
    for index, node in enumerate(nodes):
        node_device = node.get_device()
        if node.is_extern() or node.is_template():
            if run:
                calls.append(run)
                run = []
            calls.append([index])
            device = node_device or device
            continue
        if node_device is not None and node_device != device:
            if run:
                calls.append(run)
                run = []
            device = node_device
        run.append(index)
    if run:
        calls.append(run)
    return calls if any(len(call) > 1 for call in calls) else None


def _launch(node) -> tuple[str, str]:
    """``Kernel.launch`` and ``Kernel.extern_op`` of a scheduler node: a no-op node
    (``NopKernelSchedulerNode``) and the ``MultiOutput`` parts of an extern op's result run
    nothing; an extern node runs its op, named as the profiler names it: an aten fallback by
    its overload's op (``aten.scatter_reduce_.two`` is ``scatter_reduce_``), else by its
    ``python_kernel_name`` (``extern_kernels.mm`` or
    ``torch.ops.aten.convolution_backward.default``, reduced to ``mm``); the rest is a kernel
    Inductor generated."""
    if type(node).__name__ == "NopKernelSchedulerNode":
        return "", ""
    if node.is_extern() and not node.is_template():
        ir_node = getattr(node, "node", None)
        if type(ir_node).__name__ == "MultiOutput":
            return "", ""
        return "extern", extern_op_name(ir_node)
    return "fused", ""


def extern_op_name(ir_node) -> str:
    """The op an extern IR node runs, as its profiler event names it (``aten::<op>``)."""
    overload = getattr(ir_node, "op_overload", None)
    if callable(getattr(overload, "name", None)):  # an OpOverload: "aten::scatter_reduce_.two"
        return overload.name().split("::")[-1].split(".")[0]
    name = str(getattr(ir_node, "python_kernel_name", None) or "")
    parts = [part for part in name.split(".") if part not in ("default", "out", "Tensor")]
    return parts[-1] if parts else ""


def _joined(kernels: list[Kernel]) -> Kernel:
    """One kernel running ``kernels`` as one call: every buffer allocated before it, every
    read alive until it ends."""
    if len(kernels) == 1:
        return kernels[0]
    in_place: dict[str, list[str]] = {}
    for kernel in kernels:
        in_place.update(kernel.in_place)
    return Kernel("+".join(kernel.name for kernel in kernels),
                  [buffer for kernel in kernels for buffer in kernel.allocates],
                  list(dict.fromkeys(name for kernel in kernels for name in kernel.reads)),
                  in_place, sorted({origin for kernel in kernels for origin in kernel.origins}),
                  "fused" if any(kernel.launch for kernel in kernels) else "")


def _workspaces(node, device: str) -> list[Buffer]:
    """What an extern op allocates while it runs beyond its outputs, as a buffer of its
    kernel that nothing reads (freed when the kernel ends): on CUDA the workspaces known
    from the op's source (``op_workspace.CUDA_WORKSPACES``: FlashAttention's and the
    memory-efficient attention's backward); on the CPU those of ``op_workspace.MEASURED_OPS``
    (mkldnn's convolution and ``convolution_backward``, the CPU attention backward), measured by running the
    op in the layouts Inductor gives its arguments, as the plan measures them; on a GPU
    the convolution's, its backward's and cuDNN attention backward's, measured there
    (``op_workspace.measured_cuda_workspace``;
    nothing where it cannot be, as on fake CUDA tensors without a GPU). Read off the
    FX node the op was lowered from: the tuple-returning op itself, not the ``MultiOutput``
    nodes naming its parts (they share its origins)."""
    ir_node = getattr(node, "node", None)
    op = getattr(ir_node, "op_overload", None)
    measured_here = op in MEASURED_OPS and device == "cpu"
    measured_on_gpu = op in MEASURED_CUDA_OPS and device == "cuda"
    if op not in CUDA_WORKSPACES and not measured_here and not measured_on_gpu:
        return []
    origin = next((o for o in _origins(node) if o.target is op), None)
    if origin is None:
        return []
    if measured_here:
        nbytes = measured_workspace(origin, strides=_argument_strides(origin, ir_node))
    elif measured_on_gpu:
        nbytes = measured_cuda_workspace(origin, strides=_argument_strides(origin, ir_node)) or 0
    else:
        nbytes = cuda_workspace(origin)
    return [Buffer(f"{node.get_name()}_workspace", nbytes, None)] if nbytes else []


def _argument_strides(origin, ir_node) -> dict:
    """The strides Inductor gives the tensor arguments of an extern op (FX argument node ->
    strides), matched in order to ``origin``'s tensor arguments where their sizes agree."""
    arguments = [a for a in (*origin.args, *origin.kwargs.values()) if isinstance(a, torch.fx.Node)]
    inputs = list(getattr(ir_node, "inputs", ()) or ())
    if len(arguments) != len(inputs):
        return {}
    strides = {}
    for argument, tensor in zip(arguments, inputs):
        try:
            layout = tensor.get_layout()
            sizes, stride = tuple(int(s) for s in layout.size), tuple(int(s) for s in layout.stride)
        except Exception:  # symbolic sizes, not a tensor
            return {}
        value = argument.meta.get("val")
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != sizes:
            return {}
        if tuple(value.stride()) != stride:
            strides[argument] = stride
    return strides


def _wrapper_reuses(wrapper) -> dict[str, str] | None:
    """The ``ReuseLine``s of a generated wrapper (``buf5 = buf2; del buf2  # reuse``): new
    buffer -> the buffer or graph input whose memory it takes. They are both of Inductor's
    reuse rules as it applied them: in-place updates (``codegen_inplace_reuse``, saved tensors
    of the backward included) and the wrapper's pool (``AllocateLine.plan``, which holds a freed
    buffer until a later allocation of its size when ``should_reuse_buffer`` says its own peak
    estimate allows it; that estimate counts only what the scheduler sized, which without
    peak-memory reordering is the graph's freeable inputs, so it allows holds the plan's
    simulation would not guess). None when the wrapper has no planned lines to read."""
    line_classes = inductor.wrapper_lines()
    if line_classes is None:
        return None
    _, ReuseLine = line_classes
    lines = getattr(wrapper, "lines", None)
    if not lines:
        return None
    reuses = {}
    for line in lines:
        if isinstance(line, ReuseLine):
            try:
                reuses[line.reused_as.get_name()] = line.node.get_name()
            except Exception:
                return None
    return reuses


def _wrapper_allocations(wrapper) -> set[str]:
    """The buffers a generated wrapper gives memory: its ``AllocateLine``s and the new
    buffers of its ``ReuseLine``s, once planned (a buffer a kernel's code generation removed
    is a ``NullLine`` by then). Empty when there are no lines to read."""
    line_classes = inductor.wrapper_lines()
    if line_classes is None:
        return set()
    AllocateLine, ReuseLine = line_classes
    allocated = set()
    for line in getattr(wrapper, "lines", None) or ():
        try:
            if isinstance(line, AllocateLine):
                allocated.add(line.node.get_name())
            elif isinstance(line, ReuseLine):
                allocated.add(line.reused_as.get_name())
        except Exception:
            continue
    return allocated


def _multi_output_parent(node, owner: dict[str, int]) -> int | None:
    """The kernel that allocates the buffer of a ``MultiOutput`` node: the op returning a
    tuple (``convolution_backward``, ``native_layer_norm`` fallbacks, ...) allocates every
    part while it runs, its inputs alive; the ``MultiOutput`` node after it only names one
    part (``buf2 = buf1[0]`` in the wrapper). None for any other node."""
    ir = inductor.ir()
    ir_node = getattr(node, "node", None)
    if not isinstance(ir_node, ir.MultiOutput):
        return None
    parent = ir_node.inputs[0] if ir_node.inputs else None
    while isinstance(parent, ir.MultiOutput):  # a part of a nested tuple
        parent = parent.inputs[0] if parent.inputs else None
    if parent is None:
        return None
    try:  # the owner map is by operation name ("op1"); the parent's own name is its buffer's ("buf1")
        return owner.get(parent.get_operation_name())
    except Exception:
        return None


def _in_place_reads(node, index: int, owner: dict[str, int]) -> dict[str, list[str]]:
    """Per output buffer, the reads whose memory it may take over (Inductor's in-place
    reuse, ``decide_inplace_update``, decided per node inside a fused kernel): a generated
    node (not an extern or fallback op) that is the read buffer's one user in the kernel
    and reads it as it writes (``can_inplace``)."""
    found: dict[str, list[str]] = {}
    for sub in node.get_nodes():
        if type(sub).__name__ != "SchedulerNode":
            continue
        scheduler = sub.scheduler
        candidates = []
        for name in dict.fromkeys(dep.name for dep in sub.read_writes.reads):
            buf = scheduler.name_to_buf.get(name) or getattr(scheduler, "name_to_donated_buffer", {}).get(name)
            if buf is None:
                continue
            # Inductor's rule: the only use left once earlier kernels and this node's
            # ancestors inside the kernel have run.
            users = [user for user in buf.users if _still_to_run(user, index, owner, sub)]
            if len(users) == 1 and users[0].node is sub and users[0].can_inplace:
                candidates.append(name)
        if candidates:
            for buf in sub.get_outputs():
                found[buf.get_name()] = candidates
    return found


def _still_to_run(user, index: int, owner: dict[str, int], sub) -> bool:
    kernel = _user_index(user, owner)
    if kernel is not None and kernel < index:
        return False
    get_name = getattr(user.node, "get_name", None)
    return get_name is None or get_name() not in getattr(sub, "ancestors", ())


def budget_device(device_types) -> str:
    """The device type whose memory the budget bounds, of a graph using ``device_types``: its
    accelerator where it has one, else the CPU. A CUDA graph with offloads also makes CPU
    buffers (the pinned host copies the offload ops return, read back by the backward): they
    are host memory, which the budget does not bound, and counting them as device memory
    inflated the scheduled peak by every offloaded byte alive at the peak (measured on an H200:
    3.48 GiB scheduled for a plan of 1.12 GiB that measured 1.10 GiB)."""
    accelerators = sorted(set(device_types) - {"cpu", "meta"})
    return accelerators[0] if accelerators else "cpu"


def _allocation(buf, device: str, sizevars) -> Buffer:
    node = buf.node
    nbytes, key = _buffer_bytes(buf, device, sizevars)
    return Buffer(buf.get_name(), nbytes, key if node.should_allocate() else None)


def _view_base(buf) -> str | None:
    layout = getattr(buf.node, "layout", None)
    view = getattr(layout, "view", None)
    if view is None:
        return None
    try:
        return view.get_name()
    except Exception:
        return None


def _input_bytes(graph, device: str) -> dict[str, int]:
    """Bytes of each graph input on ``device`` (an offloaded saved tensor the backward receives
    is on the host: 0)."""
    sizes = {}
    for name, value in graph.graph_inputs.items():
        try:
            layout = value.get_layout()
            on_device = layout.device.type == device
            sizes[name] = _hint(graph.sizevars, layout.storage_size()) * layout.dtype.itemsize if on_device else 0
        except Exception:  # symbols, opaque objects
            continue
    return sizes


def _output_names(graph) -> list[str | None]:
    """The graph's output names as its inner compile was given them (``naming_outputs_before_passes``)
    where known and of the same count, else as Inductor's passes left them."""
    after = _fx_output_names(graph.orig_gm.graph)
    before = _names_before_passes.get()
    return before if before is not None and len(before) == len(after) else after


def _fx_output_names(graph: torch.fx.Graph) -> list[str | None]:
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    return [value.name if isinstance(value, torch.fx.Node) else None for value in values]


def _mutation_renames() -> dict[str, str]:
    scheduler = getattr(inductor.V.graph, "scheduler", None)  # set at the start of the Scheduler's __init__
    renames = getattr(scheduler, "mutation_real_name", None) if scheduler is not None else None
    return dict(renames or {})


def _user_index(user, owner: dict[str, int]):
    node = user.node
    get_name = getattr(node, "get_name", None)
    if get_name is None:  # Inductor's OutputNode: a graph output
        return None
    return owner.get(get_name())


def _origins(node) -> list:
    ir_node = getattr(node, "node", None)
    return list(getattr(ir_node, "origins", ()) or ())


def _buffer_name(ir_node) -> str | None:
    try:
        return ir_node.get_name()
    except Exception:  # None outputs, shapes, constants
        return None


def _buffer_bytes(buf, device: str, sizevars) -> tuple[int, str]:
    """Bytes of ``device`` memory a scheduler buffer allocates (0 for one that is a view or a
    mutation of another, the tuple of a multi-output op, whose parts are counted instead, or
    a buffer on another device), and the key under which Inductor's wrapper reuses freed
    buffers (device, dtype, size)."""
    ir = inductor.ir()
    layout = buf.node.get_output_spec() if hasattr(buf.node, "get_output_spec") else buf.node.layout
    if isinstance(layout, (ir.NoneLayout, ir.MultiOutputLayout)) or isinstance(
            layout, getattr(ir, "NonOwningLayout", ())):
        return 0, ""
    if layout.device.type != device:
        return 0, ""
    size = layout.storage_size()
    nbytes = _hint(sizevars, size) * layout.dtype.itemsize
    return nbytes, f"{layout.device}/{layout.dtype}/{sizevars.simplify(size)}"


def _hint(sizevars, expr) -> int:
    """A size expression at the sizes the graph is planned for (``compat.planning_sizes``,
    else this compile's: ``optimization_hint`` on torch >= 2.13, ``size_hint`` before); a
    data-dependent size at the planner's figure for it (``compat.at_data_dependent_bounds``)."""
    hint = getattr(sizevars, "optimization_hint", None) or sizevars.size_hint
    expr = compat.at_data_dependent_bounds(compat.at_planning_sizes(expr), getattr(sizevars, "shape_env", None))
    return int(hint(expr, fallback=compat.unbacked_size_fallback()))
