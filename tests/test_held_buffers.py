"""With a budget, Inductor's wrapper holds no freed buffer for a later kernel.

Inductor's wrapper may keep a freed buffer allocated for a later kernel when its own peak
estimate says that costs nothing (``AllocateLine.should_reuse_buffer``). Without peak-memory
reordering that estimate counts only the graph's freeable inputs (none in a forward, the
saved tensors in a backward) on torch 2.11 to 2.13; torch 2.14 fills it in, low, as a side
effect of its simple comm-overlap pass, and held buffers put a compiled step over a budget
its plan kept; in a backward the 2.11-2.13 estimate lets every hold pass once enough saved
tensors are freed. With a budget the pool is off (``inductor_compile._no_held_buffers``).
"""

from __future__ import annotations

import pytest
import torch

import compile_offload
from compile_offload.pipeline import inductor_compile
from compile_offload.benchmarks import budget_contract
from compile_offload.settings import resolve


def _patches(settings, graph=None):
    return inductor_compile.inductor_config_patches(resolve(settings), partitioner=None, graph=graph)


def _has_simple_overlap() -> bool:
    section = getattr(torch._inductor.config, "aten_distributed_optimizations", None)
    return hasattr(section, "enable_simple_overlap")


def test_a_budget_turns_the_simple_overlap_pass_off_where_this_torch_has_it():
    expected = {"aten_distributed_optimizations.enable_simple_overlap": False} if _has_simple_overlap() else {}
    with_budget = _patches({"memory_budget": 0.5})
    assert {k: v for k, v in with_budget.items() if "simple_overlap" in k} == expected
    assert not any("simple_overlap" in key for key in _patches({}))  # no budget: Inductor as it is


def test_a_graph_with_collectives_keeps_the_overlap_pass():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    graph.output(graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,)))
    with_collective = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert not any("simple_overlap" in key for key in _patches({"memory_budget": 0.5}, with_collective))
    plain = torch.fx.symbolic_trace(lambda x: x + 1)
    assert any("simple_overlap" in key for key in _patches({"memory_budget": 0.5}, plain)) == _has_simple_overlap()


def test_a_budget_turns_the_buffer_pool_off_where_the_graph_has_no_collective():
    assert _patches({"memory_budget": 0.5}).get("allow_buffer_reuse") is False
    assert "allow_buffer_reuse" not in _patches({})  # no budget: Inductor as it is


def _held(monkeypatch, patched: bool) -> list[tuple[bool, int]]:
    """(backward?, kernels apart) of each freed buffer the wrapper held for a later kernel's
    allocation, compiling the contract's MLP-mixer at 0.6 with the backend's patches or
    (``patched=False``) without ``_no_held_buffers``."""
    from torch._inductor.codegen import wrapper
    from torch._inductor.virtualized import V

    decided = []
    original = wrapper.AllocateLine.should_reuse_buffer

    def recording(self, free_line, size):
        reused = original(self, free_line, size)
        decided.append((bool(V.graph.is_backward), self.scheduler_node_index - free_line.scheduler_node_index, reused))
        return reused

    with monkeypatch.context() as patch:
        patch.setattr(wrapper.AllocateLine, "should_reuse_buffer", recording)
        if not patched:
            patch.setattr(inductor_compile, "_no_held_buffers", lambda graph: {})
        model, inputs, loss_of = budget_contract.build("mlp_mixer")
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            step = torch.compile(lambda *args: loss_of(model(*args)), backend=compile_offload.offload_remat(
                memory_budget=0.6, device_profile="cpu"))
            step(*inputs).backward()
    return [(backward, gap) for backward, gap, reused in decided if reused and gap > 1]


@pytest.mark.inductor
@pytest.mark.slow
def test_a_budgeted_compile_holds_no_freed_buffer_for_a_later_kernel(monkeypatch):
    from torch._inductor.codegen import wrapper

    if not hasattr(wrapper.AllocateLine, "should_reuse_buffer"):
        pytest.skip("this torch's wrapper has no should_reuse_buffer")
    # Without the patches the backward holds buffers (its estimate counts the saved tensors
    # only): the check can see them.
    assert any(backward for backward, _ in _held(monkeypatch, patched=False))
    assert _held(monkeypatch, patched=True) == []
