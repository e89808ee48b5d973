"""One INFO line per graph, through logging, TORCH_LOGS and TORCH_TRACE (compile_offload.reporting.logs)."""

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._logging import _internal as torch_logging_internal  # private: the TORCH_TRACE logger

import compile_offload
from compile_offload.reporting.logs import emit, info_line
from compile_offload.passes.plan import PLAN_SCHEMA, Plan

from .models import MLP, mlp_inputs
from .partition_results import partition_once


def test_one_info_line_per_graph(caplog):
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        backend = compile_offload.offload_remat(inner_compiler="eager", memory_budget=0.0)  # no warning
        torch.compile(MLP(), backend=backend)(*mlp_inputs()).sum().backward()
    lines = [r.getMessage() for r in caplog.records if r.name == "compile_offload" and r.levelno == logging.INFO]
    assert len(lines) == 1, lines
    assert "budget" in lines[0] and "predicted peak" in lines[0] and "keep" in lines[0] and "solver" in lines[0]


@pytest.fixture
def planned():
    return partition_once(MLP(), mlp_inputs(), memory_budget=0.5)


def test_emit_logs_one_info_line_and_the_decision_table_at_debug(planned, caplog):
    result, joint_gm, settings = planned
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="compile_offload"):
        emit(result, joint_gm, settings)
    records = [r for r in caplog.records if r.name == "compile_offload"]
    info = [r.getMessage() for r in records if r.levelno == logging.INFO]
    debug = "\n".join(r.getMessage() for r in records if r.levelno == logging.DEBUG)
    assert info == [info_line(result)]
    assert "predicted peak" in info[0] and f"[solver {result.plan.solver}" in info[0]
    assert all(d.name in debug and d.reason in debug for d in result.plan.decisions)


def test_the_info_line_says_where_the_plan_came_from(planned):
    result, _, _ = planned
    assert "[solver" in info_line(result)
    cached = dataclasses.replace(result, solution=None)  # what a plan cache hit returns
    assert info_line(cached).endswith("[from the plan cache]")
    fallback_plan = Plan.unplanned(feasible=False, budget_bytes=None, device_profile="cpu", solver="greedy", graph_name="graph_3_0", why="fallback: boom")
    unplanned = dataclasses.replace(result, plan=fallback_plan, analysis=None, solution=None)
    assert info_line(unplanned) == "graph_3_0: not planned (fallback: boom)"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_emit_traces_the_plan_as_a_tlparse_artifact(planned):
    result, joint_gm, settings = planned
    trace_log = torch_logging_internal.trace_log
    handler = _Records()
    trace_log.addHandler(handler)  # trace_structured only writes when the trace log has handlers
    try:
        emit(result, joint_gm, settings)
    finally:
        trace_log.removeHandler(handler)
    artifacts = [r for r in handler.records if "artifact" in r.metadata]
    names = [r.metadata["artifact"]["name"] for r in artifacts]
    assert names == [f"compile_offload_plan_{result.plan.graph_name}"]
    payload = json.loads(artifacts[0].payload)
    assert payload["schema"] == PLAN_SCHEMA
    assert Plan.from_dict(payload) == result.plan


def test_torch_logs_and_torch_trace_show_the_plan(tmp_path):
    script = textwrap.dedent("""
        import logging, torch, compile_offload
        logging.basicConfig(format="root: %(message)s")  # a handler on the root logger too
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        backend = compile_offload.offload_remat(inner_compiler="eager", memory_budget=0.0)  # no warning
        torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
    """)
    env = {**os.environ, "TORCH_LOGS": "+compile_offload", "TORCH_TRACE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Warning" not in result.stderr, result.stderr[-2000:]
    # One line per graph, printed once: by torch's handler, not propagated to the root's as well.
    assert result.stderr.count("predicted peak") == 1 and "root:" not in result.stderr, result.stderr[-2000:]
    assert "tensor" in result.stderr and "decision" in result.stderr  # the DEBUG table
    trace = "".join(path.read_text() for path in tmp_path.iterdir())
    assert '"name": "compile_offload_plan_graph_0_0"' in trace
