"""Reuse saved plans across restarts (``config.plan_cache_dir``).

An entry is keyed by everything the plan depends on: the prepared joint graph (code,
shapes, dtypes and strides), the knobs that change decisions, the device profile, the torch
version and compile_offload's own source. Entries are never trusted blindly: one that
cannot be read, or names a tensor the graph does not have, is ignored with a warning and
the graph is planned again.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import torch
import torch.fx as fx

from passes.plan import Plan

from .settings import Settings

_DECISION_KNOBS = ("budget_bytes", "budget_fraction", "offload", "prefetch", "debug_force_offload", "solver",
                   "exact_max_candidates", "inner_compiler")


def cache_key(joint_gm: fx.GraphModule, settings: Settings, profile: dict) -> str:
    from .partitioner import _source_hash

    digest = hashlib.sha256()
    digest.update(joint_gm.code.encode())
    for node in joint_gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            digest.update(f"{node.name}:{tuple(val.shape)}:{val.stride()}:{val.dtype}:{val.device.type}".encode())
    knobs = {knob: getattr(settings, knob) for knob in _DECISION_KNOBS}
    digest.update(json.dumps([knobs, profile, torch.__version__, _source_hash()], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


def _path(settings: Settings, key: str) -> Path:
    return Path(settings.plan_cache_dir) / f"{key}.json"


def lookup(joint_gm: fx.GraphModule, settings: Settings, profile: dict) -> Plan | None:
    path = _path(settings, cache_key(joint_gm, settings, profile))
    if not path.exists():
        return None
    try:
        plan = Plan.load(path)
    except ValueError as error:
        warnings.warn(f"compile_offload: ignoring corrupt plan cache entry {path} ({error}); planning again",
                      stacklevel=2)
        return None
    names = {node.name for node in joint_gm.graph.nodes}
    missing = sorted((set(plan.saved) | set(plan.offloaded)) - names)
    if not plan.saved or missing:
        warnings.warn(f"compile_offload: ignoring stale plan cache entry {path} (tensors not in this graph: "
                      f"{missing[:5] or 'none saved'}); planning again", stacklevel=2)
        return None
    return plan


def store(joint_gm: fx.GraphModule, settings: Settings, profile: dict, plan: Plan) -> None:
    path = _path(settings, cache_key(joint_gm, settings, profile))
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    plan.save(temporary)
    temporary.replace(path)  # atomic: a reader never sees half a file
