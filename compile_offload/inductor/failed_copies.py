"""A compiled graph's call that raises forgets the copies it started.

A copy and its wait are in one graph, so where a graph raises between them (an out-of-memory
error that a training loop catches to try again with a smaller batch), the copy's pending
entry would keep both of its ends, device memory included, until ``drain_pending_transfers``
(``runtime/ops.py``). Graphs with copies run through ``ops.forgetting_copies_on_error``: on an
exception, the call's own copies are waited for and forgotten. Inductor's compiled graph is
wrapped where it is made; one that AOTAutograd's cache serves was not made here: its forward
is covered by the backend's wrap of what Dynamo calls (``pipeline/backend.py``), its backward
is not (``drain_pending_transfers`` then frees its leftovers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..runtime import ops
from ..torch_api import inductor
from .copy_order import has_copy_ops


def forgetting_failed_copies(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """``inner_compile`` (Inductor's ``compile_fx_inner``), whose compiled graphs with copy ops
    forget their copies when a call raises."""

    @functools.wraps(inner_compile)
    def compile_forgetting_failed_copies(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any):
        copies = has_copy_ops(gm)
        compiled = inner_compile(gm, *args, **kwargs)
        if copies:
            inductor.wrap_compiled_call(compiled, ops.forgetting_copies_on_error)
        return compiled

    return compile_forgetting_failed_copies
