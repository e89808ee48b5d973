"""Our partitioner, installed into Inductor as a ``CustomPartitionerFn``.

Inductor calls it with the joint forward+backward graph after its joint-graph passes; it
returns the forward and backward graphs. Everything that decides *what* to save lives in
``passes``; this class only carries the settings and gives Inductor's caches a key that
changes whenever the settings or our code change.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from . import passes
from .settings import Settings

_PACKAGE_ROOTS = (Path(__file__).parent, Path(passes.__file__).parent)


@functools.cache
def _source_hash() -> str:
    digest = hashlib.sha256()
    for root in _PACKAGE_ROOTS:
        for path in sorted(root.glob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class OffloadRematPartitioner(CustomPartitionerFn):
    def __init__(self, settings: Settings, graph_name: str = "graph") -> None:
        self.settings = settings
        self.graph_name = graph_name

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        from .planning import plan_partition

        result = plan_partition(
            gm,
            joint_inputs,
            self.settings,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
            graph_name=self.graph_name,
        )
        self.last_plan = result.plan
        return result.fw_gm, result.bw_gm

    def uuid(self) -> str:
        # Inductor's FX graph cache and AOTAutograd's cache key on this: a cache hit must
        # never skip a different plan.
        return f"{_source_hash()}:{self.settings!r}"
