"""``compile_offload.runtime.memory_tracker.measure_peak``: the allocator's figures, Inductor included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import compile_offload
from compile_offload.runtime.memory_tracker import measure_peak

FLOAT = 4  # bytes per float32


def test_counts_eager_allocations_above_the_start():
    before = torch.ones(1000)  # allocated before the region: not counted
    with measure_peak("cpu") as measured:
        a = torch.empty(250_000)  # 1 MB
        b = torch.empty(500_000)  # 2 MB, both alive: 3 MB
        del a, b
        c = torch.empty(100_000)
        del c
    assert measured.peak_bytes == 750_000 * FLOAT
    assert before.numel() == 1000


def test_rejects_unknown_devices():
    with pytest.raises(ValueError, match="not supported"):
        measure_peak("meta")


@pytest.mark.inductor
def test_counts_the_buffers_of_an_inductor_compiled_step():
    """Inductor's CPU code allocates its buffers with ``empty_strided_cpu`` (no dispatcher).
    Hand-computed lower bound of what must be alive at once in the backward of
    ``Linear(d, d) -> tanh -> Linear(d, d)`` (no bias) on an ``(n, d)`` input that needs no
    grad: while the first weight's gradient is written, the second weight's gradient (d*d)
    and the gradient at the tanh's input (n*d) are alive; so peak >= (2*d*d + n*d) floats."""
    n, d = 512, 256
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, d, bias=False), nn.Tanh(), nn.Linear(d, d, bias=False))
    x = torch.randn(n, d)
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(model, backend=compile_offload.offload_remat(inner_compiler="inductor"))
        compiled(x).sum().backward()  # compile
    model.zero_grad(set_to_none=True)
    with measure_peak("cpu") as measured:
        compiled(x).sum().backward()
    lower_bound = (2 * d * d + n * d) * FLOAT
    assert measured.events > 0
    assert measured.peak_bytes >= lower_bound, (measured.peak_bytes, lower_bound)
    # And no more than everything the step could hold at once: the forward's two (n, d)
    # activations, their gradients, the output's gradient and both weight gradients.
    assert measured.peak_bytes <= (5 * n * d + 2 * d * d) * FLOAT * 1.5, measured.peak_bytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_is_the_caching_allocators():
    held = torch.empty(2**20, device="cuda")
    with measure_peak("cuda") as measured:
        a = torch.empty(2**20, device="cuda")
        del a
    assert measured.peak_bytes == 2**20 * FLOAT
    assert held.numel() == 2**20
