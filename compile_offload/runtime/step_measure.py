"""One step of a compiled graph measured: its allocator peak, and its time.

A step is the forward call of the compiled graph and its compiled backward, each its own
region; ``compiled_backward_node`` finds the backward among the outputs' autograd nodes so
that hooks on it mark where the backward starts and ends. ``config.verify_budget`` measures
the first step's peak; measured plan choice (``runtime/plan_trials.py``) times the steps
of its candidate plans too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from ..torch_api.fake_tensors import FakeTensor
from ..torch_api.utils import tree_leaves
from .memory_tracker import AllocationLedger, measure_peak, profiler_recording


class StepMeasure:
    """One step's peak and time: the forward call and the compiled backward, each its own
    region (the loss computed between them is in neither).

    The peak (``peak=True``): on the CPU each region is a profiler region of its own (the
    autograd engine restores the thread's profiler state when a backward ends, so a profiler
    opened in the forward and closed in a backward hook would stay enabled);
    ``AllocationLedger`` joins the two regions (memory freed between them stays counted). On
    CUDA the caching allocator's peak counter spans both. The time: the two regions'
    wall-clock seconds, the device synchronized at each edge; a CPU step profiled for its
    peak is not a fair time (the profiler adds to it)."""

    def __init__(self, device: torch.device, peak: bool = True) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.peak = peak
        self.ledger = AllocationLedger()
        self._region = None
        self._cuda_peak = None
        self._started = None
        self.seconds = 0.0
        self.interrupted = False  # a profiler of someone else's recorded when the backward started

    def forward(self, compiled: Callable[..., Any], args) -> Any:
        if self.cuda and self.peak:
            self._region = measure_peak(self.device_or_current())
            self._cuda_peak = self._region.__enter__()
        if self.cuda or not self.peak:
            self._start_clock()
            outputs = compiled(*args)
            self._stop_clock()
            return outputs
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            outputs = compiled(*args)
        self.ledger.add(prof)
        return outputs

    def device_or_current(self) -> torch.device:
        """The graph's CUDA device; "cuda" without an index is the current one."""
        if self.device.index is not None:
            return self.device
        return torch.device("cuda", torch.cuda.current_device())

    def start_backward(self) -> None:
        if not self.cuda and self.peak:
            if profiler_recording():
                self.interrupted = True
                return
            self._region = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                  profile_memory=True)
            self._region.__enter__()
        self._start_clock()

    def end_backward(self) -> None:
        self._stop_clock()
        if self._region is None:
            return
        self._region.__exit__(None, None, None)
        if not self.cuda:
            self.ledger.add(self._region)
        self._region = None

    def peak_bytes(self) -> int:
        if self.cuda:
            self.end_backward()
            return self._cuda_peak.peak_bytes
        return self.ledger.peak_bytes

    def _start_clock(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device_or_current())
        self._started = time.perf_counter()

    def _stop_clock(self) -> None:
        if self._started is None:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device_or_current())
        self.seconds += time.perf_counter() - self._started
        self._started = None


def compiled_backward_node(outputs: Any):
    """The autograd node of the compiled graph's backward among ``outputs``' grad_fns (an
    output that is a view has a view node in front of it)."""
    pending = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while pending:
        node = pending.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in type(node).__name__:
            return node
        if len(seen) < 16:
            pending.extend(next_node for next_node, _ in node.next_functions)
    return None


def on_fake_tensors(args: tuple) -> bool:
    """Whether a compiled graph's call is on fake tensors, not a step: DDPOptimizer runs each
    bucket graph so while compiling, to make the next bucket's inputs (a compiled graph's
    arguments are a flat list)."""
    return any(isinstance(arg, FakeTensor) for arg in args)
