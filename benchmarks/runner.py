"""Measure strategies on one workload and write the results.

For every strategy, in one process and on the same inputs: a fresh model (same seed, so
the same weights), the first call timed on its own (it compiles), ``warmup`` more steps,
then ``steps`` timed steps (CUDA events on GPU, ``time.perf_counter`` on CPU) and the peak
memory above the steady state before a step (GPU: ``max_memory_allocated`` after
``reset_peak_memory_stats`` minus ``memory_allocated``; CPU: the allocator events of one
extra step recorded by ``torch.profiler``). Gradients stay allocated between steps
(``zero_grad(set_to_none=False)``), so the steady state includes them and the peak counts
what the step adds: saved activations, transient buffers and gradient temporaries.

With ``in_turn`` every strategy is kept ready once measured, and at the end all are timed
again, one step of each in turn for ``steps`` rounds (``time_in_turn``): a drift of the
machine between strategies then reaches all of them alike. The step times reported are those;
the peaks stay those measured alone.

For ``ours`` the planner's prediction comes from ``compile_offload.explain`` when the
installed package has it. A strategy that fails (out of memory, a compile error) is
recorded with its error and the sweep goes on.

Outputs in ``out_dir``: ``{tag}.jsonl`` (one object per strategy, each with ``strategy``),
``{tag}.md`` (a markdown table) and ``{tag}_pareto.png`` (step time against peak memory).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from compile_offload.torch_api import dynamo

from . import workloads
from .strategies import REFERENCE, Strategy

MiB = 2**20


@dataclass
class Suite:
    """One workload at one size on one device, and how to measure it."""

    workload: str
    size: workloads.Size
    device: torch.device
    dtype: torch.dtype
    steps: int = 8
    warmup: int = 2
    out_dir: Path = Path("bench_out")
    tag: str = ""
    cpu_peak: bool = True  # CPU only: record one extra step with the profiler for its peak
    predict: bool = True  # ours only: ask compile_offload.explain for the plan
    time_limit_s: float | None = None  # start no new strategy after this many seconds
    in_turn: bool = False  # time every strategy again at the end, one step of each in turn
    extra_meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Zero steps have no median (a StatisticsError in the table), and an empty batch
        # times nothing and would still report "ok".
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"Suite: steps={self.steps} must be at least 1 and warmup={self.warmup} at least 0")
        if getattr(self.size, "batch", 1) < 1:
            raise ValueError(f"Suite: size.batch={self.size.batch} must be at least 1")
        self.tag = self.tag or self.workload
        self.out_dir = Path(self.out_dir)

    @property
    def jsonl_path(self) -> Path:
        return self.out_dir / f"{self.tag}.jsonl"

    @property
    def markdown_path(self) -> Path:
        return self.out_dir / f"{self.tag}.md"

    @property
    def plot_path(self) -> Path:
        return self.out_dir / f"{self.tag}_pareto.png"


# --- environment ----------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores)"


def git_commit() -> str | None:
    """The checkout's commit, with "-dirty" where its tracked files differ from it (results of
    uncommitted code must not pass for the commit's)."""
    where = Path(__file__).parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=where, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    if not commit:
        return None
    return f"{commit}-dirty" if dirty.returncode == 1 else commit


