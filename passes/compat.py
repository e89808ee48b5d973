"""Every private torch API the passes use, wrapped in one place.

The passes' one door to private torch names (``tests/test_private_torch_names.py`` keeps it
so): no other module under ``passes/`` imports or reaches one. The passes cannot import
``compile_offload``, so this is the second door beside ``compile_offload/torch_api/``.
Grouped by torch area below; checked on torch 2.11-2.14 (installed: 2.13).

torch's partitioner internals drift between releases; each wrapper here is the only caller
of its private function, so a version difference is fixed once. ``tests/passes/test_compat.py``
exercises each wrapper on the installed torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._functorch import partitioners as _p

# --- torch._ops ---------------------------------------------------------------------------------
# An aten overload such as aten.mm.default, and the class of higher-order ops; torch.utils.flop_counter
# itself relies on them and on OpOverload._schema.

OpOverload = torch._ops.OpOverload
HigherOrderOperator = torch._ops.HigherOrderOperator

# --- torch.utils._pytree ------------------------------------------------------------------------

tree_flatten = torch.utils._pytree.tree_flatten

# --- torch.utils._python_dispatch ---------------------------------------------------------------

try:
    # The planner may run inside a compile where a FakeTensorMode or a user's dispatch mode is
    # active; our meta-tensor flop counting must not be seen by them.
    from torch.utils._python_dispatch import _disable_current_modes as outside_dispatch_modes
except ImportError:  # pragma: no cover - present in every supported torch (2.11-2.14)
    outside_dispatch_modes = contextlib.nullcontext


def is_traceable_wrapper_subclass(val) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass as check

    return check(val)


# --- torch._prims_common ------------------------------------------------------------------------


def is_non_overlapping_and_dense(val: torch.Tensor) -> bool:
    from torch import _prims_common  # the function was renamed in torch 2.13

    fn = getattr(_prims_common, "is_non_overlapping_and_dense_or_false", None) or _prims_common.is_non_overlapping_and_dense
    return bool(fn(val))


# --- torch._guards ------------------------------------------------------------------------------


def detect_fake_mode(values):
    from torch._guards import detect_fake_mode as detect

    return detect(values)


# --- torch._functorch.partitioners (and torch._library's FakeScriptObject) -----------------------


@dataclass
class JointGraph:
    """The joint graph prepared the way torch's min-cut partitioner prepares it."""

    gm: fx.GraphModule
    node_info: _p.NodeInfo
    num_fwd_outputs: int
    static_lifetime_input_indices: list[int]
    has_recomputable_rng_ops: bool  # user activation-checkpoint regions with random ops

    @property
    def static_lifetime_input_nodes(self):
        return self.node_info.static_lifetime_input_nodes


_EXTRACT_TAKES_OPAQUE = "saved_opaque_nodes" in inspect.signature(_p._extract_fwd_bwd_modules).parameters


def _is_opaque_node(node: fx.Node) -> bool:
    # torch >= 2.12 has partitioners.is_opaque_node; 2.11 only knows FakeScriptObject values.
    check = getattr(_p, "is_opaque_node", None)
    if check is not None:
        return check(node)
    from torch._library.fake_class_registry import FakeScriptObject

    return isinstance(node.meta.get("val"), FakeScriptObject)


def _is_assert_only_symbool(node: fx.Node) -> bool:
    """A SymBool used only by ``_assert_scalar`` is not saved (module level in torch >= 2.13,
    local to the partitioner in 2.12, absent in 2.11: the same rule everywhere)."""
    check = getattr(_p, "_is_assert_only_symbool", None)
    if check is not None:
        return check(node)
    return (
        isinstance(node.meta.get("val"), torch.SymBool)
        and len(node.users) > 0
        and all(user.target is torch.ops.aten._assert_scalar.default for user in node.users)
    )


def prepare_joint(
    joint_gm: fx.GraphModule, num_fwd_outputs: int, static_lifetime_input_indices: list[int] | None
) -> JointGraph:
    """DCE, CSE, user-checkpoint tag cleanup, forced saves and node classification.

    Mirrors the first half of ``min_cut_rematerialization_partition``: mutation sources,
    collectives and effectful ops are marked ``MUST_SAVE`` there, and we honour that mark.
    """
    joint_gm.graph.eliminate_dead_code()
    if _p.config.cse:
        joint_gm.graph = _p.fx_graph_cse(joint_gm.graph)  # setting the graph recompiles the module
    else:
        joint_gm.recompile()
    has_rng = _p.has_recomputable_rng_ops(joint_gm)
    if _p.has_recomputable_ops(joint_gm):
        joint_gm = _p.cleanup_recompute_tags(joint_gm, is_default_partition=False)
    if not _p.config.unsafe_allow_optimization_of_collectives:
        _p.force_save_collectives(joint_gm)
    _p.force_save_effectful_ops(joint_gm)
    _p.force_save_bw_mutation_src(joint_gm)
    static = list(static_lifetime_input_indices or [])
    node_info = _p.classify_nodes(joint_gm, static, num_fwd_outputs)
    return JointGraph(joint_gm, node_info, num_fwd_outputs, static, has_rng)


