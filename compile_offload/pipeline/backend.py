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


from . import budget_loop, ddp, dynamic_check, fingerprint, graph_reports, inductor_compile, plan_choice
from .. import config_guard
from ..inductor import scheduled_peak
from ..runtime import pinned_pool
from ..torch_api import fake_tensors, guards
from .. import settings as settings_mod
from .device_profile import device_of
from .partitioner import OffloadRematPartitioner
from .result import PartitionResult
from ..passes import compat
from ..passes.plan import format_bytes
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
                         fixed_knobs=ours, owner=offload_remat_backend)


def offload_remat(**options: Any) -> Callable[..., Any]:
    """Return a backend with ``options`` applied on top of ``compile_offload.config``.

    ``torch.compile(model, backend=compile_offload.offload_remat(memory_budget="4GiB"))``.
    Options are validated here, so a bad value fails at once rather than at first call.
    ``torch.compile``'s own ``mode`` and ``options`` reach the backend as they reach the
    string backend ``"offload_remat"``; options given there override the ones given here.
    """
    settings_mod.resolve(options)
    return OffloadRemat(options)


class OffloadRemat:
    """The backend ``offload_remat(**options)`` returns: ``options`` over the config, and
    torch.compile's own ``options`` over those. An object, not a closure, so that it pickles
    as a compiled module holding it does (``torch.save`` of the module, a spawned worker);
    the graphs one backend compiles share its step budget (``budget_scope="step"``)."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = dict(options)
        self.__name__ = BACKEND_NAME  # what Dynamo's logs and counters call a backend

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: dict | None = None,
                 mode: str | None = None) -> Callable[..., Any]:
        ours, inductor = split_options(options)
        knobs = {**self.options, **ours}
        return compile_graph(gm, example_inputs, settings_mod.resolve(knobs), inductor_options(mode, inductor), mode,
                             fixed_knobs=knobs, owner=self)

    def __repr__(self) -> str:
        return f"compile_offload.offload_remat({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


def split_options(options: dict | None) -> tuple[dict, dict]:
    """``torch.compile(options=...)`` split into our knobs and Inductor's config options;
    a name that is neither raises ``ValueError`` naming it."""
    if not options:
        return {}, {}
    from .. import config
    from ..torch_api.inductor import config as inductor_config

    known_inductor = inductor_config.get_config_copy()
    ours = {name: value for name, value in options.items() if name not in known_inductor or name in config.get_config_copy()}
    inductor = {name: value for name, value in options.items() if name not in ours}
    settings_mod.check_option_names(ours, other_names=known_inductor)
    for name, value in inductor.items():
        _check_inductor_option_type(name, value, known_inductor[name])
    return ours, inductor


def _check_inductor_option_type(name: str, value: Any, current: Any) -> None:
    """The check ``torch.compile(backend="inductor", options=...)`` makes: a value of the
    option's declared type (a generic type such as ``list[str]`` is not checked, as there).
    Unchecked, ``"false"`` for a bool option was true."""
    import typing

    from ..torch_api.inductor import config as inductor_config

    get_type = getattr(inductor_config, "get_type", None)
    if get_type is None and current is None:  # no declared type, and a default that says none
        return
    declared = get_type(name) if get_type is not None else type(current)
    if typing.get_origin(declared) is not None or not isinstance(declared, type):
        return
    if not isinstance(value, declared):
        raise ValueError(f"compile_offload: options={{{name!r}: {value!r}}}: Inductor's {name} takes a "
                         f"{declared.__name__}, not a {type(value).__name__} (it is {current!r} now)")


def inductor_options(mode: str | None, options: dict) -> dict:
    """Inductor config patches for ``torch.compile(mode=...)`` and Inductor ``options``."""
    if mode in (None, "default"):
        return dict(options)
    from ..torch_api import inductor

    modes = inductor.list_mode_options()
    if mode not in modes:
        raise ValueError(f"compile_offload: torch.compile(mode={mode!r}) is not an Inductor mode; accepted: "
                         f"{', '.join(sorted(modes))} (or leave mode unset)")
    return {**modes[mode], **options}


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


def _may_capture_or_offload(settings: Settings, example_inputs: Sequence[Any]) -> bool:
    """Whether CUDA graphs concern this graph: it runs on CUDA, or it is planned as for a GPU
    (a GPU profile, or forced offload) on a host that stands in for one. A CPU graph under the
    CPU's own profile is never captured and never offloads: nothing to turn off or say."""
    if device_of(example_inputs).type == "cuda" or settings.debug_force_offload:
        return True
    return settings.device_profile not in (None, "cpu")


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                  inductor_patches: dict | None = None, mode: str | None = None,
                  fixed_knobs: Iterable[str] = (), owner: Any = None) -> Callable[..., Any]:
    """Compile one Dynamo graph under ``settings``; ``inductor_patches``: Inductor config
    from ``torch.compile``'s ``mode`` and ``options`` (``inductor_options``); ``fixed_knobs``:
    those the backend's options set, which no change of ``compile_offload.config`` can reach;
    ``owner``: the backend compiling it, whose graphs share one step budget
    (``budget_scope="step"``, ``runtime/step_budget.py``).

    The frame is guarded on the config as read now (``config_guard``): a call under other
    values compiles again and plans for them, never runs a plan made for another budget.
    """
    patches = dict(inductor_patches or {})
    if settings.inner_compiler == "inductor":  # the options change Inductor's code, so the plans' measured peaks
        settings = dataclasses.replace(settings, torch_config=fingerprint.with_options(settings.torch_config, patches))
    plan_choice.note_compile()
    # A graph made dynamic by a later, smaller call is planned for the earlier, larger size.
    settings = dynamic_check.plan_at_largest_sizes(gm, settings, _graph_name())
    settings = _measured_choice_applies(settings)
    if settings.offload:
        # The pool is one per process: the latest offloading compile's limit applies (config.py). Set
        # here, not while planning, so that a compile served from a cache sets it too.
        pinned_pool.set_limit(settings.pinned_pool_limit, "compile_offload.config.pinned_pool_limit" if
                              "pinned_pool_limit" not in fixed_knobs else
                              f"the options of a compile (pinned_pool_limit={settings.pinned_pool_limit})")
    try:
        if _step_scoped(settings):
            compiled, plan_of, graph_name = _compile_for_the_step(gm, example_inputs, settings, patches, mode, owner)
        else:
            compiled, plan_of, graph_name = _compile_graph(gm, example_inputs, settings, patches, mode)
    except Exception:  # a graph that asked for this compile, for larger sizes, serves again (strict_budget's
        dynamic_check.replan_failed()  # BudgetError; or a compile that failed): the next call does not fail too
        raise
    dynamic_check.note_compile()
    compiled = plan_choice.in_step_with_trials(compiled)
    if settings.verify_budget:  # measure the first step against the budget (verify_budget.py)
        from ..runtime.verify_budget import verify_first_step

        compiled = verify_first_step(compiled, plan_of, device_of(example_inputs), graph_name,
                                     _sized_inputs(gm), budget_per_call=settings.budget_scope == "graph")
    if not config_guard.install(fixed_knobs):
        compiled = config_guard.warn_when_changed(compiled, _graph_name(), fixed_knobs)
    if settings.offload:  # a forward served by AOTAutograd's cache was not wrapped where Inductor compiled it
        from ..runtime.ops import forgetting_copies_on_error

        compiled = forgetting_copies_on_error(compiled, boxed=False)
    return compiled


