"""torch._dynamo: the backend registry, ``reset``, Dynamo's config, the device interface,
``GlobalStateSource`` (guards on global state, ``add_frame_guard``), the ``aot_autograd`` backend helper, the
count of graphs compiled, the compiled versions of one code object (counted and dropped), and
whether a module was compiled in place (``nn.Module.compile`` keeps the compiled call in
``Module._compiled_call_impl``), and callables Dynamo must refuse to trace.

Checked on torch 2.11-2.14 (installed: 2.13).
"""

from __future__ import annotations

from typing import Any

import torch._dynamo
from torch._dynamo import config, device_interface  # noqa: F401  (re-exported)

__all__ = ["DDP_OPTIMIZER_MODULE", "add_frame_guard", "aot_autograd", "backend_registered", "compiled_entries",
           "compiled_graph_count", "config", "compiled_in_place", "device_interface", "drop_compiled",
           "copy_marks", "forbidden_while_traced", "global_state_source", "graph_input_sources", "register_backend", "reset"]


# Where ``torch._dynamo.mark_dynamic`` / ``maybe_mark_dynamic`` / ``mark_unbacked`` /
# ``mark_static`` keep a user's dimension marks: attributes of the tensor. Not the marks
# Dynamo itself leaves on a tensor it compiled (``_dynamo_static_input_type`` on a
# parameter): a copy marked so would be planned unlike the first copy made.
_DIMENSION_MARKS = ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_dynamo_hint_overrides",
                    "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices", "_dynamo_strict_unbacked_indices",
                    "_dynamo_unbacked_bounds", "_dynamo_static_indices", "_dynamo_shape_ids", "_specialize_on",
                    "_has_dynamo_dim_marking")


def copy_marks(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``target`` with the dimension marks a user set on ``source`` (a copy of a tensor is
    otherwise planned as unmarked)."""
    for name, value in vars(source).items():
        if name in _DIMENSION_MARKS:
            setattr(target, name, value.copy() if hasattr(value, "copy") else value)
    return target


def forbidden_while_traced(fn: Any) -> Any:
    """``torch._dynamo.forbid_in_graph``: Dynamo tracing a call of ``fn`` fails with an
    error that shows ``fn`` (its ``str``), where otherwise it would break the graph and run
    the rest of the frame eagerly."""
    return torch._dynamo.forbid_in_graph(fn)


def reset() -> None:
    """``torch._dynamo.reset``: forget every compiled frame and cache entry (looked up at each
    call, so a patched ``torch._dynamo.reset`` is followed)."""
    torch._dynamo.reset()


# The module whose ``SubmodCompiler`` calls the backend once per DDP bucket (DDPOptimizer).
DDP_OPTIMIZER_MODULE = "torch._dynamo.backends.distributed"


def backend_registered(name: str) -> bool:
    """Whether Dynamo's registry knows a backend ``name`` (registered, or found through an
    entry point and loaded)."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS

    return name in _COMPILER_FNS or _BACKENDS.get(name) is not None


def register_backend(compiler_fn, name: str) -> None:
    from torch._dynamo.backends.registry import register_backend as register

    register(compiler_fn, name=name)


def add_frame_guard(check, description: str) -> bool:
    """Guard the frame Dynamo is compiling on ``check(frame_locals)``: when it returns False
    the frame's compiled code is not reused and Dynamo compiles the frame again
    (``TORCH_LOGS=recompiles`` shows ``description``). A lambda guard on Dynamo's root guard
    manager, as Dynamo guards its own global state (grad mode, functorch state); False where
    this torch offers no way to (no ``GlobalStateSource``, or no frame being compiled)."""
    from .guards import Guard, TracingContext

    GlobalStateSource = global_state_source()
    context = TracingContext.try_get()
    if GlobalStateSource is None or context is None or getattr(context, "guards_context", None) is None:
        return False

    def COMPILE_OFFLOAD_GUARD(builder: Any, guard: Any) -> None:  # noqa: N802 (Dynamo's guard naming)
        add = builder.guard_manager.root.add_lambda_guard
        try:
            add(check, [description], None)  # torch >= 2.12: (fn, verbose code parts, user stack)
        except TypeError:
            add(check, [description])

    context.guards_context.dynamo_guards.add(Guard(GlobalStateSource(), COMPILE_OFFLOAD_GUARD))
    return True


def global_state_source():
    """``torch._dynamo.source.GlobalStateSource``, or None on a torch without it."""
    try:
        from torch._dynamo.source import GlobalStateSource
    except ImportError:  # pragma: no cover - another torch
        return None
    return GlobalStateSource


def aot_autograd(**kwargs: Any):
    """Dynamo's ``aot_autograd`` backend wrapper (``torch._dynamo.backends.common``)."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def compiled_graph_count() -> int:
    """How many graphs Dynamo has compiled in this process (``counters["stats"]["unique_graphs"]``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_input_sources(gm: torch.fx.GraphModule) -> list[tuple[str, Any]]:
    """Each input of a graph Dynamo gives a backend, as (its source's name, such as
    ``L['x']``, its fake value: a tensor whose sizes may be symbolic), from the placeholders'
    ``grapharg`` and ``example_value`` meta; inputs without them are left out."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        arg, value = node.meta.get("grapharg"), node.meta.get("example_value")
        source = getattr(arg, "source", None)
        if source is None or value is None:
            continue
        name = source.name() if callable(source.name) else source.name  # a method before torch 2.13
        found.append((str(name), value))
    return found


def compiled_entries(code: Any) -> int:
    """How many compiled versions (cache entries) Dynamo holds for the code object ``code``:
    past ``config.recompile_limit`` of them it runs the code uncompiled."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))


def drop_compiled(code: Any) -> int:
    """Drop every compiled version Dynamo holds for ``code`` (``torch._dynamo.eval_frame.reset_code``,
    as ``torch._dynamo.reset`` does for all code); the next call compiles it again. Returns
    how many there were."""
    from torch._dynamo.convert_frame import compile_lock
    from torch._dynamo.eval_frame import reset_code

    with compile_lock:  # as torch._dynamo.reset holds it
        entries = compiled_entries(code)
        if entries:
            reset_code(code)
    return entries


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile(...)`` (``nn.Module.compile``) compiled it in place."""
    return getattr(module, "_compiled_call_impl", None) is not None