def has_backward(joint: JointGraph) -> bool:
    return len(joint.node_info.required_bw_nodes) > 0


def _set_dist_from_bw(joint: JointGraph) -> None:
    """Each node's distance to the backward, which torch's partitioner reads (set by
    ``min_cut_rematerialization_partition`` before it chooses a saved set)."""
    for node in reversed(joint.gm.graph.nodes):
        if node.op == "output" or not joint.node_info.is_required_fw(node):
            node.dist_from_bw = int(1e9) if node.op == "output" else 0
        else:
            node.dist_from_bw = min((user.dist_from_bw + 1 for user in node.users), default=int(1e9))


def min_cut_saved_values(joint: JointGraph) -> list[fx.Node]:
    """The saved set torch.compile's default partitioner chooses (no memory budget)."""
    _set_dist_from_bw(joint)
    return list(_p.choose_saved_values_set(joint.gm.graph, joint.node_info, memory_budget=1.0))


def budget_saved_values(joint: JointGraph, memory_budget: float) -> list[fx.Node]:
    """The saved set torch.compile's partitioner chooses under
    ``torch._functorch.config.activation_memory_budget = memory_budget`` (its knapsack over
    the nodes its min-cut would not recompute; 0.0 saves only the inputs, recomputing the
    whole forward). The solver and runtime estimator are those of the current
    ``torch._functorch.config``."""
    if not 0.0 <= memory_budget <= 1.0:
        raise ValueError(f"activation_memory_budget must be in [0, 1], got {memory_budget!r}")
    _set_dist_from_bw(joint)  # its min-cut, the knapsack's start, runs inside choose_saved_values_set
    with _p.config.patch(activation_memory_budget=memory_budget):
        return list(_p.choose_saved_values_set(joint.gm.graph, joint.node_info, memory_budget=memory_budget))


def is_sym_node(node: fx.Node) -> bool:
    return _p.is_sym_node(node)


def must_save(node: fx.Node) -> bool:
    """Tagged MUST_SAVE by torch (mutation sources, collectives, effectful ops) or the user."""
    return node.meta.get("recompute") == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE


def must_be_in_forward(node: fx.Node) -> bool:
    """Tagged or inferred by torch as forward-only (mutations): never in the backward."""
    return _p._must_be_in_forward(node)


@functools.cache
def random_ops() -> frozenset:
    # torch builds its op lists anew on every call (a tenth of the analysis of a GPT-8
    # joint graph when asked once per node); they are fixed for a torch version.
    return frozenset(_p.get_default_op_list().random_ops)


