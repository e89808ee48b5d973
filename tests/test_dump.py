"""config.dump_dir: graphs, plan.json, report.md and timeline.png per compiled graph."""

import dataclasses
import json
import logging
import sys

import pytest
import torch

import compile_offload
from compile_offload.reporting.dump import dump_result
from compile_offload.passes.plan import PLAN_SCHEMA
from compile_offload.reporting.logs import emit
from compile_offload.passes.plan import Plan

from .models import MLP, mlp_inputs
from .partition_results import partition_once, partitions, train_step


def _is_png(path) -> bool:
    data = path.read_bytes()
    return data.startswith(b"\x89PNG") and len(data) > 1000


def test_dump_folder_holds_graphs_plan_report_and_timeline(tmp_path, caplog):
    pytest.importorskip("matplotlib")  # the optional plot extra draws the figures this test reads
    model = MLP()
    (x,) = mlp_inputs()
    backend = compile_offload.offload_remat(inner_compiler="eager", memory_budget=0.5, dump_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        torch.compile(model, backend=backend)(x).sum().backward()
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert folder.name.startswith("graph_")
    forward, backward, joint = (folder / "forward.py").read_text(), (folder / "backward.py").read_text(), (folder / "joint.py").read_text()
    assert "def forward" in forward and "def forward" in backward and "tangents" in joint
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["schema"] == PLAN_SCHEMA and plan["graph_name"] == folder.name
    assert 0.5 * plan["baseline_peak_bytes"] <= plan["budget_bytes"] < plan["baseline_peak_bytes"]
    assert {d["decision"] for d in plan["decisions"]} <= {"keep", "recompute", "offload"}
    report = (folder / "report.md").read_text()
    assert plan["decisions"][0]["name"] in report and "![predicted memory](timeline.png)" in report
    assert _is_png(folder / "timeline.png")
    assert any("predicted peak" in r.getMessage() for r in caplog.records)
    assert any(str(folder) in r.getMessage() for r in caplog.records)


def test_folders_are_named_after_dynamos_compile_ids(tmp_path):
    # A recompile of one frame (new input shape, static shapes) is Dynamo's compile
    # <frame>/1 after <frame>/0: the folders must say so.
    model = MLP()
    backend = compile_offload.offload_remat(inner_compiler="eager", dump_dir=str(tmp_path))
    compiled = torch.compile(model, backend=backend, dynamic=False)
    compiled(torch.randn(4, 16)).sum().backward()
    compiled(torch.randn(6, 16)).sum().backward()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2
    frames = {name.split("_")[1] for name in names}
    assert len(frames) == 1 and [name.split("_")[2] for name in names] == ["0", "1"]


def test_emit_writes_the_dump_and_names_it_in_the_info_line(tmp_path, monkeypatch, caplog):
    pytest.importorskip("matplotlib")  # the optional plot extra draws the figures this test reads
    result, joint_gm, settings = partition_once(MLP(), mlp_inputs(), memory_budget=0.5)
    settings = dataclasses.replace(settings, dump_dir=str(tmp_path / "dumps"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        emit(result, joint_gm, settings)
    folder = tmp_path / "dumps" / result.plan.graph_name
    assert sorted(p.name for p in folder.iterdir()) == [
        "backward.py", "forward.py", "joint.py", "plan.json", "report.md", "timeline.png"]
    assert Plan.from_dict(json.loads((folder / "plan.json").read_text())) == result.plan
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert str(folder) in line


def test_a_dump_that_cannot_be_written_warns_once_per_graph_not_per_plan(tmp_path):
    """The budget loop emits every plan it compiles for a graph: each failed alike, and each
    warned (three warnings for one graph)."""
    import warnings

    result, joint_gm, settings = partition_once(MLP(), mlp_inputs(), memory_budget=0.5)
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / result.plan.graph_name).write_text("a file where the graph's folder goes")
    settings = dataclasses.replace(settings, dump_dir=str(tmp_path / "dumps"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            emit(result, joint_gm, settings, summary=False)
    said = [str(w.message) for w in caught if "could not write the dump" in str(w.message)]
    assert len(said) == 1 and result.plan.graph_name in said[0], said


def test_a_cached_plan_is_drawn_from_the_timeline_it_records(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")  # the optional plot extra draws the figures this test reads
    result, joint_gm, _ = partition_once(MLP(), mlp_inputs(), memory_budget=0.5)
    cached = dataclasses.replace(result, solution=None)  # a plan cache hit: no solver run
    folder = dump_result(tmp_path, cached, joint_gm)
    assert _is_png(folder / "timeline.png")
    assert "![predicted memory](timeline.png)" in (folder / "report.md").read_text()


def test_an_unplanned_graph_is_dumped_with_the_reason_for_no_picture(tmp_path, monkeypatch):
    result, joint_gm, _ = partition_once(MLP(), mlp_inputs())
    fallback = Plan.unplanned(feasible=False, budget_bytes=None, device_profile="cpu", solver="greedy",
                              graph_name="graph_7_0", why="fallback: boom", fallback="boom")
    unplanned = dataclasses.replace(result, plan=fallback, analysis=None, solution=None)
    folder = dump_result(tmp_path, unplanned, joint_gm)
    assert folder.name == "graph_7_0"
    assert "def forward" in (folder / "forward.py").read_text() and "tangents" in (folder / "joint.py").read_text()
    report = (folder / "report.md").read_text()
    assert "not planned (fallback: boom)" in report and "no timeline.png: no predicted timeline" in report
    # review35c N3: no "budget: none" (a budget was asked, torch's partition ran without it) nor 0 B figures
    assert "budget: none" not in report and "predicted peak" not in report
    assert not (folder / "timeline.png").exists()


def test_without_matplotlib_the_report_says_how_to_get_the_picture(tmp_path, monkeypatch):
    result, joint_gm, _ = partition_once(MLP(), mlp_inputs(), memory_budget=0.5)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    folder = dump_result(tmp_path, result, joint_gm)
    assert "pip install 'compile_offload[plot]'" in (folder / "report.md").read_text()
    assert not (folder / "timeline.png").exists()


def test_every_graph_of_a_graph_break_gets_its_own_folder(tmp_path, monkeypatch):
    from .models import GraphBreakMLP

    with partitions() as captured:
        train_step(GraphBreakMLP(), mlp_inputs(), dump_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(c.plan.graph_name for c in captured)
    assert len(captured) == 2


@pytest.mark.inductor
@pytest.mark.slow
def test_a_warm_compile_cache_does_not_skip_the_dump(tmp_path, captured_plans):
    """The same program compiled twice with Inductor's and AOTAutograd's caches on: the
    second compile would be a cache hit that never calls the partitioner; with dump_dir set
    it is partitioned and dumped again."""
    backend = compile_offload.offload_remat(memory_budget=0.5, dump_dir=str(tmp_path / "dumps"))
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        for _ in range(2):
            torch._dynamo.reset()
            torch.compile(MLP(), backend=backend)(*mlp_inputs()).sum().backward()
    # Each compile partitions (the plan, and the unconstrained one where the budget loop compares
    # it: at 0.5 the MLP is below its minimum, whose plan keeps everything), the second as the first.
    half = len(captured_plans) // 2
    assert half >= 1 and len(captured_plans) == 2 * half
    assert [p.summary() for p in captured_plans[:half]] == [p.summary() for p in captured_plans[half:]]
    assert all(plan.decisions for plan in captured_plans)


def test_the_dump_of_explain_carries_the_plans_notes(tmp_path):
    """fuzz30b F8: explain's notes (the scheduled peak not checked, the pinned memory) came
    after the graph was dumped: plan.json and report.md lacked them."""
    import compile_offload
    from compile_offload.passes.plan import Plan

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64)).to("meta")
    plan = compile_offload.explain(model, torch.randn(32, 64, device="meta"), memory_budget=0.5,
                                   device_profile="h100", dump_dir=tmp_path, debug_force_offload=True)
    assert plan.notes
    assert Plan.load(tmp_path / plan.graph_name / "plan.json") == plan
    report = (tmp_path / plan.graph_name / "report.md").read_text()
    assert all(f"- note: {note}" in report for note in plan.notes)
