"""torch._functorch: AOTAutograd's config, ``aot_module_simplified``, its runtime wrappers'
backward compiler, and torch's default and min-cut partitions.

Checked on torch 2.11-2.14 (installed: 2.13). ``torch._functorch.partitioners``'s internals
the planner mirrors are wrapped in ``passes/compat.py``.
"""

from __future__ import annotations

from typing import Any

from torch._functorch import config  # noqa: F401  (re-exported)

__all__ = ["aot_module_simplified", "autograd_backward_compiler", "config", "default_partition",
           "min_cut_rematerialization_partition"]


def aot_module_simplified(*args: Any, **kwargs: Any):
    from torch._functorch.aot_autograd import aot_module_simplified as run

    return run(*args, **kwargs)


def default_partition(*args: Any, **kwargs: Any):
    from torch._functorch.partitioners import default_partition as partition

    return partition(*args, **kwargs)


def min_cut_rematerialization_partition(*args: Any, **kwargs: Any):
    from torch._functorch.partitioners import min_cut_rematerialization_partition as partition

    return partition(*args, **kwargs)


def autograd_backward_compiler() -> tuple[type, type] | None:
    """AOTAutograd's backward compiler (``_AutogradBackwardCompiler`` of
    ``torch._functorch._aot_autograd.runtime_wrappers``) and the class of its lazy-compile
    info (``AutogradLazyBackwardCompileInfo``); None where this torch lacks either."""
    try:
        from torch._functorch._aot_autograd import runtime_wrappers
    except ImportError:  # pragma: no cover - another torch layout
        return None
    compiler = getattr(runtime_wrappers, "_AutogradBackwardCompiler", None)
    lazy_info = getattr(runtime_wrappers, "AutogradLazyBackwardCompileInfo", None)
    if compiler is None or lazy_info is None:
        return None
    return compiler, lazy_info
