"""The plan's rows describe the graph that runs: each tensor the forward saves for the
backward (other than inputs) has one row, keep or offload, and no row names a tensor the
forward does not save unless the backward recomputes it. The solver plans views; the
forward saves one tensor per storage (``passes.saved_storages``), and the rows follow the
forward (fuzz34e F1/F3: rows listed views at their storage's size, and the tensor saved
had none)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compile_offload

from .models import TransformerBlock
from .partition_results import Partition, partitions


class SlicedUnbind(nn.Module):
    """Views covering part of a storage: the solver saves them, the forward their storage."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 128)

    def forward(self, x):
        h = self.linear(x).exp()
        return sum((p.sin() * p).sum() for p in h[:8].unbind(0))


class Attention(nn.Module):
    """q, k, v as views of one projection (Inductor's attention pattern saves those views)."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (part.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for part in self.qkv(x).split(c, dim=-1))
        a = torch.softmax(q @ k.transpose(-1, -2) / (c // self.heads) ** 0.5, -1) @ v
        return F.gelu(self.out(a.transpose(1, 2).reshape(b, t, c)))


def forward_saves(p: Partition) -> set[str]:
    """The intermediate tensors the partitioned forward returns for the backward."""
    output = next(n for n in p.fw.graph.nodes if n.op == "output")
    return {n.name for n in output.args[0][p.num_fwd_outputs:]
            if isinstance(n, torch.fx.Node) and n.op != "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}


def compiled_partitions(model: nn.Module, x: torch.Tensor, **options) -> list[Partition]:
    """Every partition of one compiled step (the budget loop may plan a graph again)."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), partitions() as found:
        torch.compile(model, backend=compile_offload.offload_remat(**options))(x).sum().backward()
    assert found
    return list(found)


CASES = [
    pytest.param(SlicedUnbind, (64, 32), {"inner_compiler": "eager"}, id="unbind-eager"),
    pytest.param(SlicedUnbind, (64, 32), {"inner_compiler": "eager", "memory_budget": 0.5}, id="unbind-eager-0.5"),
    pytest.param(Attention, (2, 16, 64), {}, id="attention-inductor"),
    pytest.param(Attention, (2, 16, 64), {"memory_budget": 0.5}, id="attention-inductor-0.5"),
    pytest.param(TransformerBlock, (2, 6, 16), {"inner_compiler": "eager", "memory_budget": 0.0},
                 id="block-eager-0"),
]


@pytest.mark.parametrize("model, shape, options", CASES)
def test_rows_name_what_the_forward_saves(model, shape, options):
    for p in compiled_partitions(model(), torch.randn(*shape), **options):
        rows = {d.name: d for d in p.plan.decisions}
        held = {name for name, d in rows.items() if d.decision in ("keep", "offload")}
        saved = forward_saves(p)
        # offloaded tensors leave the forward as their host copies, under another name
        assert held - set(p.plan.offloaded) == saved, (p.plan, p.fw.code)
        assert p.plan.bytes_of("keep") == sum(rows[name].bytes for name in saved - set(p.plan.offloaded))
        in_backward = {n.name for n in p.bw.graph.nodes}
        recomputed = [d for d in rows.values() if d.decision == "recompute"]
        for d in recomputed:
            assert d.name in in_backward and d.reason and d.bytes > 0, (d, p.bw.code)
        if options.get("memory_budget") == 0.0:  # the minimum-memory plan recomputes, and says what
            assert recomputed and any(d.cost_seconds > 0 for d in recomputed), p.plan


def test_forced_offload_rows_count_every_offload():
    """fuzz34b F3: with every saved tensor offloaded, the rows counted fewer offloads than the
    forward made (the offloaded storages of saved views had no row)."""
    [p] = compiled_partitions(Attention(), torch.randn(2, 16, 64), debug_force_offload=True)
    assert p.plan.offloaded
    assert {d.name for d in p.plan.decisions if d.decision == "offload"} == set(p.plan.offloaded)
    assert p.plan.count("offload") == len(p.plan.offloaded)
