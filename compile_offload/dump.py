"""Write what the planner decided for one graph into ``config.dump_dir``.

One folder per compiled graph, named after Dynamo's compile id (``graph_<frame>_<attempt>``,
the ids ``TORCH_LOGS=graph_code`` prints):

* ``joint.py``, ``forward.py``, ``backward.py``: the joint graph as the planner saw it and
  the partitioned graphs, as readable Python (``GraphModule.print_readable``);
* ``plan.json``: the plan, machine-readable (``"schema": "compile_offload.plan/1"``);
* ``report.md``: the summary and the per-tensor decision table;
* ``timeline.png``: predicted live memory over the forward+backward schedule for the
  chosen and the unconstrained plan, with the budget line (needs matplotlib, the ``plot``
  extra; skipped with a note in report.md without it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.fx as fx

from passes.memory import Timeline
from passes.plan import PLAN_SCHEMA, Plan, format_bytes


def plan_json(plan: Plan) -> dict:
    return {"schema": PLAN_SCHEMA, **plan.to_dict()}


def report_markdown(plan: Plan, timeline_written: bool) -> str:
    lines = [
        f"# {plan.graph_name}",
        "",
        plan.summary(),
        "",
        f"- budget: {'none' if plan.budget_bytes is None else format_bytes(plan.budget_bytes)}",
        f"- predicted peak: {format_bytes(plan.predicted_peak_bytes)} "
        f"(unconstrained {format_bytes(plan.baseline_peak_bytes)}, minimum {format_bytes(plan.min_peak_bytes)})",
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
        "![predicted memory](timeline.png)" if timeline_written else "(timeline.png needs matplotlib: pip install 'compile_offload[plot]')",
    ]
    return "\n".join(lines) + "\n"


def draw_timeline(path: Path, chosen: Timeline, baseline: Timeline | None, budget: int | None) -> bool:
    """Predicted live memory per step; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    mib = 2**20
    figure, axes = plt.subplots(figsize=(10, 4))
    if baseline is not None:
        axes.plot([b / mib for b in baseline.live_bytes], color="0.6", label="unconstrained plan")
    axes.plot([b / mib for b in chosen.live_bytes], color="C0", label="chosen plan")
    for kind, color in (("recompute", "C1"), ("reload", "C2"), ("offload", "C3")):
        points = [(i, b / mib) for i, (b, k) in enumerate(zip(chosen.live_bytes, chosen.kinds)) if k == kind]
        if points:
            axes.scatter(*zip(*points), s=8, color=color, label=kind, zorder=3)
    axes.axvline(chosen.backward_start, color="0.3", linestyle=":", label="backward starts")
    if budget is not None:
        axes.axhline(budget / mib, color="red", linestyle="--", label="budget")
    axes.set_xlabel("step of the forward+backward schedule")
    axes.set_ylabel("predicted live memory (MiB)")
    axes.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def write_dump(folder: str | os.PathLike, plan: Plan, joint_gm: fx.GraphModule, fw_gm: fx.GraphModule,
               bw_gm: fx.GraphModule, chosen: Timeline | None = None, baseline: Timeline | None = None) -> Path:
    folder = Path(folder) / plan.graph_name
    folder.mkdir(parents=True, exist_ok=True)
    for name, gm in (("joint", joint_gm), ("forward", fw_gm), ("backward", bw_gm)):
        (folder / f"{name}.py").write_text(gm.print_readable(print_output=False))
    (folder / "plan.json").write_text(json.dumps(plan_json(plan), indent=1, default=str))
    drawn = chosen is not None and draw_timeline(folder / "timeline.png", chosen, baseline, plan.budget_bytes)
    (folder / "report.md").write_text(report_markdown(plan, drawn))
    return folder
