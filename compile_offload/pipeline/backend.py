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
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


from . import budget_loop, ddp, dynamic_check, graph_reports
from .. import config_guard
from ..inductor import kernels as inductor_kernels
from ..inductor import scheduled_peak
from ..reporting import logs
from ..runtime import pinned_pool
from .. import settings as settings_mod
from .device_profile import device_of
from ..passes.analyze import COLLECTIVE_NAMESPACES, is_collective
from .partitioner import OffloadRematPartitioner
from .planning import report_budget
from .result import PartitionResult
from ..settings import Settings

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
    return compile_graph(gm, example_inputs, settings_mod.resolve(ours), inductor_options(mode, inductor), mode,
                         fixed_knobs=ours)


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
        knobs = {**closure_options, **ours}
        return compile_graph(gm, example_inputs, settings_mod.resolve(knobs), inductor_options(mode, inductor), mode,
                             fixed_knobs=knobs)

    backend.__name__ = BACKEND_NAME
    return backend


def split_options(options: dict | None) -> tuple[dict, dict]:
    """``torch.compile(options=...)`` split into our knobs and Inductor's config options;
    a name that is neither raises ``ValueError`` naming it."""
    if not options:
        return {}, {}
    from torch._inductor import config as inductor_config

    from .. import config

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
                  inductor_patches: dict | None = None, mode: str | None = None,
                  fixed_knobs: Iterable[str] = ()) -> Callable[..., Any]:
    """Compile one Dynamo graph under ``settings``; ``inductor_patches``: Inductor config
    from ``torch.compile``'s ``mode`` and ``options`` (``inductor_options``); ``fixed_knobs``:
    those the backend's options set, which no change of ``compile_offload.config`` can reach.

    The frame is guarded on the config as read now (``config_guard``): a call under other
    values compiles again and plans for them, never runs a plan made for another budget.
    """
    compiled, plan_of, graph_name = _compile_graph(gm, example_inputs, settings, dict(inductor_patches or {}), mode)
    if settings.verify_budget:  # measure the first step against the budget (verify_budget.py)
        from ..runtime.verify_budget import verify_first_step

        compiled = verify_first_step(compiled, plan_of, device_of(example_inputs), graph_name)
    if not config_guard.install(fixed_knobs):
        compiled = config_guard.warn_when_changed(compiled, _graph_name(), fixed_knobs)
    return compiled


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                   inductor_patches: dict, mode: str | None):
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
    if ddp.bucket_index() is not None:
        bucket_graphs = ddp.bucket_graph_count()
        settings = ddp.budget_per_bucket(settings, bucket_graphs)
    results: list[PartitionResult] = []
    partitioner = OffloadRematPartitioner(settings, graph_name=_graph_name(bucket_graphs), on_result=results.append)
    device = device_of(example_inputs)
    settings_mod.check_budget_fits_device(settings, device)
    settings_mod.warn_if_profile_does_not_match(settings, device, partitioner.graph_name)
    if settings.offload:
        # The pool is one per process: the latest offloading compile's limit applies (config.py). Set
        # here, not while planning, so that a compile served from a cache sets it too.
        pinned_pool.set_limit(settings.pinned_pool_limit)
    if settings.inner_compiler == "eager":
        compiled = _compile_eager(gm, example_inputs, partitioner)
        records = _records(results)
    else:
        compiled, records = _compile_inductor(gm, example_inputs, settings, partitioner, results, inductor_patches)
    # With dynamic sizes the plan is made for this call's sizes: check the others' peaks.
    compiled = dynamic_check.check_sizes(compiled, example_inputs, [r.program for r in records if r.program is not None],
                                         settings.budget_bytes, partitioner.graph_name)

    def plan_of():  # the eager path partitions at the first call; Inductor's, or its records, now
        return results[-1].plan if results else (records[-1].plan if records else None)

    return compiled, plan_of, partitioner.graph_name


