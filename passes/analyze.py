"""Facts about a graph that every later pass reads: storages and aliases, allocated bytes,
forward/backward membership and why a node must not be recomputed.

Works on any aten-level FX graph whose nodes carry ``meta["val"]`` (the joint graph, or the
partitioned forward and backward graphs).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.fx as fx

from . import compat
from .inductor.attention_bias_copies import attention_bias_copies
from .inductor.kernel_local import KernelGroups, is_generated_kernel, kernel_groups
from .inductor.rules import PYTHON, KernelRules
from .inductor.node_kinds import fuses_into, is_pointwise, is_view, loads_inputs_in_loop, tensor_value  # noqa: F401  (imported from here too)

COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d", "_dtensor")
_RECOMPUTABLE_NAMESPACES = ("aten", "prims")
# Why a node torch tagged MUST_SAVE is not recomputed (``passes.user_policy`` gives the
# nodes a user's checkpoint policy tagged their own reason).
MUST_SAVE_REASON = "marked must-save (mutation source, collective or effectful op)"


def allocation_bytes(val: torch.Tensor) -> int:
    """Bytes of the storage a freshly allocated tensor with ``val``'s size and stride needs."""
    sizes = [compat.size_hint(s) for s in val.shape]
    if any(s == 0 for s in sizes):
        return 0
    strides = [compat.size_hint(s) for s in val.stride()]
    extent = 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides))
    return extent * val.element_size()


