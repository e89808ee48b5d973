"""Inductor's C++ backend on torch 2.11 to 2.13, kept from running a read of a buffer ahead
of the in-place write that fills it.

Fusing two kernels whose loops have other ranges, the C++ backend recomputes one node's loop
body and its reads (``SchedulerNode.recompute_size_and_body``). Before torch 2.14 the
scheduler's names for buffers mutated in place (``mutation_renames``) were applied to those
reads again only on a node with fake dependencies: a node reading a buffer that an
``index_put_`` (or a scatter) fills then read it under its name before the write, lost its
dependency on the write, and could run before it: wrong gradients, under ``torch.compile``
too (pytorch#185509; fixed in 2.14 by pytorch#185873). The horizontal fusions a budget
refuses (``plan_order_fusion.py``) leave other fusions, which reach it more often
(``tests/test_mutation_order.py``: a first layer's gradients 10% off on torch 2.13).

So while this backend compiles a graph, on a torch without the fix, the method applies the
renames after it recomputes, as torch 2.14's does. The replacement is installed once, on
the first compile, and acts only in a thread inside one of this backend's compiles: other
compiles in the process, and other threads, run torch's method as it is.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..torch_api import inductor

_inside = threading.local()  # .depth: this thread's open compiles of this backend
_install_lock = threading.Lock()
_MARK = "_compile_offload_mutation_renames"


def fixed_upstream() -> bool:
    """Whether this torch's ``recompute_size_and_body`` applies the renames itself (2.14 on)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 14)


def _install() -> None:
    """Replace ``SchedulerNode.recompute_size_and_body`` once with a method that, in a thread
    inside this backend's compile, applies the mutation renames after it recomputes."""
    node_class = inductor.scheduler().SchedulerNode
    original = getattr(node_class, "recompute_size_and_body", None)
    if original is None or getattr(original, _MARK, False):
        return
    dependencies = inductor.dependencies()
    fake = (dependencies.WeakDep, dependencies.StarDep)

    @functools.wraps(original)
    def recompute_size_and_body(self, *args: Any, **kwargs: Any) -> None:
        if not getattr(_inside, "depth", 0):
            return original(self, *args, **kwargs)
        had_fake_deps = any(isinstance(dep, fake) for dep in self.read_writes.reads)
        original(self, *args, **kwargs)
        if not had_fake_deps and self.mutation_renames:  # with fake dependencies torch applied them
            self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    setattr(recompute_size_and_body, _MARK, True)
    node_class.recompute_size_and_body = recompute_size_and_body


@contextlib.contextmanager
def mutation_renames_reapplied():
    """While open, in this thread, on torch before 2.14: torch 2.14's ``recompute_size_and_body``
    (module doc). Nothing changes on torch 2.14 and later."""
    if fixed_upstream():
        yield
        return
    with _install_lock:
        _install()
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1


def keeping_mutation_order(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """``inner_compile`` (Inductor's ``compile_fx_inner``) run with torch 2.14's fix of the
    C++ backend's mutation order (module doc)."""

    @functools.wraps(inner_compile)
    def compile_keeping_mutation_order(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any):
        with mutation_renames_reapplied():
            return inner_compile(gm, *args, **kwargs)

    return compile_keeping_mutation_order
