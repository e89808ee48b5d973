"""What kind of value an FX node computes, as Inductor lowers it: the facts the memory
passes share (``analyze``'s storages and fusion rules, ``kernel_local``'s kernels)."""

from __future__ import annotations

import torch
import torch.fx as fx


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
    """A pointwise op as Inductor lowers it: tagged pointwise, or one of ``_POINTWISE_LOWERINGS``."""
    if node.op != "call_function":
        return False
    target = node.target
    if torch.Tag.pointwise in getattr(target, "tags", ()):
        return True
    return isinstance(target, torch._ops.OpOverload) and target.overloadpacket.__name__ in _POINTWISE_LOWERINGS


def fuses_into(node: fx.Node) -> bool:
    """Inductor fuses a pointwise producer into this consumer (pointwise or reduction)."""
    tags = getattr(node.target, "tags", ())
    return is_pointwise(node) or (node.op == "call_function" and torch.Tag.reduction in tags)
