"""A profiler the user has open is never disturbed (issue 49, item 3).

Profilers do not nest: one opened inside a recording one ends the outer session, which then
comes back empty ("disableProfiler called but no active profiling session"). The backend's
own CPU measurements (an extern op's workspace while planning, ``verify_budget``'s first
step) skip while one records and say so; ``measure_peak("cpu")`` refuses to open inside one.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import compile_offload


def _conv_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 4))


def _step(compiled, x):
    compiled(x).square().sum().backward()


def _recorded(prof) -> int:
    return len(prof.events())


@pytest.fixture
def fresh_compiles():
    from compile_offload.inductor import op_workspace

    op_workspace._measured.clear()
    op_workspace._warned_not_measured.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.inductor
@pytest.mark.slow
def test_compiling_inside_a_users_profiler_keeps_its_events(fresh_compiles):
    """A conv model's planning measures its convolutions' workspace by running them
    under a profiler of its own: inside the user's, it is not measured, and one warning says so."""
    compiled = torch.compile(_conv_model(), backend=compile_offload.offload_remat(memory_budget=0.5))
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings(record=True) as caught, \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        warnings.simplefilter("always")
        _step(compiled, x)
    assert _recorded(prof) > 0
    assert any(e.name == "aten::convolution_backward" or "convolution" in e.name for e in prof.events())
    said = [str(w.message) for w in caught if "was not measured" in str(w.message)]
    assert len(said) == 1 and "convolution_backward" in said[0], said


@pytest.mark.inductor
@pytest.mark.slow
def test_verify_budget_skips_a_step_inside_a_users_profiler_and_measures_the_next(fresh_compiles):
    compiled = torch.compile(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)),
                             backend=compile_offload.offload_remat(memory_budget=64, verify_budget=True))
    x = torch.randn(32, 16)
    with warnings.catch_warnings(record=True) as inside, \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        warnings.simplefilter("always")
        _step(compiled, x)
    assert _recorded(prof) > 0
    messages = [str(w.message) for w in inside]
    assert any("verify_budget did not measure this step" in m for m in messages), messages
    assert not any("verify_budget: the first compiled step measured" in m for m in messages)
    with pytest.warns(UserWarning, match="verify_budget: the first compiled step measured"):
        _step(compiled, x)  # outside the profiler: measured (64 bytes is far below any step)


def test_measure_peak_refuses_to_nest_in_a_users_profiler():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.ones(4).sum()
        with pytest.raises(RuntimeError, match="already recording"):
            with compile_offload.measure_peak("cpu"):
                pass
        torch.ones(4).sum()
    assert _recorded(prof) > 0
