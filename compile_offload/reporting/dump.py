"""Write what the planner decided for one graph into ``config.dump_dir``.

One folder per compiled graph, named after Dynamo's compile id (``graph_<frame>_<attempt>``
for the id ``<frame>/<attempt>`` that ``TORCH_LOGS=graph_code`` and tlparse print):

* ``joint.py``, ``forward.py``, ``backward.py``: the joint graph as the planner saw it and
  the partitioned graphs, as readable Python (``GraphModule.print_readable``);
* ``plan.json``: the plan, machine-readable (``"schema": "compile_offload.plan/1"``);
* ``report.md``: the summary and the per-tensor decision table;
* ``timeline.png``: predicted live memory over the forward+backward schedule for the
  chosen and the unconstrained plan, with the budget line (needs matplotlib, the ``plot``
  extra; without it, or without a prediction, report.md says why there is no picture).

Graphs the planner did not plan (torch's partition used instead) are dumped too: their
graphs are what a user needs to see why.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.fx as fx

from ..passes.memory import Timeline
from ..passes.plan import Plan, byte_unit, format_bytes
from ..pipeline.result import PartitionResult

_NO_MATPLOTLIB = "timeline.png needs matplotlib: pip install 'compile_offload[plot]'"


def report_markdown(plan: Plan, no_picture_reason: str | None) -> str:
    """report.md: the summary, the decision table, and the picture or why there is none;
    for a graph torch partitioned instead, its summary (which says why) and no figures."""
    picture = ("![predicted memory](timeline.png)" if no_picture_reason is None
               else f"(no timeline.png: {no_picture_reason})")
    if plan.is_unplanned():
        return "\n".join([f"# {plan.graph_name}", "", plan.summary(), "", picture]) + "\n"
    lines = [
        f"# {plan.graph_name}",
        "",
        plan.summary(),
        "",
        f"- budget: {'none' if plan.budget_bytes is None else format_bytes(plan.budget_bytes)}",
        f"- predicted peak: {format_bytes(plan.predicted_peak_bytes)} "
        f"(unconstrained {format_bytes(plan.baseline_peak_bytes)}{plan.minimum_text()})",
        f"- predicted step: {plan.predicted_step_seconds * 1e3:.3f} ms "
        f"(unconstrained {plan.baseline_step_seconds * 1e3:.3f} ms)",
        f"- device profile: {plan.device_profile}; solver: {plan.solver} ({plan.solve_seconds:.2f} s)",
        *(f"- note: {note}" for note in plan.notes),
        "",
        "| tensor | shape | dtype | bytes | decision | cost ms | reason |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {d.name} | {list(d.shape)} | {d.dtype} | {format_bytes(d.bytes)} | {d.decision} | "
            f"{d.cost_seconds * 1e3:.3f} | {d.reason} |"
            for d in plan.decisions
        ),
        "",
        picture,
    ]
    return "\n".join(lines) + "\n"


def draw_timeline(path: Path, chosen: Timeline, baseline: Timeline | None, budget: int | None) -> bool:
    """Predicted live memory per step; False when matplotlib is missing."""
    from .plotting import new_figure

    series = [chosen.live_bytes, *([baseline.live_bytes] if baseline is not None else [])]
    unit, scale = byte_unit(max([budget or 0, *(max(s, default=0) for s in series)]))
    try:
        figure, axes = new_figure((10, 4))
    except ImportError:
        return False
    if baseline is not None:
        axes.plot([b / scale for b in baseline.live_bytes], color="0.6", label="unconstrained plan")
    axes.plot([b / scale for b in chosen.live_bytes], color="C0", label="chosen plan")
    for kind, color in (("recompute", "C1"), ("reload", "C2"), ("offload", "C3")):
        points = [(i, b / scale) for i, (b, k) in enumerate(zip(chosen.live_bytes, chosen.kinds)) if k == kind]
        if points:
            axes.scatter(*zip(*points), s=8, color=color, label=kind, zorder=3)
    axes.axvline(chosen.backward_start, color="0.3", linestyle=":", label="backward starts")
    if chosen.live_bytes:
        peak = (chosen.peak_index, chosen.live_bytes[chosen.peak_index] / scale)
        axes.plot(*peak, "v", color="C0", zorder=4)
        right_half = chosen.peak_index > len(chosen.live_bytes) / 2  # label towards the middle, never clipped
        axes.annotate(f"peak: {chosen.peak_label}" if chosen.peak_label else "peak", peak, textcoords="offset points",
                      xytext=(-6 if right_half else 6, 6), ha="right" if right_half else "left", fontsize="small")
    if budget is not None:
        axes.axhline(budget / scale, color="red", linestyle="--", label="budget")
    axes.set_xlabel("step of the forward+backward schedule")
    axes.set_ylabel(f"predicted live memory ({unit})")
    axes.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def _timeline_of(plan: Plan) -> Timeline | None:
    """The chosen plan's timeline as far as the plan itself records it (a cached plan
    keeps live bytes per step, not what each step does)."""
    if not plan.timeline_bytes:
        return None
    peak_index = max(range(len(plan.timeline_bytes)), key=plan.timeline_bytes.__getitem__)
    return Timeline(peak_bytes=plan.timeline_bytes[peak_index], peak_index=peak_index,
                    live_bytes=list(plan.timeline_bytes), labels=[], kinds=[""] * len(plan.timeline_bytes),
                    backward_start=plan.backward_start)


def write_dump(folder: str | os.PathLike, plan: Plan, joint_gm: fx.GraphModule, fw_gm: fx.GraphModule,
               bw_gm: fx.GraphModule, chosen: Timeline | None = None, baseline: Timeline | None = None) -> Path:
    """Write one graph's folder under ``folder``; the chosen plan's timeline defaults to
    the one the plan records. Returns the graph's folder."""
    folder = Path(folder) / plan.graph_name
    folder.mkdir(parents=True, exist_ok=True)
    for name, gm in (("joint", joint_gm), ("forward", fw_gm), ("backward", bw_gm)):
        (folder / f"{name}.py").write_text(gm.print_readable(print_output=False))
    (folder / "plan.json").write_text(json.dumps(plan.to_json(), indent=1, default=str))
    chosen = chosen if chosen is not None else _timeline_of(plan)
    if chosen is None:
        no_picture_reason = "no predicted timeline, the planner did not plan this graph"
    elif draw_timeline(folder / "timeline.png", chosen, baseline, plan.budget_bytes):
        no_picture_reason = None
    else:
        no_picture_reason = _NO_MATPLOTLIB
    (folder / "report.md").write_text(report_markdown(plan, no_picture_reason))
    return folder