def _compile_inductor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                      partitioner: OffloadRematPartitioner, results: list[PartitionResult], inductor_patches: dict):
    """Inductor's ``compile_fx`` with our partitioner; the compiled graph and the plans it
    got, whether made now or read back for a compile served from Inductor's caches. With a
    budget, a plan whose scheduled peak exceeds it is made again under a lower one
    (``budget_loop.keep_within_budget``); ``results`` then ends with the plan kept."""
    # Graphs without grad never reach the partitioner: compile_fx sends them straight to
    # Inductor's inference path.
    patches = inductor_config_patches(settings, partitioner, inductor_patches, gm)
    recorder = scheduled_peak.recorder_for(settings)
    if recorder is None:
        return _compile_inductor_planned(gm, example_inputs, settings, partitioner, results, patches, None)
    # With a budget: Inductor's kernels are recorded (read-only) and the backward lowered
    # now, so the plan's scheduled peak is known when the compile returns (budget_loop.py).
    # A budget below the planner's minimum is reported then, against the plan kept (a cached
    # compile's record is reported as it is read: graph_reports.replay).
    partitioner.report_budget = False
    try:
        compiled, records = _compile_inductor_looped(gm, example_inputs, settings, partitioner, results, recorder,
                                                     patches, inductor_patches)
    finally:
        partitioner.report_budget = True
    for result in results:
        report_budget(result.plan, settings)
    return compiled, records


def _compile_inductor_looped(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                             partitioner: OffloadRematPartitioner, results: list[PartitionResult], recorder,
                             patches: dict, inductor_patches: dict):
    with scheduled_peak.recording(recorder, patches) as recording_patches:
        compiled, records = _compile_inductor_planned(gm, example_inputs, settings, partitioner, results,
                                                      recording_patches, recorder)
    if not results:  # served from the cache: its record says which plan was kept
        replanned = records[-1].plan.planned_budget_bytes if records else None
        if replanned is None:
            return compiled, records
        # The cache holds the first plan's code; the loop kept a plan made under a lower
        # budget: compile that one (the same plan: planning is deterministic), past the caches.
        log.debug("%s: compiling the plan the budget loop kept (planned under %d bytes)", partitioner.graph_name,
                  replanned)
        if records[-1].plan.unconstrained:
            replanned = None  # the unconstrained plan, compiled as without a budget
        attempt = _replan(gm, example_inputs, settings, partitioner.graph_name, inductor_patches, replanned)
        logs.remember(records[-1].plan)  # the user's view of it, not the re-plan's own
        return (compiled if attempt is None else attempt.compiled), records
    if len(records) != 1:
        return compiled, records

    def replan(budget_bytes: int | None) -> budget_loop.Attempt | None:
        return _replan(gm, example_inputs, settings, partitioner.graph_name, inductor_patches, budget_bytes)

    looped = budget_loop.acts_on(records[0].plan)
    first = budget_loop.Attempt(compiled, records[0].plan, results[0] if results else None)
    kept = budget_loop.keep_within_budget(first, replan)
    if looped and kept.result is not None:
        # Each re-plan's dump went over the graph's folder as it was made, before the loop
        # marked it: the folder shows the plan that runs, with its notes.
        logs.dump(kept.result, gm, settings)
    key = graph_reports.record_key(gm, example_inputs, settings)
    if kept.compiled is compiled:
        if looped:  # kept over its budget, or under it though predicted over: the record keeps the loop's note
            graph_reports.store(key, records)
            logs.remember(kept.plan)  # the first plan, not the last re-plan made
        return compiled, records
    kept_records = _records([kept.result])
    # verify_budget and the caller read results[-1]; a warm cache reads the record.
    results[:] = [kept.result]
    graph_reports.store(key, kept_records)
    logs.remember(kept.plan)
    return kept.compiled, kept_records


def _replan(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings, graph_name: str,
            inductor_patches: dict, budget_bytes: int | None) -> budget_loop.Attempt | None:
    """Compile the graph again with the plan made under ``budget_bytes`` (a byte budget in
    place of the user's), its kernels recorded; ``None``: the unconstrained plan compiled as
    ``torch.compile`` compiles it without a budget (Inductor's peak-memory reordering and
    buffer pool on, its kernels recorded in the order that reordering leaves them). Past
    Inductor's caches: a cached compile would skip the partitioner and the scheduler hook,
    and so give no plan and no scheduled peak (its partitioner's settings differ, so the
    first compile's code is never served)."""
    # A lowered budget may be below the planner's minimum: then its minimum-memory plan is what
    # the loop asked for, not a failure to warn about (nor, under strict_budget, to raise).
    lowered = dataclasses.replace(settings, budget_bytes=budget_bytes, budget_fraction=None, strict_budget=False)
    found: list[PartitionResult] = []
    partitioner = OffloadRematPartitioner(lowered, graph_name=graph_name, on_result=found.append)
    recorder = scheduled_peak.KernelRecorder()
    with scheduled_peak.recording(recorder, inductor_config_patches(lowered, partitioner, inductor_patches, gm)) as patches, \
            inductor_kernels.recording_reordered(recorder), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is below the minimum this planner can reach")
        compiled = _compile_past_caches(gm, example_inputs, patches, lowered)
    if not found:
        return None
    scheduled_peak.note_scheduled_peak(found[-1].plan, recorder)
    return budget_loop.Attempt(compiled, found[-1].plan, found[-1])


