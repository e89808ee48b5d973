"""The loop ranges Inductor's C++ backend gives a realized node, and whether two nodes can share a kernel there.

Inductor's CPU code generation fuses a node into a kernel that holds a reduction only when
their loops line up: a pointwise producer's ranges must be the reduction's kept ranges
followed by its reduced ones (``CppScheduling._why_fuse_nodes``: ``SAME_VARS_REDUCE`` or
``COMPATIBLE_REDUCTION``, read in torch 2.13 and 2.14), and the ranges compared are those *after*
``simplify_loops`` merged every pair of dimensions that all of the node's accesses walk
contiguously. A pointwise node that loads only same-shaped contiguous tensors (or none: a
random draw, whose offset is its linear index) collapses to one range, and a kernel
reducing the last dimension of those elements iterates over two (rows, reduced): they do
not fuse, and the pointwise node's buffer stays. Measured on the contract's GPT-2
(2026-11-26, torch 2.13, ``TORCH_LOGS=fusion``): the attention dropout's random draw
(``[4, 2, 128, 128]``, ranges ``(131072,)``) never joins the softmax backward's kernel
(``(1024,)`` kept, ``(128,)`` reduced); its 512 KiB buffer lives through the backward's peak.
Triton's kernels index by element counts alone (``SIMDScheduling.can_fuse``), so on a GPU the
two fuse: the rule is the C++ backend's.

``loop_ranges`` follows ``SchedulerNode``'s loop simplification on the FX graph's shapes and
strides: each access's stride over each dimension (a view's strides, zero for a broadcast
dimension; a value inlined into the node over the same shape contributes its own loads, a
view of an inlined value is read at the view's strides), then the merges of
``_simplify_loops_impl``. Loop reordering by stride is not followed. ``None`` where a load
does not broadcast to the loop or has no strides (a sparse value): callers treat the node
as compatible with any kernel (the rule before this one).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch
from torch import fx

from .. import compat
from .node_kinds import is_pointwise, is_view, tensor_value

Ranges = tuple[tuple[int, ...], tuple[int, ...]]  # (kept ranges, reduced ranges) after merging


def _shape(val: torch.Tensor) -> list[int]:
    return [compat.size_hint(s) for s in val.shape]


def _strides(val: torch.Tensor) -> list[int]:
    return [compat.size_hint(s) for s in val.stride()]


def _contiguous(shape: Sequence[int]) -> list[int]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return strides[::-1]


def _broadcast(shape: Sequence[int], strides: Sequence[int], space: Sequence[int]) -> list[int] | None:
    """Strides of a value of ``shape`` read at every point of ``space`` (broadcast from the
    right, as a pointwise op reads it), or None when it does not broadcast to ``space``."""
    if len(shape) > len(space):
        return None
    out = [0] * len(space)
    offset = len(space) - len(shape)
    for dim, (size, stride) in enumerate(zip(shape, strides)):
        if size == space[offset + dim]:
            out[offset + dim] = stride if size != 1 else 0
        elif size != 1:
            return None
    return out


def _accesses(node: fx.Node, space: Sequence[int], inlined: frozenset[fx.Node]) -> list[list[int]] | None:
    """The strides over ``space`` of every load of pointwise ``node`` (through the values
    inlined into it), or None when one cannot be read from the graph."""
    found: list[list[int]] = []
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        arg = stack.pop()
        if arg in seen:
            continue
        seen.add(arg)
        val = tensor_value(arg)
        if val is None:
            continue
        if val.layout != torch.strided:
            return None  # sparse or nested: no strides to read
        shape = _shape(val)
        if arg in inlined and not is_view(arg) and shape == list(space):
            if arg.target is torch.ops.aten.embedding.default:
                embedded = _embedding_accesses(arg, space)
                if embedded is None:
                    return None
                found += embedded
                continue
            stack.extend(arg.all_input_nodes)  # its loads index this loop directly
            continue
        # A view of a buffer, a buffer, or an inlined value broadcast into this loop: read
        # at its own strides (an inlined value computed contiguously over its own shape).
        strides = _strides(val) if (is_view(arg) or arg not in inlined) else _contiguous(shape)
        access = _broadcast(shape, strides, space)
        if access is None:
            return None
        found.append(access)
    return found


def _embedding_accesses(node: fx.Node, space: Sequence[int]) -> list[list[int]] | None:
    """An inlined ``embedding(weight, indices)`` over ``space`` (the indices' shape, then the
    embedding's width): the indices are read along the leading dimensions, the weight's row
    along the last (its row number is loaded, not a loop variable: stride 0 elsewhere)."""
    weight, indices = node.args[0], node.args[1]
    index_val, weight_val = tensor_value(indices), tensor_value(weight)
    if index_val is None or weight_val is None or weight_val.dim() != 2 or weight_val.layout != torch.strided:
        return None
    index_access = _broadcast(_shape(index_val), _strides(index_val), space[:-1])
    if index_access is None:
        return None
    return [index_access + [0], [0] * (len(space) - 1) + [_strides(weight_val)[1]]]


def _merged(sizes: list[int], accesses: list[list[int]]) -> tuple[int, ...]:
    """``_simplify_loops_impl``: size-1 ranges dropped; ranges ``a`` and ``b`` merged while
    every access steps over ``b`` as over ``a`` times its size (one contiguous walk)."""
    sizes = [None if size == 1 else size for size in sizes]
    changed = True
    while changed:
        changed = False
        for i, j in itertools.product(reversed(range(len(sizes))), reversed(range(len(sizes)))):
            if i == j or sizes[i] is None or sizes[j] is None:
                continue
            if all(stride[i] * sizes[i] == stride[j] for stride in accesses):
                changed = True
                sizes[i] = sizes[i] * sizes[j]
                sizes[j] = None
    return tuple(size for size in sizes if size is not None)


def _reduced_dims(node: fx.Node, rank: int) -> list[int] | None:
    """The dimensions reduction ``node`` reduces: its ``dim`` (or a prim's ``dims``)
    argument, all of them where that is absent, None or empty (aten's convention, as in
    ``sum.default`` and ``amax(x)``); None where the schema has it elsewhere than second."""
    schema = getattr(node.target, "_schema", None)
    names = [argument.name for argument in schema.arguments] if schema is not None else []
    name = next((n for n in ("dim", "dims") if n in names), None)
    if name is None:
        return list(range(rank))
    if names.index(name) != 1:
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get(name)
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    if not all(isinstance(d, int) for d in dims):
        return None
    return sorted({d % rank for d in dims}) if rank else []


def loop_ranges(node: fx.Node, inlined: frozenset[fx.Node]) -> Ranges | None:
    """(kept, reduced) loop ranges of realized ``node`` in Inductor's C++ kernels, after
    merging (module docstring); ``((n1, n2, ...), ())`` for a pointwise node or a random
    draw. ``inlined``: the values Inductor inlines (``analyze.inlined_values``)."""
    val = tensor_value(node)
    if val is None and isinstance(node.meta.get("val"), (tuple, list)) and node.meta["val"]:
        val = node.meta["val"][0]  # ``var_mean``: its results share the kernel's loops
    if not isinstance(val, torch.Tensor) or node.op != "call_function" or val.layout != torch.strided:
        return None
    reduction = torch.Tag.reduction in getattr(node.target, "tags", ())
    if not reduction:
        space = _shape(val)
        accesses = _accesses(node, space, inlined) if is_pointwise(node) else []
        if accesses is None:
            return None
        # the write, and a random draw's offset: the linear index of the output
        return _merged(space, [*accesses, _contiguous(space)]), ()
    source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    source_val = tensor_value(source) if source is not None else None
    if source_val is None:
        return None
    space = _shape(source_val)
    reduced = _reduced_dims(node, len(space))
    if reduced is None:
        return None
    accesses = _accesses(node, space, inlined)
    if accesses is None:
        return None
    kept = [d for d in range(len(space)) if d not in reduced]
    write = [0] * len(space)  # the output: contiguous over the kept dimensions
    for d, stride in zip(kept, _contiguous([space[d] for d in kept])):
        write[d] = stride
    accesses.append(write)
    return (_merged([space[d] for d in kept], [[a[d] for d in kept] for a in accesses]),
            _merged([space[d] for d in reduced], [[a[d] for d in reduced] for a in accesses]))


def fits_cpu_kernel(members: Sequence[Ranges | None]) -> bool:
    """Whether Inductor's C++ backend can run nodes of these loop ranges as one kernel:
    every reduction over the same (kept, reduced) ranges, and every pointwise node over
    the kept ranges followed by the reduced ones. Unknown ranges (None) fit anything."""
    reductions = {ranges for ranges in members if ranges is not None and ranges[1]}
    if not reductions:
        return True
    if len(reductions) > 1:
        return False
    kept, reduced = next(iter(reductions))
    return all(ranges is None or ranges[1] or ranges[0] == kept + reduced for ranges in members)


def cpu_graph(nodes: Iterable[fx.Node]) -> bool:
    """Whether Inductor generates C++ kernels for a graph of ``nodes``: its tensors are all on
    the CPU (a graph on the meta device is planned for an accelerator: Triton's rules)."""
    devices = {val.device.type for val in map(tensor_value, nodes) if val is not None}
    return devices == {"cpu"}
