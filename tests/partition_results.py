"""The one way tests see what the backend planned: every ``plan_partition`` call the
partitioner makes, with its result, joint graph and the graphs it returned. The
``captured_plans`` fixture (conftest.py), the failure-mode tests and the fuzzer all use it.

A compile served from Inductor's or AOTAutograd's cache never calls the partitioner: tests
that read these and compile through Inductor turn those caches off.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.fx as fx

import compile_offload
from compile_offload.pipeline import partitioner
from compile_offload import settings as settings_mod
from compile_offload.passes.plan import Plan
from compile_offload.pipeline.result import PartitionResult


@dataclasses.dataclass
class Partition:
    """What one call of the partitioner produced."""

    result: PartitionResult
    joint_gm: fx.GraphModule
    num_fwd_outputs: int

    @property
    def plan(self) -> Plan:
        return self.result.plan

    @property
    def fw(self) -> fx.GraphModule:
        return self.result.fw_gm

    @property
    def bw(self) -> fx.GraphModule:
        return self.result.bw_gm


class Partitions(list):
    """The captured ``Partition``s, and ``plans``: their plans, in the same order."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[Plan] = []


@contextlib.contextmanager
def partitions(rewrite: Callable[[fx.GraphModule], fx.GraphModule] | None = None) -> Iterator[Partitions]:
    """Every partition the backend makes inside the block, in order; ``rewrite`` (if given)
    replaces each partitioned graph before it is compiled. Works inside hypothesis examples
    (a context manager, not a per-test fixture)."""
    found = Partitions()
    plan_partition = partitioner.plan_partition

    def plan_and_capture(joint_gm, *args, **kwargs):
        result = plan_partition(joint_gm, *args, **kwargs)
        if rewrite is not None:
            result = dataclasses.replace(result, fw_gm=rewrite(result.fw_gm), bw_gm=rewrite(result.bw_gm))
        found.append(Partition(result, joint_gm, kwargs["num_fwd_outputs"]))
        found.plans.append(result.plan)
        return result

    with mock.patch.object(partitioner, "plan_partition", plan_and_capture):
        yield found


def train_step(model: torch.nn.Module, inputs, **options) -> None:
    """One forward and backward through the backend with the eager inner compiler."""
    backend = compile_offload.offload_remat(inner_compiler="eager", **options)
    torch.compile(model, backend=backend)(*inputs).sum().backward()


def partition_once(model: torch.nn.Module, inputs, **options):
    """``(result, joint_gm, settings)`` of the single graph ``model`` compiles to."""
    with partitions() as found:
        train_step(model, inputs, **options)
    (only,) = found
    return only.result, only.joint_gm, settings_mod.resolve({"inner_compiler": "eager", **options})
