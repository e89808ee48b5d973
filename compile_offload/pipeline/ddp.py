"""DDPOptimizer support: which bucket graph is being compiled, how many there are, and the
budget each one is planned with (docs/integrations.md).

DDPOptimizer (``torch._dynamo.config.optimize_ddp``) splits one Dynamo graph into a graph
per DDP bucket and compiles each with our backend. Nothing public says how many there
are: ``bucket_graph_count`` reads it off the call stack, the one private detail here.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings

import torch

from ..passes.plan import format_bytes
from ..settings import Settings
from ..torch_api import dynamo

log = logging.getLogger("compile_offload")

_warned_ddp_split = False
_logged_ddp_splits: set[tuple] = set()


def budget_per_bucket(settings: Settings, bucket_graphs: int | None) -> Settings:
    """The settings one DDPOptimizer bucket graph is planned with (docs/integrations.md).

    A byte budget B is split evenly: each of the ``bucket_graphs`` graphs N gets B // N, so
    the step, whose peak is at most the sum of the bucket graphs' peaks, stays within B when
    every graph's plan fits. A fraction is relative to the activations each graph's own
    unconstrained plan saves, and is left as it is. ``strict_budget`` and the below-the-minimum warning then apply to
    each graph against its share. With N unknown (``None``) every graph gets the whole
    budget, with one warning per process that the step may exceed it.
    """
    if not settings.has_budget:
        return settings
    if bucket_graphs is None:
        _warn_budget_per_bucket(settings)
        return settings
    if settings.budget_bytes is not None:
        share = settings.budget_bytes // bucket_graphs
        said = ("bytes", settings.budget_bytes, bucket_graphs)
        message = ("DDPOptimizer compiles this graph as %d bucket graphs: memory_budget %s is split evenly, "
                   "%s per bucket graph, so that the step stays within %s when every bucket graph's plan fits")
        arguments = (bucket_graphs, format_bytes(settings.budget_bytes), format_bytes(share),
                     format_bytes(settings.budget_bytes))
        settings = dataclasses.replace(settings, budget_bytes=share)
    else:
        said = ("fraction", settings.budget_fraction, bucket_graphs)
        message = ("DDPOptimizer compiles this graph as %d bucket graphs: memory_budget %s is relative to the "
                   "activations each bucket graph's unconstrained plan saves, so it applies to each of them unsplit")
        arguments = (bucket_graphs, settings.describe_budget())
    if said not in _logged_ddp_splits:  # once per budget and bucket count, not once per graph
        _logged_ddp_splits.add(said)
        log.info(message, *arguments)
    return settings


def _warn_budget_per_bucket(settings: Settings) -> None:
    """Once per process: the bucket graphs could not be counted, so the budget bounds each
    bucket's graph, not the step."""
    global _warned_ddp_split
    if _warned_ddp_split:
        return
    _warned_ddp_split = True
    warnings.warn(
        "compile_offload: DDPOptimizer compiles one graph per DDP bucket, and this torch does not let us count "
        f"them, so memory_budget ({settings.describe_budget()}) applies to each graph on its own: while a later "
        "bucket's graph runs, the activations every earlier one saved are alive, so the whole step can use more "
        "than the budget. Set torch._dynamo.config.optimize_ddp = False to compile the model as one graph that "
        "the budget bounds (docs/integrations.md)",
        stacklevel=3,
    )


def bucket_index() -> int | None:
    """Index of the DDP bucket graph being compiled under DDPOptimizer, else None. A failure
    to read it raises: taken for "no bucket", each bucket's graph would get the whole budget."""
    from ..torch_api.guards import TracingContext

    ddp = getattr(TracingContext.try_get(), "ddp_optimizer_ctx", None)
    return None if ddp is None else ddp.curr_bucket + 1


_DDP_MODULE = dynamo.DDP_OPTIMIZER_MODULE


def bucket_graph_count() -> int | None:
    """How many bucket graphs DDPOptimizer split the Dynamo graph being compiled into, or
    None when that cannot be found.

    Private, and the only place relying on it: torch's DDPOptimizer keeps the count nowhere
    public (its ``DDPOptimizerContext`` has only ``curr_bucket`` and ``metadata_per_bucket``).
    It compiles each bucket's submodule from ``SubmodCompiler`` (module
    ``torch._dynamo.backends.distributed``; the same in torch 2.11 to 2.14), a ``torch.fx``
    ``Interpreter`` running over the split graph that calls the backend once per
    ``call_module`` node (``submod_<k>``, renamed ``compiled_submod_<k>`` once compiled). We
    find that interpreter as ``self`` of a frame of that module on the call stack (it called
    the backend; matched by class name, so an older torch's nested class matches too) and
    count the call_module nodes of the graph it interprets (``Interpreter.module``).
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == _DDP_MODULE:
            owner = frame.f_locals.get("self")
            if type(owner).__name__ == "SubmodCompiler" and isinstance(owner, torch.fx.Interpreter):
                graph = getattr(getattr(owner, "module", None), "graph", None)
                if graph is None:
                    return None
                count = sum(1 for node in graph.nodes if node.op == "call_module")
                return count if count > 0 else None
        frame = frame.f_back
    return None
