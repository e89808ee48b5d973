"""The budget contract, CPU + Inductor, measured at the allocator (issue 15): model
families x byte budgets at 0.8, 0.6 and 0.4 of the measured unconstrained peak. The same
functions print the table of ``docs/benchmarks.md`` (``benchmarks/budget_contract.py``)."""

from __future__ import annotations

import pytest

from compile_offload.benchmarks import budget_contract as contract

pytestmark = [pytest.mark.inductor, pytest.mark.slow]

# Measured on CPU, torch 2.13, 2026-11-25 (docs/benchmarks.md, "The budget contract"): these
# families break the contract today; strict, so a fix shows up as an unexpected pass. The budget
# loop (budget_loop.keep_within_budget) re-plans where the scheduled peak exceeds the budget
# (GPT-2 and MLP-mixer at 0.8 and 0.6): it fixed GPT-2's 0.8 overrun but not its family.
_BROKEN = {
    "conv_bn": "the minimum-memory plan measures 2.65 MiB against 2.51 MiB predicted (+5.3%): CPU convolution "
               "backward workspace the cost model does not count",
    "hf_gpt2": "at 0.8 the re-planned step measures 5.98 MiB (budget 6.28 MiB: kept) against 5.66 MiB predicted "
               "(5.3% off; its scheduled peak 5.85 MiB is within 3%); at 0.4 the minimum measures 4.58 MiB, 3.89 "
               "predicted",
    "hf_llama": "unconstrained, predicted 5.33 MiB against 4.89 measured (+8.9%): Inductor writes outputs into "
                "dying inputs in place, which the simulator does not count",
}


@pytest.mark.parametrize("model", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=_BROKEN[m])) if m in _BROKEN else m
    for m in contract.MODELS
])
def test_budget_contract(model):
    if not contract.available(model):
        pytest.skip("needs transformers")
    points = contract.measure_model(model)
    assert [p.fraction for p in points] == [None, *contract.FRACTIONS]
    broken = {f"budget {p.fraction}": p.violations() for p in points if p.violations()}
    assert not broken, "\n" + contract.table(points)
