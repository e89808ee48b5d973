"""The budget contract, CPU + Inductor, measured at the allocator (issue 15): model
families x byte budgets at 0.8, 0.6 and 0.4 of the measured unconstrained peak. The same
functions print the table of ``docs/benchmarks.md`` (``benchmarks/budget_contract.py``)."""

from __future__ import annotations

import pytest

from compile_offload.benchmarks import budget_contract as contract

pytestmark = [pytest.mark.inductor, pytest.mark.slow]

# Measured on CPU, torch 2.13, 2026-11-25 (docs/benchmarks.md, "The budget contract"): these
# families break the contract today; strict, so a fix shows up as an unexpected pass. The scheduled
# peak (Plan.scheduled_peak_bytes) sees some overruns; nothing re-plans yet.
_BROKEN = {
    "hf_gpt2": "at 0.8 the plan fits and the compiled step measures 6.48 MiB against a 6.28 MiB budget; at 0.4 "
               "the minimum measures 4.58 MiB, 3.89 predicted: Inductor fuses the recomputed attention dropout "
               "into the softmax backward's kernel, later than the plan's order (design.md, Memory simulator)",
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
