"""A saved tensor the forward writes back into a mutated input is not donated to the backward
(compile_offload/inductor/written_back_saves.py): the backward overwrote the module buffer
with its temporaries (fuzz31a f03: off by 26.5 after one backward; the next step computed
from it), under ``torch.compile``'s default backend too."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import compile_offload
from compile_offload.inductor.written_back_saves import written_back_saves


class _Cache(nn.Module):
    """A buffer written through a slice, then read: its new value is saved for the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("cache", torch.ones(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[1:].mul_(x[:-1].detach().cos())
        return self.linear(x) * self.cache.exp()


def _steps(model: nn.Module, run, inputs: list[torch.Tensor]):
    seen = []
    for x in inputs:
        run(x).pow(2).sum().backward()
        seen.append((model.cache.clone(), model.linear.weight.grad.clone()))
        model.zero_grad()
    return seen


@pytest.mark.parametrize("budget", [None, 0.0, 0.5])
def test_a_buffer_written_back_and_saved_is_intact_after_the_backward(budget):
    torch.manual_seed(0)
    base, inputs = _Cache(), [torch.randn(4, 8) for _ in range(2)]
    eager = copy.deepcopy(base)
    expected = _steps(eager, eager, inputs)
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    got = _steps(model, torch.compile(model, backend=compile_offload.offload_remat(memory_budget=budget)), inputs)
    for (cache, grad), (want_cache, want_grad) in zip(got, expected):
        torch.testing.assert_close(cache, want_cache)
        torch.testing.assert_close(grad, want_grad)


def test_only_the_written_back_save_leaves_the_donated_buffers():
    """The forward graph AOTAutograd gives Inductor for ``_Cache``: ``slice_scatter`` is copied
    into the buffer and saved; the other saved tensors are inputs (never donated)."""
    import torch.fx as fx

    graph = fx.Graph()
    cache, x, weight = (graph.placeholder(name) for name in ("primals_1", "primals_2", "primals_3"))
    scattered = graph.call_function(torch.ops.aten.slice_scatter.default,
                                    (cache, graph.call_function(torch.ops.aten.cos.default, (x,)), 0, 1))
    product = graph.call_function(torch.ops.aten.mm.default, (x, weight))
    graph.call_function(torch.ops.aten.copy_.default, (cache, scattered))
    view = graph.call_function(torch.ops.aten.view.default, (scattered, [-1]))
    graph.output((product, x, view, product))
    metadata = type("Meta", (), {"tensors_saved_for_backwards_slice": slice(1, None), "num_symints_saved_for_bw": 0})
    assert written_back_saves(fx.GraphModule(nn.Module(), graph), metadata) == {1}  # the view of slice_scatter only


class _CacheCopy(_Cache):
    """The same arithmetic on a copy of the buffer: the same backward graph, whose saved
    tensor is rightly donated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = self.cache.clone()
        cache[1:].mul_(x[:-1].detach().cos())
        return self.linear(x) * cache.exp()


@pytest.mark.parametrize("first", [_CacheCopy, _Cache])
def test_the_backward_of_a_written_back_save_is_not_served_from_inductors_cache(first):
    """review31d H1: Inductor's FX graph cache keys a backward by its graph, not by its donated
    buffers: compiled after ``_CacheCopy`` (same backward, its save donated), ``_Cache`` was
    served the code that overwrites the buffer (off by 26.5); the other way round the copy
    would get code that donates nothing."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    for model_class in (first, _Cache if first is _CacheCopy else _CacheCopy):
        torch.manual_seed(0)
        model = model_class()
        eager = copy.deepcopy(model)
        eager(x).pow(2).sum().backward()
        torch._dynamo.reset()
        torch.compile(model, backend=compile_offload.offload_remat())(x).pow(2).sum().backward()
        torch.testing.assert_close(model.cache, eager.cache)
        torch.testing.assert_close(model.linear.weight.grad, eager.linear.weight.grad)


class _CacheChunk(_Cache):
    """A chunk of the written-back buffer is saved: through ``split``'s ``getitem``, no view op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[1:].mul_(x[:-1].detach().cos())
        first, _ = self.cache.chunk(2)
        return self.linear(x[:2]) * first


@pytest.mark.parametrize("budget", [None, 0.5])
def test_a_saved_chunk_of_a_written_back_buffer_is_not_donated(budget):
    """review31d H2: off by 4.45 after the backward where only view ops were followed."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = _CacheChunk()
    eager = copy.deepcopy(model)
    eager(x).pow(2).sum().backward()
    torch._dynamo.reset()
    torch.compile(model, backend=compile_offload.offload_remat(memory_budget=budget))(x).pow(2).sum().backward()
    torch.testing.assert_close(model.cache, eager.cache)
    torch.testing.assert_close(model.linear.weight.grad, eager.linear.weight.grad)
