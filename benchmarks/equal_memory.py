"""Ours against torch's strategies at equal memory, measured side by side in one process.

First the baselines run (``torch.compile``, torch's ``activation_memory_budget``, torch's SAC
policy where it runs, eager per-block checkpointing), each measured as ``runner`` measures
(step time, peak above the steady state at the allocator). Then ours runs at each
baseline's *measured* peak as a byte budget, and at the extra budgets asked for, each with
and without measured plan choice. The table pairs each baseline with ours at its peak: the
step time and the peak, both as ratios to ``torch.compile``'s, measured in the same run.
With ``--in-turn`` every strategy is kept ready and, once all have run, timed again one step
of each in turn (``runner.time_in_turn``), so that a drift of the machine reaches all alike.

    python -m compile_offload bench --equal-memory --model gpt --device cpu --layers 2 --width 256 \\
        --seq 256 --batch 4 --out out/eq

Writes ``{tag}_equal_memory.jsonl`` (every row) and ``{tag}_equal_memory.md`` (the table).
"""

from __future__ import annotations

import json
from dataclasses import replace

from compile_offload.passes.plan import format_bytes

from . import runner
from .strategies import REFERENCE, Budget, Strategy

BASELINES = ("compile", "torch_budget:0.5", "torch_sac_offload", "eager_ckpt")


def ours_at(budget: Budget, template: Strategy) -> list[Strategy]:
    """Ours at ``budget``, without and with measured plan choice."""
    return [replace(template, family="ours", budget=budget, measured_choice=False, detail=None),
            replace(template, family="ours", budget=budget, measured_choice=True, detail=None)]


def ours_in_order(peaks: list[tuple[str, int]], extra_budgets: list[Budget], template: Strategy) -> list[Strategy]:
    """Ours at every point, the comparisons that matter first, so that a run stopped by its
    time limit keeps them: without measured plan choice before with it (its trials compile
    several plans: on cold caches it takes several times as long), and in each half the
    baselines' peaks, then the extra budgets, then ``torch.compile``'s own peak last (where
    the only question is whether ours costs anything)."""
    points = [str(peak) for name, peak in peaks if name != REFERENCE]
    points += list(extra_budgets) + [str(peak) for name, peak in peaks if name == REFERENCE]
    pairs = [ours_at(budget, template) for budget in points]
    return [plain for plain, _ in pairs] + [measured for _, measured in pairs]


def run_equal_memory(suite: runner.Suite, baselines: list[Strategy], extra_budgets: list[Budget],
                     template: Strategy) -> tuple[list[dict], str]:
    """The rows of every strategy, and the equal-memory table."""
    tag = suite.tag
    ready = [] if suite.in_turn else None  # both halves, timed again in turn at the end
    first = runner.run_suite(replace(suite, tag=f"{tag}_baselines"), baselines, ready)
    peaks = [(row["strategy"], row["peak_bytes"]) for row in first
             if row.get("status") == "ok" and row.get("peak_bytes")]
    second = runner.run_suite(replace(suite, tag=f"{tag}_ours"), ours_in_order(peaks, extra_budgets, template), ready)
    if ready is not None:
        runner.time_in_turn(ready, suite)
    rows = first + second
    runner.add_ratios(rows)
    out = suite.out_dir / f"{tag}_equal_memory.jsonl"
    out.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
    table = equal_memory_table(rows, [name for name, _ in peaks], extra_budgets)
    (suite.out_dir / f"{tag}_equal_memory.md").write_text(table + "\n")
    return rows, table


def _ours_row(rows: list[dict], budget: Budget, measured: bool) -> dict | None:
    name = f"ours:{budget if not isinstance(budget, float) else f'{budget:g}'}" + ("+measured" if measured else "")
    return next((r for r in rows if r["strategy"] == name), None)


def _cells(row: dict | None) -> list[str]:
    if row is None:
        return ["-", "-"]
    if row.get("status") != "ok":
        return [row.get("status", "?"), ""]
    step = f"{row['ms_vs_compile']:.3f}" if row.get("ms_vs_compile") is not None else "-"
    peak = f"{row['peak_vs_compile']:.3f}" if row.get("peak_vs_compile") is not None else "-"
    return [step, peak]


def equal_memory_table(rows: list[dict], baselines: list[str], extra_budgets: list[Budget]) -> str:
    """One line per baseline (ours at its measured peak) and per extra budget: step time and
    peak as ratios to ``torch.compile``'s, for the baseline, ours, and ours with measured plan
    choice. A ratio under the baseline's is ours faster, or holding less."""
    by_name = {r["strategy"]: r for r in rows}
    header = ("| at the memory of | its peak | its step / compile | its peak / compile | ours: step / compile "
              "| peak / compile | ours, measured choice: step / compile | peak / compile |")
    lines = [header, "|" + "---|" * 8]
    for name in baselines:
        base = by_name[name]
        budget = str(base["peak_bytes"])
        lines.append("| " + " | ".join([name, format_bytes(base["peak_bytes"]), *_cells(base),
                                        *_cells(_ours_row(rows, budget, False)),
                                        *_cells(_ours_row(rows, budget, True))]) + " |")
    for budget in extra_budgets:
        label = f"{budget:g}" if isinstance(budget, float) else str(budget)
        lines.append("| " + " | ".join([f"budget {label}", "", "", "", *_cells(_ours_row(rows, budget, False)),
                                        *_cells(_ours_row(rows, budget, True))]) + " |")
    reference = by_name.get(REFERENCE)
    if reference is not None and reference.get("status") == "ok":
        lines.append("")
        timed = reference.get("timed", "alone")
        how = ("every strategy timed again, one step of each in turn" if timed == "in turn"
               else f"each strategy timed {timed}, one after another")
        lines.append(f"torch.compile: {reference['ms_median']:.2f} ms per step, peak "
                     f"{format_bytes(reference['peak_bytes'] or 0)} above the steady state ({how}).")
    kept = _measured_choices(rows, baselines, extra_budgets)
    if kept:
        lines.append("")
        lines.append("Measured choice kept " + "; ".join(kept) + ".")
    return "\n".join(lines)


def _measured_choices(rows: list[dict], baselines: list[str], extra_budgets: list[Budget]) -> list[str]:
    """Which candidate measured plan choice kept at each memory (``Plan.measured_choice``):
    where it is the planner's plan, the two columns ran one plan and differ by noise alone."""
    by_name = {r["strategy"]: r for r in rows}
    places = [(name, str(by_name[name]["peak_bytes"])) for name in baselines]
    places += [(f"budget {b:g}" if isinstance(b, float) else f"budget {b}", b) for b in extra_budgets]
    found = []
    for label, budget in places:
        row = _ours_row(rows, budget, True)
        if row is not None and row.get("status") == "ok" and row.get("measured_choice"):
            found.append(f"{', '.join(row['measured_choice'])} at {label}")
    return found
