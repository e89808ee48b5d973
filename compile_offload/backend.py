"""The ``offload_remat`` torch.compile backend: AOTAutograd -> our partitioner -> Inductor.

Training graphs go through Inductor's own ``compile_fx`` with our partitioner installed as
``torch._inductor.config.custom_partitioner_fn``, so Inductor's joint-graph passes, caches
and code generation stay exactly as in ``torch.compile``'s default; only the choice of what
the backward saves, recomputes or offloads is ours. With ``config.inner_compiler="eager"``
the same partitioner runs under ``aot_module_simplified`` and the partitioned graphs run as
plain Python (no code generation).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .passes.plan import format_bytes

from . import settings as settings_mod
from .partitioner import OffloadRematPartitioner
from .settings import Settings

log = logging.getLogger("compile_offload")

BACKEND_NAME = "offload_remat"


def offload_remat_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The Dynamo backend. ``options`` come from ``torch.compile(..., options={...})``: our
    knobs (``compile_offload.config``) and Inductor's options (``"triton.cudagraphs"``, ...);
    ``mode`` is one of Inductor's modes (``torch._inductor.list_mode_options()``)."""
    ours, inductor = split_options(options)
    return compile_graph(gm, example_inputs, settings_mod.resolve(ours), inductor_options(mode, inductor), mode)


def offload_remat(**options: Any) -> Callable[..., Any]:
    """Return a backend with ``options`` applied on top of ``compile_offload.config``.

    ``torch.compile(model, backend=compile_offload.offload_remat(memory_budget="4GiB"))``.
    Options are validated here, so a bad value fails at once rather than at first call.
    ``torch.compile``'s own ``mode`` and ``options`` reach the backend as they reach the
    string backend ``"offload_remat"``; options given there override the ones given here.
    """
    settings_mod.resolve(options)
    closure_options = options  # the backend's own ``options`` are torch.compile's

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: dict | None = None,
                mode: str | None = None) -> Callable[..., Any]:
        ours, inductor = split_options(options)
        return compile_graph(gm, example_inputs, settings_mod.resolve({**closure_options, **ours}),
                             inductor_options(mode, inductor), mode)

    backend.__name__ = BACKEND_NAME
    return backend


def split_options(options: dict | None) -> tuple[dict, dict]:
    """``torch.compile(options=...)`` split into our knobs and Inductor's config options;
    a name that is neither raises ``ValueError`` naming it."""
    if not options:
        return {}, {}
    from torch._inductor import config as inductor_config

    from . import config

    known_inductor = inductor_config.get_config_copy()
    ours = {name: value for name, value in options.items() if name not in known_inductor or name in config.get_config_copy()}
    inductor = {name: value for name, value in options.items() if name not in ours}
    settings_mod.check_option_names(ours)
    return ours, inductor


def inductor_options(mode: str | None, options: dict) -> dict:
    """Inductor config patches for ``torch.compile(mode=...)`` and Inductor ``options``."""
    if mode in (None, "default"):
        return dict(options)
    from torch._inductor import list_mode_options

    modes = list_mode_options()
    if mode not in modes:
        raise ValueError(f"compile_offload: torch.compile(mode={mode!r}) is not an Inductor mode; accepted: "
                         f"{', '.join(sorted(modes))} (or leave mode unset)")
    return {**modes[mode], **options}


def _cuda_graphs_requested(patches: dict) -> bool:
    """Whether Inductor will capture CUDA graphs: ``triton.cudagraphs`` from the mode or
    options, else its global config."""
    from torch._inductor import config as inductor_config

    return bool(patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs))


