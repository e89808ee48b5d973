"""Compiling one graph with Inductor and our partitioner: the Inductor config a budgeted graph
compiles under (``inductor_config_patches``), Inductor's inner compiler with our hooks
(``inner_compile``), and one compile of a graph with the plans it got, made now or read back
for a compile served from Inductor's caches (``compile_planned``), and one compile past
those caches (``compile_past_caches``). The budget loop (``budget_loop.BudgetLoop``) is the
one caller in the backend.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ..inductor import kernels as inductor_kernels
from ..inductor import scheduled_peak
from ..passes.analyze import COLLECTIVE_NAMESPACES, is_collective
from ..settings import Settings
from ..torch_api import functorch, inductor
from ..torch_api.utils import OpOverload, OpOverloadPacket
from . import graph_reports
from .partitioner import OffloadRematPartitioner
from .result import PartitionResult

log = logging.getLogger("compile_offload")


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
        if settings.measured_plan_choice:
            # Measured plan choice profiles a step to price nodes (runtime/kernel_costs.py): the
            # C++ backend's kernels show in the profiler only with this on (Triton's always do).
            patches["cpp.enable_kernel_profile"] = True
    return patches


def captures_cuda_graphs(patches: dict) -> bool:
    """Whether Inductor will capture CUDA graphs: ``triton.cudagraphs`` from the mode or
    options, else its global config."""
    from ..torch_api.inductor import config as inductor_config

    return bool(patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs))


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
    from ..torch_api.inductor import config as inductor_config

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
    from ..torch_api.inductor import config as inductor_config

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
    if isinstance(target, OpOverload):
        return is_collective(node)
    if isinstance(target, OpOverloadPacket):
        return target._qualified_op_name.partition("::")[0] in COLLECTIVE_NAMESPACES
    return (getattr(target, "__module__", None) or "").startswith("torch.distributed")


def inner_compile(settings: Settings):
    """Inductor's inner compiler, with its reordering passes off for graphs that carry our
    copies, so the copies run where the plan put them (copy_order.py), and the kernels it
    records naming each graph's outputs as the graph did before Inductor's passes, as the
    other graph of the compile knows them (inductor/kernels.py). With a budget, no
    horizontal fusion runs a kernel ahead of where the plan put it (plan_order_fusion.py). A
    backward lowered at compile time is lowered again when a ``backward()`` retains the graph
    (retain_graph.py). On torch before 2.14, a read of a buffer mutated in place stays after
    the mutation in the C++ backend's fused kernels (mutation_order.py). A call of a graph
    with copies that raises forgets the copies it started (failed_copies.py). A saved tensor
    the forward writes back into a mutated input is not donated to the backward
    (written_back_saves.py)."""
    from ..inductor.copy_order import keeping_copy_order
    from ..inductor.failed_copies import forgetting_failed_copies
    from ..inductor.kernels import naming_outputs_before_passes
    from ..inductor.mutation_order import keeping_mutation_order
    from ..inductor.plan_order_fusion import keeping_plan_order
    from ..inductor.retain_graph import lowering_lazily_on_retain
    from ..inductor.written_back_saves import not_donating_written_back_saves

    inner = not_donating_written_back_saves(lowering_lazily_on_retain(forgetting_failed_copies(keeping_copy_order(
        keeping_mutation_order(naming_outputs_before_passes(inductor.compile_fx_inner))))))
    return keeping_plan_order(inner) if settings.has_budget else inner


def compile_past_caches(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                        partitioner: OffloadRematPartitioner, inductor_patches: dict | None,
                        recorder: scheduled_peak.KernelRecorder | None = None):
    """One compile of ``gm`` past Inductor's and AOTAutograd's caches, under the config
    ``settings`` needs (``inductor_config_patches``), its kernels recorded when ``recorder``."""
    patches = inductor_config_patches(settings, partitioner, inductor_patches, gm)
    with scheduled_peak.recording(recorder, patches) as patches:
        return _compile_fx_past_caches(gm, example_inputs, patches, settings)


def _compile_fx_past_caches(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], patches: dict[str, Any],
                            settings: Settings):
    with functorch.config.patch(enable_autograd_cache=False):
        return inductor.compile_fx(gm, example_inputs, inner_compile=inner_compile(settings),
                                   config_patches={**patches, "fx_graph_cache": False})


def compile_planned(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                    partitioner: OffloadRematPartitioner, results: list[PartitionResult],
                    inductor_patches: dict | None, recorder):
    """One compile of ``gm`` with ``partitioner`` (its plans appended to ``results``) and the
    records of the plans it got: made now, with the scheduled peak of their kernels where
    ``recorder`` saw them, or, for code served from Inductor's caches, the stored record."""
    patches = inductor_config_patches(settings, partitioner, inductor_patches, gm)
    with scheduled_peak.recording(recorder, patches) as patches:
        return _compile_planned(gm, example_inputs, settings, partitioner, results, patches, recorder,
                                inductor_patches)


def _compile_planned(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                     partitioner: OffloadRematPartitioner, results: list[PartitionResult],
                     patches: dict[str, Any], recorder, inductor_patches: dict | None):
    def planned_records():  # the plans made now, with the scheduled peak of their kernels
        if results and recorder is not None:
            scheduled_peak.note_scheduled_peak(results[-1].plan, recorder)
        return graph_reports.records_of(results)

    if settings.dump_dir is not None or settings.verify_budget or settings.measured_plan_choice:
        # A dump asks to see the partition, verify_budget compares with the plan, measured
        # plan choice needs the plan to find its rivals (and stores its choice in the plan
        # cache, not in Inductor's): a warm FX graph or AOTAutograd cache would reuse compiled
        # code without calling the partitioner.
        compiled = _compile_fx_past_caches(gm, example_inputs, patches, settings)
        return compiled, planned_records()
    key = graph_reports.record_key(gm, example_inputs, settings, inductor_patches)
    compiled = inductor.compile_fx(gm, example_inputs, inner_compile=inner_compile(settings), config_patches=patches)
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
    compiled = _compile_fx_past_caches(gm, example_inputs, patches, settings)
    records = planned_records()
    graph_reports.store(key, records)
    return compiled, records
