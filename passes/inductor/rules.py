"""The code generator a plan's memory is predicted for, as one object the analysis takes.

``KernelRules.generator`` is Inductor's Triton (an accelerator's kernels), Inductor's C++
backend, or ``"python"``: the partitioned graphs run as written (``inner_compiler="eager"``),
no fusion. ``None`` asks for Inductor's generator for the graph's own device, as a compile
picks it (``loop_ranges.cpu_graph``); ``explain`` for a GPU profile on host tensors asks
for Triton's. ``fusion_pulls``: whether Inductor's horizontal fusion may run a kernel ahead
of its place, as its scheduler does by default; False under a budget
(``compile_offload.inductor.plan_order_fusion``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch.fx as fx

from .loop_ranges import cpu_graph

Generator = Literal["triton", "cpp", "python"]


@dataclass(frozen=True)
class KernelRules:
    generator: Generator | None = "python"
    fusion_pulls: bool = True

    @property
    def fusion(self) -> bool:
        """Inductor fuses (any generator of Inductor's)."""
        return self.generator != "python"

    @property
    def triton(self) -> bool:
        return self.generator == "triton"

    def for_nodes(self, nodes: Iterable[fx.Node]) -> "KernelRules":
        """These rules with Inductor's generator resolved for ``nodes``' device."""
        if self.generator is not None:
            return self
        return KernelRules("cpp" if cpu_graph(list(nodes)) else "triton", self.fusion_pulls)

    @classmethod
    def of_compile(cls, inductor: bool, accelerator: bool | None = None, fusion_pulls: bool = True) -> "KernelRules":
        """The rules of a compile: Inductor's (``accelerator``: Triton's where True, C++'s
        where False, the graph's device's where None) or the graphs as Python."""
        if not inductor:
            return cls("python", fusion_pulls)
        return cls(None if accelerator is None else "triton" if accelerator else "cpp", fusion_pulls)


PYTHON = KernelRules("python")
INDUCTOR = KernelRules(None)  # Inductor's generator for the graph's device
TRITON = KernelRules("triton")
CPP = KernelRules("cpp")
