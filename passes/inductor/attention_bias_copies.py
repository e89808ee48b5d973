"""The attention biases Inductor copies whole for CUDA's SDPA kernels.

Inductor's ``sdpa_constraint`` (torch/_inductor/lowering.py, torch 2.11-2.14) gives the
inputs of the SDPA extern kernels a dense layout. A bias the graph receives (a primal
input, or in the backward a saved tensor) is a buffer whose strides already qualify,
broadcast dimensions (stride 0) included, and is passed as it is. A bias the graph
computes itself is, at the kernel, a view of a value with no buffer yet, and Inductor
writes it into a contiguous buffer of the view's whole shape: SDPA's mask, which
``preprocess_mask`` expands over the heads, becomes batch x heads x queries x keys. That
buffer lives while the kernel runs. So it is made by:

- the memory-efficient attention backward and cuDNN attention's backward, when the
  backward recomputes the mask (measured on an H200, 2026-11-27: the contract's GPT-2 at
  budget 0.6 held a 512 KiB (4, 2, 128, 128) fp32 copy beside the 256 KiB mask it expands,
  at the step's peak), and
- cuDNN attention's forward, whose graph always computes its mask.

The memory-efficient attention forward is the exception: its constraint keeps the broadcast
dimensions (``effn_attn_fwd_bias``), so no copy. All four seen on the kernels Inductor
2.11 generates for fake CUDA tensors (``benchmarks/cuda_schedule.py``). On the CPU the
flash kernels take the mask unexpanded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.fx as fx

from ..compat import size_hint
from .node_kinds import is_view, tensor_value

_aten = torch.ops.aten
COPYING_OPS = (
    _aten._scaled_dot_product_efficient_attention_backward.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_cudnn_attention_backward.default,
)


def _bias_argument(node: fx.Node) -> object:
    """``node``'s ``attn_bias`` argument, positional or keyword."""
    if "attn_bias" in node.kwargs:
        return node.kwargs["attn_bias"]
    names = [argument.name for argument in node.target._schema.arguments]
    index = names.index("attn_bias")
    return node.args[index] if index < len(node.args) else None


def attention_bias_copies(nodes: Iterable[fx.Node]) -> dict[fx.Node, tuple[fx.Node, int]]:
    """Each SDPA kernel of ``nodes`` that copies its bias when its graph computes it
    (``COPYING_OPS``), and whose bias is a view not laid out densely (a mask broadcast over
    the heads) -> (that view, the bytes of its contiguous copy). Whether the copy is made
    depends on the plan: ``passes.memory`` makes it where the graph running the kernel
    computes the view's base."""
    found = {}
    for node in nodes:
        if node.op != "call_function" or node.target not in COPYING_OPS:
            continue
        bias = _bias_argument(node)
        value = tensor_value(bias) if isinstance(bias, fx.Node) else None
        if value is None or not is_view(bias):
            continue
        # Sizes and strides as hints (no guard on a symbolic shape): dense means contiguous.
        sizes = [size_hint(size) for size in value.shape]
        strides = [size_hint(stride) for stride in value.stride()]
        if _is_contiguous(sizes, strides):
            continue
        found[node] = (bias, math.prod(sizes) * value.element_size())
    return found


def _is_contiguous(sizes: list[int], strides: list[int]) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(sizes, strides))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