def _sized_inputs(gm: torch.fx.GraphModule) -> Callable[[tuple], int] | None:
    """For a graph with dynamic sizes: a call's size, the elements of the tensor inputs whose
    shape is symbolic in the graph (Dynamo hands the backend real tensors: the graph's
    placeholders say which), or where none is, the size arguments, summed; None for a
    static graph."""
    values = [node.meta.get("example_value", node.meta.get("val")) for node in gm.graph.nodes
              if node.op == "placeholder"]
    tensors = [i for i, value in enumerate(values)
               if isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in value.shape)]
    if tensors:
        return lambda args: sum(args[i].numel() for i in tensors)
    sizes = [i for i, value in enumerate(values) if isinstance(value, torch.SymInt)]
    return (lambda args: sum(int(args[i]) for i in sizes)) if sizes else None


def _step_scoped(settings: Settings) -> bool:
    """Whether the graph's byte budget is the step's (``budget_scope="step"``), not for a
    fraction (each graph's own). A DDPOptimizer bucket graph is one of the step's graphs like
    any other: split by what it needs, where ``"graph"`` splits a byte budget evenly (``ddp.py``)."""
    return settings.budget_scope == "step" and bool(settings.budget_bytes)  # 0: every graph at its minimum


def _measured_choice_off(settings: Settings, why: str, stacklevel: int = 4) -> Settings:
    """``settings`` without measured plan choice, with one warning per reason and process
    where the user turned it on (``plan_choice.warn_off``)."""
    if not settings.measured_plan_choice:
        return settings
    plan_choice.warn_off(why, stacklevel + 1)
    return dataclasses.replace(settings, measured_plan_choice=False)


