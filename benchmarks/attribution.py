"""Where a plan's extra step time goes: one profiled training step of ``torch.compile`` and one
of ours at a budget, side by side in one process, the difference split by kind of kernel.

    python -m compile_offload bench --attribute --model gpt --device cpu --layers 2 --width 256 \\
        --seq 256 --batch 4 --budgets 0.5 --out out/attr

Each strategy runs ``warmup`` steps, then ``steps`` timed steps (the median is its step time),
then one step under ``torch.profiler``. Every event directly inside a compiled graph's call
(``## Call CompiledFxGraph``) is a kernel Inductor generated or an op it calls (on the CPU
the compiles run with ``cpp.enable_kernel_profile`` so that its C++ kernels are named); a call
inside the autograd engine's backward is the backward's. Kernels are told apart by their name
less its numeric suffix (``triton_poi_fused_add_mul_3`` -> ``triton_poi_fused_add_mul``), per
phase. Ours against compile, the difference in step time is split into:

- ``copies and waits``: our offload, reload and wait ops;
- ``extra calls``: a kernel both run, called more often by ours (a recomputed matmul), at
  compile's time per call;
- ``new kernels``: kernels only ours runs (recomputation, or a fusion the plan changed);
- ``kernels gone``: kernels only compile runs (negative);
- ``same kernels, slower``: the rest of the time of kernels both run (a kernel that fused
  otherwise, or contention);
- ``outside kernels``: the step's time not in any kernel (launches, Python, the GPU idle).

On CUDA the kernels' times are device times; on the CPU their own. The rows add up to the
difference of the profiled steps' times (the table shows the median of the timed steps too).

Writes ``{tag}_attribution.json`` (the kernels of both) and ``{tag}_attribution.md`` (the table).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from compile_offload.runtime.kernel_costs import children_of, compiled_calls

from . import runner, workloads
from .strategies import Strategy

OUR_OPS = "compile_offload::"
CATEGORIES = ("copies and waits", "extra calls", "new kernels", "kernels gone", "same kernels, slower",
              "outside kernels")


@dataclass
class Kernels:
    """One strategy's profiled step: seconds and calls per (phase, kernel stem), and its step time."""

    strategy: str
    step_seconds: float  # the median of the timed steps
    profiled_seconds: float  # the profiled step's own time (the profiler adds to it)
    seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, phase: str, name: str, seconds: float) -> None:
        key = (phase, stem(name))
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.calls[key] = self.calls.get(key, 0) + 1

    @property
    def kernel_seconds(self) -> float:
        return sum(self.seconds.values())

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "step_seconds": self.step_seconds,
                "profiled_seconds": self.profiled_seconds,
                "kernels": [{"phase": p, "kernel": k, "seconds": s, "calls": self.calls[(p, k)]}
                            for (p, k), s in sorted(self.seconds.items())]}


def stem(name: str) -> str:
    """A kernel's name less what numbers it within its graph: ``graph_3_cpp_fused_gelu_1`` and
    ``triton_poi_fused_gelu_7`` -> ``cpp_fused_gelu``, ``triton_poi_fused_gelu``."""
    name = re.sub(r"^graph_\d+_", "", name)
    return re.sub(r"_\d+$", "", name) if "::" not in name else name


def _phase(event) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if "Backward" in parent.name:
            return "backward"
        parent = parent.cpu_parent
    return "forward"


def kernels_of(events: Iterable, strategy: str, step_seconds: float, profiled_seconds: float, cuda: bool) -> Kernels:
    """The kernels of one profiled step (a profiler's ``FunctionEvent``s)."""
    found = Kernels(strategy, step_seconds, profiled_seconds)
    for call in compiled_calls(events):
        phase = _phase(call)
        for child in children_of(call, cuda):
            found.add(phase, child.name, child.seconds)
    return found


def attribute(reference: Kernels, ours: Kernels) -> dict[str, float]:
    """Seconds of ``ours``'s profiled step over ``reference``'s, by category (module
    docstring); they add up to the difference of the profiled steps' times."""
    split = dict.fromkeys(CATEGORIES, 0.0)
    for key in set(reference.seconds) | set(ours.seconds):
        mine, theirs = ours.seconds.get(key, 0.0), reference.seconds.get(key, 0.0)
        if key[1].startswith(OUR_OPS):
            split["copies and waits"] += mine - theirs
        elif key not in reference.seconds:
            split["new kernels"] += mine
        elif key not in ours.seconds:
            split["kernels gone"] -= theirs
        else:
            extra_calls = ours.calls[key] - reference.calls[key]
            per_call = theirs / reference.calls[key]
            split["extra calls"] += extra_calls * per_call
            split["same kernels, slower"] += mine - theirs - extra_calls * per_call
    split["outside kernels"] = ((ours.profiled_seconds - ours.kernel_seconds)
                                - (reference.profiled_seconds - reference.kernel_seconds))
    return split