def refresh_plan(dump_dir: str | os.PathLike, plan: Plan) -> None:
    """Write ``plan`` again over its graph's ``plan.json`` and ``report.md`` (``explain``'s
    notes come after the graph was dumped); nothing where the graph has no dump there."""
    folder = Path(dump_dir) / plan.graph_name
    if not (folder / "plan.json").is_file():
        return
    (folder / "plan.json").write_text(json.dumps(plan.to_json(), indent=1, default=str))
    report = folder / "report.md"
    last = report.read_text().rstrip("\n").rsplit("\n", 1)[-1] if report.is_file() else ""
    reason = last[len("(no timeline.png: "):-1] if last.startswith("(no timeline.png: ") else None
    report.write_text(report_markdown(plan, reason))


def dump_result(dump_dir: str | os.PathLike, result: PartitionResult, joint_gm: fx.GraphModule) -> Path:
    """``write_dump`` for what ``planning.plan_partition`` returned. The joint graph written
    is the one the planner analysed when it did, else ``joint_gm``."""
    analysed = result.analysis.joint.gm if result.analysis is not None else joint_gm
    solution = result.solution
    return write_dump(dump_dir, result.plan, analysed, result.fw_gm, result.bw_gm,
                      solution.chosen.timeline if solution is not None else None,
                      solution.baseline.timeline if solution is not None else None)
