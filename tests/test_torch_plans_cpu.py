"""benchmarks/torch_plans_cpu.py: model-check's predictions of torch's plans beside the
CPU allocator's peak of the step torch compiles."""

import pytest
import torch

from compile_offload.benchmarks import torch_plans_cpu
from compile_offload.benchmarks.workloads import Decoder

TINY = dict(layers=1, d=64, heads=2, ff=256, seq=64, batch=2, dtype="float32")


@pytest.mark.inductor
@pytest.mark.slow
def test_each_strategy_is_predicted_as_model_check_does_and_measured_above_what_must_be_alive():
    rows = torch_plans_cpu.measure(TINY, {"compile": None, "compile_budget_0.0": 0.0}, reorders=(True,))
    by_strategy = {row.strategy: row for row in rows}
    assert set(by_strategy) == {"compile", "compile_budget_0.0"}
    # Every parameter's gradient is allocated in the measured region and alive at its end.
    param_bytes = sum(p.numel() * p.element_size() for p in Decoder(1, 64, 2).parameters())
    assert all(row.measured_bytes >= param_bytes for row in rows)
    # The prediction is the one model-check's construction gives, whatever else ran.
    predicted = torch_plans_cpu.predicted_peaks(TINY, torch_plans_cpu.STRATEGIES)
    assert predicted["compile"] == by_strategy["compile"].predicted_bytes


def test_the_table_says_what_is_predicted():
    row = torch_plans_cpu.Row("compile", True, 110, 100)
    assert row.error == pytest.approx(0.1)
    text = torch_plans_cpu.table([row])
    assert "predicted peak" in text and "+10.0%" in text


def test_bad_heads_are_refused():
    with pytest.raises(SystemExit):
        torch_plans_cpu.main(["--d", "10", "--heads", "3"])
