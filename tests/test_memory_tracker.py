"""``compile_offload.runtime.memory_tracker.measure_peak``: the allocator's figures, Inductor included."""

from __future__ import annotations

import re

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


def test_peak_bytes_read_inside_the_block_is_an_error_not_zero():
    # fuzz24b finding 7: it read 0, which says "nothing allocated"
    with measure_peak("cpu") as measured:
        kept = torch.empty(250_000)
        with pytest.raises(RuntimeError, match=r"peak_bytes was read before the with block ended; .*read it after"):
            measured.peak_bytes  # noqa: B018
    assert measured.peak_bytes == 250_000 * FLOAT
    assert kept.numel() == 250_000


def test_an_exception_in_the_block_keeps_the_peak_measured_up_to_it():
    # fuzz24b finding 7: after an exception (an out-of-memory step, say) the peak read 0
    with pytest.raises(KeyError), measure_peak("cpu") as measured:
        a = torch.empty(250_000)
        b = torch.empty(500_000)
        del a, b
        raise KeyError("the step failed")
    assert measured.peak_bytes == 750_000 * FLOAT and measured.events > 0


ACCEPTED = re.escape("; accepted: 'cpu', 'cuda', 'cuda:N' or a torch.device of those")


@pytest.mark.parametrize("device, error, message", [
    # fuzz24b finding 6: torch's own errors, which name neither measure_peak nor what it takes
    ("tpu", ValueError, r"compile_offload\.measure_peak\(device='tpu'\) is not a device \(Expected one of .*\)"),
    (None, TypeError, r"compile_offload\.measure_peak\(device=None\): a NoneType, not a device"),
    (1.5, TypeError, r"compile_offload\.measure_peak\(device=1\.5\): a float, not a device"),
    (True, TypeError, r"compile_offload\.measure_peak\(device=True\): a bool, not a device"),
    ("cuda:x", ValueError, r"compile_offload\.measure_peak\(device='cuda:x'\) is not a device \(.*\)"),
    ("meta", ValueError, r"compile_offload\.measure_peak\(device='meta'\): device type meta is not supported"),
    (torch.device("meta"), ValueError, r"compile_offload\.measure_peak\(device=device\(type='meta'\)\): .*"),
])
def test_a_device_it_cannot_measure_on_is_one_error_naming_the_argument(device, error, message):
    with pytest.raises(error) as raised:
        compile_offload.measure_peak(device)
    assert re.fullmatch(message + ACCEPTED, str(raised.value)), str(raised.value)


@pytest.mark.skipif(torch.cuda.is_available() or getattr(torch, "accelerator", None) is None
                    or torch.accelerator.is_available(), reason="an accelerator would make 0 a device")
def test_a_device_index_without_an_accelerator_is_the_same_error():
    with pytest.raises(ValueError) as raised:
        compile_offload.measure_peak(0)
    assert re.fullmatch(r"compile_offload\.measure_peak\(device=0\) is not a device \(.*\)" + ACCEPTED,
                        str(raised.value)), str(raised.value)
    assert "\n" not in str(raised.value)


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_is_not_read_inside_the_block_and_kept_after_an_exception():
    with pytest.raises(KeyError), measure_peak("cuda") as measured:
        a = torch.empty(2**20, device="cuda")
        with pytest.raises(RuntimeError, match="peak_bytes was read before the with block ended"):
            measured.peak_bytes  # noqa: B018
        del a
        raise KeyError("the step failed")
    assert measured.peak_bytes == 2**20 * FLOAT


class _Allocator:
    """The CUDA caching allocator's counters, as torch.cuda reads them (no GPU needed)."""

    def __init__(self, monkeypatch) -> None:
        self.now = self.peak = 0
        for name, value in {"is_available": lambda: True, "synchronize": lambda *a: None,
                            "current_device": lambda: 0, "memory_allocated": lambda *a: self.now,
                            "max_memory_allocated": lambda *a: self.peak,
                            "reset_peak_memory_stats": lambda *a: setattr(self, "peak", self.now)}.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def allocate(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)


def test_cuda_regions_nest_each_keeping_its_own_peak(monkeypatch):
    """review30c F3: verify_budget opens a region per graph, from its forward to the end of its
    backward, so a second graph's region opens inside the first's; its reset of the device's
    peak counter wiped the first one's peak (110 MiB read as 30 MiB). The step meter too."""
    from compile_offload.runtime.step_budget import CudaStepMeter

    mib = 2**20
    memory = _Allocator(monkeypatch)
    step = CudaStepMeter(torch.device("cuda"))
    step.start()
    with measure_peak("cuda") as a:
        memory.allocate(100 * mib), memory.allocate(10 * mib), memory.allocate(-100 * mib)  # A's forward
        with measure_peak("cuda:0") as b:
            memory.allocate(20 * mib), memory.allocate(-20 * mib)
        memory.allocate(5 * mib), memory.allocate(-15 * mib)
    assert (a.peak_bytes, b.peak_bytes, step.peak_bytes()) == (110 * mib, 20 * mib, 110 * mib)
    assert step.phase_peak_bytes() == 110 * mib
    memory.allocate(7 * mib)
    assert step.phase_peak_bytes() == 7 * mib  # after a phase, only what ran since