def table(reference: Kernels, ours: Kernels, split: dict[str, float]) -> str:
    """The markdown table of ``attribute``'s split, with each strategy's step and kernel time."""
    extra = ours.profiled_seconds - reference.profiled_seconds
    rows = [f"| | {reference.strategy} | {ours.strategy} |", "|---|---|---|",
            f"| step (median of the timed steps) | {reference.step_seconds * 1e3:.3f} ms | "
            f"{ours.step_seconds * 1e3:.3f} ms ({ours.step_seconds / reference.step_seconds:.3f}x) |",
            f"| the profiled step | {reference.profiled_seconds * 1e3:.3f} ms | {ours.profiled_seconds * 1e3:.3f} ms |",
            f"| in kernels (profiled step) | {reference.kernel_seconds * 1e3:.3f} ms | {ours.kernel_seconds * 1e3:.3f} ms |",
            "", f"| where the profiled step's extra {extra * 1e3:+.3f} ms goes | ms | share |", "|---|---|---|"]
    for category in CATEGORIES:
        share = f"{split[category] / extra:.0%}" if abs(extra) > 1e-12 else "-"
        rows.append(f"| {category} | {split[category] * 1e3:+.3f} | {share} |")
    new = sorted(((s, k) for k, s in ours.seconds.items() if k not in reference.seconds), reverse=True)[:5]
    if new:
        rows += ["", "| largest new kernels | phase | ms | calls |", "|---|---|---|---|"]
        rows += [f"| `{k[1]}` | {k[0]} | {s * 1e3:.3f} | {ours.calls[k]} |" for s, k in new]
    return "\n".join(rows)


def profile(strategy: Strategy, suite: runner.Suite, inputs: Sequence, loss_fn: Callable) -> Kernels:
    """``strategy``'s step time (median of ``suite.steps``, after ``suite.warmup``) and the
    kernels of one more step, profiled."""
    from compile_offload.torch_api import dynamo, inductor

    dynamo.reset()
    runner.release_memory(suite.device)
    cuda = suite.device.type == "cuda"
    with inductor.config.patch({"cpp.enable_kernel_profile": True}), strategy.run_context():
        model, _, _ = workloads.build(suite.workload, suite.size, suite.device, suite.dtype)
        fn = strategy.prepare(model)

        def step() -> None:
            with strategy.forward_context(suite.device):
                loss = loss_fn(fn(*inputs))
            loss.backward()

        for _ in range(1 + suite.warmup + strategy.trial_steps):
            step()
        runner.zero_grads(model, inputs)
        seconds = statistics.median(runner.time_steps_ms(step, suite.steps, suite.device)) * 1e-3
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        runner.synchronize(suite.device)
        with torch.profiler.profile(activities=activities) as prof:
            started = time.perf_counter()
            step()
            runner.synchronize(suite.device)
            profiled = time.perf_counter() - started
    found = kernels_of(prof.events(), strategy.name, seconds, profiled, cuda)
    dynamo.reset()
    runner.release_memory(suite.device)
    return found


def run_attribution(suite: runner.Suite, reference: Strategy, ours: Strategy) -> tuple[dict, str]:
    """Profile ``reference`` then ``ours`` on the suite's workload; the split and the table."""
    _, inputs, loss_fn = workloads.build(suite.workload, suite.size, suite.device, suite.dtype)
    first = profile(reference, suite, inputs, loss_fn)
    second = profile(ours, suite, inputs, loss_fn)
    split = attribute(first, second)
    text = table(first, second, split)
    suite.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"environment": runner.describe_environment(suite), "split_seconds": split,
              "strategies": [first.to_json(), second.to_json()]}
    (suite.out_dir / f"{suite.tag}_attribution.json").write_text(json.dumps(result, indent=1, default=str))
    (suite.out_dir / f"{suite.tag}_attribution.md").write_text(text + "\n")
    return result, text
