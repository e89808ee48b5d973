"""Measure the memory a step allocates on any device, CPU included.

``AllocationTracker`` is a ``TorchDispatchMode`` that records every storage an op creates
and notices when it is freed (a weak reference on the storage object, which torch keeps
unique per storage). Its ``peak_bytes`` is the largest total of tracked storages alive at
once: what ``torch.cuda.max_memory_allocated()`` minus the allocation before the step
measures on a GPU, but without a GPU and counted in exact tensor bytes (no allocator
rounding). Storages that existed before the mode was entered (parameters, inputs) are not
counted, which is the "above steady state" the memory budget speaks of.

Around a ``torch.compile``d call it measures the compiled code: the mode tells Dynamo to
ignore it while compiling (``ignore_compile_internals``) and sees the ops the compiled
graphs run. Any other dispatch mode makes Dynamo skip the frame and run it eagerly, which
would measure eager's allocations instead.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place ops return an input's storage: not a new allocation (and a
        # view of a parameter must not make the parameter count).
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._track(value, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live or key in inputs or storage.nbytes() == 0:
            return
        self._live[key] = storage.nbytes()
        self.current_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.current_bytes -= self._live.pop(key, 0)
