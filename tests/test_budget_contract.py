"""The budget contract, CPU + Inductor, measured at the allocator (issue 15): model
families x byte budgets at 0.8, 0.6 and 0.4 of the measured unconstrained peak. The same
functions print the table of ``docs/benchmarks.md`` (``benchmarks/budget_contract.py``)."""

from __future__ import annotations

import pytest

from compile_offload.benchmarks import budget_contract as contract

pytestmark = [pytest.mark.inductor, pytest.mark.slow]

# Measured on CPU, torch 2.13, 2026-11-26 (docs/benchmarks.md, "The budget contract"): the
# points (model, fraction; None: no budget) that break the contract today. Every other point
# must keep it, and these must still break it: a fix fails the test until it is taken off.
# None since the simulator follows the C++ backend's loop ranges and runs apart the kernel a
# cycle is really joined around (the GPT-2 minimum: 2.98 predicted, 3.28 measured before).
_BROKEN: dict[tuple[str, float | None], str] = {}


@pytest.mark.parametrize("model", contract.MODELS)
def test_budget_contract(model):
    if not contract.available(model):
        pytest.skip("needs transformers")
    points = contract.measure_model(model)
    assert [p.fraction for p in points] == [None, *contract.FRACTIONS]
    broken = {p.fraction: p.violations() for p in points if p.violations()}
    known = {fraction for name, fraction in _BROKEN if name == model}
    unexpected = {f"budget {fraction}": why for fraction, why in broken.items() if fraction not in known}
    assert not unexpected, "\n" + contract.table(points)
    fixed = sorted(str(fraction) for fraction in known - set(broken))
    assert not fixed, f"{model} now keeps the contract at budget {', '.join(fixed)}: take it off _BROKEN\n" + \
        contract.table(points)


def test_cuda_asked_for_without_a_gpu_is_a_usage_error(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        contract.main(["--device", "cuda", "--models", "transformer"])
    assert exit_info.value.code == 2
    assert "--device cuda: no CUDA device is available here" in capsys.readouterr().err


def test_an_unknown_model_is_a_usage_error_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        contract.main(["--models", "transformer,resnet"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown resnet" in err and "conv1d_bn" in err and "hf_llama" in err


def test_every_extra_family_builds_and_trains_eagerly():
    from compile_offload.benchmarks import families

    assert set(contract.EXTRA_MODELS) == set(families.FAMILIES)
    for name in families.FAMILIES:
        model, inputs, loss_of = contract.build(name)
        loss_of(model(*inputs)).backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), name
        assert any(p.requires_grad for p in model.parameters()), name


def test_the_plan_side_of_a_snapshot_is_what_the_plan_holds_at_its_peak():
    """``--snapshot`` writes, beside the allocator's blocks, the planner's program at its
    peak: the program rebuilt from the chosen plan peaks where the plan says, and the
    storages listed sum to that peak."""
    from compile_offload.pipeline.planning import plan_partition
    from compile_offload.settings import resolve

    from .passes.joint_capture import capture

    model, inputs, loss_of = contract.build("transformer")

    def hook(joint, joint_inputs):
        settings = resolve({"memory_budget": 0.6, "device_profile": "cpu"})
        return plan_partition(joint.gm, joint_inputs, settings, num_fwd_outputs=joint.num_fwd_outputs)

    result, _ = capture(lambda x: loss_of(model(x)), *inputs, hook=hook)
    text = contract.describe_plan_peak(result, top=10_000)
    first, *rows = text.splitlines()
    peak = result.plan.predicted_peak_bytes
    assert first.startswith(f"plan: peak {peak} bytes at step ") and f"(predicted {peak})" in first, first
    assert sum(int(row.split()[0]) for row in rows) == peak and len(rows) > 1
    assert contract.describe_plan_peak(None).startswith("plan: its program is not available")


@pytest.mark.inductor
@pytest.mark.slow
def test_the_mixture_of_experts_step_is_predicted_within_5_percent_at_the_allocator():
    """The top-2 mixture of experts (``benchmarks/families.py``): its gathered expert weights
    and scattered products get no buffer in Inductor's code, and its C++ backward runs as
    one call that frees nothing until it returns (``Program.call_end``). Counting the first
    put the prediction 33.7% high; missing the call, 9.9% low (9.17 MiB measured)."""
    point = contract.measure_point("moe", None)
    assert abs(point.predicted_bytes / point.measured_bytes - 1) <= 0.05, contract.table([point])
