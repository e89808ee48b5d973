"""compile_offload.tools.sweep: one plan per budget and the predicted Pareto plot."""

import sys

import pytest

import compile_offload

from .models import MLP, mlp_inputs


def test_sweep_returns_a_plan_per_budget_and_draws_the_front(tmp_path):
    pytest.importorskip("matplotlib")  # the optional plot extra draws the figures this test reads
    model = MLP()
    budgets = [None, 0.75, 0.5, 0.0]
    plans = compile_offload.sweep(model, *mlp_inputs(), budgets=budgets, out=tmp_path, device_profile="cpu")
    assert [p.budget_bytes is None for p in plans] == [True, False, False, False]
    peaks = [p.predicted_peak_bytes for p in plans]
    assert peaks == sorted(peaks, reverse=True)
    png = (tmp_path / "pareto.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_a_single_budget_is_one_plan_not_one_per_character():
    model = MLP()
    (plan,) = compile_offload.sweep(model, *mlp_inputs(), budgets="40KiB", device_profile="cpu")
    assert plan.budget_bytes == 40 * 1024
    (plan,) = compile_offload.sweep(model, *mlp_inputs(), budgets=0.5, device_profile="cpu")
    assert plan.budget_bytes is not None
    (plan,) = compile_offload.sweep(model, *mlp_inputs(), budgets=None, device_profile="cpu")  # fuzz33b F02
    assert plan.budget_bytes is None
    with pytest.raises(TypeError, match=r"budgets=<object .*> is neither a budget nor a list of budgets"):
        compile_offload.sweep(model, *mlp_inputs(), budgets=object(), device_profile="cpu")


def test_memory_budget_is_refused_naming_budgets():
    with pytest.raises(TypeError, match=r"compile_offload.sweep: give the budgets as budgets=\[...\]"):
        compile_offload.sweep(MLP(), *mlp_inputs(), budgets=[0.5], memory_budget=0.1)


def test_an_out_that_cannot_be_a_folder_is_refused_before_any_plan(tmp_path, monkeypatch):
    import importlib

    sweep_module = importlib.import_module("compile_offload.tools.sweep")  # the module, not the function
    monkeypatch.setattr(sweep_module, "explain", lambda *args, **kwargs: pytest.fail("planned before checking out"))
    a_file = tmp_path / "afile"
    a_file.write_text("")
    with pytest.raises(ValueError, match=r"out=.*afile'?: it is a file, not a folder; name a folder for pareto.png"):
        compile_offload.sweep(MLP(), *mlp_inputs(), budgets=[0.5, 0.25], out=a_file)


def test_out_under_the_home_folder_is_named_with_a_tilde(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    compile_offload.sweep(MLP(), *mlp_inputs(), budgets=[0.5], out="~/front", device_profile="cpu")
    assert (tmp_path / "home" / "front" / "pareto.png").is_file() and not (tmp_path / "~").exists()


def test_empty_budgets_and_a_bad_entry_are_named_before_planning(monkeypatch):
    import importlib

    sweep_module = importlib.import_module("compile_offload.tools.sweep")
    monkeypatch.setattr(sweep_module, "explain", lambda *args, **kwargs: pytest.fail("planned before checking"))
    with pytest.raises(ValueError, match=r"compile_offload.sweep: budgets is empty"):
        compile_offload.sweep(MLP(), *mlp_inputs(), budgets=[], out="unused")
    with pytest.raises(ValueError, match=r"compile_offload.sweep: budgets\[2\]='bad' is not a size"):
        compile_offload.sweep(MLP(), *mlp_inputs(), budgets=[0.5, "1MiB", "bad"])
    with pytest.raises(ValueError, match=r"compile_offload.sweep: budgets\[0\]=1.5: a float budget is a fraction"):
        compile_offload.sweep(MLP(), *mlp_inputs(), budgets=[1.5])
    # fuzz30b F11: a budget above the profile's GPU memory was refused only once the budgets before it were planned
    with pytest.raises(ValueError, match=r"compile_offload.sweep: budgets\[1\]: .*100\.00 GiB is more than the "
                                         r"80\.00 GiB of memory"):
        compile_offload.sweep(MLP(), *mlp_inputs(), budgets=[0.5, "100GiB"], device_profile="h100")


def test_each_budget_of_a_sweep_dumps_its_graphs_in_a_folder_of_its_own(tmp_path):
    """fuzz30b F6: every budget's graph_0 went into one folder, each over the one before."""
    plans = compile_offload.sweep(MLP(), *mlp_inputs(), budgets=[0.5, 0.2], dump_dir=tmp_path, device_profile="cpu")
    for index, plan in enumerate(plans):
        dumped = compile_offload.Plan.load(tmp_path / f"budget_{index}" / "graph_0" / "plan.json")
        assert dumped.budget_bytes == plan.budget_bytes
    (one,) = compile_offload.sweep(MLP(), *mlp_inputs(), budgets=[0.5], dump_dir=tmp_path / "one",
                                   device_profile="cpu")
    assert (tmp_path / "one" / "graph_0" / "plan.json").is_file()


def test_out_without_matplotlib_is_refused_before_planning(monkeypatch, tmp_path):
    import importlib

    sweep_module = importlib.import_module("compile_offload.tools.sweep")
    monkeypatch.setattr(sweep_module, "explain", lambda *args, **kwargs: pytest.fail("planned before checking"))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure raises ImportError
    with pytest.raises(RuntimeError, match=r"draws with matplotlib: pip install 'compile_offload\[plot\]'"):
        compile_offload.sweep(MLP(), *mlp_inputs(), budgets=[0.5, 0.25], out=tmp_path)


def test_a_graph_torch_partitions_is_returned_and_left_out_of_the_drawing(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import importlib

    from compile_offload.passes.plan import Plan

    sweep_module = importlib.import_module("compile_offload.tools.sweep")
    unplanned = Plan.unplanned(feasible=False, budget_bytes=None, device_profile="cpu", solver="greedy",
                               graph_name="graph_0", why="torch.cond", fallback="a higher-order op (cond)")
    monkeypatch.setattr(sweep_module, "explain", lambda *args, **kwargs: unplanned)
    plans = compile_offload.sweep(MLP(), *mlp_inputs(), budgets=[None, 0.5], out=tmp_path)
    assert plans == [unplanned, unplanned]
    assert (tmp_path / "pareto.png").read_bytes().startswith(b"\x89PNG")
