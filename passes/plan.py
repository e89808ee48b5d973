"""The plan: one decision per saved tensor, and what the planner predicts for it.

``Plan`` is what the solver returns, what ``compile_offload.explain`` gives the user, what
the report prints and what the plan cache stores. It is a plain dataclass: ``print(plan)``
shows a table.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

DecisionKind = Literal["keep", "recompute", "offload"]
DECISION_KINDS = typing.get_args(DecisionKind)
# What the budget loop did with a graph's plan (``Plan.budget_outcome``).
BudgetOutcome = Literal["kept", "replanned", "unconstrained", "over_budget"]
PLAN_SCHEMA = "compile_offload.plan/1"


def byte_unit(n: float) -> tuple[str, int]:
    """The largest binary unit (name, bytes) not above ``n``: readable numbers in text and plots."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return unit, scale
    return "B", 1


def format_bytes(n: float) -> str:
    unit, scale = byte_unit(n)
    return f"{int(n)} B" if scale == 1 else f"{n / scale:.2f} {unit}"


@dataclass
class Decision:
    """What happens to one tensor the forward saves for the backward, or one the
    unconstrained plan saves that the backward recomputes instead."""

    name: str  # node name in the joint graph
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # of the storage it lives in: views of one storage each show the whole storage
    decision: DecisionKind
    reason: str
    cost_seconds: float = 0.0  # predicted extra step time this decision costs


def _check_kind(kind: object, method: str) -> None:
    """A decision kind, not a typo that would read as "none of those"."""
    if kind not in DECISION_KINDS:
        raise ValueError(f"Plan.{method}({kind!r}): accepted: {', '.join(map(repr, DECISION_KINDS))}")


