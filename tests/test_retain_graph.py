"""``backward(retain_graph=True)`` under a budget (issue 49, item 2).

With a budget the backward is lowered while the forward compiles (the budget loop reads its
kernels), with its saved tensors donated; a retaining ``backward()`` lowers it again without
donated buffers, as a lazily lowered backward is (``compile_offload/inductor/retain_graph.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import compile_offload


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16)).double()


@pytest.fixture
def no_autograd_cache():
    """A compile served from AOTAutograd's cache keeps no graph to lower again (the limit
    docs/reliability.md states): each test compiles."""
    with torch._functorch.config.patch(enable_autograd_cache=False, donated_buffer=True):
        yield


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.5, "24KiB"])
def test_a_retained_graph_backs_up_twice_like_eager(budget, no_autograd_cache):
    model = _model()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16, dtype=torch.float64)
    compiled = torch.compile(model, backend=compile_offload.offload_remat(memory_budget=budget))
    for net in (compiled, reference):
        loss = net(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()  # the saved tensors the first backward kept are intact
    expected = _grads(reference)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.inductor
@pytest.mark.slow
def test_a_later_step_may_retain_after_ordinary_steps(no_autograd_cache):
    model = _model()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16, dtype=torch.float64)
    compiled = torch.compile(model, backend=compile_offload.offload_remat(memory_budget=0.5))
    for net in (compiled, reference):
        net(x).square().sum().backward()  # the early lowering, donated buffers and all
        loss = net(x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        net(x).square().sum().backward()  # and ordinary steps after it
    expected = _grads(reference)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)
