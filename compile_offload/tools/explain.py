"""``compile_offload.explain``: the plan the backend would make, without running the model.

Dynamo traces the model and each graph goes through the backend's own pipeline (Inductor's
``compile_fx``: pre-grad passes, AOTAutograd with Inductor's decompositions, the joint-graph
passes, our partitioner), so the plan is the one a compile makes. With a budget, the
backend also checks the plan against the kernels Inductor generates and re-plans a graph
whose generated code it predicts over the budget (``budget_loop``): where the model's
tensors are real, on a device this process can run, and the plan is for that device (a GPU
profile on CPU tensors is not: the CPU's generated code says nothing of the GPU's), explain
takes the backend's own Inductor path (code generated, the loop run, the forward run once on the example inputs)
and so keeps the plan the backend keeps; elsewhere (``meta``, a GPU that is not here, a GPU
profile on CPU tensors) it
skips code generation and each plan with a budget says in ``notes`` that the scheduled
peak was not checked. Without a budget only Inductor's code generation is skipped and no
kernel runs: the compiled forward graphs are executed on
fake tensors only to get output shapes (so code after a graph break can be traced too). A model or inputs on ``meta`` are traced as empty CPU tensors that are never
written: ``meta`` itself would make attention take the unfused math path (a
seq x seq score matrix), unlike the fused kernels a real run uses. A named GPU profile
plans for that GPU on a CPU-only machine: its rates, and its kernels (the memory model
groups nodes into kernels as Triton does, not as the C++ backend that would compile the
host tensors here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import re
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..passes.cost import BUILTIN_PROFILE_MEMORY_BYTES
from ..passes.plan import Plan, format_bytes

from .. import settings as settings_mod
from ..pipeline.device_profile import device_of
from ..pipeline.partitioner import OffloadRematPartitioner
from ..reporting import dump
from ..torch_api import dynamo, functorch, inductor
from ..torch_api.utils import tree_leaves, tree_map

_UNSET: Any = object()


def _meta_to_cpu(value: Any) -> Any:
    """An uninitialised CPU tensor for a meta one (untouched pages cost no memory), and a
    normal copy of an inference tensor (one made under ``inference_mode``: an eval loop's
    batch), which autograd cannot save for a backward. Either keeps Dynamo's marks
    (``mark_dynamic``, its ``hint_override``)."""
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        empty = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
        return dynamo.copy_marks(value, empty.requires_grad_(value.requires_grad))
    if isinstance(value, torch.Tensor) and value.is_inference():  # made under inference_mode: not for autograd
        with torch.inference_mode(False):
            return dynamo.copy_marks(value, value.clone().requires_grad_(value.requires_grad))
    return value


class _NamedModules(torch.nn.Module):
    """A function and the modules it names, held as children: swapping their parameters
    (``torch.func.functional_call`` on this module) swaps them for the function too."""

    def __init__(self, fn: Callable[..., Any], modules: list[torch.nn.Module]) -> None:
        super().__init__()
        self.fn, self.named = fn, torch.nn.ModuleList(modules)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


_CONTAINERS = (dict, list, tuple, set, frozenset)
_MOST_ITEMS = 10_000  # read of each container


def _modules_named_by(fn: Any) -> _NamedModules | None:
    """The modules a function reaches by name, held with it: those in its closure and in the
    globals its code names, a bound method's object, a ``functools.partial``'s function and
    arguments, a callable object's attributes, and the modules in lists, tuples, sets and
    dicts among those (two levels deep); None where it names none. Their meta parameters then
    get CPU stand-ins, as a module's do. (Modules reached otherwise, as an object's attribute
    inside a list say, are not found: pass the module itself.)"""
    found: list[torch.nn.Module] = []
    seen: set[int] = set()

    def add(value: Any, depth: int = 2) -> None:
        if isinstance(value, torch.nn.Module):
            if id(value) not in seen:
                seen.add(id(value))
                found.append(value)
            return
        kind = next((kind for kind in _CONTAINERS if isinstance(value, kind)), None) if depth else None
        if kind is not None:
            # through the built-in type's own methods: a subclass's may have effects (a lazy
            # mapping importing what it maps) or never end
            items = dict.values(value) if kind is dict else kind.__iter__(value)
            for item in itertools.islice(items, _MOST_ITEMS):
                add(item, depth - 1)

    def names_in(function: Any) -> None:
        for cell in getattr(function, "__closure__", None) or ():
            try:
                add(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                pass
        code, names = getattr(function, "__code__", None), getattr(function, "__globals__", {})
        for name in code.co_names if code is not None else ():
            add(names.get(name))

    call = fn
    while isinstance(call, functools.partial):
        for value in (*call.args, *call.keywords.values()):
            add(value)
        call = call.func
    add(call)
    if isinstance(call, types.MethodType):
        add(call.__self__)
        names_in(call.__func__)
    elif isinstance(call, types.FunctionType):
        names_in(call)
    elif not isinstance(call, torch.nn.Module):  # an object with __call__ (vars, type: no __getattr__ runs)
        try:
            attributes = list(vars(call).values())
        except TypeError:  # no __dict__
            attributes = []
        for value in attributes:
            add(value)
        names_in(type(call).__dict__.get("__call__"))
    return _NamedModules(fn, found) if found else None


def _shape_only(graph: torch.fx.GraphModule, _inputs: Any):
    """A "compiled" graph that runs on fake copies of its inputs and returns empty
    tensors: the shapes of a real run, no computation.

    Fake tensors, not ``meta`` ones: a graph may create tensors on its own device (the
    ``rand`` of a dropout mask is ``aten.rand(..., device=cpu)``), which would then meet
    meta tensors and fail; fake tensors keep every device as it is."""
    from ..torch_api.fake_tensors import FakeTensorMode

    def run(args: list):
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            args.clear()
            outputs = graph(*fakes)
        return [
            torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device) if isinstance(o, torch.Tensor) else o
            for o in outputs
        ]

    run._boxed_call = True
    return run


def _not_real(values) -> str | None:
    """Why the model's tensors cannot run generated code (None: they can): ``meta`` or fake."""
    from ..torch_api.fake_tensors import FakeTensor

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if any(t.device.type == "meta" for t in tensors):
        return "the model is on the meta device"
    if any(isinstance(t, FakeTensor) for t in tensors):
        return "the model's tensors are fake"
    return None