def describe_environment(suite: Suite) -> dict:
    return {
        "workload": suite.workload,
        "size": asdict(suite.size),
        "device": str(suite.device),
        "device_name": device_name(suite.device),
        "dtype": str(suite.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "steps": suite.steps,
        "warmup": suite.warmup,
        "timed": "in turn" if suite.in_turn else "alone",
        **suite.extra_meta,
    }


# --- measuring one step ----------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_steps_ms(step: Callable[[], None], steps: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``steps`` calls of ``step``."""
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def cpu_peak_above_steady(step: Callable[[], None]) -> int | None:
    """Peak bytes one step allocates above what was allocated before it, on the CPU: the
    CPU allocator's events through ``torch.profiler`` (Inductor's generated code allocates
    through the same allocator, so compiled steps are covered), as
    ``compile_offload.measure_peak`` reads them, the one memory measure of the project."""
    from compile_offload.runtime.memory_tracker import measure_peak

    with measure_peak("cpu") as measured:
        step()
    return measured.peak_bytes


def zero_grads(model: torch.nn.Module, inputs: Sequence) -> None:
    """Zero gradients in place, so they stay allocated: part of the steady state."""
    model.zero_grad(set_to_none=False)
    for tensor in inputs:
        if isinstance(tensor, torch.Tensor) and tensor.grad is not None:
            tensor.grad.zero_()


def measure_steps(
    step: Callable[[], None], model: torch.nn.Module, inputs: Sequence, suite: Suite, extra_warmup: int = 0
) -> dict:
    """First-call seconds, step times and peak above steady state of a ready ``step``, after
    ``suite.warmup`` + ``extra_warmup`` steps."""
    device = suite.device
    synchronize(device)
    t0 = time.perf_counter()
    step()
    synchronize(device)
    first_call_s = time.perf_counter() - t0
    for _ in range(suite.warmup + extra_warmup):
        step()
    zero_grads(model, inputs)
    synchronize(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        steady = torch.cuda.memory_allocated(device)
    times = time_steps_ms(step, suite.steps, device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - steady
    elif suite.cpu_peak:
        peak = cpu_peak_above_steady(step)
    return {
        "ms_median": statistics.median(times),
        "ms_min": min(times),
        "ms_all": [round(t, 4) for t in times],
        "first_call_s": round(first_call_s, 3),
        "peak_bytes": peak,
        "peak_mib": None if peak is None else round(peak / MiB, 2),
    }


# --- predictions of our planner -------------------------------------------------------------


def _plans(result) -> list:
    """``explain`` may return one Plan or one per compiled graph."""
    if isinstance(result, (list, tuple)):
        return list(result)
    plans = getattr(result, "plans", None)
    return list(plans) if plans is not None else [result]


def predict(strategy: Strategy, model: torch.nn.Module, inputs: Sequence) -> dict:
    """The planner's predicted peak and step time for ``ours`` at this budget.

    Graphs run one after another and their saved tensors add up, so with several graphs
    (graph breaks) peaks and times are summed.
    """
    import compile_offload

    explain = compile_offload.explain_all  # every graph's plan; explain gives only the largest one's
    options = {"memory_budget": strategy.budget}
    if strategy.device_profile is not None:
        options["device_profile"] = strategy.device_profile
    t0 = time.perf_counter()
    plans = _plans(explain(model, *inputs, **options))
    explain_s = time.perf_counter() - t0
    budgets = [p.budget_bytes for p in plans if p.budget_bytes is not None]
    return {
        "predicted_peak_bytes": sum(p.predicted_peak_bytes for p in plans),
        "predicted_step_ms": sum(p.predicted_step_seconds for p in plans) * 1e3,
        "predicted_baseline_peak_bytes": sum(p.baseline_peak_bytes for p in plans),
        "predicted_min_peak_bytes": sum(p.min_peak_bytes for p in plans),
        "budget_bytes": max(budgets) if budgets else None,
        "plan_feasible": all(p.feasible for p in plans),
        "plan_graphs": len(plans),
        "plan_decisions": {kind: sum(p.count(kind) for p in plans) for kind in ("keep", "recompute", "offload")},
        "device_profile": plans[0].device_profile if plans else None,
        "explain_s": round(explain_s, 3),
    }


def _safe_predict(strategy: Strategy, model: torch.nn.Module, inputs: Sequence, reset: bool = True) -> dict:
    """``predict``, its error recorded instead of raised; then Dynamo's caches reset unless
    ``reset`` is False (models kept ready to time in turn would compile again)."""
    try:
        return predict(strategy, model, inputs)
    except Exception as error:  # a planner bug must not hide the measurement
        return {"predicted_peak_bytes": None, "predicted_step_ms": None, "explain_error": _describe(error)}
    finally:
        if reset:
            dynamo.reset()


# --- one strategy ------------------------------------------------------------------------------


def _describe(error: BaseException) -> str:
    """One line: the error's type and message; for Dynamo's wrapper, the error inside it."""
    inner = getattr(error, "inner_exception", None)  # torch._dynamo.exc.BackendCompilerFailed
    if inner is not None:
        return f"{type(error).__name__}({_describe(inner)})"
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message[:500]}"


def _fresh_model(suite: Suite) -> torch.nn.Module:
    model, _, _ = workloads.build(suite.workload, suite.size, suite.device, suite.dtype)
    return model


@dataclass
class Ready:
    """A measured strategy, kept ready to step again (``Suite.in_turn``)."""

    strategy: Strategy
    step: Callable[[], None]
    row: dict


def run_strategy(strategy: Strategy, suite: Suite, inputs: Sequence, loss_fn: Callable,
                 ready: list[Ready] | None = None) -> dict:
    """Measure one strategy; never raises except on KeyboardInterrupt. With ``ready`` (a
    list), a strategy that ran is appended to it, its model kept, and Dynamo's caches are
    kept too (resetting them would make the kept models compile again)."""
    row = {"strategy": strategy.name, "family": strategy.family, "budget": strategy.budget}
    reason = strategy.unavailable_reason(suite.device, suite.workload)
    if reason is not None:
        return {**row, "status": "unavailable", "error": reason}
    keep = ready is not None
    if not keep:
        dynamo.reset()
    release_memory(suite.device)
    for tensor in inputs:
        if isinstance(tensor, torch.Tensor):
            tensor.grad = None

    def room() -> contextlib.AbstractContextManager:
        # Kept side by side, the models of one class (and explain's traces of them) add cache
        # entries to one forward's code: past Dynamo's recompile_limit it would run eager.
        return dynamo.config.patch(recompile_limit=1024) if keep else contextlib.nullcontext()

    try:
        model = _fresh_model(suite)
        if strategy.family == "ours" and suite.predict:
            with room():
                row.update(_safe_predict(strategy, model, inputs, reset=not keep))
        fn = strategy.prepare(model, own_backend=keep)
        if strategy.detail:
            row["detail"] = strategy.detail

        def step() -> None:
            with strategy.forward_context(suite.device):
                loss = loss_fn(fn(*inputs))
            loss.backward()

        from compile_offload.reporting.logs import latest_plans

        earlier = {id(p) for p in latest_plans()}  # without a reset, other strategies' plans stay listed
        with strategy.run_context(), room():
            row.update(measure_steps(step, model, inputs, suite, strategy.trial_steps))
        if strategy.measured_choice:
            measured = [p for p in latest_plans() if p.measured_candidates and id(p) not in earlier]
            row["measured_candidates"] = max((p.measured_candidates for p in measured), default=0)
            row["measured_choice"] = sorted({p.measured_choice for p in measured if p.measured_choice})
        row["status"] = "ok"
        if keep:
            ready.append(Ready(strategy, step, row))
    except Exception as error:  # OOM or a compile failure: record it, keep going
        row.update(status="error", error=_describe(error))
        if os.environ.get("COMPILE_OFFLOAD_BENCH_TRACEBACK"):
            traceback.print_exc()
    finally:
        if not keep:  # a kept step reads ``fn`` from here
            model = fn = step = None  # drop references before freeing cached memory
            dynamo.reset()
        release_memory(suite.device)
    _add_prediction_checks(row)
    return row


def _add_prediction_checks(row: dict) -> None:
    peak, predicted, budget = row.get("peak_bytes"), row.get("predicted_peak_bytes"), row.get("budget_bytes")
    if peak is not None and predicted:
        row["peak_vs_predicted"] = round(peak / predicted, 4)
    if peak is not None and budget is not None:
        row["within_budget"] = peak <= budget


def add_ratios(rows: list[dict]) -> None:
    """Step time and peak of each row relative to ``torch.compile`` default."""
    reference = next((r for r in rows if r["strategy"] == REFERENCE and r.get("status") == "ok"), None)
    for row in rows:
        if reference is None or row.get("status") != "ok":
            continue
        row["ms_vs_compile"] = round(row["ms_median"] / reference["ms_median"], 4)
        if row.get("peak_bytes") is not None and reference.get("peak_bytes"):
            row["peak_vs_compile"] = round(row["peak_bytes"] / reference["peak_bytes"], 4)


# --- the sweep ----------------------------------------------------------------------------------


class Progress:
    """Progress lines with a bar on stderr, one when a strategy starts and one when it ends."""

    def __init__(self, total: int, stream=sys.stderr, width: int = 20) -> None:
        self.total, self.stream, self.width, self.done = total, stream, width, 0
        self.started = time.perf_counter()

    def _bar(self) -> str:
        filled = self.width * self.done // max(self.total, 1)
        return "#" * filled + "." * (self.width - filled)

    def start(self, name: str) -> None:
        print(f"[{self._bar()}] {self.done + 1}/{self.total} {name} ...", file=self.stream, flush=True)

    def finish(self, row: dict) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        print(f"[{self._bar()}] {self.done}/{self.total} {row['strategy']}: {summarize(row)} ({elapsed:.0f} s so far)",
              file=self.stream, flush=True)


def summarize(row: dict) -> str:
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('error')}"
    peak = "n/a" if row.get("peak_mib") is None else f"{row['peak_mib']:.1f} MiB"
    text = f"{row['ms_median']:.2f} ms median, peak {peak}, first call {row['first_call_s']:.1f} s"
    if row.get("predicted_peak_bytes") is not None:
        text += f", predicted peak {row['predicted_peak_bytes'] / MiB:.1f} MiB"
    return text


def run_suite(suite: Suite, strategies: list[Strategy], ready: list[Ready] | None = None) -> list[dict]:
    """Measure ``strategies`` on ``suite``; write JSON lines as they finish, then the
    ratios, the markdown table and the plot. Interrupting (Ctrl-C, ``timeout -s INT``)
    or ``time_limit_s`` ends the sweep early; what was measured is still written. With
    ``suite.in_turn`` the strategies are timed again in turn before the tables are written;
    where ``ready`` is given (a list several suites share) they are appended to it instead,
    for the caller's ``time_in_turn``."""
    own = suite.in_turn and ready is None
    if own:
        ready = []
    suite.out_dir.mkdir(parents=True, exist_ok=True)
    meta = describe_environment(suite)
    common = {k: meta[k] for k in ("workload", "size", "device", "device_name", "dtype", "torch")}
    model, inputs, loss_fn = workloads.build(suite.workload, suite.size, suite.device, suite.dtype)
    del model  # only the inputs are shared; each strategy builds its own model
    progress = Progress(len(strategies))
    rows: list[dict] = []
    started = time.perf_counter()
    with open(suite.jsonl_path, "w") as stream:
        for index, strategy in enumerate(strategies):
            if suite.time_limit_s is not None and time.perf_counter() - started > suite.time_limit_s:
                rows += _skipped(strategies[index:], common, f"time limit of {suite.time_limit_s:g} s reached")
                break
            progress.start(strategy.name)
            try:
                row = run_strategy(strategy, suite, inputs, loss_fn, ready if suite.in_turn else None)
                row.update(common)  # in place: a kept strategy's ``Ready.row`` is this dict
            except KeyboardInterrupt:
                rows += _skipped(strategies[index:], common, "interrupted")
                break
            rows.append(row)
            progress.finish(row)
            stream.write(json.dumps(row, default=str) + "\n")
            stream.flush()
    if own:
        time_in_turn(ready, suite)
    add_ratios(rows)
    write_jsonl(rows, suite.jsonl_path)
    suite.markdown_path.write_text(markdown_report(rows, meta))
    try:
        pareto_plot(rows, suite.plot_path, title=_title(meta))
    except ImportError:  # matplotlib is the optional `plot` extra: the figures are in the files
        print(f"bench: no {suite.plot_path.name} (needs matplotlib: pip install 'compile_offload[plot]')",
              file=sys.stderr)
    return rows


def time_in_turn(ready: list[Ready], suite: Suite) -> None:
    """Time the ready strategies again: one round untimed, then ``suite.steps`` rounds of one
    step of each in turn. Each row's ``ms_median``, ``ms_min`` and ``ms_all`` become these
    (``timed``: "in turn"); the figures measured alone stay as ``ms_median_alone`` and
    ``ms_all_alone``. Where a step compiles a graph (it would time its compiler), fails, or
    the run is interrupted, every row keeps its figures measured alone and ``timed`` says
    why. The models and Dynamo's caches are released at the end."""
    if not ready:
        return
    print(f"timing {len(ready)} strategies again, one step of each in turn, {suite.steps} rounds", file=sys.stderr)
    graphs = dynamo.compiled_graph_count()
    times: list[list[float]] = [[] for _ in ready]
    why = None
    try:
        for timed in [False] + [True] * suite.steps:
            for kept, measured in zip(ready, times):
                with kept.strategy.run_context():
                    ms = time_steps_ms(kept.step, 1, suite.device)
                if timed:
                    measured += ms
    except KeyboardInterrupt:
        why = "interrupted"
    except Exception as error:  # out of memory with every model kept, say
        why = f"{kept.strategy.name} failed: {_describe(error)}"
    if why is None and dynamo.compiled_graph_count() != graphs:
        why = "a strategy compiled a graph while timed in turn"
    for kept, measured in zip(ready, times):
        row = kept.row
        if why is not None:
            row["timed"] = f"alone ({why})"
            continue
        row.update(ms_median_alone=row["ms_median"], ms_all_alone=row["ms_all"], ms_median=statistics.median(measured),
                   ms_min=min(measured), ms_all=[round(t, 4) for t in measured], timed="in turn")
    if why is not None:
        print(f"bench: timing in turn: {why}; the step times are those measured alone", file=sys.stderr)
    ready.clear()
    dynamo.reset()  # the kept models' cache entries
    release_memory(suite.device)


def _skipped(strategies: list[Strategy], common: dict, why: str) -> list[dict]:
    return [{"strategy": s.name, "family": s.family, "budget": s.budget, "status": "skipped", "error": why, **common}
            for s in strategies]


def write_jsonl(rows: list[dict], path: Path) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
    tmp.replace(path)


# --- reports -----------------------------------------------------------------------------------


def _title(meta: dict) -> str:
    size = meta["size"]
    return (f"{meta['workload']} L{size['layers']} d{size['width']} h{size['heads']} seq{size['seq']} "
            f"b{size['batch']} {meta['dtype']} on {meta['device_name']}, torch {meta['torch']}")


def _fmt(value, spec: str = ".1f", scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value / scale, spec)


_COLUMNS = (
    ("strategy", lambda r: r["strategy"]),
    ("median ms", lambda r: _fmt(r.get("ms_median"), ".2f")),
    ("min ms", lambda r: _fmt(r.get("ms_min"), ".2f")),
    ("× compile", lambda r: _fmt(r.get("ms_vs_compile"), ".3f")),
    ("peak MiB", lambda r: _fmt(r.get("peak_bytes"), ".1f", MiB)),
    ("peak × compile", lambda r: _fmt(r.get("peak_vs_compile"), ".3f")),
    ("first call s", lambda r: _fmt(r.get("first_call_s"), ".1f")),
    ("predicted peak MiB", lambda r: _fmt(r.get("predicted_peak_bytes"), ".1f", MiB)),
    ("predicted ms", lambda r: _fmt(r.get("predicted_step_ms"), ".2f")),
    ("budget MiB", lambda r: _fmt(r.get("budget_bytes"), ".1f", MiB)),
    ("status", lambda r: _status(r)),
)


def _status(row: dict) -> str:
    """``ok``, saying where the measured peak passed the row's budget (the table is what a
    reader sees; the row's ``within_budget`` alone said it), or what went wrong."""
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('error', '')}"
    if row.get("within_budget") is False:
        budget = row["budget_bytes"]
        return f"ok, over budget ({row['peak_bytes'] / budget:.3f}x)" if budget else "ok, over budget"
    return "ok"