def _compile_inductor_planned(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                              partitioner: OffloadRematPartitioner, results: list[PartitionResult],
                              patches: dict[str, Any], recorder):
    from torch._inductor.compile_fx import compile_fx

    def planned_records():  # the plans made now, with the scheduled peak of their kernels
        if results and recorder is not None:
            scheduled_peak.note_scheduled_peak(results[-1].plan, recorder)
        return _records(results)

    if settings.dump_dir is not None or settings.verify_budget:
        # A dump asks to see the partition, verify_budget compares with the plan: a warm FX
        # graph or AOTAutograd cache would reuse compiled code without calling the partitioner.
        compiled = _compile_past_caches(gm, example_inputs, patches, settings)
        return compiled, planned_records()
    key = graph_reports.record_key(gm, example_inputs, settings)
    compiled = compile_fx(gm, example_inputs, inner_compile=_inner_compile(settings), config_patches=patches)
    if results and inductor_kernels.served_from_cache(recorder, patches):
        # Planned again (AOTAutograd's cache passed this graph by) but Inductor's FX graph cache
        # served the code of the first compile's first plan: what that compile kept, and what
        # runs, is the record's (a re-plan the budget loop kept is compiled again), not this plan.
        results.clear()
    if results:
        records = planned_records()
        graph_reports.store(key, records)
        return compiled, records
    if not graph_reports.trains(example_inputs):
        return compiled, []
    # Served from the cache: report the plans the record keeps, as when they were made.
    records = graph_reports.load(key)
    if records is not None:
        graph_reports.replay(records, settings, partitioner.graph_name)
        return compiled, records
    log.debug("%s: compiled code from the cache without a plan record: compiling again past the caches",
              partitioner.graph_name)
    compiled = _compile_past_caches(gm, example_inputs, patches, settings)
    records = planned_records()
    graph_reports.store(key, records)
    return compiled, records


def inductor_config_patches(settings: Settings, partitioner: OffloadRematPartitioner,
                            inductor_patches: dict | None = None,
                            graph: torch.fx.GraphModule | None = None) -> dict[str, Any]:
    """The Inductor config a graph compiles under (``explain`` plans under the same):
    ``torch.compile``'s mode and options, our partitioner, and, when there is a budget, no
    peak-memory reordering and no buffer held for a later kernel (``graph``, Dynamo's graph,
    says whether it has collectives; see ``_no_held_buffers``)."""
    patches: dict[str, Any] = {**(inductor_patches or {}), "custom_partitioner_fn": partitioner}
    if settings.has_budget:
        # Inductor's peak-memory reordering moves the plan's recomputations away from where
        # the plan put them (just before their first backward use) and so raises the peak
        # the plan budgeted: on a small Llama at a fitting budget 4.10 MiB measured against
        # 2.94 MiB budgeted, 3.39 MiB without it (docs/design.md, "Where the compiled peak
        # exceeds the plan"). It only orders kernels (none is changed or added).
        patches["reorder_for_peak_memory"] = False
        patches.update(_no_partition_reordering())
        patches.update(_no_held_buffers(graph))
    return patches


_SIMPLE_OVERLAP = "aten_distributed_optimizations.enable_simple_overlap"
_PARTITION_REORDER = "triton.reorder_for_reducing_graph_partitions"


def _no_partition_reordering() -> dict[str, Any]:
    """Under CUDA graphs (``mode="reduce-overhead"``, ``"max-autotune"``) Inductor's scheduler
    moves kernels so that fewer CUDA-graph partitions form
    (``triton.reorder_for_reducing_graph_partitions``), after the kernels are recorded for the
    scheduled peak: on the CPU, where nothing is captured, an MLP planned and scheduled at
    482.50 KiB measured 512.26 KiB, its backward's kernels moved ahead of where the plan put
    them. Off under a budget, so the kernels run in the order the budget was checked in; a
    graph with ops CUDA graphs cannot capture may then form more partitions."""
    from torch._inductor import config as inductor_config

    section, name = _PARTITION_REORDER.split(".")
    return {_PARTITION_REORDER: False} if hasattr(getattr(inductor_config, section, None), name) else {}


