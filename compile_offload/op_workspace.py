"""The memory an extern op holds while it runs, beyond its outputs, measured by running it.

On the CPU, ATen's mkldnn ``convolution_backward`` allocates temporaries inside the op:
buffers for the weight gradient before it is written out in the weight's layout, and
oneDNN's scratchpad (measured 2026-11-26, torch 2.13: two weight-sized buffers at the op's
peak, live only while it runs). Inductor calls the op as an
extern kernel, so the step's peak is there, and nothing in the graph says how much: on a
convolution + BatchNorm net with 32 channels at 16x16 it was 72 KiB, 7.5% of the step's
peak. The size depends on the op's implementation, its shapes, layouts and thread count, so
it is measured: the op runs once on zero-filled tensors of the node's shapes, with the
layouts Inductor gives it, under ``measure_peak``; what the allocator held above the outputs
is the workspace. Measured once per signature per process.

Only on the CPU, only for static shapes, and only where the op's inputs are small enough to
copy (``MAX_INPUT_BYTES``): running a GPU kernel at planning time could fail for lack of
memory on a GPU that is nearly full, which is exactly where a budget is used, and cuDNN's
workspace depends on the algorithm it picks at run time. Elsewhere no workspace is counted.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .memory_tracker import measure_peak
from .passes.analyze import tensor_value
from .passes.compat import inductor_channels_last_convolutions

MAX_INPUT_BYTES = 64 * 2**20  # the op's tensor inputs, all together
_measured: dict[tuple, int] = {}  # signature -> workspace bytes


def op_workspaces(nodes: list[fx.Node], inductor: bool = True) -> dict[fx.Node, int]:
    """Each CPU ``convolution_backward`` of ``nodes`` (a joint graph's) -> the bytes it holds
    while it runs beyond its outputs (omitted where nothing, or where it is not measured).
    ``inductor``: the graphs are compiled by Inductor, whose layout optimization decides the
    layouts the op gets; otherwise they run as written, in the traced layouts."""
    convolutions = [n for n in nodes if n.op == "call_function"
                    and n.target is torch.ops.aten.convolution_backward.default]
    if not convolutions:
        return {}
    forward_convolutions = [n for n in nodes if n.op == "call_function"
                            and n.target is torch.ops.aten.convolution.default]
    channels_last = inductor and inductor_channels_last_convolutions(
        [tensor_value(arg) for n in forward_convolutions for arg in n.args[:2] if isinstance(arg, fx.Node)])
    found = {}
    for node in convolutions:
        args = _tensor_args(node)
        if args is None:
            continue
        key = (*(_signature(t) for t in args), *map(repr, node.args[3:]), channels_last, torch.get_num_threads())
        if key not in _measured:
            _measured[key] = _measure(node, args, channels_last)
        if _measured[key] > 0:
            found[node] = _measured[key]
    return found


def _tensor_args(node: fx.Node) -> list[torch.Tensor] | None:
    """The fake values of (grad_output, input, weight), when all are static CPU tensors
    small enough to run the op on."""
    values = [tensor_value(arg) if isinstance(arg, fx.Node) else None for arg in node.args[:3]]
    if any(v is None or v.device.type != "cpu" for v in values):
        return None
    if any(isinstance(s, torch.SymInt) for v in values for s in (*v.shape, *v.stride())):
        return None  # dynamic shapes: reading a size would guard on it
    total = sum(v.dtype.itemsize * v.numel() for v in values)
    return values if total <= MAX_INPUT_BYTES else None


def _signature(value: torch.Tensor) -> tuple:
    return tuple(value.shape), tuple(value.stride()), value.dtype


def _measure(node: fx.Node, args: list[torch.Tensor], channels_last: bool) -> int:
    """Run the op once to warm it up and once under ``measure_peak``: its peak less its
    outputs. An op that cannot run here counts nothing rather than failing the plan."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily(), torch.no_grad():
            real = []
            for value in args:
                # Inductor's layout optimization gives the convolution every 4-d argument in
                # channels-last: the activations, and the weight through its channels-last copy
                # (``analyze.layout_copies``), which the backward receives. In another layout
                # the op converts them itself, and that conversion is part of what it holds.
                if channels_last and value.dim() == 4:
                    tensor = torch.empty(value.shape, dtype=value.dtype, memory_format=torch.channels_last).zero_()
                else:
                    tensor = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).zero_()
                real.append(tensor)
            rest = node.args[3:]
            node.target(*real, *rest)
            with measure_peak("cpu") as measured:
                outputs = node.target(*real, *rest)
            output_bytes = sum(out.untyped_storage().nbytes() for out in outputs if isinstance(out, torch.Tensor))
    except Exception:  # noqa: BLE001
        return 0
    return max(0, measured.peak_bytes - output_bytes)
