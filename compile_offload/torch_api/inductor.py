"""torch._inductor: ``compile_fx`` and ``compile_fx_inner``, its config and modes, custom pass
classes, the decomposition table, the cache folder, device hints, and the internals read
while it compiles (the scheduler, IR, wrapper code lines, ``V``, the peak-memory pass).

Checked on torch 2.11-2.14 (installed: 2.13). Importing ``compile_offload`` must not load
``compile_fx`` and what it pulls in (scheduler, lowering, code generation...): those modules
are imported when a function here is called. What torch has already loaded with
``torch._inductor`` itself is imported at the top.
"""

from __future__ import annotations

from typing import Any

from torch._inductor import config, list_mode_options  # noqa: F401  (re-exported)
from torch._inductor.custom_graph_pass import CustomPartitionerFn  # noqa: F401
from torch._inductor.runtime import hints  # noqa: F401  (DeviceProperties)
from torch._inductor.runtime.cache_dir_utils import cache_dir  # noqa: F401
from torch._inductor.virtualized import V  # noqa: F401

__all__ = ["CustomPartitionerFn", "V", "cache_dir", "compile_fx", "compile_fx_inner", "compile_fx_module", "config",
           "decomposition_table", "fresh_backend", "graph", "hints", "ir", "list_mode_options", "memory",
           "dependencies", "scheduler", "scheduler_pass_base", "triton_codegen", "wrapper_lines"]

# --- compiling ----------------------------------------------------------------------------------


def compile_fx(*args: Any, **kwargs: Any):
    from torch._inductor.compile_fx import compile_fx as compile

    return compile(*args, **kwargs)


def compile_fx_inner(*args: Any, **kwargs: Any):
    from torch._inductor.compile_fx import compile_fx_inner as compile

    return compile(*args, **kwargs)


def fresh_backend():
    """A backend that compiles as ``torch.compile``'s default does (Inductor, default mode)
    and is a new object at each call. Dynamo serves a second instance of a module class the
    graph it compiled for the first where their backends compare equal, as two default
    ``torch.compile`` calls do, whatever config was patched around each first call: models
    compiled side by side in one process under different configs need backends of their own."""

    def inductor(gm, example_inputs):
        return compile_fx(gm, example_inputs)

    return inductor


def compile_fx_module():
    """The module ``torch._inductor.compile_fx`` (to patch what it looks up, such as its
    ``min_cut_rematerialization_partition``)."""
    import torch._inductor.compile_fx as module

    return module


def decomposition_table() -> dict:
    """Inductor's decomposition table (``select_decomp_table``), with ``torch._inductor.lowering``
    loaded first: some decompositions in the table need it."""
    import torch._inductor.lowering  # noqa: F401
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def scheduler_pass_base() -> type:
    """``CustomSchedulerPass``, the base of a post-fusion pass Inductor's cache can key on;
    ``object`` on an older torch (a plain callable: Inductor's cache then bypasses)."""
    try:
        from torch._inductor.custom_graph_pass import CustomSchedulerPass
    except ImportError:
        return object
    return CustomSchedulerPass


# --- the modules read or patched while Inductor compiles ----------------------------------------


def wrapper_lines() -> tuple[type, type] | None:
    """``AllocateLine`` and ``ReuseLine`` of ``torch._inductor.codegen.wrapper``, or None."""
    try:
        from torch._inductor.codegen.wrapper import AllocateLine, ReuseLine
    except ImportError:
        return None
    return AllocateLine, ReuseLine


def ir():
    import torch._inductor.ir as module

    return module


def memory():
    """``torch._inductor.memory`` (``reorder_for_peak_memory``, patched where the scheduler
    looks it up)."""
    import torch._inductor.memory as module

    return module


def scheduler():
    import torch._inductor.scheduler as module

    return module


def dependencies():
    """``torch._inductor.dependencies`` (the scheduler's ``WeakDep``, ``StarDep``)."""
    import torch._inductor.dependencies as module

    return module


def graph():
    """``torch._inductor.graph`` (``GraphLowering``)."""
    import torch._inductor.graph as module

    return module


def triton_codegen():
    """``torch._inductor.codegen.triton``."""
    import torch._inductor.codegen.triton as module

    return module


def wrap_compiled_call(compiled: Any, wrap: Any) -> bool:
    """Inductor's compiled graph (an ``OutputCode``, which calls its ``current_callable``)
    runs ``wrap(current_callable)`` from now on; False where it holds no callable."""
    current = getattr(compiled, "current_callable", None)
    if current is None:
        return False
    compiled.current_callable = wrap(current)
    return True
