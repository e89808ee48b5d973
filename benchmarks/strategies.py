"""How each alternative runs one training step, so the runner can measure them alike.

A ``Strategy`` turns a freshly built model into the callable the step runs
(``prepare``), and says which context wraps every call (``run_context``: config patches
that must be active when the first call compiles) and which wraps each forward
(``forward_context``: ``save_on_cpu`` packs tensors as the forward saves them).

Strategy names, as ``--strategies`` takes them:

=========================  ==================================================================
``eager``                  the model as is
``eager_ckpt``             ``torch.utils.checkpoint`` (non-reentrant) around every block
``eager_save_on_cpu``      ``torch.autograd.graph.save_on_cpu`` (pinned on CUDA)
``eager_ckpt_save_on_cpu`` both: only block inputs are saved, and they go to the host
``hf_ckpt_offload``        Hugging Face's own switch on a transformers model (``--model hf_gpt2``):
                           ``activation_checkpointing_enable(offload=True)`` (called
                           ``gradient_checkpointing_enable(offload=True)`` before transformers
                           v6): checkpointing with the saved block inputs in (pinned) host
                           memory through ``save_on_cpu``; on a transformers without ``offload``,
                           the same built by hand
``compile``                ``torch.compile(model)``: the reference for every ratio
``torch_budget:F``         ``torch.compile`` with ``torch._functorch.config.activation_memory_budget=F``
``torch_sac_offload``      per-block SAC tagging matmul/attention/conv outputs
                           ``MUST_CPU_OFFLOAD`` (the rest ``PREFER_RECOMPUTE``) with torch's
                           activation offloading; needs CUDA and a torch that has it
``ours:B``                 ``torch.compile(model, backend=compile_offload.offload_remat(memory_budget=B))``
``ours:B+measured``        the same with ``measured_plan_choice=True`` (the runner warms up past its trial steps)
=========================  ==================================================================

``torch_budget`` and ``ours`` without ``:`` expand to the sweeps given on the command line.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

EAGER_FAMILIES = ("eager", "eager_ckpt", "eager_save_on_cpu", "eager_ckpt_save_on_cpu", "hf_ckpt_offload")
COMPILED_FAMILIES = ("compile", "torch_budget", "torch_sac_offload", "ours")
FAMILIES = EAGER_FAMILIES + COMPILED_FAMILIES
REFERENCE = "compile"  # ratios are taken against this strategy

Budget = float | str | None
MEASURED_PLAN_STEPS = 3  # timed steps per candidate plan of ours with measured plan choice


# --- private torch features, detected here and nowhere else -----------------------------

# Config keys of torch's own activation offloading (torch._functorch.config); the first is
# required, the others are set when the installed torch has them.
_OFFLOAD_REQUIRED_KEY = "enable_activation_offloading"
_OFFLOAD_OPTIONAL_KEYS = ("activation_offload_separate_stream", "activation_offload_sink_wait", "activation_reload_prefetch")


def _functorch_config():
    from compile_offload.torch_api import functorch

    return functorch.config


def sac_offload_unavailable_reason(device: torch.device) -> str | None:
    """Why torch's SAC + CPU offload cannot run here, or None when it can."""
    from torch.utils.checkpoint import CheckpointPolicy

    if device.type != "cuda":
        return "offloading activations to the host needs a CUDA device"
    if not hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD"):
        return f"torch {torch.__version__} has no CheckpointPolicy.MUST_CPU_OFFLOAD"
    if not hasattr(_functorch_config(), _OFFLOAD_REQUIRED_KEY):
        return f"torch {torch.__version__} lacks torch._functorch.config.{_OFFLOAD_REQUIRED_KEY}"
    return None


def _sac_offload_patches() -> dict:
    config = _functorch_config()
    patches = {_OFFLOAD_REQUIRED_KEY: True}
    patches.update({key: True for key in _OFFLOAD_OPTIONAL_KEYS if hasattr(config, key)})
    return patches


def _offloaded_ops() -> frozenset:
    """The expensive producers worth offloading rather than recomputing (as the anchors did)."""
    names = (
        "mm", "addmm", "bmm", "convolution",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    )
    return frozenset(getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name))


