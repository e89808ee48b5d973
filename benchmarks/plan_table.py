"""Predicted plans for the GPT-8 anchor shapes over a sweep of budgets, as a markdown table.

Runs anywhere (the model is built on the meta device and planned for a named profile):

    python -m compile_offload.benchmarks.plan_table --profile h100 --budgets none,0.75,0.5,0.25,1.9GB,0
    python -m compile_offload.benchmarks.plan_table --layers 96 --width 1024 --seq 4096 --batch 4 --budgets 2GB --offload on
"""

from __future__ import annotations

import argparse
import time

import torch

import compile_offload
from compile_offload.passes.plan import format_bytes

from .workloads import Decoder


def gpt8_on_meta(layers: int = 8, width: int = 2048, heads: int = 16, seq: int = 2048, batch: int = 8):
    with torch.device("meta"):
        model = Decoder(layers, width, heads).to(torch.bfloat16)
        x = torch.randn(batch, seq, width, dtype=torch.bfloat16, requires_grad=True)
    return model, x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h100")
    parser.add_argument("--budgets", default="none,0.75,0.5,0.25,1.9GB,0")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--offload", choices=("on", "off", "both"), default="both")
    args = parser.parse_args(argv)
    model, x = gpt8_on_meta(args.layers, args.width, args.heads, args.seq, args.batch)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.offload]
    print(f"GPT {args.layers}x d{args.width}, seq {args.seq}, batch {args.batch}, bf16, profile {args.profile}, "
          f"torch {torch.__version__}\n")
    print("| budget | offload | predicted peak | predicted step | vs unconstrained | keep / recompute / offload | feasible | planning s |")
    print("|---|---|---|---|---|---|---|---|")
    for text in args.budgets.split(","):
        for offload in modes:
            started = time.perf_counter()
            plan = compile_offload.explain(model, x, memory_budget=text, device_profile=args.profile,
                                           offload=offload)
            seconds = time.perf_counter() - started
            ratio = plan.predicted_step_seconds / plan.baseline_step_seconds
            print(f"| {text} | {'on' if offload else 'off'} | {format_bytes(plan.predicted_peak_bytes)} | "
                  f"{plan.predicted_step_seconds * 1e3:.1f} ms | {ratio:.3f}x | "
                  f"{plan.count('keep')} / {plan.count('recompute')} / {plan.count('offload')} | "
                  f"{'yes' if plan.feasible else 'no'} | {seconds:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
