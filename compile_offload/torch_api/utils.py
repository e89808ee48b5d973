"""Private utilities of torch outside the compiler stack: ``torch.utils._config_module`` (the
config machinery ``compile_offload.config`` is built on), ``torch.utils._pytree``,
``torch.utils._python_dispatch``, ``torch.utils._sympy``, ``torch.utils._triton``,
``torch.fx._lazy_graph_module``, ``torch._logging``, ``torch._ops``, the autograd engine's
``queue_callback`` and the saved-tensor hooks set (``torch._C._autograd``).
(``torch._prims_common`` is wrapped in ``passes/compat.py``: ``is_non_overlapping_and_dense``.)

Checked on torch 2.11-2.14 (installed: 2.13).
"""

from __future__ import annotations

from typing import Any

from torch._ops import OpOverload, OpOverloadPacket  # noqa: F401  (re-exported)
from torch.utils._config_module import Config, ContextDecorator, install_config_module  # noqa: F401
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: F401
from torch.utils._pytree import tree_leaves, tree_map  # noqa: F401
from torch.utils._sympy import functions as sympy_functions  # noqa: F401  (FloorDiv, Mod, ... as torch prints them)

__all__ = ["Config", "ContextDecorator", "OpOverload", "OpOverloadPacket", "UNSET_SENTINEL", "disable_current_modes",
           "install_config_module", "keep_environment_strings", "parameter_hooks", "queue_backward_callback",
           "register_log", "sympy_functions", "trace_structured",
           "tree_leaves", "tree_map",
           "triton_utils", "use_lazy_graph_module"]

# --- the autograd engine ------------------------------------------------------------------------


def parameter_hooks(tensor) -> int:
    """How many gradient hooks a tensor carries (``register_hook``, and
    ``register_post_accumulate_grad_hook``): torch keeps them in private dicts."""
    return sum(len(getattr(tensor, name, None) or {}) for name in ("_backward_hooks", "_post_accumulate_grad_hooks"))


def queue_backward_callback(callback) -> bool:
    """Run ``callback`` once the backward under way has finished, after the callbacks queued
    before it (FSDP2 queues its final post-backward from the backward's start); False, and
    nothing queued, outside a backward."""
    import torch

    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        return False
    return True


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensor hooks are set on this thread (``torch.autograd.graph.saved_tensors_hooks``,
    ``save_on_cpu``): the autograd Function that runs a compiled forward hands its saved
    tensors to their pack hook as the forward returns."""
    import torch

    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (activation
    checkpointing's recompute runs a forward inside one)."""
    import torch

    return torch._C._current_graph_task_id() != -1


# --- torch.utils._config_module -----------------------------------------------------------------

UNSET_SENTINEL: Any = None
try:
    # What an entry's ``user_override`` holds while nothing was set in code.
    from torch.utils._config_module import _UNSET_SENTINEL as UNSET_SENTINEL
except ImportError:  # pragma: no cover - torch without the sentinel
    pass


# What a flag's environment variable may say (any case, spaces around ignored).
ENVIRONMENT_FLAGS = {"1": True, "true": True, "yes": True, "on": True,
                     "0": False, "false": False, "no": False, "off": False}


def keep_environment_strings(module: Any, variable_of) -> None:
    """torch's config module reads an environment value "0" or "1" as a bool, whatever the
    knob, and any other value as its string (``_read_env_variable``): for each knob of
    ``module`` that is not a flag (its default is no bool), the variable's own string is what
    it reads instead, as any other value (``"0"``: 0 bytes, not ``False``); for each flag,
    the bool a word of ``ENVIRONMENT_FLAGS`` says (``"no"`` read back as the string ``"no"``
    was true to ``if config.offload:``). Another word stays a string, which the settings
    refuse. ``variable_of(knob)``: its variable."""
    import os

    for knob, entry in module._config.items():
        raw = os.environ.get(variable_of(knob))
        if raw is None:
            continue
        if isinstance(entry.default, bool):
            word = raw.strip().lower()
            if word in ENVIRONMENT_FLAGS:
                entry.env_value_default = ENVIRONMENT_FLAGS[word]
        elif isinstance(entry.env_value_default, bool) and raw in ("0", "1"):
            entry.env_value_default = raw


# --- torch.utils._triton, torch.fx._lazy_graph_module --------------------------------------------


def triton_utils():
    """The module ``torch.utils._triton`` (``has_triton``, ``triton_hash_with_backend``)."""
    import torch.utils._triton as triton_utils

    return triton_utils


def use_lazy_graph_module(use: bool):
    """``torch.fx._lazy_graph_module._use_lazy_graph_module``: a context choosing whether new
    GraphModules compile their code lazily."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(use)


# --- torch._logging -----------------------------------------------------------------------------


def register_log(setting_name: str, log_name: str) -> None:
    from torch._logging._internal import register_log as register  # private (torch >= 2.1), not re-exported

    register(setting_name, log_name)


def trace_structured(*args: Any, **kwargs: Any) -> None:
    from torch._logging import trace_structured as trace

    trace(*args, **kwargs)
