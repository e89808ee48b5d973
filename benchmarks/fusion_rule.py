"""The step time of one budgeted plan with and without the horizontal-fusion rule.

Under a budget the backend compiles with ``compile_offload.inductor.plan_order_fusion``: Inductor
may not join two kernels that only share a read where the later one waits for work placed
after the earlier one. A refused pair reads its shared buffer twice. This compiles each
model of the budget contract (``budget_contract.build``) twice under the same byte budget,
with the rule and without it (the same plan: the planner's own model does not change), and
times the two steps interleaved in one process, gradients set to None before each.

    python -m compile_offload.benchmarks.fusion_rule                               # CPU, 0.6
    python -m compile_offload.benchmarks.fusion_rule --models hf_gpt2 --fraction 0.4 --device cuda

The budget is ``--fraction`` of the unconstrained step's measured peak, as the contract
sets it. A plan that the budget loop re-plans may differ between the two compiles (its
scheduled peak depends on the rule); the line says so. Ratios only: absolute times are the
machine's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import compile_offload
from compile_offload.reporting import logs
from compile_offload.inductor import plan_order_fusion
from compile_offload.torch_api import dynamo, functorch, inductor

from .budget_contract import MODELS, _on, available, build, measure_point


def _compiled(name: str, device: str, budget: int, rule: bool):
    model, inputs, loss_of = build(name)
    model, inputs = _on(device, model, inputs)
    model.train()
    keeping = plan_order_fusion.keeping_plan_order
    if not rule:  # the backend looks the wrapper up at each compile
        plan_order_fusion.keeping_plan_order = lambda inner_compile: inner_compile
    try:
        dynamo.reset()
        with inductor.config.patch(fx_graph_cache=False), \
                functorch.config.patch(enable_autograd_cache=False):
            step = torch.compile(lambda *args: loss_of(model(*args)), backend=compile_offload.offload_remat(
                memory_budget=budget, device_profile="cpu" if device == "cpu" else None))
            step(*inputs).backward()
    finally:
        plan_order_fusion.keeping_plan_order = keeping
    plan = logs.latest_plans()[-1]
    return model, inputs, step, plan


def compare(name: str, fraction: float, device: str, steps: int) -> str:
    unconstrained = measure_point(name, None, device=device)
    budget = int(fraction * unconstrained.measured_bytes)
    runs = {rule: _compiled(name, device, budget, rule) for rule in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(steps):
        for rule, (model, inputs, step, _) in runs.items():
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(*inputs).backward()
            if device == "cuda":
                torch.cuda.synchronize()
            times[rule].append(time.perf_counter() - start)
    with_rule, without = (statistics.median(times[rule]) for rule in (True, False))
    same = runs[True][3].summary() == runs[False][3].summary()
    return (f"| {name} | {fraction:g} | {min(times[True]) * 1e3:.2f} / {with_rule * 1e3:.2f} ms | "
            f"{min(times[False]) * 1e3:.2f} / {without * 1e3:.2f} ms | {with_rule / without:.3f} | "
            f"{'same plan' if same else 'plans differ'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="hf_gpt2,transformer,hf_llama",
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--fraction", type=float, default=0.6, help="the budget, of the unconstrained measured peak")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=60, help="timed steps of each, interleaved")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {args.device}, {args.steps} steps each, interleaved")
    print("| model | budget | with the rule: best / median | without: best / median | median ratio | plans |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        if not available(name):
            print(f"| {name} | skipped: needs transformers | | | | |")
            continue
        print(compare(name, args.fraction, args.device, args.steps), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
