"""The budget contract, CPU + Inductor, measured at the allocator (issue 15): model
families x byte budgets at 0.8, 0.6 and 0.4 of the measured unconstrained peak. The same
functions print the table of ``docs/benchmarks.md`` (``benchmarks/budget_contract.py``)."""

from __future__ import annotations

import pytest

from compile_offload.benchmarks import budget_contract as contract

pytestmark = [pytest.mark.inductor, pytest.mark.slow]

_measured: dict[str, list] = {}


def _points(model: str) -> list:
    """One unconstrained compile and one per budget, measured once per model for all the
    tests of that model."""
    if not contract.available(model):
        pytest.skip("needs transformers")
    if model not in _measured:
        _measured[model] = contract.measure_model(model)
    return _measured[model]


@pytest.mark.parametrize("model", contract.MODELS)
def test_budget_contract(model):
    points = _points(model)
    assert [p.fraction for p in points] == [None, *contract.FRACTIONS]
    broken = {f"budget {p.fraction}": p.violations() for p in points if p.violations()}
    assert not broken, "\n" + contract.table(points)
