"""A compiled graph is reused only under the configuration that planned it.

Dynamo reuses the compiled code of a frame while its guards hold, and a string backend
(``backend="offload_remat"``) is the same backend for every ``torch.compile`` call: without
a guard of ours, a new ``torch.compile`` of another instance of the same model class, or a
call after ``config.memory_budget`` changed, would run the plan made for the old budget.
``install`` adds one guard to the frame being compiled: the knobs read now (and torch's
``activation_memory_budget``, our budget where ``memory_budget`` is None) must equal the
knobs that planned the graph, else Dynamo compiles the frame again (and our backend plans
again, under the new values). ``TORCH_LOGS=recompiles`` names it.

The guard is a lambda guard on Dynamo's root guard manager (``torch_api.dynamo.add_frame_guard``),
the way Dynamo guards its own global state; that is private API, so where it is missing
(another torch) the compiled graph is wrapped instead, and its first call under changed
knobs warns once that the running plan was made for other values.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from typing import Any

from . import config, process_config

KNOBS = tuple(sorted(config._config))  # every knob: each one changes the plan or what is reported
# torch's own budget knob, the budget where ``memory_budget`` is None (``settings._with_torch_budget``)
TORCH_BUDGET = "torch._functorch.config.activation_memory_budget"


def knob_values(fixed: Mapping[str, Any] | Iterable[str] = ()) -> tuple[tuple[str, Any], ...]:
    """The knobs as this thread reads them now (``fixed``: those a backend's options fix, with
    their values), each as it is understood: ``0.5`` and ``"0.5"``, ``"1MiB"`` and ``1048576``
    are one value, which compiled again would plan the same (and use up Dynamo's recompile
    limit). Unless ``memory_budget`` is fixed to a budget, the fraction taken from torch's
    ``activation_memory_budget`` comes last (None where ours is set or torch's asks for none:
    its changes then plan alike)."""
    values = tuple((knob, _understood(knob, getattr(config, knob))) for knob in KNOBS if knob not in fixed)
    if "memory_budget" not in fixed:
        return (*values, (TORCH_BUDGET, torch_budget()))
    ours = fixed["memory_budget"] if isinstance(fixed, Mapping) else "set"
    if _understood("memory_budget", ours) != ("read", (None, None)):
        return values
    # fixed to no budget (``offload_remat(memory_budget=None)``): torch's knob is still the budget
    return (*values, (TORCH_BUDGET, torch_budget(ours)))


_FROM_CONFIG = object()


def torch_budget(ours: Any = _FROM_CONFIG) -> float | None:
    """The fraction a compile takes from torch's knob, ``ours`` being ``memory_budget``
    (default: the config's)."""
    from .settings import torch_budget_taken

    return torch_budget_taken() if ours is _FROM_CONFIG else torch_budget_taken(ours)


def _torch_knob() -> Any:
    """torch's ``activation_memory_budget`` as set (cheap to read; ``torch_budget`` judges it)."""
    from .torch_api.functorch import config as functorch_config

    return getattr(functorch_config, "activation_memory_budget", 1.0)


def _understood(knob: str, value: Any) -> Any:
    """``value`` of ``knob`` as the settings read it, for the knobs with several spellings;
    a value they refuse stays as written (compiling under it raises the error)."""
    from .settings import SPELLED_KNOBS as readers

    if knob not in readers:
        return value
    try:
        return "read", readers[knob](value)
    except (TypeError, ValueError):
        return "as written", value  # never equal to a value read, whatever it holds


def _describe(values: tuple[tuple[str, Any], ...], changed_from: tuple[tuple[str, Any], ...] | None = None) -> str:
    if changed_from is None:
        return ", ".join(f"{knob}={_shown(knob, value)!r}" for knob, value in values
                         if knob in ("memory_budget", TORCH_BUDGET)) or "its knobs"
    old = dict(changed_from)
    return ", ".join(f"{knob}={_shown(knob, old.get(knob))!r} (now {_shown(knob, value)!r})"
                     for knob, value in values if old.get(knob) != value)


def _shown(knob: str, value: Any) -> Any:
    """A knob's value as ``_understood`` tagged it, shown as the user wrote it (a budget
    read as ``(bytes, fraction)``: the one that is set)."""
    if not (isinstance(value, tuple) and len(value) == 2 and value[0] in ("read", "as written")):
        return value
    how, value = value
    if how == "read" and knob == "memory_budget":
        return value[0] if value[0] is not None else value[1]
    return value


_NOT_WATCHED = object()


def install(fixed: Mapping[str, Any] | Iterable[str] = ()) -> bool:
    """Guard the frame Dynamo is compiling on the knobs read now (``fixed``: those the
    backend's options fix); False where this torch offers no way to (then use
    ``warn_when_changed``)."""
    from .torch_api import dynamo

    planned = knob_values(fixed)
    fixed_budget = dict(fixed).get("memory_budget", _FROM_CONFIG) if isinstance(fixed, Mapping) else _FROM_CONFIG

    # Reading every knob costs ~80 us; the guard runs at every call of the frame. A context
    # that found the knobs as planned at some change count need not read them again until
    # a knob changes (the count is process-wide, the cache per context: a patch in one
    # thread never passes another thread's check).
    checked_at: ContextVar[int | None] = ContextVar("compile_offload_config_checked_at", default=None)

    watched_torch = dict(planned).get(TORCH_BUDGET, _NOT_WATCHED)
    knob_when_planned = _torch_knob()

    def check(_frame_locals: Any) -> bool:
        # torch's knob is outside our config's change count: read at every call, and judged
        # (a few microseconds) only where it is not as set when planned
        if watched_torch is not _NOT_WATCHED:
            knob = _torch_knob()
            if (knob is not knob_when_planned and knob != knob_when_planned
                    and torch_budget(fixed_budget) != watched_torch):
                return False
        changes = process_config.version()
        if changes is not None and checked_at.get() == changes:
            return True
        matches = knob_values(fixed) == planned
        if matches and changes is not None:
            checked_at.set(changes)
        return matches

    return dynamo.add_frame_guard(
        check, f"compile_offload.config as when planned ({_describe(planned)}; every knob compared)")


def warn_when_changed(compiled: Callable[..., Any], graph_name: str,
                      fixed: Mapping[str, Any] | Iterable[str] = ()) -> Callable[..., Any]:
    """``compiled``, warning once when it is called under other knobs than planned it."""
    planned = knob_values(fixed)
    warned = False

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal warned
        if not warned:
            now = knob_values(fixed)
            if now != planned:
                warned = True
                warnings.warn(
                    f"compile_offload: {graph_name}: running a plan made for other settings: "
                    f"{_describe(now, planned)}; this torch offers no guard to recompile on a config change: "
                    "call torch._dynamo.reset() or compile with backend=compile_offload.offload_remat(...)",
                    stacklevel=2,
                )
        return compiled(*args, **kwargs)

    return run
