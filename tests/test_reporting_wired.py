"""Reporting through the backend once the partitioner calls logs.emit and passes the
analysis to plan_cache.lookup: every graph reported, however it was partitioned."""

import json
import logging

import pytest
import torch

from compile_offload.pipeline import planning
from compile_offload.passes.analyze import UnsupportedGraph
from compile_offload.passes.plan import Plan

from .models import MLP, TransformerBlock, mlp_inputs, sequence_inputs
from .partition_results import train_step


def test_a_graph_the_planner_cannot_handle_is_logged_and_dumped(tmp_path, monkeypatch, caplog):
    def unsupported(*args, **kwargs):
        raise UnsupportedGraph("an op the planner does not know")

    monkeypatch.setattr(planning, "analyze_joint", unsupported)
    with caplog.at_level(logging.INFO, logger="compile_offload"), pytest.warns(UserWarning, match="falling back"):
        train_step(MLP(), mlp_inputs(), memory_budget=0.5, dump_dir=str(tmp_path))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "compile_offload" and r.levelno == logging.INFO]
    assert ("not planned (fallback: an op the planner does not know; torch's partition ran, without the memory "
            "budget 0.5 of the unconstrained activations)") in line and "[dump:" in line
    (folder,) = list(tmp_path.iterdir())
    assert "def forward" in (folder / "forward.py").read_text()
    assert "no predicted timeline" in (folder / "report.md").read_text()


def test_a_restart_from_the_plan_cache_is_logged_and_dumped(tmp_path, caplog):
    pytest.importorskip("matplotlib")  # the optional plot extra draws the figures this test reads
    cache, dumps = tmp_path / "cache", tmp_path / "dumps"
    train_step(MLP(), mlp_inputs(), memory_budget=0.5, plan_cache_dir=str(cache))
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        train_step(MLP(), mlp_inputs(), memory_budget=0.5, plan_cache_dir=str(cache), dump_dir=str(dumps))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "compile_offload" and r.levelno == logging.INFO]
    assert "[from the plan cache]" in line and "[dump:" in line
    (folder,) = list(dumps.iterdir())
    assert (folder / "timeline.png").read_bytes().startswith(b"\x89PNG")
    assert "reused from the plan cache" in json.loads((folder / "plan.json").read_text())["notes"]


def test_a_cached_entry_that_would_recompute_dropout_is_not_trusted(tmp_path):
    train_step(TransformerBlock(), sequence_inputs(), memory_budget=0.5, plan_cache_dir=str(tmp_path))
    (entry,) = tmp_path.glob("*.json")
    plan = Plan.load(entry)
    plan.saved = [name for name in plan.saved if name.startswith("primals")]
    plan.save(entry)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="stale plan cache entry.*would recompute.*random op"):
        train_step(TransformerBlock(), sequence_inputs(), memory_budget=0.5, plan_cache_dir=str(tmp_path))
    assert any(not name.startswith("primals") for name in Plan.load(entry).saved)  # planned again, rewritten
