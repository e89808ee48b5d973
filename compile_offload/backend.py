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
from collections.abc import Callable, Sequence
from typing import Any

import torch


from . import ddp, pinned_pool
from . import settings as settings_mod
from .device_profile import device_of
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
    """Compile one Dynamo graph under ``settings``; with ``verify_budget``, its first step is
    measured against the budget (``verify_budget.py``)."""
    compiled, partitioner = _compile_graph(gm, example_inputs, settings)
    if not settings.verify_budget:
        return compiled
    from .verify_budget import verify_first_step

    return verify_first_step(compiled, lambda: partitioner.last_plan, device_of(example_inputs),
                             partitioner.graph_name)


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings):
    bucket_graphs = None
    if ddp.bucket_index() is not None:
        bucket_graphs = ddp.bucket_graph_count()
        settings = ddp.budget_per_bucket(settings, bucket_graphs)
    partitioner = OffloadRematPartitioner(settings, graph_name=_graph_name(bucket_graphs))
    device = device_of(example_inputs)
    settings_mod.check_budget_fits_device(settings, device)
    settings_mod.warn_if_profile_does_not_match(settings, device, partitioner.graph_name)
    if settings.offload:
        # The pool is one per process: the latest compile's limit applies (config.py). Set
        # here, not while planning, so that a compile served from a cache sets it too.
        pinned_pool.set_limit(settings.pinned_pool_limit)
    if settings.inner_compiler == "eager":
        return _compile_eager(gm, example_inputs, partitioner), partitioner
    from torch._inductor.compile_fx import compile_fx

    # Graphs without grad never reach the partitioner: compile_fx sends them straight to
    # Inductor's inference path.
    patches = inductor_config_patches(settings, partitioner)
    if settings.dump_dir is None and not settings.verify_budget:
        return compile_fx(gm, example_inputs, config_patches=patches), partitioner
    # A dump asks to see the partition, verify_budget compares with the plan: a warm FX
    # graph or AOTAutograd cache would reuse compiled code without calling the partitioner.
    patches["fx_graph_cache"] = False
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, config_patches=patches), partitioner


def inductor_config_patches(settings: Settings, partitioner: OffloadRematPartitioner) -> dict[str, Any]:
    """The Inductor config a graph compiles under (``explain`` plans under the same)."""
    patches: dict[str, Any] = {"custom_partitioner_fn": partitioner}
    if settings.budget_bytes is not None or settings.budget_fraction is not None:
        # Inductor's peak-memory reordering moves the plan's recomputations away from where
        # the plan put them (just before their first backward use) and so raises the peak
        # the plan budgeted: on a small Llama at a fitting budget 4.10 MiB measured against
        # 2.94 MiB budgeted, 3.39 MiB without it (docs/design.md, "Where the compiled peak
        # exceeds the plan"). It only orders kernels (none is changed or added).
        patches["reorder_for_peak_memory"] = False
    return patches


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
    bucket = ddp.bucket_index()
    if bucket is None:
        return name
    return f"{name}_bucket{bucket}" + ("" if bucket_graphs is None else f"of{bucket_graphs}")
