"""A saved tensor that the forward writes back into a mutated input is not donated to the
backward.

A forward that mutates an input in place (a module buffer written through a slice:
``self.cache[1:].mul_(...)``) computes the input's new value as a fresh tensor and copies it
back (``copy_(primals_1, slice_scatter)``); where the backward reads that value, the same
tensor is saved. Inductor writes the value straight into the input's storage, so at run time
the saved tensor is the input. AOTAutograd's donated buffers
(``torch._functorch.config.donated_buffer``) tell the backward it may reuse a saved tensor's
storage when it is no alias of an input, and it judges that on the traced values, where the
two are different tensors: the backward then overwrote the buffer with its own temporaries
(the buffer off by up to 26 after one ``backward()``, and every later step computed from it),
under ``torch.compile`` too.

So while the forward compiles, the saved tensors that are (views of) a value copied back into
an input are taken out of the graph's donated buffers, before the backward is lowered. Other
saved tensors stay donated. The backward of such a graph is compiled past Inductor's FX graph
cache, whose key holds neither the donated buffers nor the forward: the same backward graph
compiled before with the tensor donated (the same model on a copy of its buffer) would be
served with the code that overwrites it, and this backward's code would serve that one.
Private AOTAutograd metadata, read through ``torch_api.guards``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..torch_api import inductor
from ..torch_api.guards import TracingContext


def not_donating_written_back_saves(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Inductor's inner compiler: compiling a forward, drop from the donated buffers the
    saved tensors it writes back into a mutated input (module docstring)."""

    @functools.wraps(inner_compile)
    def compile_keeping_written_back_saves(gm: fx.GraphModule, example_inputs, **kwargs: Any):
        metadata = getattr(TracingContext.try_get(), "fw_metadata", None)
        if kwargs.get("is_backward"):
            if getattr(metadata, _MARK, False):  # its donated buffers differ from what a cached backward had
                with inductor.config.patch(fx_graph_cache=False):
                    return inner_compile(gm, example_inputs, **kwargs)
        elif not kwargs.get("is_inference"):
            donated = getattr(metadata, "bw_donated_idxs", None)
            if donated:
                written_back = written_back_saves(gm, metadata)
                if written_back:
                    donated[:] = [index for index in donated if index not in written_back]  # shared with AOTAutograd's
                    setattr(metadata, _MARK, True)
        return inner_compile(gm, example_inputs, **kwargs)

    return compile_keeping_written_back_saves


_MARK = "_compile_offload_written_back_saves"  # set on the graph's ViewAndMutationMeta


def written_back_saves(gm: fx.GraphModule, metadata: Any) -> set[int]:
    """The backward input indices (as ``bw_donated_idxs`` counts them: the saved symbolic
    sizes first) of the forward's saved tensors that are, or view, a value the forward copies
    into one of its inputs: the same node through view ops, or the same storage in the traced
    values (a chunk of it through ``split``'s ``getitem``, an ``_unsafe_view``)."""
    copies = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
    written = [node.args[1] for node in copies
               if isinstance(node.args[1], fx.Node) and _base(node.args[0]).op == "placeholder"]
    if not written:
        return set()
    bases = {_base(node) for node in written}
    storages = {storage for storage in map(_storage, written) if storage is not None}
    outputs = next(reversed(gm.graph.find_nodes(op="output"))).args[0]
    saved = list(outputs)[metadata.tensors_saved_for_backwards_slice]
    symbols = metadata.num_symints_saved_for_bw or 0
    return {symbols + index for index, node in enumerate(saved)
            if isinstance(node, fx.Node) and (_base(node) in bases or _storage(node) in storages - {None})}


def _base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` views (itself where it is no view)."""
    while (node.op == "call_function" and getattr(node.target, "is_view", False) and node.args
           and isinstance(node.args[0], fx.Node)):
        node = node.args[0]
    return node


def _storage(node: fx.Node) -> StorageWeakRef | None:
    """The storage of ``node``'s traced value (views share their base's), where it has one."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.is_sparse:
        return None
    return StorageWeakRef(value.untyped_storage())