@dataclass
class Plan:
    feasible: bool  # predicted_peak_bytes <= budget (always True without a budget)
    budget_bytes: int | None
    predicted_peak_bytes: int
    predicted_step_seconds: float
    baseline_peak_bytes: int  # the unconstrained plan (torch.compile's default saved set)
    baseline_step_seconds: float
    min_peak_bytes: int  # the lowest peak simulated: the minimum where the budget is below every plan read
    decisions: list[Decision] = field(default_factory=list)
    device_profile: str = ""
    solver: str = "greedy"
    solve_seconds: float = field(default=0.0, compare=False)  # how long planning took, not what it planned
    graph_name: str = "graph"
    notes: list[str] = field(default_factory=list)
    # What rebuilds the graphs without solving again (the plan cache): the joint-graph
    # names of the saved tensors, and of the offloaded ones with their reload distance.
    saved: list[str] = field(default_factory=list)
    offloaded: dict[str, int] = field(default_factory=dict)
    # Predicted live bytes at each step of the forward+backward schedule (the simulator's
    # timeline), and the index of the first backward step.
    timeline_bytes: list[int] = field(default_factory=list)
    backward_start: int = 0
    # Predicted from the kernels Inductor scheduled for this plan's graphs (fusion, its
    # buffer reuse): the peak the generated code holds; None where Inductor's kernels were
    # not seen (no budget, inner_compiler="eager", explain on meta or fake tensors, a torch
    # without the hook).
    scheduled_peak_bytes: int | None = None
    # The budget the plan was made under when the backend re-planned the graph because the
    # scheduled peak of the first plan exceeded ``budget_bytes`` (the user's budget, which
    # ``budget_bytes`` and ``feasible`` still refer to); None when planned under ``budget_bytes``.
    planned_budget_bytes: int | None = None
    # What the budget loop did (Inductor compiling under a budget; None where no loop ran):
    # "kept" the plan first made (its scheduled peak fits, or the planner's minimum-memory
    # plan was the least it could do), "replanned" to the plan kept (``replans`` re-plans),
    # kept "unconstrained" (torch.compile's saved set compiled as torch.compile compiles it,
    # whose code fits the budget, or peaks lower than every plan made for it), or kept the
    # lowest "over_budget" after ``replans`` re-plans: over by ``scheduled_peak_bytes -
    # budget_bytes``.
    budget_outcome: BudgetOutcome | None = None
    replans: int = 0
    # The plan is the unconstrained plan compiled as without a budget (Inductor's peak-memory
    # reordering on): a compile served from a cache compiles it so again.
    unconstrained: bool = False
    # Predicted bytes the unconstrained plan holds between its forward and its backward (its
    # saved tensors and the forward's outputs) or at its end (what the step returns: the
    # gradients), the larger: no order of its kernels peaks lower, so a budget below it is
    # never met by torch.compile's own code. None where not simulated.
    baseline_held_bytes: int | None = None
    # Why torch's own partition was used for the graph instead of a plan; None when planned.
    fallback: str | None = None
    # Measured plan choice (``config.measured_plan_choice``): the number of candidate plans
    # whose training steps were timed when this one was kept as the fastest that fits (0: the
    # plan was not chosen by measurement), and what its own steps measured: the median step
    # time of the compiled graph (forward and backward) and the highest allocator peak.
    measured_candidates: int = 0
    measured_step_seconds: float | None = None
    measured_peak_bytes: int | None = None
    # ... and which candidate it is: "the planner's plan", or a rival ("planned under 1.20 MiB",
    # "offload off", "planned from measured costs").
    measured_choice: str | None = None
    # What priced the nodes: "model" (the device profile's roofline) or "measured" (kernel
    # times profiled on the device the graph runs on, by measured plan choice).
    cost_source: str = "model"
    # Where no plan fits the budget and the search's two starts each gave a lowest plan: which
    # start this plan is the lowest of ("greedy", or "segments": per-segment checkpointing),
    # and the other one's predicted peak. The budget loop compiles the other where its
    # prediction is near, and keeps the lower scheduled peak. None elsewhere.
    lowest_start: str | None = None
    rival_peak_bytes: int | None = None
    # ``plan_time_limit`` stopped the search before it ended: ``min_peak_bytes`` is the lowest
    # peak found by then, not the minimum the planner can reach.
    time_limit_reached: bool = False

    @classmethod
    def unplanned(cls, *, feasible: bool, budget_bytes: int | None, device_profile: str, solver: str,
                  graph_name: str, why: str, fallback: str | None = None) -> "Plan":
        """The plan of a graph torch partitioned instead (no backward, or a ``fallback``, the
        reason): no decisions and no predictions, ``why`` as its note, which its summary
        shows. ``feasible`` says whether the budget holds anyway (a graph without a backward
        saves nothing; a fallback holds none it was given)."""
        return cls(feasible=feasible, budget_bytes=budget_bytes, predicted_peak_bytes=0,
                   predicted_step_seconds=0.0, baseline_peak_bytes=0, baseline_step_seconds=0.0, min_peak_bytes=0,
                   device_profile=device_profile, solver=solver, graph_name=graph_name, notes=[why],
                   fallback=fallback)

    def replanned_under(self, budget_bytes: int, planned_under: int) -> None:
        """Mark a plan made under ``planned_under`` in place of the user's ``budget_bytes``
        (the budget loop's re-plans, measured plan choice's rivals): it keeps the user's
        budget, ``feasible`` against it, and says what it was made under."""
        self.budget_bytes = budget_bytes
        self.planned_budget_bytes = planned_under
        self.feasible = self.predicted_peak_bytes <= budget_bytes

    def is_unplanned(self) -> bool:
        """A graph torch partitioned instead (``unplanned``): no decisions, no predictions."""
        return self.fallback is not None or not (self.decisions or self.baseline_peak_bytes)

    def meets_budget(self) -> bool:
        """Whether the budget is met (always without one, and under a budget of 0, which asks
        for the minimum-memory plan): by the scheduled peak where Inductor's code for the plan
        was seen (the nearer figure to the allocator's), else by the prediction (``feasible``)."""
        if self.fallback is not None:  # torch's partition ran: the budget was not applied
            return self.feasible
        if self.budget_bytes is None or self.budget_bytes == 0:
            return True
        if self.scheduled_peak_bytes is not None:
            return self.scheduled_peak_bytes <= self.budget_bytes
        return self.feasible

    def count(self, kind: str) -> int:
        """How many saved tensors have decision ``kind`` ("keep", "recompute" or "offload")."""
        _check_kind(kind, "count")
        return sum(1 for d in self.decisions if d.decision == kind)

    def bytes_of(self, kind: str) -> int:
        """Bytes of the storages of the tensors with decision ``kind`` (a row per storage the
        forward saves; a recomputed view counts its whole storage)."""
        _check_kind(kind, "bytes_of")
        return sum(d.bytes for d in self.decisions if d.decision == kind)

    def summary(self, scheduled: bool = True) -> str:
        """One line: budget, predicted peak (and, with ``scheduled``, the scheduled peak where
        it is known), step time, decision counts; for a graph torch partitioned instead, why."""
        if self.is_unplanned():
            return f"{self.graph_name}: not planned ({'; '.join(self.notes) or 'no reason recorded'})"
        budget = "none" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        if self.budget_bytes == 0:  # memory_budget=0 or 0.0: the minimum-memory plan asked for
            budget = "0 (the minimum-memory plan)"
        if self.planned_budget_bytes not in (None, self.budget_bytes):
            budget += f" (planned under {format_bytes(self.planned_budget_bytes)})"
        ratio = self.predicted_step_seconds / self.baseline_step_seconds if self.baseline_step_seconds else 1.0
        minimum = self.minimum_text()
        # Known once Inductor generated the code (after the INFO line at planning time): the
        # nearer figure to the allocator's where the planner's simulation misses what it does.
        scheduled_text = ("" if self.scheduled_peak_bytes is None or not scheduled
                          else f", scheduled {format_bytes(self.scheduled_peak_bytes)}")
        return (
            f"{self.graph_name}: budget {budget}, predicted peak {format_bytes(self.predicted_peak_bytes)}{scheduled_text} "
            f"(unconstrained {format_bytes(self.baseline_peak_bytes)}{minimum}), "
            f"step {self.predicted_step_seconds * 1e3:.3f} ms ({ratio:.3f}x unconstrained), "
            f"keep {self.count('keep')} / recompute {self.count('recompute')} / offload {self.count('offload')}"
            + ("" if self.meets_budget() else " -- over budget")
            + self._measured_text()
        )

    def minimum_text(self) -> str:
        """What ``min_peak_bytes`` is, as the summary says it after the unconstrained peak: the
        minimum where the budget sent the search to it (below every plan it read, or 0), the
        lowest peak it read where a plan fitted on the way (``lowest simulated``), the lowest
        found where ``plan_time_limit`` stopped it, nothing with no budget or where the search
        read no plan below the unconstrained one."""
        lowest = format_bytes(self.min_peak_bytes)
        if self.time_limit_reached:
            return f", lowest found {lowest} before plan_time_limit"
        if self.budget_bytes is None or (self.feasible and self.min_peak_bytes >= self.baseline_peak_bytes):
            return ""
        return f", lowest simulated {lowest}" if self.feasible and self.budget_bytes > 0 else f", minimum {lowest}"

    def _measured_text(self) -> str:
        priced = "; priced from measured kernel times" if self.cost_source == "measured" else ""
        if not self.measured_candidates:
            return priced
        step = "" if self.measured_step_seconds is None else f" step {self.measured_step_seconds * 1e3:.3f} ms"
        peak = "" if self.measured_peak_bytes is None else f" peak {format_bytes(self.measured_peak_bytes)}"
        if self.measured_candidates == 1:
            return f"{priced}; measured plan choice: no other candidate fits the budget"
        chosen = f" ({self.measured_choice})" if self.measured_choice else ""
        return f"{priced}; measured the fastest of {self.measured_candidates} candidates{chosen}:{step}{peak}"

    def table(self) -> str:
        header = f"{'tensor':<32} {'shape':<22} {'dtype':<9} {'size':>11}  {'decision':<9} {'cost ms':>8}  reason"
        rows = [header, "-" * len(header)]
        for d in self.decisions:
            rows.append(
                f"{d.name[:32]:<32} {str(list(d.shape))[:22]:<22} {d.dtype:<9} {format_bytes(d.bytes):>11}  "
                f"{d.decision:<9} {d.cost_seconds * 1e3:>8.3f}  {d.reason}"
            )
        return "\n".join(rows)

    def __str__(self) -> str:
        """The summary, and the table of decisions where there are any (a plan torch's
        partition made, or of a graph with nothing to decide, has none)."""
        return self.summary() + ("\n" + self.table() if self.decisions else "")

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> dict:
        """``to_dict`` tagged with the schema: what ``save``, dumps and traces write."""
        return {"schema": PLAN_SCHEMA, **self.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """The inverse of ``to_dict``; raises ``ValueError`` on anything malformed,
        including a field of the wrong type (a plan read from disk is not trusted)."""
        try:
            values = dict(data)
            values.pop("schema", None)
            values["decisions"] = [Decision(**{**d, "shape": tuple(d["shape"])}) for d in values["decisions"]]
            plan = cls(**values)
        except (TypeError, KeyError) as error:
            raise ValueError(f"not a compile_offload plan: {error}") from error
        for record in (plan, *plan.decisions):
            wrong = _mistyped_field(record)
            if wrong is not None:
                raise ValueError(f"not a compile_offload plan: {type(record).__name__}.{wrong} has the wrong type "
                                 "(or is negative, or not finite)")
        return plan

    def save(self, path) -> None:
        """Write the plan as JSON (schema ``compile_offload.plan/1``)."""
        import json
        from pathlib import Path

        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path) -> "Plan":
        """Read a plan written by ``save``; ``ValueError`` if the file is not one."""
        import json
        from pathlib import Path

        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:  # not text, or not JSON
            raise ValueError(f"cannot read a plan from {path}: {error}") from error
        if not isinstance(data, dict) or data.get("schema") != PLAN_SCHEMA:
            raise ValueError(f"{path} is not a {PLAN_SCHEMA} plan")
        return cls.from_dict(data)


def _mistyped_field(record) -> str | None:
    """The first field of dataclass ``record`` whose value does not match its annotation."""
    hints = typing.get_type_hints(type(record))
    for f in fields(record):
        if not _matches(getattr(record, f.name), hints[f.name]):
            return f.name
    return None


def _matches(value, annotation) -> bool:
    """Whether a value read back from JSON fits ``annotation`` (the few forms Plan uses)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, arg) for arg in args)
    if origin is Literal:
        return value in args
    if origin is list:
        return isinstance(value, list) and all(_matches(item, args[0]) for item in value)
    if origin is tuple:  # only tuple[X, ...] is used
        return isinstance(value, tuple) and all(_matches(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
    if annotation is type(None):
        return value is None
    if annotation is float:  # every number of a plan is a size or a time: finite, not negative
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return isinstance(value, annotation)
