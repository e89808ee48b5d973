"""What the user is told about each planned graph: log lines, TORCH_TRACE artifacts, dumps.

``TORCH_LOGS="+compile_offload"`` works through torch's own support for module names in
``TORCH_LOGS``: when torch parses the variable (at its import) it imports the module named
and registers its logger, so our logger gets torch's handler and format. We also register
the logger with ``torch._logging`` ourselves, so it is one of torch's loggers whatever the
variable says, but never re-run torch's log set-up: that happens while torch is importing
us, and a second set-up inside the first doubled every line. Named in the variable, the
logger does not propagate to the root logger, as torch's own do (its handler prints each
line); otherwise it does, for logging configured by the user.
``torch._logging.set_logs(modules={"compile_offload": logging.DEBUG})`` and plain
``logging.getLogger("compile_offload")`` work too.

Per graph (``emit``): one INFO line (budget, predicted peak, keep / recompute / offload
counts, solver and its time, or why the graph was not planned), the decision table at
DEBUG, the plan as a ``TORCH_TRACE`` artifact for tlparse, and with ``dump_dir`` set the
graph's dump folder (``dump``; the budget loop writes it again with the plan it kept).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import torch.fx as fx

from .dump import dump_result
from ..passes.plan import Plan
from ..pipeline.result import PartitionResult
from ..settings import Settings

LOGGER_NAME = "compile_offload"
log = logging.getLogger(LOGGER_NAME)


def register_with_torch_logging() -> None:
    from ..torch_api import utils

    utils.register_log(LOGGER_NAME, LOGGER_NAME)
    if _named_in_torch_logs():
        # torch gives the logger its own handler, as to its loggers, which do not propagate: each
        # line is printed once, also where the root logger has a handler (logging.basicConfig).
        # torch sets that on the loggers registered before its set-up; we register during it.
        log.propagate = False


def _named_in_torch_logs() -> bool:
    """Whether ``TORCH_LOGS`` names our logger or a module under it (``+compile_offload``)."""
    names = os.environ.get("TORCH_LOGS", "").split(",")
    return any(name.strip().lstrip("+-").split(".")[0] == LOGGER_NAME for name in names)


# The latest plan of each graph this process partitioned, by graph name: what
# profile_step draws when it is given no plans.
_latest_plans: dict[str, Plan] = {}


# (dump folder, graph name) -> why the graph's latest dump there failed (``dump``); the
# ``explain`` command line reads it so as not to say a dump was written that was not.
_dump_failures: dict[tuple[str, str], str] = {}


def latest_plans() -> list[Plan]:
    """The most recent plan of each graph partitioned in this process, oldest first."""
    return list(_latest_plans.values())


def remember(plan: Plan) -> None:
    """Make ``plan`` its graph's latest (the budget loop keeps a plan other than the last made)."""
    _latest_plans.pop(plan.graph_name, None)
    _latest_plans[plan.graph_name] = plan


def emit(result: PartitionResult, joint_gm: fx.GraphModule, settings: Settings, summary: bool = True) -> None:
    """Report one graph the partitioner planned, through every channel. ``summary=False``:
    one of the plans the budget loop compiles for the graph, of which it keeps one; the line
    goes to DEBUG, and the loop logs the INFO line of the plan it keeps (``emit_kept``)."""
    remember(result.plan)
    folder = dump(result, joint_gm, settings)
    log.log(logging.INFO if summary else logging.DEBUG, "%s",
            info_line(result) + (f" [dump: {folder}]" if folder is not None else ""))
    if result.plan.decisions:
        log.debug("%s: decisions\n%s", result.plan.graph_name, result.plan.table())
    trace_plan(result.plan)


# (graph, dump folder, error) of each dump that could not be written, warned once
_dump_failures_said: set[tuple[str, str, str]] = set()


def dump(result: PartitionResult, joint_gm: fx.GraphModule, settings: Settings) -> Path | None:
    """Write ``result`` into ``config.dump_dir`` (over an earlier dump of the same graph); the
    graph's folder, or None without a dump folder or when it could not be written (warned)."""
    if settings.dump_dir is None:
        return None
    key = (settings.dump_dir, result.plan.graph_name)
    try:
        folder = dump_result(settings.dump_dir, result, joint_gm)
    except OSError as error:  # checked when the knob was read; the folder changed since
        _dump_failures[key] = str(error)
        said = (result.plan.graph_name, settings.dump_dir, str(error))
        if said in _dump_failures_said:  # the budget loop's other plans of the graph fail alike
            return None
        _dump_failures_said.add(said)
        warnings.warn(f"compile_offload: {result.plan.graph_name}: could not write the dump into "
                      f"config.dump_dir={settings.dump_dir!r} ({error}); the plan is used, not dumped",
                      stacklevel=3)
        return None
    _dump_failures.pop(key, None)  # written over the graph's folder: the failed dump is replaced
    return folder


def dump_failure(dump_dir: str, graph_name: str) -> str | None:
    """Why the latest dump of ``graph_name`` into ``dump_dir`` (as ``config.dump_dir`` holds it)
    could not be written, or None when it was written or none was tried (``dump`` warned too)."""
    return _dump_failures.get((dump_dir, graph_name))


def emit_kept(result: PartitionResult, settings: Settings) -> None:
    """The graph's INFO line for the plan the budget loop kept, once its compiles are done:
    ``emit``'s line, with what the loop marked on the plan (as a warm cache's record says it)."""
    folder = None if settings.dump_dir is None else Path(settings.dump_dir) / result.plan.graph_name
    log.info("%s", info_line(result) + (f" [dump: {folder}]" if folder is not None and folder.is_dir() else ""))


def emit_cached(plan: Plan) -> None:
    """Report a plan whose graphs came from Inductor's or AOTAutograd's cache (the
    partitioner did not run): the same log lines and trace as when it was made."""
    remember(plan)
    if plan.notes and not plan.decisions:  # torch's partition was used: say why, as info_line does
        line = f"{plan.graph_name}: not planned ({'; '.join(plan.notes)})"
    else:
        # The line a planning compile logs, which comes before Inductor's kernels (and so the
        # scheduled peak) exist: a warm cache says what a cold compile said.
        line = plan.summary(scheduled=False)
    log.info("%s [compiled code from Inductor's cache]", line)
    if plan.decisions:
        log.debug("%s: decisions\n%s", plan.graph_name, plan.table())
    trace_plan(plan)


def info_line(result: PartitionResult) -> str:
    """The one INFO line for a graph: its plan's summary and where the plan came from."""
    plan = result.plan
    if result.analysis is None:  # torch's partition was used: say why
        return f"{plan.graph_name}: not planned ({'; '.join(plan.notes) or 'no reason recorded'})"
    # Without the scheduled peak, known once Inductor generated the code: the line a planning
    # compile logs, whoever logs it (``emit_kept`` after the budget loop, ``emit_cached``).
    if result.solution is None:
        return f"{plan.summary(scheduled=False)} [from the plan cache]"
    return f"{plan.summary(scheduled=False)} [solver {plan.solver}, {plan.solve_seconds:.2f} s]"


def trace_plan(plan: Plan) -> None:
    """The plan as a ``TORCH_TRACE`` artifact, so tlparse shows it next to the graph's
    other artifacts (trace_structured tags it with the current compile id)."""
    from ..torch_api.utils import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"compile_offload_plan_{plan.graph_name}", "encoding": "json"},
        payload_fn=lambda: json.dumps(plan.to_json(), default=str),
    )
