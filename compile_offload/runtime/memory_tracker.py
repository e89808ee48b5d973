"""The one measure of memory: the peak a region allocates, as the allocator reports it.

``measure_peak`` is what tests, ``profile_step``, ``benchmarks/``, ``config.verify_budget``
and the docs use::

    with measure_peak("cpu") as measured:
        compiled(x).sum().backward()
    measured.peak_bytes   # the most bytes allocated at once above the start of the region

- On CUDA it reads the caching allocator's own counters: ``reset_peak_memory_stats`` before,
  ``max_memory_allocated() - memory_allocated()``-at-start after. Regions nest (one graph's
  ``verify_budget`` region opens inside another's, or inside the step's): a reset through
  ``reset_cuda_peak`` first keeps the peak so far of every region open on the device.
- On CPU there are no such counters; the profiler's memory events carry the CPU
  allocator's figures for every allocation and free, including the buffers Inductor's
  generated code allocates through ``empty_strided_cpu`` (which never passes the dispatcher,
  so a ``TorchDispatchMode`` cannot see them: on one compiled step a dispatch-mode tracker
  saw 10.5 MB of a 75.9 MB peak). Replayed in order, they give the largest total allocated
  during the region above the total before it (the allocator's "Total Allocated" less its
  value before the first event).

Profilers do not nest: a second one opened inside a recording one ends the first's session
and leaves it empty. So ``measure_peak("cpu")`` raises where a profiler already records on
the thread (``profiler_recording``), and the backend's own CPU measurements skip, saying so,
rather than disturb a profiler the user has open.

Either way it is the quantity the memory budget bounds: the peak above what was allocated
when the region started (saved activations, transient buffers, gradients; not parameters
or inputs that already existed). On CPU the figures are exact tensor bytes (the CPU
allocator does not round); profiling adds time, not memory, to the region.
"""

from __future__ import annotations

import weakref

import torch

from ..torch_api import profiler


# What reads the CUDA peak counter over a region now open (``measure_peak`` regions, the step
# meters): each has ``cuda_device`` (with its index) and ``held_peak``.
_open_cuda_readers: weakref.WeakSet = weakref.WeakSet()


def cuda_device(device: torch.device) -> torch.device:
    """``device`` with its index ("cuda" is the current device)."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def reads_cuda_peak(reader) -> None:
    """Keep ``reader``'s ``held_peak`` up to date through later resets (until it is collected)."""
    _open_cuda_readers.add(reader)


def reset_cuda_peak(device: torch.device) -> None:
    """``torch.cuda.reset_peak_memory_stats(device)``, the peak so far kept first by every
    region open on it (``held_peak``): the counter is the device's, shared by the regions."""
    device = cuda_device(device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    for reader in list(_open_cuda_readers):
        if reader.cuda_device == device:
            reader.held_peak = max(reader.held_peak, peak)
    torch.cuda.reset_peak_memory_stats(device)


def profiler_recording() -> bool:
    """Whether a ``torch.profiler`` (or ``torch.autograd.profiler``) records on this thread."""
    return profiler.profiler_enabled()


class MeasuredPeak:
    """What ``measure_peak`` found. ``peak_bytes`` is known when the region ends: read
    inside it, it raises rather than read as 0 ("nothing allocated"). After an exception in
    the region it is the peak up to the exception (an out-of-memory step's is worth
    knowing), or None where the allocator could not be read then."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events = 0  # allocator events seen (CPU); 0 on CUDA
        self._peak_bytes: int | None = None
        self._ended = False

    @property
    def peak_bytes(self) -> int | None:
        if not self._ended:
            raise RuntimeError("compile_offload.measure_peak: peak_bytes was read before the with block ended; "
                               "it is measured when the block ends: read it after the block")
        return self._peak_bytes

    def _end(self, peak_bytes: int | None) -> None:
        self._peak_bytes, self._ended = peak_bytes, True

    def __repr__(self) -> str:
        peak = self._peak_bytes if self._ended else "<not ended>"
        return f"MeasuredPeak(device={self.device!r}, peak_bytes={peak}, events={self.events})"


_ACCEPTED_DEVICES = "accepted: 'cpu', 'cuda', 'cuda:N' or a torch.device of those"


def _device(device: object) -> torch.device:
    """``measure_peak``'s device, or the error naming the argument and the accepted values
    (torch's own errors name neither)."""
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"compile_offload.measure_peak(device={device!r}): a {type(device).__name__}, not a "
                        f"device; {_ACCEPTED_DEVICES}")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"compile_offload.measure_peak(device={device!r}) is not a device ({reason}); "
                         f"{_ACCEPTED_DEVICES}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"compile_offload.measure_peak(device={device!r}): device type {parsed.type} is not "
                         f"supported; {_ACCEPTED_DEVICES}")
    return parsed


