"""What a compile served from Inductor's caches still tells the user.

With a warm FX graph or AOTAutograd cache (``TORCHINDUCTOR_CACHE_DIR``, kept across
processes) Inductor returns compiled code without calling our partitioner: no plan is
made, so nothing would be logged or warned, and ``dynamic_check`` would have nothing to
check. Each compile that did plan therefore writes a small record next to Inductor's
cache (``<cache dir>/compile_offload_records/<key>.json``): every plan the Dynamo graph got
and its symbolic memory program. A compile served from the cache reads it back and
``replay`` reports it exactly as a planned one is reported (the INFO line and decision
table, the ``TORCH_TRACE`` artifact, ``latest_plans``, the budget-below-minimum and
fallback warnings, or ``BudgetError`` under ``strict_budget``). The key covers what the
cache keys on that the plan depends on (the Dynamo graph's code and input metadata, the
sizes a dynamic graph is planned at, every setting, torch's and our own source), so a record
never describes other code.
Where no record exists (a cache filled by another version, records deleted), the graph is
compiled again past the caches, so that it is planned and reported. The pinned pool's
limit is set by the backend on every compile, cached or not. A dump (``dump_dir``) always
compiles past the caches (it needs the graphs, which a record does not keep).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import budget_report, planning
from .dynamic_check import SymbolicProgram, program_of, sizes_planned_at
from .fingerprint import options_text, source_hash
from ..reporting.logs import emit_cached
from ..passes.plan import Plan
from ..settings import Settings

log = logging.getLogger("compile_offload")

RECORD_SCHEMA = "compile_offload.graph_record/1"


@dataclass
class GraphRecord:
    """One plan a Dynamo graph got, and its memory program when sizes are symbolic."""

    plan: Plan
    program: SymbolicProgram | None


def records_of(results: list) -> list[GraphRecord]:
    """The records of the plans ``results`` (``PartitionResult``s) got."""
    return [GraphRecord(r.plan, program_of(r)) for r in results]


def trains(example_inputs: Sequence[Any]) -> bool:
    """Whether Inductor compiles this graph for training (calls the partitioner): grad
    mode on and some input requiring grad, as ``compile_fx`` decides."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def record_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
               inductor_patches: dict | None = None) -> str:
    """The record's key: what decides the plans and the code that Inductor's caches serve
    alike (the graph, its inputs, the settings, ``torch.compile``'s mode or options, the GPU's
    model: one cached compile per mode or GPU, each with the record of its own plans)."""
    digest = hashlib.sha256(gm.code.encode())
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            gpu = torch.cuda.get_device_name(value.device) if value.device.type == "cuda" else ""
            digest.update(f"{tuple(map(str, value.shape))}:{tuple(map(str, value.stride()))}:{value.dtype}:"
                          f"{value.device.type}:{gpu}:{value.requires_grad}".encode())
        else:
            digest.update(f"{type(value).__name__}:{value}".encode())
    # The sizes planned at: a dynamic graph's tensors are the call's, not the sizes it is planned for.
    digest.update(json.dumps([repr(settings), repr(sizes_planned_at(gm, settings)), torch.__version__,
                              source_hash(), options_text(inductor_patches or {})]).encode())
    return digest.hexdigest()[:32]


def _folder() -> Path:
    from ..torch_api import inductor

    return Path(inductor.cache_dir()) / "compile_offload_records"


def store(key: str, records: list[GraphRecord]) -> None:
    """Write the record; a failure only means a later warm compile compiles again. A plan
    another run may not get (``replayable``) is not written, and one written before under
    the key is removed: a warm compile then finds no record and plans again."""
    path = _folder() / f"{key}.json"
    if not all(replayable(record.plan) for record in records):
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return
    data = {"schema": RECORD_SCHEMA,
            "graphs": [{"plan": r.plan.to_json(), "program": None if r.program is None else r.program.to_json()}
                       for r in records]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, default=str)
        os.replace(temporary, path)
    except OSError as error:
        log.debug("could not write the graph record %s (%s)", path, error)


def replayable(plan: Plan) -> bool:
    """Whether a later run compiling the same graph under the same settings gets ``plan``:
    not where ``plan_time_limit`` cut the search short (wall-clock time: a busy machine), nor
    where the planner fell back after an error of its own (under ``suppress_errors``: it may
    not happen again); a graph the planner does not support falls back every time."""
    return not plan.time_limit_reached and (plan.fallback is None or plan.fallback.startswith("UnsupportedGraph:"))


def load(key: str) -> list[GraphRecord] | None:
    """The records stored under ``key``; None when there are none or they cannot be read."""
    path = _folder() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("schema") != RECORD_SCHEMA:
            return None
        if not isinstance(data["graphs"], list) or not data["graphs"]:
            raise ValueError("no graphs")  # a compile that planned stores at least one
        return [GraphRecord(Plan.from_dict(g["plan"]),
                            None if g["program"] is None else SymbolicProgram.from_json(g["program"]))
                for g in data["graphs"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.debug("ignoring the graph record %s (%s)", path, error)
        return None


def replay(records: list[GraphRecord], settings: Settings, graph_name: str) -> None:
    """Report the plans of a compile served from the cache as when they were made."""
    for record in records:
        plan = record.plan
        plan.graph_name = graph_name
        if plan.fallback is not None:
            planning.raise_if_strict_fallback(graph_name, plan.fallback, settings)
            warnings.warn(planning.fallback_message(graph_name, plan.fallback), stacklevel=4)
        emit_cached(plan)
        budget_report.report_budget(plan, settings)
        if plan.scheduled_peak_bytes is not None and plan.budget_outcome == "over_budget":
            # the budget loop's warning, as when it was made
            budget_report.warn_over_budget(plan, stacklevel=4, verified=settings.verify_budget,
                                           strict=settings.strict_budget)
