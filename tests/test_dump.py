"""config.dump_dir: graphs, plan.json, report.md and timeline.png per compiled graph."""

import json
import logging

import torch

import compile_offload
from compile_offload.dump import PLAN_SCHEMA

from .models import MLP, mlp_inputs


def test_dump_folder_holds_graphs_plan_report_and_timeline(tmp_path, caplog):
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
    assert plan["budget_bytes"] == int(0.5 * plan["baseline_peak_bytes"])
    assert {d["decision"] for d in plan["decisions"]} <= {"keep", "recompute", "offload"}
    report = (folder / "report.md").read_text()
    assert plan["decisions"][0]["name"] in report and "![predicted memory](timeline.png)" in report
    png = (folder / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    assert any("predicted peak" in r.getMessage() for r in caplog.records)
    assert any(str(folder) in r.getMessage() for r in caplog.records)
