"""model-check's predictions of torch's own plans, checked at the CPU allocator.

``python -m compile_offload model-check`` predicts the peak of torch's partitions of the
anchor decoder (``torch.compile`` default and ``activation_memory_budget``) from the
meta-device joint graph, and compares with H100 measurements it cannot reproduce here. This
runs the same predictions (``model_check.predicted_peak`` of the saved set torch's
partitioner chooses, the eager loss and the input's gradient included) on a small decoder of
the same block, and measures the same step as ``bench_anchors.py`` (compiled model, its
output held while the eager ``y.float().pow(2).mean()`` loss and the backward run, gradients
zeroed in place, two steps measured) with Inductor on the CPU, at the allocator
(``compile_offload.measure_peak``), with Inductor's peak-memory reordering on (torch's
default, as the anchors ran) and off.

    python -m compile_offload.benchmarks.torch_plans_cpu                 # 2 layers, d 256
    python -m compile_offload.benchmarks.torch_plans_cpu --layers 4 --seq 1024

What it can tell: whether the simulator's model of torch's plans is low against the code
Inductor generates for them on this device; not what a GPU's kernels hold.
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import dataclass

import torch

from compile_offload.passes.inductor.rules import INDUCTOR
from compile_offload.tools import model_check
from compile_offload.runtime.memory_tracker import measure_peak
from compile_offload.passes import compat
from compile_offload.passes.analyze import analyze_joint
from compile_offload.passes.plan import format_bytes
from compile_offload.torch_api import dynamo, functorch, inductor

from .workloads import Decoder

STRATEGIES = {"compile": None, "compile_budget_0.5": 0.5, "compile_budget_0.0": 0.0}


@dataclass
class Row:
    strategy: str
    reorder_for_peak_memory: bool
    predicted_bytes: int
    measured_bytes: int

    @property
    def error(self) -> float:
        return self.predicted_bytes / self.measured_bytes - 1


def predicted_peaks(args: dict, strategies: dict[str, float | None]) -> dict[str, int]:
    """Each strategy's predicted peak, built as ``model_check.torch_plans`` builds the anchors'."""
    model, x = model_check.decoder_on_meta(args)
    joint = model_check.capture_joint(model, x)
    analysis = analyze_joint(joint, INDUCTOR)
    loss_bytes = model_check.loss_peak_bytes(args)
    input_grad = model_check.input_grad_bytes(args)  # measured over two steps, as the anchors are
    peaks = {}
    for strategy, budget in strategies.items():
        saved = compat.min_cut_saved_values(joint) if budget is None else compat.budget_saved_values(joint, budget)
        peaks[strategy] = model_check.predicted_peak(analysis, set(saved), loss_bytes) + input_grad
    return peaks


def measured_peak(args: dict, budget: float | None, reorder: bool, warmup: int = 1, steps: int = 2) -> int:
    """The allocator's peak of the anchor step compiled by torch under ``budget`` (None: torch's
    default), run as ``bench_anchors.py`` runs it: the output held while the eager loss and
    the backward run, ``warmup`` steps (the first compiles), gradients zeroed in place, then
    ``steps`` measured steps in one region."""
    torch.manual_seed(0)
    dtype = getattr(torch, args["dtype"])
    model = Decoder(args["layers"], args["d"], args["heads"]).to(dtype)
    x = torch.randn(args["batch"], args["seq"], args["d"], dtype=dtype, requires_grad=True)
    dynamo.reset()
    with functorch.config.patch(activation_memory_budget=1.0 if budget is None else budget,
                                       enable_autograd_cache=False), \
            inductor.config.patch(reorder_for_peak_memory=reorder, fx_graph_cache=False):
        compiled = torch.compile(model)

        def step():
            y = compiled(x)
            y.float().pow(2).mean().backward()

        for _ in range(warmup):
            step()
        model.zero_grad(set_to_none=False)
        x.grad = None
        with measure_peak("cpu") as measured:
            for _ in range(steps):
                step()
    dynamo.reset()
    return measured.peak_bytes


def measure(args: dict, strategies: dict[str, float | None] = STRATEGIES,
            reorders: tuple[bool, ...] = (True, False)) -> list[Row]:
    predicted = predicted_peaks(args, strategies)
    return [Row(strategy, reorder, predicted[strategy], measured_peak(args, budget, reorder))
            for reorder in reorders for strategy, budget in strategies.items()]


def table(rows: list[Row]) -> str:
    lines = ["| strategy | reorder_for_peak_memory | predicted peak | measured peak | predicted error |",
             "|---|---|---|---|---|"]
    lines += [f"| {r.strategy} | {r.reorder_for_peak_memory} | {format_bytes(r.predicted_bytes)} | "
              f"{format_bytes(r.measured_bytes)} | {r.error:+.1%} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    options = parser.parse_args(argv)
    if options.d % options.heads:
        parser.error(f"--d {options.d} is not divisible by --heads {options.heads}")
    args = dict(layers=options.layers, d=options.d, heads=options.heads, ff=4 * options.d, seq=options.seq,
                batch=options.batch, dtype=options.dtype)
    rows = measure(args)
    print(f"torch {torch.__version__}, {datetime.date.today()}, CPU, Inductor; decoder {args}; predicted under "
          "model-check's construction (torch's saved set, our simulator, eager loss), measured at the CPU allocator "
          "(compile_offload.measure_peak)\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
