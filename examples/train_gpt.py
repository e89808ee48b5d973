"""Train a small GPT-style language model with the ``offload_remat`` backend: a plain loop.

    python examples/train_gpt.py                                   # tiny sizes, a few seconds on a CPU
    python examples/train_gpt.py --budget 0.25 --dump-dir dump     # a quarter of the activation memory; dump the plan
    python examples/train_gpt.py --budget 64MiB --layers 8 --width 512 --seq 1024 --device cuda
    python -m compile_offload explain examples/train_gpt.py:make --budget 0.5 --profile h100   # plan only

Prints the plan of each compiled graph (the ``compile_offload`` INFO log line: budget,
predicted peak, keep / recompute / offload counts) and the loss of each step. With
``--check`` it also trains a copy of the model without our backend, from the same weights
on the same batches, and prints the largest difference between the two runs' losses.

The model is ``compile_offload.tools.demo.TinyGPT``: token embedding, pre-LN decoder blocks
(causal attention, GELU MLP), a linear head and the cross-entropy loss, all inside the
compiled forward. On the CPU the partitioned graphs run as Python (``--inner-compiler
eager``, the default there): Inductor's CPU code generation takes minutes on a small machine.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time

import torch

import compile_offload
from compile_offload.tools.demo import TinyGPT

VOCAB = 256


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default=None,
                        help="memory budget of each compiled graph: a fraction of the activations the "
                             "unconstrained plan saves ('0.75'), a size ('64MiB'), or 'none'; default: "
                             "compile_offload.config (COMPILE_OFFLOAD_MEMORY_BUDGET), 0.75 where that is unset")
    parser.add_argument("--profile", default=None,
                        help="device profile of the cost model: h100, h200, a100, rtx4090, cpu (default: "
                             "compile_offload.config: measure this machine's GPU, or 'cpu' without one)")
    parser.add_argument("--dump-dir", default=None,
                        help="write each graph's plan, graphs and predicted timeline under this folder "
                             "(default: compile_offload.config, COMPILE_OFFLOAD_DUMP_DIR)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--inner-compiler", choices=("inductor", "eager"), default=None,
                        help="default: inductor on a GPU, eager on the CPU")
    parser.add_argument("--offload", choices=("on", "off"), default=None,
                        help="let the planner offload saved tensors to host memory; default: compile_offload.config "
                             "(COMPILE_OFFLOAD_OFFLOAD, on). The cpu profile never offloads (host memory is the "
                             "CPU's own memory there, so a copy frees nothing)")
    parser.add_argument("--check", action="store_true",
                        help="also train without our backend and compare the losses")
    return parser.parse_args(argv)


def batches(args: argparse.Namespace, device: torch.device):
    """``args.steps`` batches of random tokens; each target is the next token."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=generator).to(device)
        yield tokens[:, :-1], tokens[:, 1:]


def train(model: torch.nn.Module, step_fn, args: argparse.Namespace, device: torch.device, label: str) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step, (tokens, targets) in enumerate(batches(args, device)):
        started = time.perf_counter()
        loss = step_fn(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"{label} step {step}: loss {losses[-1]:.4f} ({time.perf_counter() - started:.2f} s)")
    return losses


def make(layers: int = 2, width: int = 64, heads: int = 4, seq: int = 64, batch: int = 4, device="meta"):
    """``(model, (tokens, targets))`` for ``python -m compile_offload explain
    examples/train_gpt.py:make``; on the ``meta`` device by default (nothing runs)."""
    with torch.device(device):
        model = TinyGPT(vocab=VOCAB, width=width, heads=heads, layers=layers)
        tokens = torch.randint(0, VOCAB, (batch, seq))
        return model, (tokens, torch.roll(tokens, -1, dims=1))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"train_gpt: --steps {args.steps}: train at least one step")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    inner = args.inner_compiler or ("inductor" if device.type == "cuda" else "eager")

    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, width=args.width, heads=args.heads, layers=args.layers).to(device)
    reference = copy.deepcopy(model) if args.check else None

    # The options given on the command line, on top of compile_offload.config and the
    # COMPILE_OFFLOAD_* variables (which set the rest), validated here: a bad budget or
    # profile fails before anything runs.
    if args.budget is None and compile_offload.config.memory_budget is None:
        args.budget = "0.75"
    given = {"memory_budget": args.budget, "device_profile": args.profile, "dump_dir": args.dump_dir,
             "offload": None if args.offload is None else args.offload == "on"}
    options = {name: value for name, value in given.items() if value is not None}
    try:
        backend = compile_offload.offload_remat(inner_compiler=inner, **options)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"train_gpt: {error}") from None

    # The plan of each compiled graph is one INFO line of the "compile_offload" logger.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("plan: %(message)s"))
    logger = logging.getLogger("compile_offload")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    compiled = torch.compile(model, backend=backend)
    budget = options.get("memory_budget", compile_offload.config.memory_budget)
    offload = options.get("offload", compile_offload.config.offload)
    print(f"training {args.layers}x d{args.width} seq {args.seq} batch {args.batch} on {device.type}, "
          f"budget {budget}, offload {'on' if offload else 'off'}, inner compiler {inner}")
    losses = train(model, compiled, args, device, "offload_remat")
    logger.removeHandler(handler)
    if args.dump_dir:
        print(f"dump: {args.dump_dir} (plan.json, report.md, timeline.png per graph)")

    if reference is not None:
        expected = train(reference, reference, args, device, "eager")
        difference = max(abs(a - b) for a, b in zip(losses, expected))
        print(f"largest loss difference against eager: {difference:.2e}")
        if difference > 1e-3:
            print("check failed: the losses differ", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