def _measured_choice_applies(settings: Settings) -> Settings:
    """Measured plan choice times Inductor's code of several plans under a budget: without
    a budget there is one plan (it recomputes and copies nothing, so no rival is faster),
    and with ``inner_compiler="eager"`` no Inductor code to time."""
    if not settings.has_budget:
        return _measured_choice_off(settings, "without a memory budget (the one plan recomputes and copies "
                                    "nothing: no candidate could be faster)", stacklevel=5)
    if settings.inner_compiler == "eager":
        return _measured_choice_off(settings, "with inner_compiler='eager' (it times the candidates' Inductor "
                                    "code)", stacklevel=5)
    return settings


def _compile_for_the_step(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                          inductor_patches: dict, mode: str | None, owner: Any):
    """The graph at its minimum-memory plan, wrapped in its backend's ``StepBudget``, which
    compiles it again under its share of the step's budget once a step has been counted."""
    from ..runtime.step_budget import step_budget_for

    settings = _measured_choice_off(settings, "under budget_scope='step' (the graphs are compiled again once "
                                    "the step's budget is split between them)", stacklevel=5)
    settings_mod.check_budget_fits_device(settings, device_of(example_inputs))  # the step's, not a share
    minimum = dataclasses.replace(settings, budget_bytes=None, budget_fraction=0.0)
    log.info("budget_scope='step': this graph runs its minimum-memory plan (memory_budget 0.0) until a step has "
             "run; the step's budget %s is then split between its graphs", format_bytes(settings.budget_bytes))
    share_of: list[Callable[[], int | None]] = []  # the graph's share, once the step budget holds it
    compiled, plan_of, graph_name = _compile_graph(gm, example_inputs, minimum, inductor_patches, mode,
                                                   check_against=lambda: share_of[0]() if share_of else None)

    def recompile(budget_bytes: int, args: tuple):
        # Compiled for the arguments of the call it runs at, not Dynamo's example inputs: those are
        # the first call's real tensors (its batch, the activations a graph after a break gets),
        # which holding here would keep alive as long as the graph, outside every plan.
        share = dataclasses.replace(settings, budget_bytes=budget_bytes)
        try:
            again, again_plan_of, _ = _compile_graph(gm, list(args), share, dict(inductor_patches), mode, graph_name)
        except (fake_tensors.DataDependentOutputException, fake_tensors.DynamicOutputShapeException):
            # A value the graph reads from a tensor (.item()), or a size that depends on one
            # (nonzero), needs the shape environment Dynamo traced it in: traced again in a
            # fresh one, on fakes of this call's arguments.
            with fake_tensors.traced_afresh(gm, list(args)) as fakes:
                again, again_plan_of, _ = _compile_graph(gm, fakes, share, dict(inductor_patches), mode, graph_name)
        # Compiled outside Dynamo, a graph with dynamic sizes is specialized to that call's sizes:
        # other sizes run the minimum-memory plan, which serves every size.
        return dynamic_check.for_the_sizes_of(gm, args, again, otherwise=compiled), again_plan_of

    budget = step_budget_for(owner if owner is not None else compile_graph, settings.budget_bytes,
                             device_of(example_inputs), strict=settings.strict_budget)
    wrapped = budget.add(graph_name, compiled, plan_of, recompile, guards.compile_id())
    graph = wrapped.graph
    share_of.append(lambda: graph.budget_bytes)
    return wrapped, wrapped.graph_plan_of, graph_name


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                   inductor_patches: dict, mode: str | None, graph_name: str | None = None,
                   check_against: Callable[[], int | None] | None = None):
    """``check_against``: where ``settings`` has no byte budget, what dynamic sizes are checked
    against, read at each call (``dynamic_check.check_sizes``)."""
    if settings.inner_compiler == "eager" and inductor_patches:
        raise ValueError(
            f"compile_offload: Inductor options {sorted(inductor_patches)} (from torch.compile's mode or options) "
            "need inner_compiler='inductor'; with inner_compiler='eager' no Inductor code runs"
        )
    if (settings.inner_compiler == "inductor" and inductor_compile.captures_cuda_graphs(inductor_patches)
            and _may_capture_or_offload(settings, example_inputs)):
        if "triton.cudagraphs" not in inductor_patches:
            said = "torch._inductor.config.triton.cudagraphs=True"
        elif mode not in (None, "default"):  # torch.compile takes a mode or options, not both
            said = f"torch.compile(mode={mode!r})"
        else:
            said = "options={'triton.cudagraphs': True}"
        settings = _without_offload_under_cuda_graphs(settings, said)
        settings = _measured_choice_off(settings, f"under CUDA graphs ({said}): the captured graphs replay, so a "
                                                  "step of another plan would not compare")
    device = device_of(example_inputs)
    settings_mod.check_budget_fits_device(settings, device)  # the whole budget, before DDP's buckets share it
    bucket_graphs = None
    if ddp.bucket_index() is not None:
        bucket_graphs = ddp.bucket_graph_count()
        if settings.budget_scope != "step":  # under "step" the StepBudget splits it (by need, not evenly)
            settings = ddp.budget_per_bucket(settings, bucket_graphs)
    results: list[PartitionResult] = []
    # With Inductor and a budget the budget loop reports each plan once its code is known.
    recorder = scheduled_peak.recorder_for(settings) if settings.inner_compiler == "inductor" else None
    partitioner = OffloadRematPartitioner(settings, graph_name=graph_name or _graph_name(bucket_graphs),
                                          on_result=results.append, report=recorder is None,
                                          sizes=dynamic_check.sizes_planned_at(gm, settings))
    if graph_reports.trains(example_inputs):  # a graph without a backward gets no plan to misjudge
        settings_mod.warn_if_profile_does_not_match(settings, device, partitioner.graph_name)
    with compat.planning_sizes(dict(settings.planning_sizes)):  # Inductor's scheduled peak, the sizes checked
        if settings.inner_compiler == "eager":
            compiled = _compile_eager(gm, example_inputs, partitioner)
            records = graph_reports.records_of(results)
        else:
            compiled, records = _compile_inductor(gm, example_inputs, settings, partitioner, results,
                                                  inductor_patches, recorder)
        # With dynamic sizes the plan is made for one set of sizes: check the others' peaks.
        programs = [r.program for r in records if r.program is not None]
        covering = dynamic_check.sizes_covering_all(settings, programs, partitioner.graph_name)
        if covering is not None:  # over the budget at sizes another call had: plan for the next, or the largest
            return _compile_graph(gm, example_inputs, covering, inductor_patches, mode, partitioner.graph_name)
        compiled = dynamic_check.check_sizes(
            compiled, example_inputs, programs,
            settings.budget_bytes if settings.budget_bytes is not None else check_against,
            partitioner.graph_name, gm if settings.budget_bytes is not None else None, settings.strict_budget)

    def plan_of():  # the eager path partitions at the first call; Inductor's, or its records, now
        return results[-1].plan if results else (records[-1].plan if records else None)

    return compiled, plan_of, partitioner.graph_name


