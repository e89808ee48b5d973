"""What the user is told about a graph's budget, once: a budget below what the planner can
reach, or than the plans it found before ``plan_time_limit`` (``report_budget``: a warning,
or ``BudgetError`` under ``strict_budget``), and a plan the budget loop kept over its budget
(``warn_over_budget``; ``BudgetError`` under ``strict_budget`` too). Called once a graph's plan is final: by the partitioner where no
budget loop runs, by the budget loop once Inductor's code for the plan kept is known, and for
a compile served from a cache as its record is read (``graph_reports.replay``).
"""

from __future__ import annotations

import warnings

from ..passes.plan import Plan, format_bytes
from ..settings import Settings
from .result import BudgetError


def report_budget(plan: Plan, settings: Settings) -> None:
    """Warn (or, under ``strict_budget``, raise) when ``plan`` could not meet its budget;
    also run for a plan whose graphs came from a cache (``graph_reports.replay``). Under the
    budget loop it runs once Inductor's code is known (``budget_loop.BudgetLoop``): a plan
    predicted over the budget whose scheduled peak fits it is not reported."""
    if plan.feasible or plan.budget_bytes is None or plan.fallback is not None:
        return  # (a fallback: torch partitioned the graph without the budget, and that was said)
    if plan.scheduled_peak_bytes is not None and plan.scheduled_peak_bytes <= plan.budget_bytes:
        return  # the planner over-predicted: the code Inductor generated for the plan fits (budget_loop.py)
    if plan.budget_bytes == 0:
        return  # memory_budget=0 or 0.0 asks for the minimum-memory plan: this is it
    if plan.budget_outcome == "over_budget":
        return  # the budget loop kept it over the budget, and warned (warn_over_budget)
    if plan.time_limit_reached:  # the search did not end: its lowest plan is not the planner's minimum
        stopped = (f"compile_offload: {plan.graph_name}: plan_time_limit stopped the search before it found a plan "
                   f"within the memory budget {format_bytes(plan.budget_bytes)} (predicted peak "
                   f"{format_bytes(plan.predicted_peak_bytes)}; the lowest found {format_bytes(plan.min_peak_bytes)})")
        if settings.strict_budget:
            raise BudgetError(stopped + "; strict_budget=True")
        warnings.warn(stopped + "; using the lowest plan found (raise or unset plan_time_limit)", stacklevel=4)
        return
    unconstrained = plan.unconstrained
    if unconstrained and plan.scheduled_peak_bytes is not None:
        # The plans made to lower memory peaked higher in Inductor's code than this one:
        # what the step can reach is this plan's scheduled peak, not the search's minimum.
        reached = (f"{format_bytes(plan.scheduled_peak_bytes)} in the code Inductor generated, the unconstrained "
                   f"plan's; the plans it made to lower memory, predicted down to "
                   f"{format_bytes(plan.min_peak_bytes)}, peaked higher there")
    elif plan.scheduled_peak_bytes is not None:  # what the step holds, first; the planner's figure after
        reached = (f"{format_bytes(plan.scheduled_peak_bytes)} in the code Inductor generated for its minimum-memory "
                   f"plan; predicted {format_bytes(plan.min_peak_bytes)}")
    else:
        reached = f"{format_bytes(plan.min_peak_bytes)}; predicted peak {format_bytes(plan.predicted_peak_bytes)}"
    message = (f"compile_offload: {plan.graph_name}: memory budget {format_bytes(plan.budget_bytes)} is below the "
               f"minimum this planner can reach ({reached})")
    if settings.strict_budget:
        raise BudgetError(message + "; strict_budget=True")
    message += "; using the unconstrained plan" if unconstrained else "; using the minimum-memory plan"
    warnings.warn(message, stacklevel=4)


def warn_over_budget(plan: Plan, stacklevel: int = 2, verified: bool = False, strict: bool = False) -> None:
    """The loop's one warning for ``plan``, kept with its scheduled peak over the budget
    (also when a warm cache replays the plan's record: ``graph_reports.replay``);
    ``verified``: ``verify_budget`` is on, and will measure the first step; ``strict``:
    ``strict_budget``, a ``BudgetError`` in place of the warning."""
    tried = f"{plan.replans} other plan{'s' * (plan.replans != 1)} compiled"
    # "though" only where the planner's prediction fits: a plan kept over the budget may be
    # one (the unconstrained plan, re-planned) that the planner predicted over it as well
    predicted = format_bytes(plan.predicted_peak_bytes)
    against = (f"though the plan predicts {predicted}" if plan.predicted_peak_bytes <= plan.budget_bytes
               else f"as the plan predicts ({predicted})")
    message = (f"compile_offload: {plan.graph_name}: the code Inductor generates for this graph is predicted to peak "
               f"at {format_bytes(plan.scheduled_peak_bytes)} (scheduled peak), over the memory budget "
               f"{format_bytes(plan.budget_bytes)}, {against} ({tried}")
    if strict:
        raise BudgetError(message + "); strict_budget=True")
    warnings.warn(
        message + "; the lowest scheduled peak is kept). "
        + ("The first step is measured (verify_budget)" if verified
           else "Not measured: config.verify_budget=True measures the first step"),
        stacklevel=stacklevel,
    )