def _no_held_buffers(graph: torch.fx.GraphModule | None) -> dict[str, Any]:
    """Keep Inductor's wrapper from holding a freed buffer for a later kernel's allocation:
    its buffer pool off (``allow_buffer_reuse``), and on torch 2.14 its simple comm-overlap
    pass off, where Dynamo's graph has no collective.

    The wrapper hands a freed buffer to a later allocation of the same size, keeping it
    allocated until then, when its estimate of the graph's peak (``EfficientPeakEstimate``,
    ``AllocateLine.should_reuse_buffer``) says holding it costs nothing. That estimate counts
    only what the scheduler sized: without peak-memory reordering, on torch 2.11 to 2.13,
    just the graph's freeable inputs (none in a forward; in a backward the saved tensors, so
    once enough of them are freed every hold passes), and on torch 2.14, whose simple
    comm-overlap pass (``aten_distributed_optimizations.enable_simple_overlap``) sizes the
    buffers as a side effect, an estimate that is low. Either way a hold the plan never
    counted: Hugging Face GPT-2 of the contract suite at its minimum-memory plan measured
    4.58 MiB with the pool, 4.08 MiB without (3.89 MiB predicted), and a small MLP-mixer on
    torch 2.14 2.77 MiB against 2.70 MiB (docs/design.md, "Where the compiled peak exceeds
    the plan"). Without the pool each buffer is freed after its last use, as the plan
    assumes; in-place updates (``inplace_buffers``) stay, and so do the kernels: no step
    time was lost on that GPT-2 (CPU, 14.18 ms against 14.12 ms, best of 60 interleaved
    steps). With collectives both are kept: comm buffers share the pool switch, and the
    overlap pass is there for them."""
    from torch._inductor import config as inductor_config

    if graph is not None and any(_is_collective_call(node) for node in graph.graph.nodes):
        return {}
    patches: dict[str, Any] = {"allow_buffer_reuse": False}
    section = getattr(inductor_config, _SIMPLE_OVERLAP.split(".")[0], None)
    if hasattr(section, _SIMPLE_OVERLAP.split(".")[1]):
        patches[_SIMPLE_OVERLAP] = False
    return patches


def _is_collective_call(node: torch.fx.Node) -> bool:
    """A collective in Dynamo's graph: an op of a collective namespace, or a call of
    ``torch.distributed``'s functional collectives."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return is_collective(node)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.partition("::")[0] in COLLECTIVE_NAMESPACES
    return (getattr(target, "__module__", None) or "").startswith("torch.distributed")


def _inner_compile(settings: Settings):
    """Inductor's inner compiler, with its reordering passes off for graphs that carry our
    copies, so the copies run where the plan put them (copy_order.py), and the kernels it
    records naming each graph's outputs as the graph did before Inductor's passes, as the
    other graph of the compile knows them (inductor/kernels.py). With a budget, no
    horizontal fusion runs a kernel ahead of where the plan put it (plan_order_fusion.py). A
    backward lowered at compile time is lowered again when a ``backward()`` retains the graph
    (retain_graph.py)."""
    from torch._inductor.compile_fx import compile_fx_inner

    from ..inductor.copy_order import keeping_copy_order
    from ..inductor.kernels import naming_outputs_before_passes
    from ..inductor.plan_order_fusion import keeping_plan_order
    from ..inductor.retain_graph import lowering_lazily_on_retain

    inner = lowering_lazily_on_retain(keeping_copy_order(naming_outputs_before_passes(compile_fx_inner)))
    return keeping_plan_order(inner) if settings.has_budget else inner


def _compile_past_caches(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], patches: dict[str, Any],
                         settings: Settings):
    from torch._inductor.compile_fx import compile_fx

    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=_inner_compile(settings),
                          config_patches={**patches, "fx_graph_cache": False})


def _records(results: list[PartitionResult]) -> list[graph_reports.GraphRecord]:
    return [graph_reports.GraphRecord(r.plan, dynamic_check.program_of(r)) for r in results]


def _compile_eager(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], partitioner: OffloadRematPartitioner):
    import torch._inductor.lowering  # noqa: F401  some decompositions in the table need it loaded
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    from ..passes.compat import boxed_python

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