def extract_forward_backward(
    joint: JointGraph, saved_values: list[fx.Node]
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Build forward and backward GraphModules that save exactly ``saved_values``.

    Anything else the backward needs is recomputed there from the saved values. Mirrors the
    second half of ``min_cut_rematerialization_partition``.
    """
    saved_sym_nodes = [n for n in saved_values if _p.is_sym_node(n) and not _is_assert_only_symbool(n)]
    opaque_kwargs = {}
    saved_tensors = [n for n in saved_values if not _p.is_sym_node(n)]
    if _EXTRACT_TAKES_OPAQUE:  # torch >= 2.12; 2.11 separates opaque objects itself
        opaque_kwargs["saved_opaque_nodes"] = [n for n in saved_tensors if _is_opaque_node(n)]
        saved_tensors = [n for n in saved_tensors if not _is_opaque_node(n)]
    fw_module, bw_module = _p._extract_fwd_bwd_modules(
        joint.gm,
        saved_tensors,
        saved_sym_nodes=saved_sym_nodes,
        num_fwd_outputs=joint.num_fwd_outputs,
        static_lifetime_input_nodes=joint.node_info.static_lifetime_input_nodes,
        **opaque_kwargs,
    )
    if joint.has_recomputable_rng_ops:
        fw_module, bw_module = _p.functionalize_rng_ops(joint.gm, fw_module, bw_module, len(saved_sym_nodes))
    bw_module = _p.reordering_to_mimic_autograd_engine(bw_module)
    fw_module = _p.raise_getitems(fw_module)
    bw_module = _p.raise_getitems(bw_module)
    fw_module = _p.thread_graphsafe_rng_from_hops(fw_module, is_backward=False)
    bw_module = _p.thread_graphsafe_rng_from_hops(bw_module, is_backward=True)
    return fw_module, bw_module


def default_partition(joint: JointGraph, joint_inputs) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's min-cut partition, for graphs our planner does not handle."""
    return _p.min_cut_rematerialization_partition(
        joint.gm,
        joint_inputs,
        compiler="inductor",
        num_fwd_outputs=joint.num_fwd_outputs,
        static_lifetime_input_indices=joint.static_lifetime_input_indices,
    )


# --- torch._inductor ----------------------------------------------------------------------------


def inductor_joint_passes(joint_gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """Inductor's joint-graph passes (pattern rewrites, no-op removal, ...), as
    ``compile_fx``'s partition function runs them on the joint graph before any partitioner
    sees it: the graph torch.compile partitions, which the backend's and ``explain``'s plans
    see through ``compile_fx``. Older torch versions transform in place and return None, and
    take no ``input_device``."""
    import inspect

    from torch._inductor.compile_fx import _recursive_joint_graph_passes

    parameters = inspect.signature(_recursive_joint_graph_passes).parameters
    kwargs = {"skip_invoke_subgraph": True} if "skip_invoke_subgraph" in parameters else {}
    if "input_device" in parameters:
        kwargs["input_device"] = device
    result = _recursive_joint_graph_passes(joint_gm, **kwargs)
    return joint_gm if result is None else result


@dataclass(frozen=True)
class BmmDotRule:
    """Where Inductor lowers an accelerator ``bmm`` of a row by a column (M = N = 1) to a
    product and a sum: these dtypes, K at most ``max_k``."""

    dtypes: tuple
    max_k: int


@functools.cache
def bmm_dot_rule() -> BmmDotRule | None:
    """torch 2.13's ``tuned_bmm`` rule for dot-shaped ``bmm`` on CUDA and XPU (its private
    ``_BMM_DOT_DECOMPOSE_DTYPES`` and ``_BMM_DOT_K_DECOMPOSE_THRESHOLD``); None on a torch
    without it (every such ``bmm`` is a GEMM there)."""
    try:
        from torch._inductor.kernel import bmm
    except ImportError:
        return None
    dtypes = getattr(bmm, "_BMM_DOT_DECOMPOSE_DTYPES", None)
    max_k = getattr(bmm, "_BMM_DOT_K_DECOMPOSE_THRESHOLD", None)
    if dtypes is None or max_k is None:
        return None
    return BmmDotRule(tuple(dtypes), int(max_k))


def inductor_writes_in_place() -> bool:
    """Whether Inductor writes a kernel's output into a buffer it reads last
    (``torch._inductor.config.inplace_buffers``): a buffer its graph computes. A saved
    tensor the backward receives is written into only where AOTAutograd donates it too
    (``inductor_overwrites_saved``). Read at plan time, so a patched config is followed."""
    try:
        from torch._inductor import config as inductor_config
    except ImportError:  # pragma: no cover - a torch without Inductor
        return False
    return bool(getattr(inductor_config, "inplace_buffers", False))


def inductor_overwrites_saved() -> bool:
    """Whether Inductor's backward may write a kernel's output into a saved tensor it reads
    last: ``torch._inductor.config.inplace_buffers`` (in-place reuse at all) and
    ``torch._functorch.config.donated_buffer`` (AOTAutograd hands the backward its saved
    tensors to overwrite; torch 2.6 on). Read at plan time, so a patched config is followed."""
    if not inductor_writes_in_place():
        return False
    from torch._functorch import config as functorch_config

    return bool(getattr(functorch_config, "donated_buffer", False))


def inductor_channels_last_convolutions(conv_args) -> bool:
    """Whether Inductor's layout optimization (``GraphLowering.decide_layout_opt``) puts the
    convolutions of a graph whose convolution inputs and weights are ``conv_args`` (fake
    tensors) in channels-last, as far as it is decided without a flop model:
    ``config.layout_optimization`` on and either ``force_layout_optimization`` or every
    argument on the CPU with mkldnn enabled and available (the same rule in torch
    2.11-2.14). False where Inductor would weigh flops (GPUs)."""
    try:
        from torch._inductor import config
    except ImportError:  # pragma: no cover - a torch without Inductor
        return False
    if not getattr(config, "layout_optimization", False):
        return False
    if getattr(config, "force_layout_optimization", False):
        return True
    return (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()
            and all(arg is not None and arg.device.type == "cpu" for arg in conv_args))


def realize_thresholds(cpu: bool) -> tuple[int, int]:
    """Inductor's store-or-inline thresholds, read from its live config as its lowering reads
    them (torch 2.11-2.14): ``realize_reads_threshold`` (a value read by more than one
    consumer whose body loads more buffers is realized: ``StorageBox.should_realize_on_reuse``)
    and the accumulated-reads threshold (any value whose body loads more is realized:
    ``StorageBox.has_exceeded_max_reads``), which is ``realize_acc_reads_threshold`` where set,
    else ``realize_cpu_acc_reads_threshold`` on the CPU and ``_realize_acc_reads_threshold_default``
    elsewhere. A config without a name gets the value torch 2.11-2.14 ship (4; 12 and 8)."""
    try:
        from torch._inductor import config
    except ImportError:  # pragma: no cover - a torch without Inductor
        config = None
    reads = getattr(config, "realize_reads_threshold", 4)
    accumulated = getattr(config, "realize_acc_reads_threshold", None)
    if accumulated is None:
        accumulated = (getattr(config, "realize_cpu_acc_reads_threshold", 12) if cpu
                       else getattr(config, "_realize_acc_reads_threshold_default", 8))
    return reads, accumulated


# --- torch.fx (its private _BoxedCodeGen; size hints of torch.fx.experimental) -------------------


_planning_sizes: contextvars.ContextVar[dict[str, int]] = contextvars.ContextVar("planning_sizes", default={})


@contextlib.contextmanager
def planning_sizes(sizes: dict[str, int]):
    """Plan with these size symbols (by name) at these sizes in place of their hints
    (``size_hint``, ``at_planning_sizes``) while the block runs."""
    token = _planning_sizes.set(dict(sizes))
    try:
        yield
    finally:
        _planning_sizes.reset(token)


def at_planning_sizes(expr):
    """``expr`` (a sympy expression) with the symbols ``planning_sizes`` names at its sizes."""
    sizes = _planning_sizes.get()
    if not sizes or not hasattr(expr, "free_symbols"):
        return expr
    import sympy

    return expr.xreplace({s: sympy.Integer(sizes[s.name]) for s in expr.free_symbols if s.name in sizes})


def size_hint(value) -> int:
    """A concrete int for a possibly symbolic size: the size the graph is planned for. That
    is the size of the call that compiled it, the size a user named with
    ``torch._dynamo.mark_dynamic(x, dim, hint_override=n)`` (torch 2.13 makes that override
    the symbol's hint; it is substituted here too, so a torch that records the override
    beside the hint, ``ShapeEnv.var_to_hint_override``, plans for it alike), or else one
    that ``planning_sizes`` names."""
    if isinstance(value, int):
        return value
    from torch.fx.experimental import symbolic_shapes

    overrides = getattr(value.node.shape_env, "var_to_hint_override", None) or {}
    expr = value.node.expr
    bounded = at_data_dependent_bounds(expr, value.node.shape_env)
    if overrides or _planning_sizes.get() or bounded is not expr:
        import sympy

        expr = at_planning_sizes(bounded.xreplace({symbol: sympy.Integer(n) for symbol, n in overrides.items()}))
        if expr.is_number:
            return int(expr)
        if expr != value.node.expr:  # other symbols left: theirs are hints
            env = value.node.shape_env
            if hasattr(env, "optimization_hint"):
                return int(env.optimization_hint(expr, fallback=unbacked_size_fallback()))
            return int(env.size_hint(expr))

    # optimization_hint in torch >= 2.12; 2.11 has size_hint (its hint_int is a deprecated
    # alias that warns FutureWarning on every call).
    hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.size_hint
    return int(hint(value, fallback=unbacked_size_fallback()))


def at_data_dependent_bounds(expr, shape_env):
    """``expr`` with each data-dependent (unbacked) symbol at the largest value torch knows it
    can take (``nonzero``'s count at most the input's elements), at most
    ``unbacked_size_fallback()``; ``expr`` itself where it has none. A budget bounds the
    largest such tensor, not a typical one."""
    from torch.fx.experimental import symbolic_shapes

    symbols = symbolic_shapes.free_unbacked_symbols(expr) if hasattr(expr, "free_symbols") else ()
    if not symbols:
        return expr
    import sympy

    fallback = unbacked_size_fallback()
    ranges = getattr(shape_env, "var_to_range", None) or {}

    def largest(symbol) -> int:
        try:
            return min(int(ranges[symbol].upper), fallback)
        except (KeyError, AttributeError, TypeError, OverflowError):  # no range, or unbounded above (oo)
            return fallback

    return expr.xreplace({symbol: sympy.Integer(largest(symbol)) for symbol in symbols})


def unbacked_size_fallback() -> int:
    """The size a data-dependent (unbacked) symbol stands for, having no hint: Inductor's own
    (``torch._inductor.config.unbacked_symint_fallback``), so that the plan and the check of
    Inductor's code count such a tensor alike, as large as Inductor assumes it when it tunes."""
    from torch._inductor import config

    return int(getattr(config, "unbacked_symint_fallback", 8192))


def boxed_python(gm: fx.GraphModule):
    """Run ``gm`` as Python with the boxed calling convention, clearing the argument list
    on entry so each input is freed at its last use (as Inductor's compiled code does);
    without it the saved tensors would live until the backward returns."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list):
        return gm(args)

    run._boxed_call = True
    return run
