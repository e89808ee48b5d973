"""CUDA graphs and offload (reliability.md, bad input): ``torch.compile(mode="reduce-overhead")``
and ``options={"triton.cudagraphs": True}``, through the string backend and the closure
``offload_remat(...)`` alike, turn offloading off with one warning naming the spelling; the
plan then keeps or recomputes under the same budget, exactly the plan of ``offload=False``.

On a CPU Inductor compiles the graphs and cudagraph trees skip the CPU graphs, so these
tests check the warning, the plan chosen and the gradients; the CUDA run is in
``tests/test_ops_cuda.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import compile_offload

SPELLINGS = {
    "mode": ({"mode": "reduce-overhead"}, "torch.compile(mode='reduce-overhead')"),
    "options": ({"options": {"triton.cudagraphs": True}}, "options={'triton.cudagraphs': True}"),
}
KNOBS = {"memory_budget": 0.5, "device_profile": "h100", "debug_force_offload": True}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))


def _train_step(backend, **compile_kwargs):
    model, x = _model(), torch.randn(4, 16)
    with warnings.catch_warnings(record=True) as caught, \
            torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        warnings.simplefilter("always")
        torch.compile(model, backend=backend, **compile_kwargs)(x).pow(2).sum().backward()
    messages = [str(w.message) for w in caught if "CUDA graphs are on" in str(w.message)]
    return {n: p.grad for n, p in model.named_parameters()}, messages


def _decisions(plan) -> list[tuple[str, str]]:
    return [(d.name, d.decision) for d in plan.decisions]


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("backend_kind", ["string", "closure"])
def test_cuda_graphs_turn_offload_off_with_one_warning_and_plan_recompute_only(spelling, backend_kind,
                                                                              captured_plans):
    compile_kwargs, said = SPELLINGS[spelling]
    if backend_kind == "string" and spelling == "options":
        grads, messages = _train_step("offload_remat", options={**compile_kwargs["options"], **KNOBS})
    elif backend_kind == "string":  # torch.compile takes mode or options, not both
        with compile_offload.config.patch(**KNOBS):
            grads, messages = _train_step("offload_remat", **compile_kwargs)
    else:
        grads, messages = _train_step(compile_offload.offload_remat(**KNOBS), **compile_kwargs)
    assert len(messages) == 1 and said in messages[0], messages
    assert "same memory budget" in messages[0]
    (plan,) = captured_plans
    assert plan.count("offload") == 0 and not plan.offloaded

    # The same budget with offload off, without CUDA graphs: the same plan.
    # (Without CUDA graphs the budget loop may also compile the unconstrained plan to compare:
    # the plan made for the budget is the first captured by each step.)
    reference, _ = _train_step(compile_offload.offload_remat(**{**KNOBS, "offload": False, "debug_force_offload": False}))
    assert len(captured_plans) >= 2
    assert plan.budget_bytes == captured_plans[1].budget_bytes
    assert _decisions(plan) == _decisions(captured_plans[1])
    # Without CUDA graphs the same knobs offload (so the check above has teeth).
    before = len(captured_plans)
    _train_step(compile_offload.offload_remat(**KNOBS))
    assert captured_plans[before].count("offload") > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name])


@pytest.mark.inductor
@pytest.mark.parametrize("profile", [None, "cpu"])
def test_a_cpu_graph_under_the_cpu_profile_is_not_told_about_cuda_graphs(profile):
    """Nothing of a CPU graph is captured, and the CPU profile never offloads: no warning."""
    _, messages = _train_step(compile_offload.offload_remat(memory_budget=0.5, device_profile=profile),
                              mode="reduce-overhead")
    assert messages == []


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"mode='fastest'\) is not an Inductor mode"):
        torch.compile(nn.Linear(4, 2), backend=compile_offload.offload_remat(), mode="fastest")(torch.randn(3, 4))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_inductor_options_with_the_eager_inner_compiler_are_refused_by_name(spelling):
    compile_kwargs, _ = SPELLINGS[spelling]
    backend = compile_offload.offload_remat(inner_compiler="eager")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"\['triton.cudagraphs'\] .* need inner_compiler='inductor'"):
        torch.compile(nn.Linear(4, 2), backend=backend, **compile_kwargs)(torch.randn(3, 4))


def test_an_option_neither_ours_nor_inductors_is_refused_by_name():
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed,
                       match=r"unknown option\(s\) \['triton.cudagraph'\] \('triton.cudagraph': did you mean "
                             r"'triton.cudagraphs'\?\).*and Inductor's options"):
        torch.compile(nn.Linear(4, 2), backend="offload_remat",
                      options={"triton.cudagraph": True, "inner_compiler": "eager"})(torch.randn(3, 4))


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_run_the_kernels_in_the_order_the_budget_was_checked_in(mode, captured_plans):
    """Under CUDA graphs Inductor reorders kernels for fewer graph partitions after they were
    recorded for the scheduled peak; under a budget that reordering is off, so the step
    measures what its scheduled peak says (an MLP at a fitting byte budget measured 512.26 KiB
    against 482.50 KiB scheduled before)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)])
    x = torch.randn(64, 64)
    with warnings.catch_warnings(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        warnings.simplefilter("ignore")  # offload turned off under CUDA graphs; below the minimum
        compiled = torch.compile(model, backend=compile_offload.offload_remat(memory_budget="500KiB"), mode=mode)
        compiled(x).sum().backward()
        with compile_offload.measure_peak("cpu") as measured:
            compiled(x).sum().backward()
    plan = captured_plans[-1]
    assert plan.scheduled_peak_bytes is not None and plan.scheduled_peak_bytes <= plan.budget_bytes
    assert measured.peak_bytes <= plan.budget_bytes, (measured.peak_bytes, plan.scheduled_peak_bytes)
