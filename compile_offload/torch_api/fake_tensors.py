"""torch._subclasses (fake tensors): ``FakeTensor``, ``FakeTensorMode``,
``unset_fake_temporarily``, ``DataDependentOutputException``, ``DynamicOutputShapeException``
and the ``fake_tensor`` module
itself (patched by the CUDA schedule benchmark); ``traced_afresh`` (with
``torch.fx.experimental.symbolic_shapes.ShapeEnv``). ``torch._library``'s ``FakeScriptObject`` is used by the passes only
(``passes/compat.py``).

Checked on torch 2.11-2.14 (installed: 2.13).
"""

import contextlib

from torch._subclasses import fake_tensor  # noqa: F401  (re-exported)
from torch._subclasses.fake_tensor import (  # noqa: F401
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)

__all__ = ["DataDependentOutputException", "DynamicOutputShapeException", "FakeTensor", "FakeTensorMode",
           "fake_tensor", "traced_afresh", "unset_fake_temporarily"]


@contextlib.contextmanager
def traced_afresh(gm, args: list):
    """``args``' tensors as fake tensors of their own static sizes, in a fresh fake mode with
    a shape environment, for tracing Dynamo's ``gm`` again: its data-dependent values
    (``.item()``, ``nonzero``) become unbacked symbols, as under Dynamo, where real inputs in
    a mode without one raise ``DataDependentOutputException``. Other arguments are kept.
    Meanwhile ``gm``'s nodes lose the unbacked symbols Dynamo's shape environment bound
    (``meta["unbacked_bindings"]``): a retrace renames its new symbols to those, and the
    fresh environment's first symbols have the same names (torch's "possible memo disaster")."""
    import torch
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
    bound = {node: node.meta.pop("unbacked_bindings") for node in gm.graph.nodes if "unbacked_bindings" in node.meta}
    try:
        yield fakes
    finally:
        for node, bindings in bound.items():
            node.meta["unbacked_bindings"] = bindings
