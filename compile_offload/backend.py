"""The ``offload_remat`` torch.compile backend: AOTAutograd -> our partitioner -> Inductor.

Training graphs go through Inductor's own ``compile_fx`` with our partitioner installed as
``torch._inductor.config.custom_partitioner_fn``, so Inductor's joint-graph passes, caches
and code generation stay exactly as in ``torch.compile``'s default; only the choice of what
the backward saves, recomputes or offloads is ours. With ``config.inner_compiler="eager"``
the same partitioner runs under ``aot_module_simplified`` and the partitioned graphs run as
plain Python (no code generation).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

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
    """The Dynamo backend. ``options`` come from ``torch.compile(..., options={...})``."""
    if mode not in (None, "default"):
        raise ValueError(
            f"compile_offload: torch.compile(mode={mode!r}) is not supported by the offload_remat backend; "
            "leave mode unset (Inductor options can be set through torch._inductor.config)"
        )
    return compile_graph(gm, example_inputs, settings_mod.resolve(options))


def offload_remat(**options: Any) -> Callable[..., Any]:
    """Return a backend with ``options`` applied on top of ``compile_offload.config``.

    ``torch.compile(model, backend=compile_offload.offload_remat(memory_budget="4GiB"))``.
    Options are validated here, so a bad value fails at once rather than at first call.
    """
    settings_mod.resolve(options)

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return compile_graph(gm, example_inputs, settings_mod.resolve(options))

    backend.__name__ = BACKEND_NAME
    return backend


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings) -> Callable[..., Any]:
    """Compile one Dynamo graph under ``settings``."""
    if _ddp_bucket_index() is not None:
        _warn_budget_per_ddp_bucket(settings)
    partitioner = OffloadRematPartitioner(settings, graph_name=_graph_name())
    device = _inputs_device(example_inputs)
    settings_mod.check_budget_fits_device(settings, device)
    settings_mod.warn_if_profile_does_not_match(settings, device, partitioner.graph_name)
    if settings.inner_compiler == "eager":
        return _compile_eager(gm, example_inputs, partitioner)
    from torch._inductor.compile_fx import compile_fx

    # Graphs without grad never reach the partitioner: compile_fx sends them straight to
    # Inductor's inference path.
    patches: dict[str, Any] = {"custom_partitioner_fn": partitioner}
    if settings.dump_dir is None:
        return compile_fx(gm, example_inputs, config_patches=patches)
    # A dump asks to see the partition: a warm FX graph or AOTAutograd cache would reuse
    # compiled code without calling the partitioner, and so write nothing.
    patches["fx_graph_cache"] = False
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, config_patches=patches)


def _inputs_device(example_inputs: Sequence[Any]) -> torch.device:
    """Where the graph runs: the first non-CPU device among its inputs (parameters are
    inputs too), else the CPU."""
    devices = [x.device for x in example_inputs if isinstance(x, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def _compile_eager(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], partitioner: OffloadRematPartitioner):
    import torch._inductor.lowering  # noqa: F401  some decompositions in the table need it loaded
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    from passes.compat import boxed_python

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


def _graph_name() -> str:
    """Dynamo's id of the graph being compiled (``"0_0"`` style), for dumps and logs."""
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
    return name if bucket is None else f"{name}_bucket{bucket}"


_warned_ddp_split = False


def _warn_budget_per_ddp_bucket(settings: Settings) -> None:
    """Once per process: a budget under DDPOptimizer bounds each bucket's graph, not the step."""
    global _warned_ddp_split
    if _warned_ddp_split or (settings.budget_bytes is None and settings.budget_fraction is None):
        return
    _warned_ddp_split = True
    warnings.warn(
        "compile_offload: DDPOptimizer compiles one graph per DDP bucket, and memory_budget "
        f"({settings.describe_budget()}) applies to each graph on its own: while a later bucket's graph runs, "
        "the activations every earlier one saved are alive, so the whole step can use more than the budget. "
        "Set torch._dynamo.config.optimize_ddp = False to compile the model as one graph that the budget "
        "bounds (docs/distributed.md)",
        stacklevel=2,
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