def _aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output shares (views, in-place ops), else None."""
    if node.op != "call_function":
        return None
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        if isinstance(parent, fx.Node) and _aliased_input(parent) is not None:
            return _aliased_input(parent)  # split/unbind outputs are views of the input
        return None
    if _is_wait_tensor(target):
        # A functional collective's wait returns the tensor it waited on (its schema does
        # not say so): the collective's output buffer, not a new allocation.
        first = node.args[0] if node.args else None
        return first if isinstance(first, fx.Node) else None
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return None
    if getattr(target, "is_view", False):  # views, including list-returning split/unbind
        first = node.args[0] if node.args else None
        return first if isinstance(first, fx.Node) else None
    alias = schema.returns[0].alias_info
    if alias is None:
        return None
    for argument, value in zip(schema.arguments, node.args):  # in-place and out= ops
        if argument.alias_info is not None and set(argument.alias_info.before_set) & set(alias.before_set):
            return value if isinstance(value, fx.Node) else None
    return None


def _is_wait_tensor(target) -> bool:
    return (isinstance(target, compat.OpOverload) and target.namespace in COLLECTIVE_NAMESPACES
            and target._opname == "wait_tensor")


def is_collective(node: fx.Node) -> bool:
    """A call of a collective op (``_c10d_functional`` and the other collective namespaces,
    ``wait_tensor`` included)."""
    target = node.target
    return node.op == "call_function" and isinstance(target, compat.OpOverload) and (
        target.namespace in COLLECTIVE_NAMESPACES
    )


def collective_source(node: fx.Node) -> fx.Node | None:
    """The collective whose output ``node`` is or aliases (through views, ``getitem`` and
    ``wait_tensor``): an all-gathered parameter, a reduced tensor. None otherwise."""
    current: fx.Node | None = node
    while current is not None:
        if is_collective(current):
            return current
        current = _aliased_input(current)
    return None


def storage_roots(graph: fx.Graph, copied: frozenset[fx.Node] = frozenset()) -> dict[fx.Node, fx.Node]:
    """Map each tensor-producing node to the node that allocated its storage. A view in
    ``copied`` (a view Inductor copies: ``copy_decisions``) allocates its own."""
    roots: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        source = None if node in copied else _aliased_input(node)
        roots[node] = roots.get(source, source) if source is not None else node
    return roots


def allocated_bytes(node: fx.Node, roots: dict[fx.Node, fx.Node]) -> int:
    """Bytes ``node`` allocates: 0 for views, aliases, non-tensors and multi-output parents
    (their ``getitem`` users own the outputs)."""
    if roots.get(node, node) is not node:
        return 0
    val = tensor_value(node)
    return 0 if val is None else allocation_bytes(val)


def recompute_ban_reason(node: fx.Node) -> str | None:
    """Why ``node`` must never be recomputed in the backward, or None if it may be.

    Recomputing a random op draws new randomness (wrong gradients, pytorch#190758); a
    mutating op would apply its mutation twice (BatchNorm running stats); collectives and
    effectful or custom ops may have effects we cannot see.
    """
    if node.op == "placeholder":
        return None
    if node.op != "call_function":
        return f"{node.op} node"
    if compat.must_save(node):
        return MUST_SAVE_REASON
    if compat.must_be_in_forward(node):
        return "must stay in the forward (mutation)"
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        return recompute_ban_reason(parent) if isinstance(parent, fx.Node) else None
    if not isinstance(target, compat.OpOverload):
        if _scalar_arithmetic(node):
            return None
        return f"{getattr(target, '__name__', target)} is not an aten op"
    namespace = target.namespace
    if namespace in COLLECTIVE_NAMESPACES:
        return "collective"
    if namespace not in _RECOMPUTABLE_NAMESPACES:
        return f"custom op {namespace}::{target._opname}"
    if torch.Tag.nondeterministic_seeded in target.tags or target.overloadpacket in compat.random_ops():
        if not _dropout_disabled(node):
            return "random op (recompute would draw new randomness)"
    if target._schema.is_mutable:
        return "mutates an input"
    return None


def _scalar_arithmetic(node: fx.Node) -> bool:
    """Python arithmetic on symbolic sizes (``operator.truediv(1.0, s0 * 64)``, BatchNorm's
    ``1/N`` under dynamic shapes): no effects, and recomputed in the backward from the sizes,
    as torch's partitioner does (it never saves a ``SymFloat``; Inductor's FX graph cache
    cannot key one: a saved ``SymFloat`` bypassed it)."""
    if getattr(node.target, "__module__", None) not in ("_operator", "operator", "math"):
        return False
    scalars = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
    return isinstance(node.meta.get("val"), scalars) and all(
        isinstance(arg.meta.get("val"), scalars) for arg in node.all_input_nodes)


def mutated_inputs(graph: fx.Graph, roots: dict[fx.Node, fx.Node], where: Callable[[fx.Node], bool] | None = None,
                   outputs: bool = True) -> set[fx.Node]:
    """Placeholders whose storage some node of the graph writes (e.g. the ``copy_`` that
    writes a BatchNorm running statistic back), and those AOTAutograd writes once the forward
    has run: an input that requires grad (``nn.Embedding(max_norm=...)``'s weight) gets its
    new value from a forward output, which the output's descriptor names. ``where``: the
    writing nodes counted (all by default); ``outputs=False``: not those AOTAutograd writes."""
    written = [getattr(desc, "mutated_input", None) for desc in _output_node(graph).meta.get("desc") or ()]
    mutated = {node for node in graph.nodes if outputs and node.op == "placeholder"
               and node.meta.get("desc") is not None and node.meta["desc"] in written}
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable or (where and not where(node)):
            continue
        for argument, value in zip(schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, fx.Node):
                root = roots.get(value, value)
                if root.op == "placeholder":
                    mutated.add(root)
    return mutated


def _output_node(graph: fx.Graph) -> fx.Node:
    return next(node for node in reversed(graph.nodes) if node.op == "output")


def _dropout_disabled(node: fx.Node) -> bool:
    """Attention ops are tagged random for their dropout; with ``dropout_p == 0`` they are
    deterministic and safe to recompute."""
    schema = node.target._schema
    for index, argument in enumerate(schema.arguments):
        if argument.name == "dropout_p":
            value = node.args[index] if index < len(node.args) else node.kwargs.get("dropout_p", argument.default_value)
            return isinstance(value, (int, float)) and value == 0
    return False


_COMPUTE_INTENSIVE = {
    "mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward",
}


def is_compute_intensive(node: fx.Node) -> bool:
    """Matmuls, convolutions and attention: worth saving rather than recomputing when cheap
    alternatives exist."""
    target = node.target
    return isinstance(target, compat.OpOverload) and target.overloadpacket.__name__ in _COMPUTE_INTENSIVE


# Inductor's store-or-inline choice for a pointwise value read by more than one consumer
# (``StorageBox.should_realize_on_reuse`` in torch/_inductor/ir.py, called from
# ``GraphLowering.run_node``; the same in torch 2.11-2.14): it is realized (gets a buffer)
# when its inlined body loads more than ``config.realize_reads_threshold`` buffers or, on
# CPU, uses one of these ops; inlining it would redo that work in every consumer. Any
# pointwise value, however many consumers, is realized once its body loads more than the
# accumulated-reads threshold (``StorageBox.has_exceeded_max_reads``). Both thresholds are
# read from Inductor's live config when a graph is analysed (``compat.realize_thresholds``).
# Aten ops (after Inductor's decompositions) whose lowering uses one of the heavy ops
# ``should_realize_on_reuse`` lists for CPU: exp, log, log10, log1p, log2, sigmoid, tanh.
_HEAVY_ON_CPU = frozenset({
    "exp", "exp_", "log", "log_", "log10", "log1p", "log2", "sigmoid", "sigmoid_", "tanh", "tanh_",
    "logaddexp", "softplus", "silu", "mish", "logit", "log_sigmoid_forward",
})


def _uses_heavy_op(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, compat.OpOverload) and target.overloadpacket.__name__ in _HEAVY_ON_CPU


def _on_cpu(node: fx.Node) -> bool:
    val = tensor_value(node)
    return val is not None and val.device.type == "cpu"


def _realized_anyway(node: fx.Node, reads: frozenset[fx.Node], heavy: bool) -> bool:
    """Inductor gives pointwise ``node`` a buffer although every consumer could fuse it:
    its inlined body (itself and the unrealized pointwise values it reads) loads
    ``reads`` and, with ``heavy``, uses an op ``should_realize_on_reuse`` calls heavy."""
    cpu = _on_cpu(node)
    reads_threshold, accumulated_threshold = compat.realize_thresholds(cpu)
    if len(reads) > accumulated_threshold:
        return len(reads) > 1  # ``realize_hint``: realized when it loads more than one buffer
    if len(node.users) > 1:
        return (cpu and heavy) or len(reads) > reads_threshold
    return False


def view_base(node: fx.Node) -> fx.Node:
    """The node whose value ``node`` views, through a chain of views (``node`` if none)."""
    while is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def with_view_bases(kept: Iterable[fx.Node]) -> set[fx.Node]:
    """``kept`` and the nodes its views are views of: a kept view keeps its base's buffer
    (a fused base would leave the view without storage)."""
    found = set()
    for node in kept:
        while node not in found:
            found.add(node)
            if not (is_view(node) and node.args and isinstance(node.args[0], fx.Node)):
                break
            node = node.args[0]
    return found


def _consumers_fuse(node: fx.Node, copies: bool = False) -> bool:
    """Every consumer of ``node`` fuses it: pointwise and reduction consumers, views
    (Inductor indexes an unrealized value through a view without a buffer) whose own
    consumers fuse it, and, with ``copies``, the views Inductor copies
    (``_copied_view_candidate``: the copy's kernel inlines ``node``)."""
    return bool(node.users) and all(
        fuses_into(u) or loads_inputs_in_loop(u)
        or (is_view(u) and (_consumers_fuse(u) or (copies and _copied_view_candidate(u))))
        for u in node.users)


# Extern kernels for which ``GraphLowering.run_node`` fixes the layout of an input that has
# more than one consumer (its ``need_fixed_layout``, torch 2.11-2.14; the convolution only
# when layout optimization is off, and the mkldnn ops never appear in a joint graph).
_FIXED_LAYOUT_USERS = frozenset({"mm", "_int_mm", "convolution_backward"})


def _copied_view_candidate(node: fx.Node) -> bool:
    """A view of a pointwise value that Inductor copies into a buffer of its own when the
    value is not realized: the view has more than one consumer and one of them is a
    ``_FIXED_LAYOUT_USERS`` kernel, so ``run_node`` requires its stride order
    (``ExternKernel.require_stride_order``), and a view of an unrealized value has no
    storage to reinterpret: ``copy_input`` makes one (unless the value's body loads more
    than one tensor at a varying index, ``_nontrivial_reads``: the view's ``realize_hint``
    then realizes the value itself first, and the view reads its buffer). The value itself
    stays unrealized, and its other consumers compute it again inline, reading its inputs
    (measured on the contract's MLP-mixer: the loss gradient, copied for the last linear's
    matmuls and recomputed in the residual's backward kernel, keeps the saved tensor it
    reads alive past its in-place reuse)."""
    if not (is_view(node) and node.args and isinstance(node.args[0], fx.Node) and is_pointwise(node.args[0])):
        return False
    return len(node.users) > 1 and any(
        u.op == "call_function" and isinstance(u.target, compat.OpOverload)
        and u.target.overloadpacket.__name__ in _FIXED_LAYOUT_USERS for u in node.users)


def _nontrivial_reads(reads: Iterable[fx.Node]) -> int:
    """The tensor loads of an inlined body at a varying index (``OpCounterCSE``'s
    ``nontrivial_read_count``): a tensor of one element, such as the loss's incoming
    gradient, is loaded at a constant index, also through a view (``expand``)."""
    count = 0
    for read in reads:
        val = tensor_value(view_base(read))
        count += val is not None and val.numel() != 1
    return count


def copy_candidates(nodes: Iterable[fx.Node], fusable: frozenset[fx.Node]) -> dict[fx.Node, fx.Node]:
    """The views Inductor may copy (``_copied_view_candidate``) because the value they view
    may be inlined (in ``fusable``, ``fusable_nodes`` with a ``may_copy``), each with that
    value, in graph order."""
    return {n: n.args[0] for n in nodes if n.args and n.args[0] in fusable and _copied_view_candidate(n)}


def inlined_values(nodes: Iterable[fx.Node], fusable: frozenset[fx.Node]) -> frozenset[fx.Node]:
    """The values of ``fusable`` that Inductor inlines whatever the plan: those whose view it
    may copy (``copy_candidates``) are realized when their body loads more than one tensor."""
    return fusable - frozenset(copy_candidates(nodes, fusable).values())


def copy_decisions(candidates: dict[fx.Node, fx.Node], fused: set[fx.Node],
                   loads: Callable[[fx.Node, set[fx.Node]], Iterable[fx.Node]]) -> tuple[frozenset[fx.Node], set[fx.Node]]:
    """Which candidate views (``copy_candidates``) Inductor copies when ``fused`` are the
    inlined values, and those values less the ones it realizes instead: a value whose
    inlined body loads more than one tensor at a varying index (``loads(value, fused)``,
    counted by ``_nontrivial_reads``) is realized by the view's ``realize_hint``, and the
    view reads its buffer. In graph order: a realized value is one load for the later ones."""
    copies = set()
    fused = set(fused)
    for view, value in candidates.items():
        if value not in fused:
            continue
        if _nontrivial_reads(loads(value, fused)) <= 1:
            copies.add(view)
        else:
            fused.discard(value)
    return frozenset(copies), fused


def fusable_nodes(nodes: Iterable[fx.Node],
                  may_copy: Callable[[fx.Node], bool] | None = None) -> frozenset[fx.Node]:
    """Pointwise nodes Inductor inlines into every consumer: each consumer fuses them
    (pointwise or reduction) and Inductor's store-or-inline rule does not realize them
    (``_realized_anyway``). They get no buffer of their own unless something keeps them
    (``passes.memory.fused_nodes``). ``nodes`` in graph order: a node's loads go through
    the fused nodes it reads, as Inductor's inlined bodies do. Where ``may_copy(node)``, a
    view Inductor may copy (``copy_candidates``) counts as a consumer that fuses ``node``
    (meant for nodes no plan saves). Such a node is inlined only if the plan leaves its body
    loading at most one tensor (``copy_decisions``); otherwise it is realized."""
    fusable: dict[fx.Node, tuple[frozenset[fx.Node], bool]] = {}  # node -> (its loads, heavy)
    for node in nodes:
        if is_view(node) and node.args and node.args[0] in fusable and _consumers_fuse(node):
            fusable[node] = fusable[node.args[0]]  # a view of an inlined value is inlined too
            continue
        if not is_pointwise(node):
            continue
        if not _consumers_fuse(node, may_copy is not None and may_copy(node)):
            continue
        reads: set[fx.Node] = set()
        heavy = _uses_heavy_op(node)
        for arg in node.all_input_nodes:
            if arg in fusable:
                arg_reads, arg_heavy = fusable[arg]
                reads |= arg_reads
                heavy = heavy or arg_heavy
            elif tensor_value(arg) is not None:
                reads.add(arg)
        frozen = frozenset(reads)
        if not _realized_anyway(node, frozen, heavy):
            fusable[node] = (frozen, heavy)
    return frozenset(fusable)


_CONVOLUTIONS = ("convolution", "convolution_backward")


def is_convolution(node: fx.Node) -> bool:
    """``aten.convolution`` and its backward: the ops Inductor's layout optimization serves."""
    target = node.target
    return node.op == "call_function" and isinstance(target, compat.OpOverload) and (
        target.overloadpacket.__name__ in _CONVOLUTIONS)


def layout_copies(nodes: Iterable[fx.Node], steady: Iterable[fx.Node]) -> dict[fx.Node, int]:
    """Steady tensors (parameters, user inputs) Inductor copies into a channels-last buffer
    because a convolution reads them, with the copy's bytes.

    With layout optimization on (``GraphLowering.decide_layout_opt``), the inputs and
    outputs of convolutions and the values feeding them prefer channels-last
    (``find_nodes_prefer_channels_last``); a graph input in another layout is copied
    once, at the start of the graph, and the copy is what the forward's convolutions read
    and what the backward receives when the input is saved for it (measured on the
    contract's conv+BN model: its input and its four weights, 0.12 MiB, live from the
    forward's first kernel to the backward's convolutions). Decided for CPU graphs only,
    where Inductor turns it on whenever mkldnn can run every convolution
    (``compat.inductor_channels_last_convolutions``); elsewhere its choice rests on a flop
    model this does not copy, and no copy is counted."""
    steady = set(steady)
    convolutions = [n for n in nodes if is_convolution(n) and n.target._opname == "convolution"]
    if not convolutions or not compat.inductor_channels_last_convolutions(
            [tensor_value(arg) for n in convolutions for arg in n.args[:2] if isinstance(arg, fx.Node)]):
        return {}
    copies = {}
    for conv in convolutions:
        for arg in conv.args[:2]:
            val = tensor_value(arg) if isinstance(arg, fx.Node) else None
            if arg in steady and val is not None and val.dim() == 4 and not val.is_contiguous(
                    memory_format=torch.channels_last):
                copies[arg] = allocation_bytes(val)
    return copies


@dataclass
class JointAnalysis:
    """The joint graph split into forward and backward, with storage facts."""

    joint: compat.JointGraph
    fw_nodes: list[fx.Node]  # required forward nodes, joint order (primals included)
    bw_nodes: list[fx.Node]  # required backward nodes, joint order (tangents included)
    fw_outputs: list[fx.Node]  # user outputs of the forward
    bw_outputs: list[fx.Node]  # gradients
    position: dict[fx.Node, int]
    roots: dict[fx.Node, fx.Node]
    bytes_of: dict[fx.Node, int]  # storage bytes a node allocates (0 if it allocates none)
    steady: frozenset[fx.Node]  # primal inputs: parameters and user inputs, not counted
    ban: dict[fx.Node, str]  # forward nodes that must not be recomputed, with the reason
    forward_side: frozenset[fx.Node]
    # The code generator the memory model follows (``passes.inductor.rules``): whether to
    # simulate Inductor's fusion (see passes.memory), with Triton's or the C++ backend's rules.
    rules: KernelRules = PYTHON
    # Graph facts the solver reads for every candidate plan, computed once:
    # ``node.all_input_nodes`` (a property that builds a list per call) ...
    inputs: dict[fx.Node, tuple[fx.Node, ...]] = field(default_factory=dict)
    # ... and the input whose storage each node's output shares (``_aliased_input``).
    alias_parent: dict[fx.Node, fx.Node | None] = field(default_factory=dict)
    # ... and the nodes fusion may leave without a buffer (``fusable_nodes``): each plan
    # then only takes away the ones it keeps.
    fusable: frozenset[fx.Node] = frozenset()
    # ... and the realized nodes Inductor runs as one kernel (``passes.inductor.kernel_local``), and the
    # values it keeps inside one with all their readers: no buffer either, unless a plan saves them.
    kernels: tuple[frozenset[fx.Node], ...] = ()
    kernel_local: frozenset[fx.Node] = frozenset()
    # The kernel each cycle of units met while running the kernels of some saved set runs
    # apart (``kernel_local.fused_kernel_order``): filled as plans are simulated. Plans of a
    # sequence differ by a move, and the same layer's cycles come back in each.
    kernel_cycles: dict = field(default_factory=dict, repr=False, compare=False)
    # ... and the order of each run of overlapping kernels met (most come back unchanged).
    kernel_runs: dict = field(default_factory=dict, repr=False, compare=False)
    # Where a horizontal fusion may not run a kernel ahead of its place (``rules.fusion_pulls``
    # False: a memory budget), a kernel's parts joined by a shared read (``kernel_parts``;
    # ``kernel_inlined``: what stores no buffer) stay apart where joining them would pull one ahead.
    kernel_parts: dict = field(default_factory=dict, repr=False, compare=False)
    kernel_inlined: frozenset[fx.Node] = frozenset()
    # Each kernel member's kernel and part: (its index in ``kernels``, its part's index in
    # ``kernel_parts``, 0 for a kernel of one part). Triton's in-place rule reads which steps
    # share a kernel and a part (``memory.Program.kernel_of_step``).
    kernel_index: dict[fx.Node, tuple[int, int]] = field(default_factory=dict, repr=False, compare=False)
    # ... and the views Inductor may copy, each with the value it views (``copy_candidates``),
    # with the bytes of each copy: each plan decides which it copies (``copy_decisions``).
    copy_candidates: dict[fx.Node, fx.Node] = field(default_factory=dict)
    copy_bytes: dict[fx.Node, int] = field(default_factory=dict)
    # ... and, for the walks every saved set repeats (``passes.memory``: recomputed nodes,
    # forward nodes needed, the just-in-time backward order): each node's inputs on the
    # forward side (``inputs`` filtered by ``is_forward``, same order), the forward-side
    # inputs the backward nodes read (joint order, each once) and, for each forward node,
    # the indices in ``bw_nodes`` of the backward nodes reading it.
    fw_inputs: dict[fx.Node, tuple[fx.Node, ...]] = field(default_factory=dict)
    bw_reads: tuple[fx.Node, ...] = ()
    bw_readers: dict[fx.Node, tuple[int, ...]] = field(default_factory=dict)
    # ... and the storages each node reads (the roots of its inputs, in order, each once).
    input_roots: dict[fx.Node, tuple[fx.Node, ...]] = field(default_factory=dict)
    # Under Inductor, the steady inputs (parameters, user inputs) it copies into a
    # channels-last buffer for the convolutions that read them (``layout_copies``), with
    # the copy's bytes.
    layout_copies: dict[fx.Node, int] = field(default_factory=dict)
    # ... and the bytes an extern op holds while it runs beyond its outputs (a CPU
    # convolution's backward: ``compile_offload.inductor.op_workspace``, measured by the caller).
    workspace_bytes: dict[fx.Node, int] = field(default_factory=dict)
    # ... and, under Inductor, the CUDA attention kernels that copy their broadcast bias
    # whole when their graph computes it (``attention_bias_copies``): kernel -> (the bias
    # view, the copy's bytes). Each plan decides where the bias is computed.
    bias_copies: dict[fx.Node, tuple[fx.Node, int]] = field(default_factory=dict)

    def is_forward(self, node: fx.Node) -> bool:
        """Forward side: needed by the forward, or needed by neither side yet (torch's
        "unclaimed" nodes, e.g. a GELU derivative that reads only forward values): both
        can run in the forward and be saved, or be recomputed in the backward."""
        return node in self.forward_side

    @property
    def fusion(self) -> bool:
        """Inductor's pointwise fusion is simulated (see passes.memory)."""
        return self.rules.fusion

    @property
    def triton_kernels(self) -> bool:
        """The kernels are Triton's (an accelerator's graph) rather than the C++ backend's:
        their loops need not line up, and a kernel a cycle breaks keeps what does not wait on it."""
        return self.rules.triton

    @property
    def fusion_pulls(self) -> bool:
        """A horizontal fusion may run a kernel ahead of its place (Inductor's default)."""
        return self.rules.fusion_pulls

    def storage_bytes(self, node: fx.Node) -> int:
        return self.bytes_of.get(self.roots.get(node, node), 0)

    @cached_property
    def fw_needed_by_outputs(self) -> tuple[frozenset[fx.Node], tuple[fx.Node, ...]]:
        """The forward-side nodes the user outputs need (through forward-side inputs), and
        those of them in ``fw_nodes``, in that order: ``passes.memory.forward_nodes_needed``
        with nothing saved, the part every saved set shares."""
        needed: set[fx.Node] = set()
        stack = list(self.fw_outputs)
        while stack:
            node = stack.pop()
            if node in needed or node not in self.forward_side:
                continue
            needed.add(node)
            stack.extend(self.fw_inputs[node])
        return frozenset(needed), tuple(n for n in self.fw_nodes if n in needed)

    @cached_property
    def generated_kernels(self) -> frozenset[fx.Node]:
        """The nodes Inductor runs as kernels it generates (``kernel_local.is_generated_kernel``),
        asked for every step of every plan's program on the CPU (``passes.memory.in_cpp_call``)."""
        return frozenset(n for n in self.position if n.op == "call_function" and is_generated_kernel(n))

    @cached_property
    def calls(self) -> frozenset[fx.Node]:
        """The nodes that run a kernel (``call_function``), the only ones a step time sums:
        a set, so summing a plan's times filters its nodes in C (``solve._seconds_of``)."""
        return frozenset(n for n in self.position if n.op == "call_function")


class UnsupportedGraph(NotImplementedError):
    """A joint graph the planner is known not to handle. The backend falls back to torch's
    own partition for it (correct, without the budget) with one warning; any other error
    is a bug and raises (unless ``config.suppress_errors``)."""


def unsupported_nodes(graph: fx.Graph) -> list[str]:
    """What in ``graph`` the planner cannot partition: higher-order ops with subgraphs
    (``torch.cond``, ``while_loop``, ``flex_attention``, ...). Their branches are
    ``get_attr`` submodules, which a plan would save like tensors (the backward compile
    then fails on a placeholder without a value)."""
    owner = graph.owning_module
    found = set()
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(owner, str(node.target), None), torch.nn.Module):
            users = [u.target for u in node.users if u.op == "call_function"]
            found |= {f"higher-order op {getattr(t, '__name__', t)}" for t in users} or {f"submodule {node.target}"}
    return sorted(found)


def analyze_joint(joint: compat.JointGraph, rules: KernelRules = PYTHON,
                  workspaces: Callable[[list[fx.Node]], dict[fx.Node, int]] | None = None) -> JointAnalysis:
    """The analysis every plan of ``joint`` reads, for the code generator ``rules`` names
    (``passes.inductor.rules``: Inductor's Triton or C++ kernels, or the graphs run as
    written; Inductor's for the graph's device where the generator is None).
    ``workspaces(nodes)``: node -> the bytes it holds while it runs beyond its outputs
    (``JointAnalysis.workspace_bytes``)."""
    graph = joint.gm.graph
    rules = rules.for_nodes(graph.nodes)
    fusion = rules.fusion
    unsupported = unsupported_nodes(graph)
    if unsupported:
        raise UnsupportedGraph(f"unsupported in the joint graph: {', '.join(unsupported)}")
    info = joint.node_info
    nodes = list(graph.nodes)
    output = nodes[-1]
    outputs = list(output.args[0])
    fw_outputs = [o for o in outputs[: joint.num_fwd_outputs] if isinstance(o, fx.Node)]
    bw_outputs = [o for o in outputs[joint.num_fwd_outputs :] if isinstance(o, fx.Node)]
    steady = frozenset(n for n in nodes if n.op == "placeholder" and not is_tangent(n))
    bw_nodes = [n for n in nodes if n.op != "output" and (info.is_required_bw(n) or is_tangent(n))]
    bw_set = set(bw_nodes)
    # Views Inductor may copy (``copy_candidates``), of backward values only: no plan saves
    # those; whether it copies them depends on what the plan inlines (``copy_decisions``).
    fusable = fusable_nodes(nodes, bw_set.__contains__)
    candidates = copy_candidates(nodes, fusable) if fusion else {}
    roots = storage_roots(graph)
    fw_nodes = [n for n in nodes if n.op != "output" and n not in bw_set]
    bytes_of = {n: (0 if n in steady else allocated_bytes(n, roots)) for n in nodes if n.op != "output"}
    ban = {}
    for n in fw_nodes:
        reason = recompute_ban_reason(n)
        if reason is not None:
            ban[n] = reason
    # An input the graph mutates holds its new value by the time the backward runs, so a
    # node reading it (or a view of it) computes something else when recomputed there
    # (pytorch/pytorch#197039).
    mutated = mutated_inputs(graph, roots)
    for n in fw_nodes:
        if n not in ban and n.op == "call_function" and any(roots.get(arg, arg) in mutated for arg in n.all_input_nodes):
            ban[n] = "reads an input that the graph mutates"
    forward_side = frozenset(fw_nodes)
    position = {n: i for i, n in enumerate(nodes)}
    groups = (kernel_groups(nodes, inlined_values(nodes, fusable), position, steady.__contains__,
                            forward_side.__contains__, cpu=not rules.triton) if fusion else KernelGroups((), frozenset()))
    inputs = {n: tuple(n.all_input_nodes) for n in nodes}
    fw_inputs = {n: tuple(arg for arg in args if arg in forward_side) for n, args in inputs.items()}
    bw_readers: dict[fx.Node, list[int]] = {}
    for index, n in enumerate(bw_nodes):
        for arg in dict.fromkeys(fw_inputs[n]):
            bw_readers.setdefault(arg, []).append(index)
    bw_reads = tuple(dict.fromkeys(arg for n in bw_nodes for arg in fw_inputs[n]))
    return JointAnalysis(
        joint=joint,
        fw_nodes=fw_nodes,
        bw_nodes=bw_nodes,
        fw_outputs=fw_outputs,
        bw_outputs=bw_outputs,
        position=position,
        roots=roots,
        bytes_of=bytes_of,
        steady=steady,
        ban=ban,
        forward_side=forward_side,
        rules=rules,
        inputs=inputs,
        alias_parent={n: _aliased_input(n) for n in nodes},
        fusable=fusable,
        kernels=groups.kernels,
        kernel_local=groups.local,
        kernel_parts=groups.parts,
        kernel_inlined=groups.inlined,
        kernel_index=_kernel_index(groups),
        copy_candidates=candidates,
        copy_bytes={view: allocation_bytes(tensor_value(view)) for view in candidates},
        layout_copies=layout_copies(nodes, steady) if fusion else {},
        workspace_bytes=workspaces(nodes) if workspaces is not None else {},
        bias_copies=attention_bias_copies(nodes) if fusion else {},
        fw_inputs=fw_inputs,
        bw_reads=bw_reads,
        bw_readers={node: tuple(indices) for node, indices in bw_readers.items()},
        input_roots={n: tuple(dict.fromkeys(roots.get(arg, arg) for arg in args)) for n, args in inputs.items()},
    )


def _kernel_index(groups: KernelGroups) -> dict[fx.Node, tuple[int, int]]:
    """``JointAnalysis.kernel_index``: a node listed with two kernels (an inlined value)
    goes with the first, as it runs there."""
    index: dict[fx.Node, tuple[int, int]] = {}
    for number, kernel in enumerate(groups.kernels):
        for part_number, part in enumerate(groups.parts.get(kernel, (kernel,))):
            for node in part:
                index.setdefault(node, (number, part_number))
    return index


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in str(node.target)