def _compile_inductor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], settings: Settings,
                      partitioner: OffloadRematPartitioner, results: list[PartitionResult], inductor_patches: dict,
                      recorder):
    """Inductor's ``compile_fx`` with our partitioner; the compiled graph and the plans it
    got, whether made now or read back for a compile served from Inductor's caches. With a
    budget (``recorder``: Inductor's kernels are recorded, so a plan's scheduled peak is known
    when the compile returns) the budget loop owns the compile (``budget_loop.BudgetLoop``);
    ``results`` then ends with the plan kept. Graphs without grad never reach the
    partitioner: compile_fx sends them straight to Inductor's inference path."""
    return budget_loop.BudgetLoop(gm, example_inputs, settings, partitioner, results, recorder,
                                  inductor_patches).compile()


def _compile_eager(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], partitioner: OffloadRematPartitioner,
                   compile_graph: Callable[[torch.fx.GraphModule, Sequence[Any]], Callable] | None = None):
    """AOTAutograd with ``partitioner`` and Inductor's decompositions, each graph run as
    Python (``compile_graph``: ``explain`` runs them on shapes only)."""
    from ..passes.compat import boxed_python
    from ..torch_api import dynamo, inductor

    def run_as_python(graph: torch.fx.GraphModule, _inputs: Sequence[Any]):
        from ..inductor.copy_order import has_copy_ops
        from ..runtime.ops import forgetting_copies_on_error

        run = boxed_python(graph)
        return forgetting_copies_on_error(run) if has_copy_ops(graph) else run

    compile_graph = compile_graph or run_as_python
    # Dynamo's aot_autograd wrapper, not aot_module_simplified itself: DDPOptimizer (one
    # graph per DDP bucket) counts AOTAutograd compiles through the wrapper's counter to
    # pair each bucket's forward with its backward, and fails the first backward without it.
    backend = dynamo.aot_autograd(
        fw_compiler=compile_graph,
        bw_compiler=compile_graph,
        inference_compiler=compile_graph,
        partition_fn=functools.partial(partitioner, compiler="inductor"),
        decompositions=inductor.decomposition_table(),  # with the lowering some decompositions need loaded
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)


def _graph_name(bucket_graphs: int | None = None) -> str:
    """Dynamo's id of the graph being compiled (``"0_0"`` style), for dumps and logs; under
    DDPOptimizer with ``bucket_graphs`` known, ``graph_0_0_bucket1of3`` (bucket 1 of 3)."""
    try:
        from ..torch_api.guards import CompileContext

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
