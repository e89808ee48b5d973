"""CUDA and host-memory internals the runtime uses: ``torch.cuda._sleep``,
``torch.cuda._pin_memory_utils``, and ``torch._C``'s storage use count, pinned host cache and
below-autograd dispatch guard (profiler bits of ``torch._C`` are in ``profiler.py``).

Checked on torch 2.11-2.14 (installed: 2.13).
"""

from __future__ import annotations

import torch


def sleep(cycles: int) -> None:
    """Spin the current CUDA stream for ``cycles`` clock cycles."""
    torch.cuda._sleep(cycles)


def below_autograd():
    """A context under which ops dispatch below autograd (no graph recorded)."""
    return torch._C._AutoDispatchBelowAutograd()


def storage_use_count_fn():
    """``torch._C._storage_Use_Count`` (private; present in torch 2.1 and later), or None."""
    return getattr(torch._C, "_storage_Use_Count", None)


def pin_memory_fns():
    """``cudaHostRegister``/``cudaHostUnregister`` wrappers torch's checkpoint staging uses
    (``torch.cuda._pin_memory_utils``, torch >= 2.6), or None."""
    try:
        from torch.cuda import _pin_memory_utils
    except ImportError:
        return None
    return _pin_memory_utils.pin_memory, _pin_memory_utils.unpin_memory


def empty_host_cache() -> None:
    """Give torch's cached pinned blocks back to the system (``torch._C._host_emptyCache``;
    absent: nothing to do)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