def _offload_policy(offloaded: frozenset, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_CPU_OFFLOAD if op in offloaded else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_offload_context_fn() -> Callable:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    policy = functools.partial(_offload_policy, _offloaded_ops())
    return functools.partial(create_selective_checkpoint_contexts, policy)


# --- checkpoint per block ---------------------------------------------------------------


class CheckpointedBlock(nn.Module):
    """Runs ``inner`` under non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, inner: nn.Module, context_fn: Callable | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.context_fn = context_fn

    def forward(self, *args, **kwargs):  # keywords too: Hugging Face blocks take them
        if self.context_fn is None:
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)


def wrap_blocks(model: nn.Module, context_fn: Callable | None = None) -> int:
    """Wrap every module of ``model.checkpoint_block_types`` in ``CheckpointedBlock``.

    Returns how many were wrapped; blocks nested inside a wrapped block are left alone.
    """
    block_types = tuple(getattr(model, "checkpoint_block_types", ()))
    if not block_types:
        raise ValueError(f"{type(model).__name__} names no checkpoint_block_types")
    targets = []
    for parent in model.modules():
        if isinstance(parent, block_types):
            continue  # its children are inside a block that gets wrapped
        for name, child in parent.named_children():
            if isinstance(child, block_types):
                targets.append((parent, name, child))
    for parent, name, child in targets:
        setattr(parent, name, CheckpointedBlock(child, context_fn))
    return len(targets)


# --- Hugging Face's checkpointing with offload --------------------------------------------


def hf_offload_unavailable_reason(workload: str | None) -> str | None:
    """Why ``hf_ckpt_offload`` cannot run on ``workload``, or None when it can."""
    from . import workloads

    # The model first: installing transformers would not make another model run it.
    if workload is not None and workload not in workloads.HF_WORKLOADS:
        return f"runs on Hugging Face models only (--model {' or '.join(workloads.HF_WORKLOADS)})"
    if importlib.util.find_spec("transformers") is None:
        return "needs Hugging Face transformers (pip install transformers)"
    return None


def enable_hf_checkpoint_offload(model: nn.Module) -> str:
    """Turn on Hugging Face's checkpointing with activation offload on ``model`` (or its
    ``hf_model``), as its users do; returns which way it was done.

    transformers >= 5 takes ``offload=True`` (``activation_checkpointing_enable``, or the
    deprecated ``gradient_checkpointing_enable``); it runs each block's checkpoint under
    ``torch.autograd.graph.save_on_cpu(pin_memory=True)``. Older releases lack the switch,
    and without an accelerator the switch fails (transformers 5.23 asks for pinned memory
    on a CPU-only torch: "pin_memory=True requires a CUDA or other accelerator backend"),
    so there the same is built here around the checkpoint function they install, with
    pageable host memory."""
    hf_model = getattr(model, "hf_model", model)
    enable = getattr(hf_model, "activation_checkpointing_enable", None) or hf_model.gradient_checkpointing_enable
    parameters = inspect.signature(enable).parameters
    kwargs_name = next((name for name in parameters if name.endswith("checkpointing_kwargs")), None)
    options = {kwargs_name: {"use_reentrant": False}} if kwargs_name else {}
    if "offload" in parameters and _has_accelerator():
        enable(offload=True, **options)
        return f"{enable.__name__}(offload=True)"
    enable(**options)
    device_type = next(hf_model.parameters()).device.type
    for module in hf_model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if function is not None:
            module._gradient_checkpointing_func = functools.partial(_checkpoint_on_cpu, function, device_type)
    return f"{enable.__name__}() + save_on_cpu"


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


def _checkpoint_on_cpu(function: Callable, device_type: str, *args, **kwargs):
    with torch.autograd.graph.save_on_cpu(pin_memory=device_type == "cuda"):
        return function(*args, **kwargs)


# --- budgets ------------------------------------------------------------------------------

_FRACTION = re.compile(r"^\s*(?:[0-9]*\.[0-9]+|[01]\.?)\s*$")


def parse_budget(token: str) -> Budget:
    """A ``--budgets`` entry: ``"none"`` -> None, ``"0.5"`` -> 0.5 (a fraction),
    ``"2GiB"`` or ``"1000000"`` -> the string (bytes, parsed by compile_offload)."""
    text = token.strip()
    if text.lower() == "none":
        return None
    if _FRACTION.match(text) and "." in text:
        value = float(text)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"budget {token!r}: a fraction must lie in [0, 1]")
        return value
    from compile_offload.settings import parse_bytes

    parse_bytes(text, "memory_budget")  # raises with the accepted forms
    return text


def budget_label(budget: Budget) -> str:
    return "none" if budget is None else (f"{budget:g}" if isinstance(budget, float) else str(budget))


def parse_budget_list(text: str) -> list[Budget]:
    return [parse_budget(token) for token in text.split(",") if token.strip()]


def parse_torch_budget(token: str) -> float:
    value = float(token)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"torch activation_memory_budget {token!r} must lie in [0, 1]")
    return value


# --- strategies ---------------------------------------------------------------------------


@dataclass
class Strategy:
    family: str
    budget: Budget = None
    inner_compiler: str = "inductor"  # ours only
    device_profile: str | None = None  # ours only
    detail: str | None = None  # how prepare() did it, where there is more than one way
    measured_choice: bool = False  # ours only: config.measured_plan_choice

    @property
    def name(self) -> str:
        if self.family in ("torch_budget", "ours"):
            return f"{self.family}:{budget_label(self.budget)}" + ("+measured" if self.measured_choice else "")
        return self.family

    @property
    def trial_steps(self) -> int:
        """Steps measured plan choice may take before the chosen plan runs alone (at most four
        candidates, each a warm-up, a peak step on the CPU and ``measured_plan_steps`` timed
        steps): the runner warms up past them, so the timed steps run the chosen plan."""
        return 4 * (MEASURED_PLAN_STEPS + 2) if self.measured_choice else 0

    @property
    def compiled(self) -> bool:
        return self.family in COMPILED_FAMILIES

    @property
    def checkpoints_blocks(self) -> bool:
        return self.family in ("eager_ckpt", "eager_ckpt_save_on_cpu", "torch_sac_offload")

    def unavailable_reason(self, device: torch.device, workload: str | None = None) -> str | None:
        if self.family == "torch_sac_offload":
            return sac_offload_unavailable_reason(device)
        if self.family == "hf_ckpt_offload":
            return hf_offload_unavailable_reason(workload)
        return None

    def ours_options(self) -> dict:
        options = {"memory_budget": self.budget, "inner_compiler": self.inner_compiler}
        if self.measured_choice:
            options.update(measured_plan_choice=True, measured_plan_steps=MEASURED_PLAN_STEPS)
        if self.device_profile is not None:
            options["device_profile"] = self.device_profile
        return options

    def prepare(self, model: nn.Module, own_backend: bool = False) -> Callable:
        """The callable one step runs; wraps blocks and compiles as the strategy says. With
        ``own_backend``, torch's compiled strategies get a backend object of their own, so
        that models kept side by side in one process never share a graph compiled under
        another strategy's config (``inductor.fresh_backend``)."""
        if self.family == "hf_ckpt_offload":
            self.detail = enable_hf_checkpoint_offload(model)
            return model
        if self.checkpoints_blocks:
            context_fn = _sac_offload_context_fn() if self.family == "torch_sac_offload" else None
            wrap_blocks(model, context_fn)
        if self.family == "ours":
            import compile_offload

            return torch.compile(model, backend=compile_offload.offload_remat(**self.ours_options()))
        if self.compiled:
            if own_backend:
                from compile_offload.torch_api import inductor

                return torch.compile(model, backend=inductor.fresh_backend())
            return torch.compile(model)
        return model

    def run_context(self) -> contextlib.AbstractContextManager:
        """Active around every call, including the first one, which compiles."""
        if self.family == "torch_budget":
            return _functorch_config().patch(activation_memory_budget=self.budget)
        if self.family == "torch_sac_offload":
            return _functorch_config().patch(**_sac_offload_patches())
        return contextlib.nullcontext()

    def forward_context(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Active around each forward."""
        if self.family in ("eager_save_on_cpu", "eager_ckpt_save_on_cpu"):
            return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
        return contextlib.nullcontext()


def expand(
    names: Iterable[str],
    ours_budgets: list[Budget],
    torch_budgets: list[float],
    *,
    inner_compiler: str = "inductor",
    device_profile: str | None = None,
) -> list[Strategy]:
    """Turn ``--strategies`` names into strategies, expanding the two budget sweeps."""
    strategies = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        measured = name.endswith("+measured")
        family, _, budget_text = name.removesuffix("+measured").partition(":")
        if measured and family != "ours":
            raise ValueError(f"only ours takes +measured (got {name!r})")
        if family not in FAMILIES:
            raise ValueError(f"unknown strategy {name!r}; known: {', '.join(FAMILIES)} (budgets as torch_budget:0.5, ours:2GiB)")
        if budget_text and family not in ("torch_budget", "ours"):
            raise ValueError(f"strategy {family!r} takes no budget (got {name!r})")
        if family == "torch_budget":
            budgets = [parse_torch_budget(budget_text)] if budget_text else torch_budgets
            strategies += [Strategy(family, budget) for budget in budgets]
        elif family == "ours":
            budgets = [parse_budget(budget_text)] if budget_text else ours_budgets
            strategies += [Strategy(family, b, inner_compiler, device_profile, measured_choice=measured)
                           for b in budgets]
        else:
            strategies.append(Strategy(family))
    return strategies