def markdown_table(rows: list[dict]) -> str:
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")[:160]

    lines = ["| " + " | ".join(name for name, _ in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(cell(get(row)) for _, get in _COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def markdown_report(rows: list[dict], meta: dict) -> str:
    notes = [
        f"- device: {meta['device_name']} ({meta['device']}), torch {meta['torch']}"
        + (f" (CUDA {meta['cuda']})" if meta.get("cuda") else "") + f", Python {meta['python']}",
        f"- date: {meta['date']}, commit {meta.get('commit') or 'unknown'}",
        f"- {meta['steps']} timed steps after {meta['warmup']} warm-up steps; peak = peak memory above "
        "the steady state before a step; ratios against `torch.compile` default",
    ]
    notes += [f"- {key}: {value}" for key, value in meta.items() if key not in _SHOWN_META]
    return f"## {_title(meta)}\n\n" + "\n".join(notes) + "\n\n" + markdown_table(rows)


_SHOWN_META = {"workload", "size", "device", "device_name", "dtype", "torch", "cuda", "python", "date", "commit", "steps", "warmup"}


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats in both memory and time, by increasing memory."""
    front, best_time = [], math.inf
    for memory, ms in sorted(points):
        if ms < best_time:
            front.append((memory, ms))
            best_time = ms
    return front


def pareto_plot(rows: list[dict], path: Path, title: str = "") -> None:
    """Median step time against peak memory, one point per strategy; hollow markers are
    our planner's predictions, joined to what was measured."""
    from compile_offload.reporting.plotting import new_figure

    measured = [r for r in rows if r.get("status") == "ok" and r.get("peak_bytes") is not None]
    fig, ax = new_figure((9, 6))
    colors = {}
    for row in measured:
        x, y = row["peak_bytes"] / MiB, row["ms_median"]
        color = colors.setdefault(row["family"], f"C{len(colors) % 10}")
        ax.scatter([x], [y], color=color, label=row["family"] if row["family"] not in ax.get_legend_handles_labels()[1] else None)
        ax.annotate(row["strategy"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if row.get("predicted_peak_bytes") is not None and row.get("predicted_step_ms") is not None:
            px, py = row["predicted_peak_bytes"] / MiB, row["predicted_step_ms"]
            ax.scatter([px], [py], facecolors="none", edgecolors=color)
            ax.plot([px, x], [py, y], color=color, linewidth=0.6, linestyle=":")
    if any(r.get("predicted_peak_bytes") is not None and r.get("predicted_step_ms") is not None for r in measured):
        ax.scatter([], [], facecolors="none", edgecolors="grey", label="predicted by our planner")
    front = pareto_front([(r["peak_bytes"] / MiB, r["ms_median"]) for r in measured])
    if front:
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="grey", linewidth=0.8, label="Pareto front")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no strategy has a measured peak", ha="center", va="center", transform=ax.transAxes)
    times = [r["ms_median"] for r in measured]
    if times and max(times) > 20 * min(times):  # eager offload can be 10x slower than the rest
        ax.set_yscale("log")
    ax.set_xlabel("peak memory above steady state (MiB)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