def _without_offload_under_cuda_graphs(settings: Settings, mode_said: str) -> Settings:
    """CUDA graphs and offload do not mix: Inductor would split the captured graphs at every
    copy (their ``cudagraph_unsafe`` tag: no overlap left) and copy each reloaded tensor into
    a static buffer (no memory saved). So offload is turned off, with one warning per
    compiled graph, and the planner keeps or recomputes under the same budget."""
    if not settings.offload:
        return settings
    warnings.warn(
        f"compile_offload: CUDA graphs are on ({mode_said}): offloading is turned off for this graph (captured "
        "graphs would be split at every copy and each reloaded tensor copied into a static buffer); the plan only "
        f"keeps or recomputes, under the same memory budget ({settings.describe_budget()})",
        stacklevel=4,
    )
    return dataclasses.replace(settings, offload=False)


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                  inductor_patches: dict | None = None, mode: str | None = None) -> Callable[..., Any]:
    """Compile one Dynamo graph under ``settings``; ``inductor_patches``: Inductor config
    from ``torch.compile``'s ``mode`` and ``options`` (``inductor_options``)."""
    inductor_patches = dict(inductor_patches or {})
    if settings.inner_compiler == "eager" and inductor_patches:
        raise ValueError(
            f"compile_offload: Inductor options {sorted(inductor_patches)} (from torch.compile's mode or options) "
            "need inner_compiler='inductor'; with inner_compiler='eager' no Inductor code runs"
        )
    if settings.inner_compiler == "inductor" and _cuda_graphs_requested(inductor_patches):
        if "triton.cudagraphs" not in inductor_patches:
            said = "torch._inductor.config.triton.cudagraphs=True"
        elif mode not in (None, "default"):  # torch.compile takes a mode or options, not both
            said = f"torch.compile(mode={mode!r})"
        else:
            said = "options={'triton.cudagraphs': True}"
        settings = _without_offload_under_cuda_graphs(settings, said)
    bucket_graphs = None
    if _ddp_bucket_index() is not None:
        bucket_graphs = _ddp_bucket_graph_count()
        settings = _budget_per_ddp_bucket(settings, bucket_graphs)
    partitioner = OffloadRematPartitioner(settings, graph_name=_graph_name(bucket_graphs))
    device = _inputs_device(example_inputs)
    settings_mod.check_budget_fits_device(settings, device)
    settings_mod.warn_if_profile_does_not_match(settings, device, partitioner.graph_name)
    if settings.inner_compiler == "eager":
        return _compile_eager(gm, example_inputs, partitioner)
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from .copy_order import keeping_copy_order

    # Graphs without grad never reach the partitioner: compile_fx sends them straight to
    # Inductor's inference path. Graphs with copies are compiled without Inductor's
    # reordering passes, so the copies run where the plan put them (copy_order.py).
    inner_compile = keeping_copy_order(compile_fx_inner)
    patches: dict[str, Any] = {**inductor_patches, "custom_partitioner_fn": partitioner}
    if settings.dump_dir is None:
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
    # A dump asks to see the partition: a warm FX graph or AOTAutograd cache would reuse
    # compiled code without calling the partitioner, and so write nothing.
    patches["fx_graph_cache"] = False
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


def _inputs_device(example_inputs: Sequence[Any]) -> torch.device:
    """Where the graph runs: the first non-CPU device among its inputs (parameters are
    inputs too), else the CPU."""
    devices = [x.device for x in example_inputs if isinstance(x, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def _compile_eager(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], partitioner: OffloadRematPartitioner):
    import torch._inductor.lowering  # noqa: F401  some decompositions in the table need it loaded
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    from .passes.compat import boxed_python

    def run_as_python(graph: torch.fx.GraphModule, _inputs: Sequence[Any]):
        return boxed_python(graph)

    # Dynamo's aot_autograd wrapper, not aot_module_simplified itself: DDPOptimizer (one
    # graph per DDP bucket) counts AOTAutograd compiles through the wrapper's counter to
    # pair each bucket's forward with its backward, and fails the first backward without it.
    backend = aot_autograd(
        fw_compiler=run_as_python,
        bw_compiler=run_as_python,
        inference_compiler=run_as_python,
        partition_fn=functools.partial(partitioner, compiler="inductor"),
        decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)


def _graph_name(bucket_graphs: int | None = None) -> str:
    """Dynamo's id of the graph being compiled (``"0_0"`` style), for dumps and logs; under
    DDPOptimizer with ``bucket_graphs`` known, ``graph_0_0_bucket1of3`` (bucket 1 of 3)."""
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    except Exception:  # outside Dynamo (explain() on an FX graph)
        compile_id = None
    name = "graph" if compile_id is None else f"graph_{compile_id}".replace("/", "_")
    # DDPOptimizer compiles one graph per DDP bucket under one compile id; the buckets are
    # compiled in forward order and counted on the tracing context (the count goes up once
    # each bucket's graph is compiled).
    bucket = _ddp_bucket_index()
    if bucket is None:
        return name
    return f"{name}_bucket{bucket}" + ("" if bucket_graphs is None else f"of{bucket_graphs}")


_warned_ddp_split = False
_logged_ddp_splits: set[tuple] = set()


def _budget_per_ddp_bucket(settings: Settings, bucket_graphs: int | None) -> Settings:
    """The settings one DDPOptimizer bucket graph is planned with (docs/distributed.md).

    A byte budget B is split evenly: each of the ``bucket_graphs`` graphs N gets B // N, so
    the step, whose peak is at most the sum of the bucket graphs' peaks, stays within B when
    every graph's plan fits. A fraction is relative to the activations each graph's own
    unconstrained plan saves, and is left as it is. ``strict_budget`` and the below-the-minimum warning then apply to
    each graph against its share. With N unknown (``None``) every graph gets the whole
    budget, with one warning per process that the step may exceed it.
    """
    if settings.budget_bytes is None and settings.budget_fraction is None:
        return settings
    if bucket_graphs is None:
        _warn_budget_per_ddp_bucket(settings)
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


def _warn_budget_per_ddp_bucket(settings: Settings) -> None:
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
        "the budget bounds (docs/distributed.md)",
        stacklevel=3,
    )


def _ddp_bucket_index() -> int | None:
    """Index of the DDP bucket graph being compiled under DDPOptimizer, else None."""
    try:
        from torch._guards import TracingContext

        context = TracingContext.try_get()
    except Exception:
        return None
    ddp = getattr(context, "ddp_optimizer_ctx", None)
    return None if ddp is None else ddp.curr_bucket + 1


_DDP_MODULE = "torch._dynamo.backends.distributed"


def _ddp_bucket_graph_count() -> int | None:
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
