"""``compile_offload.profile_step``: measured GPU memory of one step against the plan.

Records a CUDA memory snapshot (``torch.cuda.memory._record_memory_history``) around one
call, saves it (``snapshot.pickle``, viewable at https://pytorch.org/memory_viz) and draws
``measured.png``: allocated memory above the start of the step over the step's progress,
with the predicted timeline of each plan given (e.g. ``compile_offload.explain_all``'s)
over the same axis, and their budgets. Allocator events and planner steps are not one to
one, so both are drawn against the fraction of the step done.
"""

from __future__ import annotations

import linecache
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..runtime.memory_tracker import allocator_block_bytes, measure_peak
from ..passes.plan import Plan
from ..torch_api import profiler


def allocated_over_time(snapshot: dict, device: int = 0) -> list[int]:
    """Bytes allocated after each allocator event of ``snapshot``, relative to the start
    (each request rounded to the allocator's block, ``allocator_block_bytes``)."""
    live, series = 0, []
    for event in snapshot.get("device_traces", [[]])[device]:
        if event["action"] == "alloc":
            live += allocator_block_bytes(event["size"])
        elif event["action"] == "free_completed":
            live -= allocator_block_bytes(event["size"])
        else:
            continue
        series.append(live)
    return series


@dataclass
class LiveBlock:
    """An allocation made during a recorded step and alive at its peak."""

    nbytes: int  # as the allocator counts it: the request rounded to its block
    frames: list[str]  # innermost first: "file:line in function: source line"


def live_at_peak(snapshot: dict, device: int = 0) -> tuple[int, list[LiveBlock]]:
    """The most bytes allocated above the start of the recorded step (``allocated_over_time``'s
    maximum, the first time it is reached) and the allocations made during the step that are
    alive then, largest first. Blocks allocated before recording started are not listed, and
    their frees lower the running total, as they lower ``torch.cuda.memory_allocated``. This
    is what tells which buffer of a generated program, or which op's own workspace, a
    prediction missed: each block's frames name the line that allocated it."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for event in snapshot.get("device_traces", [[]])[device]:
        if event["action"] == "alloc":
            total += allocator_block_bytes(event["size"])
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            total -= allocator_block_bytes(event["size"])
            live.pop(event["addr"], None)
        else:
            continue
        if total > peak:
            peak, at_peak = total, list(live.values())
    blocks = [LiveBlock(allocator_block_bytes(event["size"]), [_frame(f) for f in event.get("frames", [])])
              for event in at_peak]
    return peak, sorted(blocks, key=lambda block: -block.nbytes)


def _frame(frame: dict) -> str:
    source = linecache.getline(frame.get("filename", ""), frame.get("line", 0)).strip()
    where = f"{frame.get('filename', '?')}:{frame.get('line', '?')} in {frame.get('name', '?')}"
    return f"{where}: {source}" if source else where


def describe_live_at_peak(snapshot: dict, device: int = 0, frames: int = 3, top: int = 25) -> str:
    """``live_at_peak`` as text: the peak, then each of the ``top`` largest blocks with its
    ``frames`` innermost frames outside torch's own Python files (the generated program's
    line or the user's; torch's frames when there are no others)."""
    peak, blocks = live_at_peak(snapshot, device)
    lines = [f"peak {peak} bytes above the step's start; {len(blocks)} blocks allocated in the step alive then"]
    for block in blocks[:top]:
        outside = [f for f in block.frames if f"{os.sep}torch{os.sep}" not in f.split(":", 1)[0]]
        lines.append(f"  {block.nbytes:>12} bytes")
        lines += [f"      {frame}" for frame in (outside or block.frames)[:frames]]
    if len(blocks) > top:
        lines.append(f"  ... {len(blocks) - top} smaller blocks, {sum(b.nbytes for b in blocks[top:])} bytes")
    return "\n".join(lines)


def profile_step(fn: Callable[..., Any], *args: Any, out: str | Path = "profile",
                 plans: Sequence[Plan] | None = None) -> dict:
    """Run ``fn(*args)`` once under the CUDA memory recorder; returns the measured peak
    above the start of the step, the files written, the bytes ``plans`` offload
    (``offloaded_bytes``) and the pinned host memory held after the step
    (``pinned_host_bytes``, the pinned pool's ``bytes_held``). ``plans`` drawn over the measured
    curve default to the latest plan of each graph partitioned in this process (compiled
    or explained), including those ``fn`` compiled; pass ``[]`` for none."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "compile_offload.profile_step records a CUDA memory snapshot and needs a GPU; on the CPU measure "
            "the peak with compile_offload.measure_peak('cpu') instead"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with measure_peak(torch.device("cuda", torch.cuda.current_device())) as measured:
        profiler.record_memory_history(max_entries=1_000_000, clear_history=True)  # not an earlier step's events
        try:
            fn(*args)
            torch.cuda.synchronize()
            snapshot = profiler.memory_snapshot()
        finally:
            profiler.record_memory_history(enabled=None)
    measured_peak = measured.peak_bytes
    (out / "snapshot.pickle").write_bytes(pickle.dumps(snapshot))
    series = allocated_over_time(snapshot, torch.cuda.current_device())
    if plans is None:
        from ..reporting.logs import latest_plans

        plans = latest_plans()
    _draw(out / "measured.png", series, plans)
    from ..runtime.pinned_pool import get_pool

    return {"measured_peak_bytes": measured_peak, "snapshot": str(out / "snapshot.pickle"),
            "plot": str(out / "measured.png"),
            # Host side: bytes the plans offload, and the pinned host memory the process's
            # pool holds after the step (page-locked bytes, as the pool counts them).
            "offloaded_bytes": sum(plan.bytes_of("offload") for plan in plans),
            "pinned_host_bytes": get_pool().stats().bytes_held}


def _progress(series: Sequence) -> list[float]:
    return [index / max(len(series) - 1, 1) for index in range(len(series))]


def _draw(path: Path, series: list[int], plans: Sequence[Plan]) -> None:
    from ..reporting.plotting import new_figure

    figure, axes = new_figure((10, 4))
    axes.plot(_progress(series), [b / 2**20 for b in series], label="measured (allocated above step start)")
    for plan in plans:
        predicted = plan.timeline_bytes or [plan.predicted_peak_bytes]
        axes.plot(_progress(predicted), [b / 2**20 for b in predicted], linestyle="--",
                  label=f"{plan.graph_name} predicted")
        if plan.budget_bytes is not None:
            axes.axhline(plan.budget_bytes / 2**20, color="red", linestyle=":", label=f"{plan.graph_name} budget")
    axes.set_xlabel("fraction of the step")
    axes.set_ylabel("MiB")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
