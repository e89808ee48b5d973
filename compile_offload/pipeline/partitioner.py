"""Our partitioner, installed into Inductor as a ``CustomPartitionerFn``.

Inductor calls it with the joint forward+backward graph after its joint-graph passes; it
returns the forward and backward graphs. Everything that decides *what* to save lives in
``passes`` and ``planning``; this class carries the settings, reports each plan (logs,
trace, dump, and its budget unless the budget loop will) and hands it to whoever asked (``on_result``), and gives Inductor's caches a
key that changes whenever the settings or our code change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..passes import compat
from ..torch_api.inductor import CustomPartitionerFn
from .fingerprint import source_hash
from ..reporting.logs import emit
from .budget_report import report_budget
from .planning import plan_partition
from .result import PartitionResult
from ..runtime.kernel_costs import MeasuredCosts
from ..settings import Settings


class OffloadRematPartitioner(CustomPartitionerFn):
    def __init__(self, settings: Settings, graph_name: str = "graph",
                 on_result: Callable[[PartitionResult], None] | None = None, accelerator: bool | None = None,
                 report: bool = True, measured: MeasuredCosts | None = None,
                 sizes: tuple[tuple[str, int], ...] = ()) -> None:
        self.settings = settings
        # The size each size symbol is planned at (``dynamic_check.sizes_planned_at``): the plan
        # depends on them, and Inductor's caches do not key on them.
        self.sizes = sizes
        self.measured = measured  # plan_partition's: costs measured on the device, in place of the model
        self.graph_name = graph_name
        self.on_result = on_result
        self.accelerator = accelerator  # plan_partition's: the kernels Inductor generates (None: the graph's device says)
        # Whether each plan's budget and INFO line are reported here (budget_report.report_budget,
        # logs.emit); False under the budget loop, which reports the plan it keeps, once, when
        # Inductor's code for it is known.
        self.report = report

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        if not joint_inputs:
            return nested_region_partition(gm, **kwargs)
        result = plan_partition(
            gm,
            joint_inputs,
            self.settings,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
            graph_name=self.graph_name,
            accelerator=self.accelerator,
            measured=self.measured,
        )
        if self.report:
            report_budget(result.plan, self.settings)
        emit(result, gm, self.settings, summary=self.report)
        if self.on_result is not None:
            self.on_result(result)
        return result.fw_gm, result.bw_gm

    def __getstate__(self) -> dict:
        # Inductor's cache key pickles its config, this object included: only what decides
        # the partition (not ``on_result``'s target, which holds graphs).
        return {"settings": self.settings, "graph_name": self.graph_name, "on_result": None,
                "accelerator": self.accelerator, "report": self.report, "measured": self.measured,
                "sizes": self.sizes}

    def uuid(self) -> str:
        # Inductor's FX graph cache and AOTAutograd's cache key on this: a cache hit must
        # never skip a different plan.
        measured = None if self.measured is None else self.measured.digest()
        return f"{source_hash()}:{self.settings!r}:{self.accelerator!r}:{measured}:{self.sizes!r}"


def nested_region_partition(gm: torch.fx.GraphModule, **kwargs: Any) -> tuple[torch.fx.GraphModule,
                                                                                torch.fx.GraphModule]:
    """torch's min-cut partition of the body of a ``torch.compiler.nested_compile_region``
    (an ``invoke_subgraph``), which AOTAutograd partitions with the graph's partitioner,
    passing no joint inputs. Planned on its own under the budget, it would be reported as a
    graph of its own under the graph's name, though its peak is not the step's; and the graph
    that calls it falls back to torch's partition anyway (``UnsupportedGraph``), with the one
    warning that says the budget is not applied."""
    joint = compat.prepare_joint(gm, kwargs["num_fwd_outputs"], kwargs.get("static_lifetime_input_indices"))
    return compat.default_partition(joint, [])
