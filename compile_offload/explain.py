"""``compile_offload.explain``: the plan the backend would make, without running the model.

The model is traced by Dynamo and AOTAutograd on ``meta`` copies of its parameters, buffers
and inputs, so planning costs no device memory and no kernel runs, and a GPU profile can be
planned on a CPU-only machine. The partitioner is the backend's own; only code generation is
skipped.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from passes.plan import Plan

from . import settings as settings_mod
from .partitioner import OffloadRematPartitioner

_UNSET: Any = object()


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return meta.requires_grad_(value.requires_grad)
    return value


def _device_of(model_or_fn: Any, inputs: tuple) -> torch.device:
    tensors = [t for t in tree_map(lambda x: x, list(inputs)) if isinstance(t, torch.Tensor)]
    if isinstance(model_or_fn, torch.nn.Module):
        tensors += list(model_or_fn.parameters())
    for tensor in tensors:
        if tensor.device.type not in ("cpu", "meta"):
            return tensor.device
    return torch.device("cpu")


def explain_all(
    model_or_fn: torch.nn.Module | Callable[..., Any],
    *example_inputs: Any,
    memory_budget: Any = _UNSET,
    device_profile: Any = _UNSET,
    **options: Any,
) -> list[Plan]:
    """One Plan per compiled graph (several when the model has graph breaks)."""
    if memory_budget is not _UNSET:
        options["memory_budget"] = memory_budget
    if device_profile is not _UNSET:
        options["device_profile"] = device_profile
    settings = settings_mod.resolve(options)
    if settings.device_profile is None:
        device = _device_of(model_or_fn, example_inputs)
        if device.type != "cuda":
            # meta/CPU models are planned for this machine's kind of device.
            settings = settings_mod.resolve({**options, "device_profile": "cpu"})
    plans: list[Plan] = []

    def planning_backend(gm: torch.fx.GraphModule, inputs):
        from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
        from torch._inductor.decomposition import select_decomp_table

        partitioner = OffloadRematPartitioner(settings, graph_name=f"graph_{len(plans)}")

        def capture(joint, joint_inputs, **kwargs):
            fw, bw = partitioner(joint, joint_inputs, **kwargs)
            plans.append(partitioner.last_plan)
            return fw, bw

        return aot_module_simplified(
            gm,
            inputs,
            fw_compiler=lambda g, _: make_boxed_func(g.forward),
            bw_compiler=lambda g, _: make_boxed_func(g.forward),
            partition_fn=capture,
            decompositions=select_decomp_table(),
        )

    meta_inputs = tree_map(_to_meta, list(example_inputs))
    if isinstance(model_or_fn, torch.nn.Module):
        state = {name: _to_meta(t) for name, t in
                 [*model_or_fn.named_parameters(), *model_or_fn.named_buffers()]}
        module = model_or_fn

        def run(*args):
            return torch.func.functional_call(module, state, args)
    else:
        run = functools.partial(model_or_fn)
    compiled = torch.compile(run, backend=planning_backend)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        compiled(*meta_inputs)
    if not plans:
        raise ValueError(
            "compile_offload.explain: no training graph was produced; the model's outputs must require grad "
            "(parameters with requires_grad=True or inputs with requires_grad=True)"
        )
    return plans


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
            f"compile_offload.explain: the model compiles to {len(plans)} graphs (graph breaks); returning the plan "
            "of the one with the largest unconstrained peak; explain_all() returns all of them",
            stacklevel=2,
        )
    return max(plans, key=lambda p: p.baseline_peak_bytes)
