"""``compile_offload.inductor.mutation_order``: on torch before 2.14 the C++ backend's fused
kernels could read a buffer that an ``index_put_`` fills before the write (pytorch#185509);
every graph this backend compiles gets torch 2.14's fix while it compiles."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compile_offload  # noqa: F401  (registers the backend)
from compile_offload.inductor import mutation_order
from compile_offload.inductor.mutation_order import mutation_renames_reapplied


def test_the_fix_acts_only_in_a_thread_inside_a_compile():
    """Installed once, on torch before 2.14, it applies the renames only while this backend
    compiles in the thread (a compile in another thread runs torch's method as it is)."""
    import threading

    from torch._inductor.scheduler import SchedulerNode

    before = SchedulerNode.recompute_size_and_body
    seen = []
    with mutation_renames_reapplied():
        with mutation_renames_reapplied():  # a compile inside a compile
            seen.append(mutation_order._inside.depth)
        seen.append(mutation_order._inside.depth)
        other = threading.Thread(target=lambda: seen.append(getattr(mutation_order._inside, "depth", 0)))
        other.start()
        other.join()
    seen.append(getattr(mutation_order._inside, "depth", 0))
    if mutation_order.fixed_upstream():
        assert SchedulerNode.recompute_size_and_body is before
    else:
        assert seen == [2, 1, 0, 0]
        assert getattr(SchedulerNode.recompute_size_and_body, mutation_order._MARK)


class RandomSoftmaxIndexPut(nn.Module):
    """Found by an adversarial run (its generated case 103): two random factors, a softmax, a
    residual and an in-place row update; at budget 0 with every saved tensor offloaded, the
    backward's fused kernel read the index_put's buffer before the write, on torch 2.13."""

    def __init__(self, width: int = 48) -> None:
        super().__init__()
        self.width = width
        self.inp, self.lin, self.out = nn.Linear(16, width), nn.Linear(width, width), nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        residual = h
        h = torch.softmax(h, -1) * self.width
        h = h * (torch.rand_like(h) + 0.5)
        h = h + residual
        h = h * (torch.rand_like(h) + 0.5)
        h = F.gelu(h) + 0
        rows = torch.arange(0, h.shape[0], 5)
        h[rows] = h[rows] * 0.5
        return self.out(self.lin(h))


def _gradients(model: nn.Module, x: torch.Tensor, **compile_args) -> dict[str, torch.Tensor]:
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    torch.manual_seed(1234)  # the same random factors in both compiles
    torch.compile(model, **compile_args)(x).pow(2).sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.inductor
@pytest.mark.slow
def test_a_read_of_a_buffer_filled_in_place_runs_after_the_write():
    torch.manual_seed(0)
    model = RandomSoftmaxIndexPut()
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(0))
    try:
        expected = _gradients(model, x, backend="inductor")
        got = _gradients(model, x, backend="offload_remat",
                         options={"memory_budget": 0.0, "debug_force_offload": True})
    finally:
        torch._dynamo.reset()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=name)
