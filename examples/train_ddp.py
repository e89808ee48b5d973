"""Train a small model with DistributedDataParallel and the ``offload_remat`` backend.

    torchrun --nproc-per-node 2 examples/train_ddp.py                 # 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/train_ddp.py --budget 28MiB  # 7 MiB for each of 4 bucket graphs
    torchrun --nproc-per-node 2 examples/train_ddp.py --one-graph     # the budget bounds the step
    torchrun --nproc-per-node 1 examples/train_ddp.py --check         # 1 GPU: NCCL, checked against eager DDP

On CPUs the ranks talk over gloo, on GPUs over NCCL (one GPU per rank). Rank 0 prints each
compiled graph's plan (the ``compile_offload`` INFO log line) and the loss of each step.

The model's blocks hold 1 MiB of parameters each, and DDP buckets are 1 MiB
(``--bucket-cap-mb``), so Dynamo's DDPOptimizer compiles one graph per block. A byte budget
(``--budget 28MiB``) is then split evenly over those N bucket graphs, B/N each, which keeps
the step within B when every bucket graph's plan fits its share; a fraction (the default
``0.6``) applies to each bucket graph's own unconstrained plan (see docs/integrations.md, "DDP").
``--one-graph`` sets ``torch._dynamo.config.optimize_ddp = False``: one graph for the whole
model, whose budget bounds the step and can go lower, at the cost of all-reducing the
gradients after the backward instead of during it.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import compile_offload


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc2(F.gelu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget", default="0.6",
                        help="memory budget per rank: a size such as 64MiB (under DDPOptimizer split evenly over the "
                             "bucket graphs), a fraction of each compiled graph's unconstrained plan, or none")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512, help="rows of each rank's batch")
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
    parser.add_argument("--one-graph", action="store_true",
                        help="torch._dynamo.config.optimize_ddp = False: one graph, the budget bounds the step")
    parser.add_argument("--inner-compiler", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--offload", choices=["on", "off"], default="on")
    parser.add_argument("--check", action="store_true", help="also train eager DDP and compare the gradients")
    return parser.parse_args(argv)


def set_up() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (or a 1-rank group without torchrun)."""
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), device


def batch(rank: int, step: int, args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
    return torch.randn(args.tokens, args.width, generator=generator).to(device)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, device = set_up()
    if rank == 0:
        print(f"{world} rank(s), {dist.get_backend()} on {device.type}; budget {args.budget}; "
              f"{'one graph' if args.one_graph else 'one graph per DDP bucket (DDPOptimizer)'}", flush=True)
        # One line per compiled graph: its budget, predicted peak, keep / recompute / offload;
        # under DDPOptimizer also one line saying how the budget is shared by the bucket graphs.
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("plan: %(message)s"))
        logger = logging.getLogger("compile_offload")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    torch._dynamo.config.optimize_ddp = not args.one_graph

    torch.manual_seed(0)
    model = Net(args.width, args.blocks).to(device)
    reference = copy.deepcopy(model) if args.check else None
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    backend = compile_offload.offload_remat(memory_budget=args.budget, inner_compiler=args.inner_compiler,
                                            offload=args.offload == "on")
    step_fn = torch.compile(ddp, backend=backend)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    if reference is not None:
        reference_ddp = nn.parallel.DistributedDataParallel(reference, bucket_cap_mb=args.bucket_cap_mb)
        reference_optimizer = torch.optim.SGD(reference_ddp.parameters(), lr=0.01, momentum=0.9)

    worst = 0.0
    for step in range(args.steps):
        x = batch(rank, step, args, device)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = step_fn(x).square().mean()
        loss.backward()
        if reference is not None:
            reference_optimizer.zero_grad(set_to_none=True)
            reference_loss = reference_ddp(x).square().mean()
            reference_loss.backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                if not torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5):
                    raise SystemExit(f"rank {rank} step {step}: gradient of {name} differs from eager DDP "
                                     f"by {(p.grad - q.grad).abs().max().item():.3g}")
                worst = max(worst, (p.grad - q.grad).abs().max().item())
            reference_optimizer.step()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.5f} ({time.perf_counter() - started:.2f} s)", flush=True)
    if rank == 0 and reference is not None:
        print(f"gradients match eager DDP on every step (largest difference {worst:.3g})", flush=True)
    # Let gloo's worker thread finish the last all-reduces (it needs the GIL to free them)
    # before DDP and the process group are torn down: without it, the teardown of the
    # one-graph run could deadlock at exit (main thread joining gloo's thread with the GIL).
    dist.barrier()
    del step_fn, ddp
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
