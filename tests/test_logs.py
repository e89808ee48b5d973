"""One INFO line per graph, through logging and TORCH_LOGS."""

import logging
import os
import subprocess
import sys
import textwrap

import torch

import compile_offload

from .models import MLP, mlp_inputs


def test_one_info_line_per_graph(caplog):
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        backend = compile_offload.offload_remat(inner_compiler="eager", memory_budget=0.5)
        torch.compile(MLP(), backend=backend)(*mlp_inputs()).sum().backward()
    lines = [r.getMessage() for r in caplog.records if r.name == "compile_offload" and r.levelno == logging.INFO]
    assert len(lines) == 1, lines
    assert "budget" in lines[0] and "predicted peak" in lines[0] and "keep" in lines[0] and "solver" in lines[0]


def test_torch_logs_enables_our_logger():
    script = textwrap.dedent("""
        import torch, compile_offload
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        backend = compile_offload.offload_remat(inner_compiler="eager", memory_budget=0.5)
        torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
    """)
    env = {**os.environ, "TORCH_LOGS": "+compile_offload"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "predicted peak" in result.stderr
    assert "tensor" in result.stderr and "decision" in result.stderr  # the DEBUG table
