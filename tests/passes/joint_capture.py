"""Capture joint graphs the way the backend sees them, and the small models pass-level
tests capture."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch._functorch.aot_autograd import aot_module_simplified

import torch._inductor.lowering  # noqa: F401  (decompositions in the table need it)
from torch._inductor.decomposition import select_decomp_table

from compile_offload.passes.inductor.rules import INDUCTOR, PYTHON
from compile_offload.passes import compat
from compile_offload.passes.analyze import JointAnalysis, analyze_joint


def capture(fn, *inputs, hook, partition=None, dynamic=False, decompose=True):
    """Compile ``fn`` through AOTAutograd; ``hook(joint, joint_inputs)`` runs on the prepared
    joint graph and its result is returned. The graphs AOTAutograd runs come from
    ``partition(joint, joint_inputs, hooked)`` if given, else from ``compat.default_partition``.
    ``decompose``: with Inductor's decomposition table, as the backend traces.
    Returns (hook's result, fn's compiled output)."""
    captured = {}

    def partition_fn(joint_gm, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **_):
        joint = compat.prepare_joint(joint_gm, num_fwd_outputs, static_lifetime_input_indices)
        captured["hooked"] = hook(joint, joint_inputs)
        if partition is not None:
            return partition(joint, joint_inputs, captured["hooked"])
        return compat.default_partition(joint, joint_inputs)

    def backend(gm, example_inputs):
        return aot_module_simplified(
            gm, example_inputs,
            fw_compiler=lambda g, _: compat.boxed_python(g),
            bw_compiler=lambda g, _: compat.boxed_python(g),
            partition_fn=partition_fn,
            decompositions=select_decomp_table() if decompose else None,
            keep_inference_input_mutations=True,  # as the backend's eager path
        )

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs)
    assert "hooked" in captured, "the partition hook never ran (no joint graph?)"
    return captured["hooked"], out


def capture_analysis(fn, *inputs, fusion: bool = False) -> tuple[JointAnalysis, list]:
    """(analysis, torch's min-cut saved set) of ``fn``'s joint graph; ``fn`` runs once."""
    (analysis, base), _ = capture(
        fn, *inputs, hook=lambda joint, _: (analyze_joint(joint, INDUCTOR if fusion else PYTHON), compat.min_cut_saved_values(joint)))
    return analysis, base


class Tower(nn.Module):
    """tanh(linear(...)) ``depth`` times: the backward needs every tanh output, and
    recomputing one means redoing a matmul."""

    def __init__(self, width: int = 64, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.mean()


class ResidualMLP(nn.Module):
    """``x + mlp(norm(x))`` ``depth`` times: the residual stream is the only value between blocks."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


CHAIN_OPS = ("linear", "tanh", "relu", "mul", "sin")


def chain_model(ops, width: int) -> nn.Module:
    """A chain of ``ops`` (names from ``CHAIN_OPS``); linear layers keep the width."""

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.linears = nn.ModuleList(nn.Linear(width, width) for op in ops if op == "linear")

        def forward(self, x):
            linears = iter(self.linears)
            for op in ops:
                if op == "linear":
                    x = next(linears)(x)
                elif op == "mul":
                    x = x * x
                else:
                    x = getattr(torch, op)(x)
            return x.sum()

    return Chain()


@functools.cache
def encoder_stack(layers: int, width: int, heads: int, ff: int, batch: int, seq: int,
                  fusion: bool = True) -> tuple[JointAnalysis, list]:
    """A stack of ``nn.TransformerEncoderLayer`` (seed 0, no dropout), captured and
    analysed (``capture_analysis`` of its summed output), once per shape."""
    torch.manual_seed(0)
    stack = nn.Sequential(*(nn.TransformerEncoderLayer(width, heads, ff, dropout=0.0, batch_first=True)
                            for _ in range(layers)))
    return capture_analysis(lambda x: stack(x).sum(), torch.randn(batch, seq, width, requires_grad=True),
                            fusion=fusion)