class measure_peak:  # noqa: N801  used as a function: ``with measure_peak("cpu") as m``
    """Measure the peak bytes allocated on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``)
    above the start of the ``with`` block, at the allocator. Regions nest."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        device = _device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("compile_offload.measure_peak: device 'cuda' asked for, but no CUDA GPU is available")
        self.result = MeasuredPeak(device)
        self._profiler = None
        self._start = 0
        self.cuda_device = cuda_device(device) if device.type == "cuda" else None
        self.held_peak = 0  # on CUDA: the region's peak before the counter was last reset within it

    def __enter__(self) -> MeasuredPeak:
        device = self.result.device
        if device.type == "cuda":
            reset_cuda_peak(device)
            self._start = torch.cuda.memory_allocated(device)
            reads_cuda_peak(self)
        else:
            from torch.profiler import ProfilerActivity, profile

            if profiler_recording():
                raise RuntimeError(
                    "compile_offload.measure_peak('cpu'): a torch.profiler is already recording on this thread; "
                    "the CPU peak is read through a profiler of its own, and profilers do not nest (opening one "
                    "would end yours): measure outside your profiler, or read its memory events")
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self.result

    def __exit__(self, *exc_info) -> None:
        device = self.result.device
        if device.type != "cuda":
            self._profiler.__exit__(*exc_info)
        _open_cuda_readers.discard(self)
        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peak = max(self.held_peak, torch.cuda.max_memory_allocated(device)) - self._start
                peak = max(peak, 0)
            else:
                ledger = AllocationLedger()
                ledger.add(self._profiler)
                peak, self.result.events = ledger.peak_bytes, ledger.events
        except Exception:
            if exc_info[0] is None:
                raise
            # The block's own exception (a CUDA error, say, that synchronizing raises again)
            # is the one to see; the peak is unknown.
            peak = None
        self.result._end(peak)


class AllocationLedger:
    """The CPU allocator's allocations and frees, replayed in time order from one or more
    finished ``torch.profiler.profile(profile_memory=True)`` regions (in the order they ran).
    A free of memory allocated in an earlier region is matched by address; memory
    allocated before the first region (parameters, inputs) never counts, as in the
    allocator's own "Total Allocated", which counts only what it saw allocated. Memory
    freed between two regions stays counted (the ledger did not see it go): with gaps,
    the peak can only be over-stated."""

    def __init__(self) -> None:
        self._live: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.events = 0

    def add(self, prof) -> None:
        for ptr, size in cpu_allocation_events(prof):
            self.events += 1
            if size > 0:
                self.current_bytes += size - self._live.get(ptr, 0)
                self._live[ptr] = size
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            else:
                self.current_bytes -= self._live.pop(ptr, 0)


# The CUDA caching allocator hands out blocks in multiples of 512 bytes (``kMinBlockSize``,
# c10/cuda/CUDACachingAllocator.cpp's ``round_size``) and counts the block in
# ``memory_allocated``, while a snapshot's trace records the size asked for. Rounding each
# event as the allocator does makes a replayed snapshot's peak (``profile_step``)
# ``max_memory_allocated``'s (H200, 2026-11-27: two 4-byte scalars had put it 1,016 bytes
# under). Not followed: a cached large block handed out unsplit (the allocator splits a
# large block only when more than 1 MiB would remain) and ``roundup_power2_divisions``; both
# count more than this.
ALLOCATOR_BLOCK_BYTES = 512


def allocator_block_bytes(size: int) -> int:
    """The bytes the CUDA caching allocator counts for a request of ``size`` bytes (none
    for an empty tensor, which it does not allocate)."""
    return -(-size // ALLOCATOR_BLOCK_BYTES) * ALLOCATOR_BLOCK_BYTES


def cpu_allocation_events(prof) -> list[tuple[int, int]]:
    """``(address, bytes)`` of every CPU allocation (bytes > 0) and free (bytes < 0) in a
    finished ``torch.profiler.profile(profile_memory=True)``, in time order.

    Read from the profiler's raw results (``_ExtraFields_Allocation``, nanosecond
    timestamps), a private but stable part of ``torch.profiler`` that its own memory
    profiler (``torch.profiler._memory_profiler``) reads too; ``prof.events()`` carries only
    microsecond times, too coarse to order an allocation and a free in the same microsecond."""
    _EventType = profiler.event_types()
    found = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            found.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    found.sort(key=lambda item: item[0])
    return [(ptr, size) for _, ptr, size in found]
