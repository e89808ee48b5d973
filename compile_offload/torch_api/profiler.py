"""The profilers' private corners: ``torch._C._autograd._profiler_enabled``, the raw event
types of ``torch._C._profiler``, and the CUDA memory snapshot
(``torch.cuda.memory._record_memory_history``, ``_snapshot``).

Checked on torch 2.11-2.14 (installed: 2.13).
"""

from __future__ import annotations

from typing import Any

import torch


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` (or ``torch.autograd.profiler``) records on this thread."""
    return bool(torch._C._autograd._profiler_enabled())


def event_types():
    """``torch._C._profiler._EventType`` (``.Allocation`` tags an allocation event)."""
    from torch._C._profiler import _EventType

    return _EventType


def record_memory_history(*args: Any, **kwargs: Any) -> None:
    torch.cuda.memory._record_memory_history(*args, **kwargs)


def memory_snapshot() -> dict:
    return torch.cuda.memory._snapshot()
