"""``backward(retain_graph=True)`` on a backward lowered while the forward compiled.

With a budget the backward is lowered during the compile (``inductor_kernels.
backward_lowered_at_compile``), so that the budget loop knows its scheduled peak. AOTAutograd
lowers it with its saved tensors donated (``torch._functorch.config.donated_buffer``): the
backward may overwrite them, so it runs once only. Left lazy, as ``torch.compile`` leaves it,
the backward is lowered at the first ``backward()``, and one that retains the graph is
lowered without donated buffers (``_AutogradBackwardCompiler._prepare_lazy_backward_context``);
lowered at compile time, AOTAutograd raises instead ("compiled with non-empty donated
buffers").

So a backward we lowered early keeps torch's lazy switch: the first ``backward()`` that
retains the graph drops the early lowering, and AOTAutograd lowers the backward again,
without donated buffers, as it would have lazily (the retained saved tensors stay intact;
every later backward of that graph runs the new lowering). Where AOTAutograd's cache served
the graph, nothing of ours ran and no graph is kept to lower again: AOTAutograd raises its
own error, which names ``torch._functorch.config.donated_buffer=False``. Private AOTAutograd
names, used here only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..torch_api import functorch
from ..torch_api.guards import TracingContext

_MARK = "_compile_offload_lowered_early"  # set on the graph's ViewAndMutationMeta


def lowering_lazily_on_retain(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Inductor's inner compiler: a backward lowered at compile time with donated
    buffers is marked, so a retaining ``backward()`` lowers it again (module doc)."""

    @functools.wraps(inner_compile)
    def compile_marking_early_backward(gm: torch.fx.GraphModule, example_inputs, **kwargs: Any):
        # Marked as soon as the donated buffers are known (from the forward's compile on).
        if functorch.config.force_non_lazy_backward_lowering:
            context = TracingContext.try_get()
            metadata = getattr(context, "fw_metadata", None)
            if metadata is not None and getattr(metadata, "bw_donated_idxs", None) and _install():
                setattr(metadata, _MARK, True)
        return inner_compile(gm, example_inputs, **kwargs)

    return compile_marking_early_backward


@functools.cache
def _install() -> bool:
    """Patch AOTAutograd's backward compiler once; False where this torch lacks it (then a
    retaining backward raises AOTAutograd's own error)."""
    classes = functorch.autograd_backward_compiler()
    if classes is None:  # pragma: no cover - another torch layout
        return False
    compiler, lazy_info = classes
    if not hasattr(compiler, "get_or_compile"):
        return False
    original = compiler.get_or_compile

    @functools.wraps(original)
    def get_or_compile(self, *, saved_tensors_use_once: bool):
        metadata = getattr(self, "fw_metadata", None)
        if (not saved_tensors_use_once and self.compiled_bw is not None and getattr(metadata, _MARK, False)
                and isinstance(self.lazy_backward_info, lazy_info)):  # a graph to lower again
            setattr(metadata, _MARK, False)
            self.compiled_bw = None  # lowered again below, without donated buffers, as a lazy backward is
        return original(self, saved_tensors_use_once=saved_tensors_use_once)

    compiler.get_or_compile = get_or_compile
    return True
