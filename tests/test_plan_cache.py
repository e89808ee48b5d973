"""Plan.save / Plan.load and config.plan_cache_dir."""

import pytest
import torch

import compile_offload
from compile_offload.partitioner import OffloadRematPartitioner
from passes.plan import Plan

from .models import MLP, mlp_inputs


def test_plan_round_trips_through_json(tmp_path):
    model = MLP()
    plan = compile_offload.explain(model, *mlp_inputs(), memory_budget=0.5, device_profile="cpu")
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


@pytest.mark.parametrize("content", ["{not json", '{"schema": "other"}', '{"schema": "compile_offload.plan/1", "x": 1}'])
def test_loading_a_corrupt_file_is_an_error(tmp_path, content):
    (tmp_path / "plan.json").write_text(content)
    with pytest.raises(ValueError):
        Plan.load(tmp_path / "plan.json")


def _train_once(cache_dir, calls):
    torch._dynamo.reset()
    model = MLP()
    backend = compile_offload.offload_remat(inner_compiler="eager", memory_budget=0.5, plan_cache_dir=str(cache_dir))
    torch.compile(model, backend=backend)(*mlp_inputs()).sum().backward()
    return calls[-1]


@pytest.fixture
def plans(monkeypatch):
    calls = []
    original = OffloadRematPartitioner.__call__

    def spy(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        calls.append(self.last_plan)
        return result

    monkeypatch.setattr(OffloadRematPartitioner, "__call__", spy)
    return calls


def test_a_restart_reuses_the_saved_plan(tmp_path, plans):
    first = _train_once(tmp_path, plans)
    assert len(list(tmp_path.glob("*.json"))) == 1
    second = _train_once(tmp_path, plans)
    assert "reused from the plan cache" in second.notes
    assert second.saved == first.saved and second.decisions == first.decisions


def test_a_corrupt_entry_is_ignored_with_a_warning(tmp_path, plans):
    _train_once(tmp_path, plans)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text("{garbage")
    with pytest.warns(UserWarning, match="corrupt plan cache entry"):
        plan = _train_once(tmp_path, plans)
    assert "reused from the plan cache" not in plan.notes
    Plan.load(entry)  # planned again and rewritten


def test_a_stale_entry_is_ignored_with_a_warning(tmp_path, plans):
    _train_once(tmp_path, plans)
    (entry,) = tmp_path.glob("*.json")
    stale = Plan.load(entry)
    stale.saved = ["no_such_tensor"]
    stale.save(entry)
    with pytest.warns(UserWarning, match="stale plan cache entry"):
        plan = _train_once(tmp_path, plans)
    assert "reused from the plan cache" not in plan.notes


def test_sweep_returns_a_plan_per_budget_and_draws_the_front(tmp_path):
    model = MLP()
    budgets = [None, 0.75, 0.5, 0.0]
    plans = compile_offload.sweep(model, *mlp_inputs(), budgets=budgets, out=tmp_path, device_profile="cpu")
    assert [p.budget_bytes is None for p in plans] == [True, False, False, False]
    peaks = [p.predicted_peak_bytes for p in plans]
    assert peaks == sorted(peaks, reverse=True)
    png = (tmp_path / "pareto.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
