"""``compile_offload.sweep``: plans for several budgets, and the predicted Pareto front."""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..passes.plan import Plan, byte_unit
from ..settings import folder_problem

from .explain import explain


def sweep(model_or_fn, *example_inputs, budgets, out: str | Path | None = None, **options: Any) -> list[Plan]:
    """One plan per budget (``explain`` for each; a single budget, ``"1MiB"`` or ``0.5``, is
    one, ``None`` too); with ``out``, draw ``out/pareto.png``: predicted step time against predicted peak
    memory, one point per budget."""
    if budgets is None or isinstance(budgets, (str, numbers.Real)):  # not its characters, one by one
        budgets = [budgets]
    if not isinstance(budgets, Iterable):
        raise TypeError(f"compile_offload.sweep: budgets={budgets!r} is neither a budget nor a list of budgets, "
                        "such as budgets=[None, 0.5, 0.0]")
    budgets = list(budgets)
    if not budgets:
        raise ValueError("compile_offload.sweep: budgets is empty; give at least one budget, such as "
                         "budgets=[None, 0.5, 0.0]")
    if "memory_budget" in options:
        raise TypeError("compile_offload.sweep: give the budgets as budgets=[...]; memory_budget is not an option "
                        "of sweep")
    if out is not None:  # before planning every budget, not after
        out = os.path.expanduser(os.fspath(out))
        problem = folder_problem(out)
        if problem is not None:
            raise ValueError(f"compile_offload.sweep: out={out!r}: {problem}; name a folder for pareto.png")
        try:  # a broken install too (found, but failing to import)
            import matplotlib.figure  # noqa: F401
        except ImportError as error:
            raise RuntimeError(NO_MATPLOTLIB) from error
    for index, budget in enumerate(budgets):  # every entry read before the first plan (planning takes a while)
        _check_budget(index, budget, options, example_inputs)
    dump_dir = options.pop("dump_dir", None)
    if dump_dir is not None and len(budgets) > 1:  # each budget's graphs in a folder of their own, not over another's
        plans = [explain(model_or_fn, *example_inputs, memory_budget=budget,
                         dump_dir=os.path.join(os.path.expanduser(os.fspath(dump_dir)), f"budget_{index}"), **options)
                 for index, budget in enumerate(budgets)]
    else:
        plans = [explain(model_or_fn, *example_inputs, memory_budget=budget, dump_dir=dump_dir, **options)
                 for budget in budgets]
    if out is not None:
        draw_pareto(Path(out) / "pareto.png", budgets, plans)
    return plans


NO_MATPLOTLIB = ("compile_offload.sweep(out=...) draws with matplotlib: pip install 'compile_offload[plot]' "
                 "(or leave out out= for the plans alone)")


def _check_budget(index: int, budget, options: dict, example_inputs: tuple) -> None:
    """A budget ``explain`` can read, and within the memory of the device it is planned for
    (the inputs' GPU, or the profile's), or the error naming it as ``budgets[index]``."""
    from ..settings import check_budget_fits_device, parse_budget, resolve

    parse_budget(budget, label=f"compile_offload.sweep: budgets[{index}]")
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), None)
    if device is None:
        return
    settings = resolve({**options, "memory_budget": budget})
    try:
        check_budget_fits_device(settings, device)
    except ValueError as error:
        raise ValueError(f"compile_offload.sweep: budgets[{index}]: {error}") from None


def draw_pareto(path: Path, budgets, plans: list[Plan]) -> None:
    from ..reporting.plotting import new_figure

    try:
        figure, axes = new_figure((6, 4))
    except ImportError as error:
        raise RuntimeError(NO_MATPLOTLIB) from error
    path.parent.mkdir(parents=True, exist_ok=True)
    # A graph torch partitioned (a fallback) has no predictions to draw: it is left out.
    drawn = [(budget, plan) for budget, plan in zip(budgets, plans) if plan.fallback is None and plan.baseline_step_seconds]
    budgets, plans = [budget for budget, _ in drawn], [plan for _, plan in drawn]
    if not plans:
        axes.text(0.5, 0.5, "no plan to draw: torch partitioned the graph (a fallback)", ha="center",
                  transform=axes.transAxes)
        figure.savefig(path, dpi=100)
        return
    unit, scale = byte_unit(max(p.predicted_peak_bytes for p in plans))
    peaks = [p.predicted_peak_bytes / scale for p in plans]
    ratios = [p.predicted_step_seconds / p.baseline_step_seconds for p in plans]
    axes.plot(peaks, ratios, "o-")
    labels: dict[tuple[float, float], list[str]] = {}  # budgets that land on the same plan share a label
    for budget, x, y, plan in zip(budgets, peaks, ratios, plans):
        labels.setdefault((x, y), []).append(f"{budget}{'' if plan.feasible else ' (min)'}")
    for (x, y), names in labels.items():
        axes.annotate(", ".join(names), (x, y), textcoords="offset points", xytext=(4, 4), fontsize="small")
    axes.set_xlabel(f"predicted peak memory ({unit})")
    axes.set_ylabel("predicted step time / unconstrained")
    axes.set_title("predicted time against memory, per budget")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
