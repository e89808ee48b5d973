"""What kind of value an FX node computes, as Inductor lowers it: the facts the memory
passes share (``analyze``'s storages and fusion rules, ``kernel_local``'s kernels)."""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import compat


def tensor_value(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "is_view", False)


# Ops without the pointwise tag that Inductor lowers to a pointwise loop all the same
# (``Pointwise.create`` in torch/_inductor/lowering.py, torch 2.11-2.14): ``full`` a constant
# that loads nothing (``tensor_constructor``/``_full``), ``select_scatter`` and
# ``slice_scatter`` a ``where`` over the index that loads the source and the base,
# ``embedding`` a load at the rows its indices name, ``iota`` the index itself. Inlined
# like any pointwise value: the zeros a backward scatters the query/key/value gradients
# into (384 KiB on the contract's transformer) get no buffer of their own, nor does the
# Llama's recomputed token embedding (128 KiB, measured at its 0.6 budget, 2026-11-26).
_POINTWISE_LOWERINGS = frozenset({"full", "select_scatter", "slice_scatter", "embedding", "iota"})


def is_pointwise(node: fx.Node) -> bool:
    """A pointwise op as Inductor lowers it: tagged pointwise, one of ``_POINTWISE_LOWERINGS``,
    or an ``index`` by integer tensors (``_is_pointwise_index``)."""
    if node.op != "call_function":
        return False
    target = node.target
    if torch.Tag.pointwise in getattr(target, "tags", ()):
        return True
    if not isinstance(target, compat.OpOverload):
        return False
    name = target.overloadpacket.__name__
    return name in _POINTWISE_LOWERINGS or (name in ("index", "_unsafe_index") and _is_pointwise_index(node))


def _is_pointwise_index(node: fx.Node) -> bool:
    """``aten.index`` by integer tensors is a pointwise load at the rows the indices name
    (``index_impl``: ``Pointwise.create``, torch 2.11-2.14); by a boolean mask it falls back
    to ATen's kernel (its output size depends on the data). A mixture of experts' gathered
    expert weights (``w[chosen]``) get no buffer where their consumer fuses them."""
    return len(node.args) > 1 and _integer_indices(node.args[1])


def _integer_indices(indices) -> bool:
    """An ``index``/``index_put`` index list holding at least one tensor, all of them
    integer tensors: Inductor's indexed load or store; a boolean mask sends the op to ATen."""
    values = [tensor_value(index) for index in indices if isinstance(index, fx.Node)]
    return bool(values) and all(v is not None and not v.dtype.is_floating_point and v.dtype not in (torch.bool, torch.uint8)
                                for v in values)


def fuses_into(node: fx.Node) -> bool:
    """Inductor fuses a pointwise producer into this consumer (pointwise or reduction, or a
    ``bmm`` it lowers as one: ``bmm_as_reduction``)."""
    tags = getattr(node.target, "tags", ())
    return is_pointwise(node) or (node.op == "call_function" and (torch.Tag.reduction in tags or bmm_as_reduction(node)))


def loads_inputs_in_loop(node: fx.Node) -> bool:
    """An op Inductor lowers to loops that load its tensor inputs where they are used, so a
    pointwise input is inlined into it, though the op is neither pointwise nor a reduction:
    ``index_put`` (``index_put_impl_``: a copy of the base, then an ``ir.Scatter`` whose
    body loads the values and the indices; a mixture of experts' weight gradients scatter
    their per-token products so, 4 MiB each on the family of ``benchmarks/families.py``),
    and ``scatter`` without a reduction (``_scatter_in_loop``).
    Not where Inductor calls ATen's kernel instead: boolean indices, deterministic
    algorithms, or an accumulation in a dtype its atomic add lacks."""
    if node.op != "call_function" or not isinstance(node.target, compat.OpOverload):
        return False
    name = node.target.overloadpacket.__name__
    if name not in ("scatter", "index_put", "_unsafe_index_put") or torch.are_deterministic_algorithms_enabled():
        return False
    if name == "scatter":
        return _scatter_in_loop(node)
    if len(node.args) < 3 or not _integer_indices(node.args[1]):
        return False
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    base = tensor_value(node.args[0])
    if base is None:
        return False
    if accumulate and (base.dtype in (torch.int64, torch.bool) or (base.dtype == torch.bfloat16 and base.device.type != "cpu")):
        return False  # ``needs_fallback_due_to_atomic_add_limitations`` (bf16: not on every GPU)
    return True


def _scatter_in_loop(node: fx.Node) -> bool:
    """``aten.scatter`` without a reduction (``.src``, ``.value``): a copy of the base, then
    an ``ir.Scatter`` loading the source (``scatter_``), unless ``use_scatter_fallback``
    (deterministic algorithms, checked by the caller; a bf16 source on a GPU whose atomic
    add lacks it, taken here as any GPU)."""
    if node.target._overloadname not in ("src", "value"):
        return False
    base = tensor_value(node.args[0]) if node.args else None
    source = tensor_value(node.args[3]) if len(node.args) > 3 and isinstance(node.args[3], fx.Node) else None
    if base is None:
        return False
    return not (source is not None and source.dtype == torch.bfloat16 and source.device.type != "cpu")


def bmm_as_reduction(node: fx.Node) -> bool:
    """A ``bmm`` Inductor lowers to a pointwise product summed over the shared dimension
    (``tuned_bmm`` in torch/_inductor/kernel/bmm.py) instead of calling a GEMM: on CPU
    where one side is a row or a column (``(B, 1, K) @ (B, K, N)``: each token times its
    expert's weights), on CUDA where both are and K is small (``compat.bmm_dot_rule``;
    torch 2.13 and later). Its inputs are then loaded inside the sum, so a pointwise input
    (a gathered weight) is fused into it, not given a buffer."""
    if node.op != "call_function" or node.target is not torch.ops.aten.bmm.default or len(node.args) < 2:
        return False
    mat1, mat2 = (tensor_value(arg) if isinstance(arg, fx.Node) else None for arg in node.args[:2])
    if mat1 is None or mat2 is None or mat1.dim() != 3 or mat2.dim() != 3:
        return False
    m, k, n = (compat.size_hint(size) for size in (mat1.shape[1], mat1.shape[2], mat2.shape[2]))
    if mat1.device.type == "cpu" and mat2.device.type == "cpu":
        return m == 1 or n == 1
    rule = compat.bmm_dot_rule()
    return (rule is not None and mat1.device.type in ("cuda", "xpu") and mat1.device.type == mat2.device.type
            and mat1.dtype == mat2.dtype and mat1.dtype in rule.dtypes and m == 1 and n == 1 and k <= rule.max_k)
