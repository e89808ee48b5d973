"""``benchmarks/kernel_fidelity.py``: the comparison of the simulator's kernels with a record
of Inductor's (the machinery; the counts it prints are measurements, not tested)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torch._inductor.lowering  # noqa: F401
from torch._inductor.decomposition import select_decomp_table

from compile_offload.benchmarks.kernel_fidelity import compared_pairs
from compile_offload.inductor.kernels import GraphKernels, Kernel


def _two_readers(x, y):
    shared = torch.tanh(x + y)  # realized (a heavy op read twice); both readers fuse with it
    return shared * 3, shared * 2


def _record(kernels: list[list[str]]) -> GraphKernels:
    return GraphKernels(False, [Kernel(f"op{i}", origins=origins) for i, origins in enumerate(kernels)], [], [], [])


def test_pairs_grouped_unlike_the_record_are_counted():
    gm = make_fx(_two_readers, tracing_mode="fake", decomposition_table=select_decomp_table())(
        torch.randn(4, 8), torch.randn(4, 8))
    names = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.aten.tanh.default, torch.ops.aten.mul.Tensor)]
    assert len(names) == 3
    together = compared_pairs(gm, _record([names]), "m", "forward")
    assert together.compared == 3 and together.mismatches == []
    apart = compared_pairs(gm, _record([[name] for name in names]), "m", "forward")
    assert apart.compared == 3 and len(apart.mismatches) == 3
    assert all(not fused for _, _, fused in apart.mismatches)
