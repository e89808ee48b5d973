"""What ``planning.plan_partition`` returns for each graph a compile partitions, for tests of
the code that reports on it (logs, dumps, the plan cache)."""

from __future__ import annotations

import torch
import torch.fx as fx

import compile_offload
from compile_offload import partitioner, settings as settings_mod
from compile_offload.result import PartitionResult


def capture_partitions(monkeypatch) -> list[tuple[PartitionResult, fx.GraphModule]]:
    """From now on, record ``(result, joint_gm)`` for every ``plan_partition`` call the
    partitioner makes (it looks the function up in its module on each call)."""
    captured = []
    plan_partition = partitioner.plan_partition

    def plan_and_capture(joint_gm, *args, **kwargs):
        result = plan_partition(joint_gm, *args, **kwargs)
        captured.append((result, joint_gm))
        return result

    monkeypatch.setattr(partitioner, "plan_partition", plan_and_capture)
    return captured


def train_step(model: torch.nn.Module, inputs, **options) -> None:
    """One forward and backward through the backend with the eager inner compiler."""
    backend = compile_offload.offload_remat(inner_compiler="eager", **options)
    torch.compile(model, backend=backend)(*inputs).sum().backward()


def partition_once(monkeypatch, model: torch.nn.Module, inputs, **options):
    """``(result, joint_gm, settings)`` of the single graph ``model`` compiles to."""
    captured = capture_partitions(monkeypatch)
    train_step(model, inputs, **options)
    ((result, joint_gm),) = captured
    return result, joint_gm, settings_mod.resolve({"inner_compiler": "eager", **options})