@contextlib.contextmanager
def state_kept(module: torch.nn.Module | None):
    """Run a block that runs ``module`` without changing what training would see: its
    buffers (BatchNorm's running statistics) and the random generators (the CPU's, and the
    current CUDA device's where CUDA is in use) are as before afterwards."""
    buffers = {} if module is None else {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, buffer in ([] if module is None else module.named_buffers()):
                    if name in buffers:
                        buffer.copy_(buffers[name])


def _gpu_profile_on_host(settings, device: torch.device) -> bool:
    """A named GPU profile for tensors that are not on a GPU: the plan is for that GPU, and
    the code Inductor would generate here is not."""
    return settings.device_profile in BUILTIN_PROFILE_MEMORY_BYTES and device.type != "cuda"


def _lowers_like_backend(settings, device: torch.device, not_real: str | None) -> str | None:
    """None where explain lowers each graph with Inductor as the backend does, so that the
    backend's budget loop (``budget_loop.keep_within_budget``) runs here too and the plan is
    the one the backend keeps: a budget, ``inner_compiler="inductor"``, real tensors on a
    device this process can run, a torch with the scheduler hook. Elsewhere the note its
    plans carry (empty where the loop never runs: no budget, or the eager inner compiler)."""
    from ..inductor import kernels as inductor_kernels

    if not settings.has_budget:
        return ""
    if settings.inner_compiler != "inductor":
        return ""
    if not_real is not None:
        why = not_real
    elif _gpu_profile_on_host(settings, device):
        # Planning for a GPU on this machine's tensors: the code Inductor would generate here
        # is not the GPU's, so its scheduled peak says nothing about the plan asked for.
        why = f"the plan is for the {settings.device_profile!r} GPU profile and the tensors are on {device.type}"
    elif device.type == "cuda" and not torch.cuda.is_available():
        why = "no CUDA device here"
    elif device.type not in ("cpu", "cuda"):
        why = f"explain does not lower for {device.type} devices"
    elif not inductor_kernels.available():
        why = "this torch has no post-fusion scheduler hook"
    else:
        return None
    return (f"scheduled peak not checked: explain did not lower this graph with Inductor ({why}); the backend "
            "re-plans a graph whose generated code it predicts over the budget, so its plan may differ")


def compile_with_the_budget_loop(gm: torch.fx.GraphModule, inputs, settings, graph_name: str, plans: list):
    """The backend's Inductor path itself (``backend._compile_inductor``: code generated,
    kernels recorded, the budget loop), past Inductor's caches so that every graph is
    planned here; the plan it keeps is appended to ``plans``."""
    from ..inductor import scheduled_peak
    from ..pipeline.backend import _compile_inductor

    results: list = []
    recorder = scheduled_peak.recorder_for(settings)
    partitioner = OffloadRematPartitioner(settings, graph_name=graph_name, on_result=results.append,
                                          report=recorder is None)
    with inductor.config.patch(fx_graph_cache=False), \
            functorch.config.patch(enable_autograd_cache=False):
        compiled, _records = _compile_inductor(gm, inputs, settings, partitioner, results, {}, recorder)
    plans.extend(result.plan for result in results)
    return compiled


def compile_like_backend(gm: torch.fx.GraphModule, inputs, partitioner: OffloadRematPartitioner, settings):
    """The backend's own pipeline (``backend.compile_graph``'s Inductor path): Inductor's
    ``compile_fx`` with ``partitioner`` as its ``custom_partitioner_fn``, so the joint graph
    goes through Inductor's pre-grad and joint-graph passes and its decompositions exactly as
    in a compile, and the plan is the backend's. Only code generation is replaced: Inductor's
    ``inner_compile`` step (where it would lower and generate kernels) gets ``_shape_only``.
    AOTAutograd's cache is off: a hit would skip the partitioner and so the plan."""
    from ..pipeline.inductor_compile import inductor_config_patches

    def shape_only_inner(graph: torch.fx.GraphModule, graph_inputs, **_kwargs):
        return _shape_only(graph, graph_inputs)

    with functorch.config.patch(enable_autograd_cache=False):
        return inductor.compile_fx(gm, inputs, inner_compile=shape_only_inner,
                          config_patches=inductor_config_patches(settings, partitioner, graph=gm))


def _with_own_code(fn):
    """A copy of ``fn`` with a code object of its own. Dynamo keeps compiled code per code
    object: planning through a shared one would add an entry per call to the same cache
    (after ``recompile_limit`` calls Dynamo gives up and runs the model eagerly) and could
    touch the cache of the user's own compiled model."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def explain_all(
    model_or_fn: torch.nn.Module | Callable[..., Any],
    *example_inputs: Any,
    memory_budget: Any = _UNSET,
    device_profile: Any = _UNSET,
    **options: Any,
) -> list[Plan]:
    """One Plan per compiled graph (several when the model has graph breaks)."""
    if not callable(model_or_fn):
        raise TypeError(f"compile_offload.tools.explain: model_or_fn is a {type(model_or_fn).__name__}, which cannot "
                        "be called; pass the model (an nn.Module) or a function, then its example inputs")
    if memory_budget is not _UNSET:
        options["memory_budget"] = memory_budget
    if device_profile is not _UNSET:
        options["device_profile"] = device_profile
    knobs = settings_mod.config.get_config_copy()
    inputs_by_name = [name for name, value in options.items() if name not in knobs
                      and isinstance(value, (torch.Tensor, list, tuple, dict))]
    if inputs_by_name:  # read as an unknown option, with the list of knobs, before
        raise TypeError(f"compile_offload.explain: {', '.join(inputs_by_name)}=...: the example inputs are "
                        "positional (explain(model, x, y)); keyword inputs: explain(lambda x: model(x=x), x)")
    settings = settings_mod.resolve(options)
    parameters = list(model_or_fn.parameters()) if isinstance(model_or_fn, torch.nn.Module) else []
    device = device_of([*tree_leaves(list(example_inputs)), *parameters])
    settings_mod.check_budget_fits_device(settings, device)
    if settings.device_profile is None:
        if device.type != "cuda":
            # meta/CPU models are planned for this machine's kind of device.
            settings = settings_mod.resolve({**options, "device_profile": "cpu"})
    plans: list[Plan] = []

    lowers = _lowers_like_backend(settings, device, _not_real([*tree_leaves(list(example_inputs)), *parameters,
                                                                *(model_or_fn.buffers() if isinstance(
                                                                    model_or_fn, torch.nn.Module) else [])]))

    # A GPU profile with host tensors standing in for the GPU's: the GPU's code is Triton's,
    # whose kernels group nodes otherwise than the C++ backend's (analyze_joint), so the
    # memory model groups them as Triton would. With the budget loop the graph's own device
    # decides (it is lowered for real).
    for_gpu_here = _gpu_profile_on_host(settings, device)
    step_scoped = settings.budget_scope == "step" and bool(settings.budget_bytes)  # 0: every graph at its minimum
    # budget_scope="step": the graphs' minimum-memory plans first (as the backend's first
    # step runs them), then each graph under its share of the step's budget
    shares: list[int] | None = None

    def planning_backend(gm: torch.fx.GraphModule, inputs):
        if shares is not None:
            own = dataclasses.replace(settings, budget_bytes=shares[len(plans)])
        elif step_scoped:
            own = dataclasses.replace(settings, budget_bytes=None, budget_fraction=0.0)
        else:
            own = settings
        if lowers is None:
            return compile_with_the_budget_loop(gm, inputs, own, f"graph_{len(plans)}", plans)
        made: list = []
        partitioner = OffloadRematPartitioner(own, graph_name=f"graph_{len(plans)}", on_result=made.append,
                                              accelerator=True if for_gpu_here else None)
        if own.inner_compiler == "eager":  # the backend's eager path: no Inductor passes on the graph
            from ..pipeline.backend import _compile_eager

            with functorch.config.patch(enable_autograd_cache=False):
                compiled = _compile_eager(gm, inputs, partitioner, compile_graph=_shape_only)
        else:
            compiled = compile_like_backend(gm, inputs, partitioner, own)
        for result in made:
            if lowers and result.plan.decisions:
                result.plan.notes.append(lowers)
            plans.append(result.plan)
        return compiled

    meta_inputs = any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tree_leaves(list(example_inputs)))
    inputs = tree_map(_meta_to_cpu, list(example_inputs))
    module = model_or_fn if isinstance(model_or_fn, torch.nn.Module) else _modules_named_by(model_or_fn)
    has_meta_state = module is not None and any(
        t.device.type == "meta" for t in [*module.parameters(), *module.buffers()]
    )
    if has_meta_state:
        state = {name: _meta_to_cpu(t) for name, t in [*module.named_parameters(), *module.named_buffers()]}

        def run(*args):
            return torch.func.functional_call(module, state, args)
    else:

        def run(*args):
            return model_or_fn(*args)

    def plan_every_graph() -> None:
        # A backend of its own each time: Dynamo keeps the code it compiled for the frames after
        # a graph break per backend, and would run the first pass's again.
        compiled = torch.compile(_with_own_code(run), backend=lambda gm, inputs: planning_backend(gm, inputs))
        try:
            # A training step is planned, whatever the caller's grad mode (an eval loop's no_grad).
            with torch.inference_mode(False), torch.enable_grad():
                if lowers is None:
                    # The generated forward runs on the real tensors: leave the model's buffers (a
                    # BatchNorm's running statistics) and the random state as they were.
                    with state_kept(module):
                        compiled(*inputs)
                else:
                    compiled(*inputs)
        except Exception as error:
            ours = _our_error(error)
            if ours is not None:
                raise ours from None
            if meta_inputs and not has_meta_state and _META_MISMATCH.search(str(error)):
                raise ValueError(_META_OUT_OF_REACH) from error
            raise

    plan_every_graph()
    if step_scoped:
        shares = _step_shares(plans, settings.budget_bytes, settings.strict_budget)
        if shares is not None:  # each graph again under its share, as the backend does after a step
            plans.clear()
            plan_every_graph()
        what = "planned under this graph's share" if shares else "the minimum-memory plan, above its share"
        for plan in plans:
            plan.notes.append(f"budget_scope='step': {what} of the step's budget {format_bytes(settings.budget_bytes)} "
                              "(each graph assumed called once per step; the backend counts a real step's calls)")
    recurrence = _eager_recurrence(module)
    if not plans:
        raise ValueError(
            "compile_offload.tools.explain: no training graph was produced; "
            + (recurrence if recurrence else "the model's outputs must require grad "
               "(parameters with requires_grad=True or inputs with requires_grad=True)"))
    for plan in plans:
        _note_pinned_memory(plan, settings.pinned_pool_limit)
        if settings.verify_budget or settings.measured_plan_choice:  # accepted, as a compile takes them
            plan.notes.append("verify_budget and measured_plan_choice act on training steps: explain runs none")
        if recurrence:
            plan.notes.append(recurrence)
        if settings.dump_dir is not None:  # the dump, written as the graph was planned, gets these notes too
            dump.refresh_plan(settings.dump_dir, plan)
    if recurrence:
        warnings.warn(f"compile_offload.tools.explain: {recurrence}", stacklevel=2)
    return plans


# Dynamo's (and ATen's) device mismatch between the stood-in inputs and a meta tensor
_META_MISMATCH = re.compile(r"found at least two devices, (cpu and meta|meta and cpu)|"
                            r"Expected all tensors to be on the same device.*\bmeta\b")
_META_OUT_OF_REACH = (
    "compile_offload.tools.explain: the inputs are on meta, which explain stands in for with values of their shapes, "
    "and the function used a module or tensor on meta that explain could not find to do the same (it finds "
    "modules in the function's closure and globals, a bound method's object, a functools.partial's function and "
    "arguments, a callable object's attributes, and lists, tuples, sets and dicts held so, two levels deep); pass "
    "the module itself as model_or_fn, hold it where explain looks, or pass a meta tensor as an input")


def _our_error(error: Exception) -> Exception | None:
    """The ``ValueError`` or ``TypeError`` (``BudgetError`` included) our planning raised,
    where Dynamo wrapped it in its ``BackendCompilerFailed`` (``inner_exception``); else
    None. The user catches ours as documented, its traceback kept."""
    inner = getattr(error, "inner_exception", None)
    if not isinstance(inner, (ValueError, TypeError)) or inner.__traceback__ is None:
        return None
    last = inner.__traceback__
    while last.tb_next is not None:
        last = last.tb_next
    raised_in = last.tb_frame.f_globals.get("__name__", "")
    return inner if raised_in.startswith("compile_offload.") else None


def _step_shares(plans: list[Plan], budget_bytes: int, strict: bool = False) -> list[int] | None:
    """Each graph's share of a step's budget (``runtime/step_budget.split_budget``) from its
    minimum-memory plan ``plans``, one call per graph; None where a graph has no plan of ours
    or the minimums exceed the budget (then the minimum-memory plans are shown, with a
    warning, as the backend keeps them; ``strict``: ``BudgetError``, as the backend raises)."""
    from ..pipeline.result import BudgetError
    from ..runtime.step_budget import minimum_parts, need_of, split_budget

    needs = [need_of(f"{index}", plan, 1) for index, plan in enumerate(plans)]
    if any(need is None for need in needs):
        return None
    shares, share = split_budget(budget_bytes, needs)
    if share < 0:
        floor = sum(n.min_bytes for n in needs)
        message = (f"compile_offload.tools.explain: budget_scope='step': the graphs' minimum-memory plans sum "
                   f"to {format_bytes(floor)}, above the memory budget {format_bytes(budget_bytes)}")
        if strict:
            raise BudgetError(f"{message}; strict_budget=True")
        warnings.warn(f"{message}; each graph keeps its minimum-memory plan", stacklevel=3)
        parts = minimum_parts(budget_bytes, needs, floor)
        for plan, need in zip(plans, needs):  # under its part of the budget, which it does not meet (as the backend)
            plan.budget_bytes = parts[need.name]
            plan.feasible = plan.predicted_peak_bytes <= plan.budget_bytes
        return None
    return [shares[f"{index}"] for index in range(len(plans))]


def _eager_recurrence(module: torch.nn.Module | None) -> str | None:
    """What to say where the model has recurrent modules Dynamo runs eagerly (``nn.RNN``,
    ``nn.GRU``, ``nn.LSTM`` are not traced unless ``torch._dynamo.config.allow_rnn``): their
    activations are in no graph, so no plan covers them, and the backend cannot tell (its
    graphs are what is left around them, often nothing: the frame that calls one runs
    eagerly whole). None where there is none, or they are traced."""
    if module is None or dynamo.config.allow_rnn:
        return None
    recurrent = [f"{name or 'the model'} ({type(m).__name__})" for name, m in module.named_modules()
                 if isinstance(m, torch.nn.RNNBase)]
    if not recurrent:
        return None
    return (f"{', '.join(recurrent)} run eagerly outside the compiled graphs (torch._dynamo.config.allow_rnn is "
            "False): their activations are not planned under the budget; set allow_rnn = True to trace them")


def _note_pinned_memory(plan: Plan, limit: int | None = None) -> None:
    """Add to ``plan.notes`` the pinned host memory its offloads will hold (predicted: the
    pool's buffer sizes for the offloaded tensors, ``pinned_pool.pinned_bytes``), and where
    that passes ``pinned_pool_limit``, that training with it would raise."""
    from ..passes.plan import format_bytes
    from ..runtime.pinned_pool import pinned_bytes

    offloaded = [d.bytes for d in plan.decisions if d.decision == "offload"]
    if not offloaded:
        return
    pinned = pinned_bytes(offloaded)
    plan.notes.append(f"pinned host memory (predicted): {format_bytes(pinned)} for {format_bytes(sum(offloaded))} "
                      f"offloaded ({pinned / sum(offloaded):.3f}x)")
    if limit is not None and pinned > limit:
        plan.notes.append(f"above pinned_pool_limit {format_bytes(limit)}: a training step with this plan raises "
                          "RuntimeError when its offloads take the pool past it")


class _KeywordInputs(torch.nn.Module):
    """``model(**dict(zip(names, values)))`` called with the values alone: explain traces
    positional inputs, and keyword inputs passed this way are the graph's inputs too."""

    def __init__(self, model: Callable[..., Any], names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *values: Any) -> Any:
        return self.model(**dict(zip(self.names, values)))


def positional_call(model: Callable[..., Any], inputs: Any) -> tuple[Callable[..., Any], tuple]:
    """The model and inputs a factory returned, as ``explain_all`` takes them: a tuple or list
    is the positional inputs, a dict the keyword inputs (a tokenizer's output), anything else
    (a tensor) the one input."""
    if isinstance(inputs, Mapping):  # the modules a function names held too (meta parameters)
        named = None if isinstance(model, torch.nn.Module) else _modules_named_by(model)
        return _KeywordInputs(named or model, list(inputs)), tuple(inputs.values())
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def explain(model_or_fn, *example_inputs, memory_budget: Any = _UNSET, device_profile: Any = _UNSET, **options) -> Plan:
    """The plan for a model (or function) and example inputs, without running it.

    ``memory_budget`` and ``device_profile`` default to ``compile_offload.config``; other
    knobs can be passed as keyword options. Models and inputs may live on the ``meta``
    device; a named GPU profile (``"h100"``) works on a CPU-only machine. With graph
    breaks, use ``explain_all`` (this returns the plan of the largest graph and warns).
    """
    plans = explain_all(model_or_fn, *example_inputs, memory_budget=memory_budget,
                        device_profile=device_profile, **options)
    if len(plans) > 1:
        warnings.warn(
            f"compile_offload.tools.explain: the model compiles to {len(plans)} graphs (graph breaks); returning the plan "
            "of the one with the largest unconstrained peak; explain_all() returns all of them",
            stacklevel=2,
        )
    return max(plans, key=lambda p: p.baseline_peak_bytes)
