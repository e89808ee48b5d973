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
# (GPT-2 at 0.8 and MLP-mixer at 0.6): it fixed GPT-2's 0.8 overrun but not its family.
_BROKEN = {
    "hf_gpt2": "at 0.4 the minimum measures 4.58 MiB, 3.89 predicted: Inductor fuses the recomputed attention "
               "dropout into the softmax backward's kernel, later than the plan's order (design.md, Memory "
               "simulator); at 0.8 the re-planned step keeps its budget (5.98 MiB of 6.28) but its prediction "
               "(5.66 MiB) is 5.3% low",
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
