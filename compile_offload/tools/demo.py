"""``python -m compile_offload demo``: plan and train a small GPT-style model for a few steps.

The quickest way to see the backend work on a new machine: it prints the plan for the
budget and the loss of each step, on the GPU when there is one, else on the CPU.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..benchmarks.workloads import DecoderBlock
from ..reporting.logs import latest_plans


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 128, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        # The block the benchmarks measure (pre-norm attention + MLP, causal SDPA).
        self.blocks = nn.Sequential(*[DecoderBlock(width, heads, 4 * width) for _ in range(layers)])
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(self.embed(tokens)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", default=None, help="memory budget: bytes ('64MiB') or a fraction ('0.5'); "
                        "default: COMPILE_OFFLOAD_MEMORY_BUDGET, else 0.5")
    parser.add_argument("--steps", type=_positive_int, default=3, help="training steps to run (default 3)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--inner-compiler", default=None, choices=("inductor", "eager"),
                        help="default: inductor on a GPU, eager on the CPU (Inductor's CPU compile is slow on small machines)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _device(name: str | None) -> torch.device:
    """The device ``--device`` names; ``SystemExit`` with the reason when it is not one the
    demo can train on."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise SystemExit(f"demo: --device {name!r} is not a device ({error}); use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"demo: --device {name!r}: the demo trains on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"demo: --device {name!r}: no CUDA device is available here; use cpu")
    return device


def run_demo(args: argparse.Namespace) -> int:
    import compile_offload
    from .. import settings as settings_mod
    from ..settings import parse_budget

    if args.budget is not None and not args.budget.strip():
        raise SystemExit(f"demo: --budget {args.budget!r}: an empty budget; leave --budget out for the demo's "
                         "default, give 'none' for no budget, else bytes ('4GiB') or a fraction ('0.5')")
    try:
        parse_budget(args.budget)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"demo: --budget: {error}") from None
    device = _device(args.device)
    inner = args.inner_compiler or ("inductor" if device.type == "cuda" else "eager")
    options = {"inner_compiler": inner}
    if args.budget is not None or compile_offload.config.memory_budget is None:
        # a string, parsed by compile_offload like the environment variable; else the config's
        options["memory_budget"] = "0.5" if args.budget is None else args.budget
    try:  # the environment's values too (COMPILE_OFFLOAD_MEMORY_BUDGET=5x), before the model is built
        settings_mod.resolve(options)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"demo: {error}") from None
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    tokens = torch.randint(0, 256, (8, 128), device=device)
    targets = torch.roll(tokens, -1, dims=1)
    compiled = torch.compile(model, backend=compile_offload.offload_remat(**options))
    earlier = {id(plan) for plan in latest_plans()}  # of other compiles in this process
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        started = time.perf_counter()
        loss = compiled(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:  # the plans the first step compiled: the ones it trains with (explain's may differ: with
            for plan in latest_plans():  # the eager inner compiler, explain traces Inductor's graph)
                if id(plan) not in earlier:
                    print(plan)
                    print()
        print(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - started:.2f} s, {device.type}, inner compiler {inner})")
    return 0
