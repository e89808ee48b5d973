"""The whole training step under one device budget: ``compile_offload.fit`` against FSDP2's own
CPU offload with per-block checkpointing, side by side in one process.

    python -m compile_offload bench --fit --model gpt --device cuda --layers 16 --width 2048 \\
        --heads 16 --seq 1024 --batch 1 --budgets 8GiB --out out/fit

The baseline is torch's recipe for a model whose state does not fit: every block wrapped in
``torch.utils.checkpoint`` (non-reentrant), then ``fully_shard`` with
``CPUOffloadPolicy`` on every block and on the root, eager, AdamW (``fused=True``, torch's
fastest on the host; ``fit`` gets the same) stepping on the host. It
runs first; on CUDA its device peak over a step (the optimizer step included) is measured at
the allocator, and ours runs under that peak as its budget (equal memory), then under each of
``--budgets`` (sizes: ``fit`` takes bytes). Each strategy builds the model on the host as a
user has it, runs ``warmup`` steps and then ``steps`` timed ones (forward, loss, backward,
``optimizer.step()``, ``zero_grad()``; ``fit`` first also the steps that measure where its
host state steps, whose means the table shows, and on CUDA its own measured step with any
correction of the blocks' budget); the device peak is that of the timed steps, absolute
(parameters, gradients, optimizer state and activations together: what ``fit``'s budget
bounds). One process group of one rank serves both (gloo on the CPU, nccl on CUDA).

On the CPU host and device memory are one: no device peak is measured, ours runs only at
``--budgets``, and only the times compare.

Writes ``{tag}_fit.jsonl`` (every row) and ``{tag}_fit.md`` (the table).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from compile_offload.passes.plan import format_bytes
from compile_offload.training.optimizer_step import DEVICE, HOST, TRIALS

from . import runner, workloads

BASELINE = "fsdp2_offload_ckpt"


class _Checkpointed(nn.Module):
    """A block whose activations are recomputed in the backward (``torch.utils.checkpoint``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _blocks_list(model: nn.Module) -> nn.ModuleList:
    from compile_offload.training.fit import default_blocks

    first = default_blocks(model)[0]
    return next(m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) and m[0] is first)


def _optimizer(params) -> torch.optim.Optimizer:
    # torch's fastest AdamW for both: the baseline's state steps on the host, where torch's
    # default (for-loop) implementation is several times slower than the fused one.
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def prepare_baseline(model: nn.Module, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Per-block checkpointing, then FSDP2 with ``CPUOffloadPolicy`` on every block and the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    import torch.distributed as dist

    blocks = _blocks_list(model)
    for index, block in enumerate(blocks):
        blocks[index] = _Checkpointed(block)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model, _optimizer(model.parameters())


# Steps run at most, after the first, for fit to settle (its optimizer step's untimed streamed
# step and trials, and on CUDA a measured step with up to two corrections, each compiling the
# blocks once more), with one to spare.
MAX_SETTLING_STEPS = 2 * TRIALS + 8


def _measure(step: Callable[[], None], device: torch.device, steps: int, warmup: int,
             settle: Callable[[], bool] = lambda: True) -> dict:
    """The first call timed on its own, then the steps until ``settle()`` (training steps all),
    ``warmup`` more, and ``steps`` timed ones."""
    started = time.perf_counter()
    step()
    runner.synchronize(device)
    first_call_s = time.perf_counter() - started
    for _ in range(MAX_SETTLING_STEPS):
        if settle():
            break
        step()
    for _ in range(warmup):
        step()
    peak = None
    if device.type == "cuda":
        runner.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = runner.time_steps_ms(step, steps, device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    return {"ms_median": statistics.median(times), "ms_all": [round(t, 4) for t in times],
            "first_call_s": round(first_call_s, 3), "device_peak_bytes": peak}


def run_baseline(suite: runner.Suite) -> dict:
    row = {"strategy": BASELINE}
    try:
        model, inputs, loss_fn = workloads.build(suite.workload, suite.size, "cpu", suite.dtype)
        inputs = tuple(t.to(suite.device).detach().requires_grad_(t.requires_grad) for t in inputs)
        model, optimizer = prepare_baseline(model, suite.device)

        def step() -> None:
            loss_fn(model(*inputs)).backward()
            optimizer.step()
            optimizer.zero_grad()

        row.update(_measure(step, suite.device, suite.steps, suite.warmup), status="ok")
    except Exception as error:  # an OOM or a failure of the recipe: recorded, the run goes on
        row.update(status="error", error=runner._describe(error))
    finally:
        model = optimizer = None
        runner.release_memory(suite.device)
    return row


def run_fit(suite: runner.Suite, budget: int, inner_compiler: str, why: str) -> dict:
    import compile_offload

    row = {"strategy": f"fit:{budget}", "budget_bytes": budget, "budget_from": why}
    fitted = None
    try:
        model, inputs, loss_fn = workloads.build(suite.workload, suite.size, "cpu", suite.dtype)
        inputs = tuple(t.to(suite.device).detach().requires_grad_(t.requires_grad) for t in inputs)
        fitted = compile_offload.fit(model, _optimizer, inputs, memory_budget=budget, loss_fn=loss_fn,
                                     device=suite.device, inner_compiler=inner_compiler)
        row["plan"] = str(fitted.plan)
        row["parameters_on"] = fitted.plan.parameters_on
        row["predicted_device_peak_bytes"] = fitted.plan.predicted_device_peak_bytes
        stepper = fitted.optimizer_step
        row.update(_measure(lambda: fitted.step(*inputs), suite.device, suite.steps, suite.warmup,
                            settle=lambda: fitted.settled), status="ok")
        row["budget_corrections"] = fitted.corrections
        row["per_block_budget_bytes"] = fitted.plan.per_block_activation_budget_bytes
        row["fit_measured_peak_bytes"] = fitted.plan.measured_device_peak_bytes
        row["optimizer_step"] = fitted.plan.optimizer_step if fitted.plan.cpu_offload else "device"
        if stepper is not None and stepper.times[HOST] and stepper.times[DEVICE]:
            row["optimizer_step_ms"] = {w: round(1e3 * sum(t) / len(t), 3) for w, t in stepper.times.items()}
    except Exception as error:
        row.update(status="error", error=runner._describe(error))
    finally:
        if fitted is not None:
            fitted.close()  # a group fit made (none here: the bench's own serves)
        fitted = None
        runner.dynamo.reset()
        runner.release_memory(suite.device)
    return row


def _one_rank_group(device: torch.device) -> bool:
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    return True


def run_fit_bench(suite: runner.Suite, budgets: list[int], inner_compiler: str,
                  progress: Callable[[str], None] = print) -> tuple[list[dict], str]:
    """The baseline, then ours at its device peak (CUDA) and at ``budgets``; the rows and the table."""
    import torch.distributed as dist

    created = _one_rank_group(suite.device)
    rows = []
    try:
        progress(f"{BASELINE}: per-block checkpointing, FSDP2 CPUOffloadPolicy on every block and the root")
        baseline = run_baseline(suite)
        rows.append(baseline)
        progress(_summary(baseline))
        planned = [(b, "--budgets") for b in budgets]
        if baseline.get("device_peak_bytes"):
            planned.insert(0, (baseline["device_peak_bytes"], f"{BASELINE}'s device peak"))
        for budget, why in planned:
            progress(f"fit at {format_bytes(budget)} ({why})")
            row = run_fit(suite, budget, inner_compiler, why)
            rows.append(row)
            progress(_summary(row))
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    reference = baseline.get("ms_median") if baseline.get("status") == "ok" else None
    for row in rows:
        if reference and row.get("status") == "ok":
            row["ms_vs_baseline"] = round(row["ms_median"] / reference, 4)
    out: Path = suite.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{suite.tag}_fit.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    table = fit_table(rows, suite)
    (out / f"{suite.tag}_fit.md").write_text(table + "\n")
    return rows, table


def _summary(row: dict) -> str:
    if row.get("status") != "ok":
        return f"  {row['strategy']}: {row.get('status')}: {row.get('error', '')}"
    peak = row.get("device_peak_bytes")
    return f"  {row['strategy']}: {row['ms_median']:.2f} ms per step" + (
        f", device peak {format_bytes(peak)}" if peak else "")


def fit_table(rows: list[dict], suite: runner.Suite) -> str:
    size = suite.size
    lines = [f"{suite.workload}: {size.layers} blocks of width {size.width}, {size.heads} heads, sequence {size.seq}, "
             f"batch {size.batch}, {str(suite.dtype).removeprefix('torch.')}, {suite.device.type}: {suite.steps} timed "
             f"steps after {suite.warmup} warm-up steps, AdamW's step included",
             "",
             "| strategy | budget | state placed | optimizer step | device peak | step | step / baseline |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.get("status") != "ok":
            lines.append(f"| {row['strategy']} | {_bytes(row.get('budget_bytes'))} | | | | {row.get('status')}: "
                         f"{row.get('error', '')[:120]} | |")
            continue
        budget = "" if row["strategy"] == BASELINE else f"{_bytes(row['budget_bytes'])} ({row['budget_from']})"
        lines.append(f"| {'FSDP2 CPU offload + per-block checkpointing' if row['strategy'] == BASELINE else 'fit'} | "
                     f"{budget} | {row.get('parameters_on', 'host')} | {_optimizer_step(row)} | "
                     f"{_bytes(row.get('device_peak_bytes'))} | "
                     f"{row['ms_median']:.2f} ms | {row.get('ms_vs_baseline', '')} |")
    if suite.device.type != "cuda":
        lines += ["", "On the CPU host and device memory are one: no device peak is measured."]
    return "\n".join(lines)


def _optimizer_step(row: dict) -> str:
    """Where the host state stepped, with the trials' means where both were measured."""
    where = row.get("optimizer_step", "host")
    times = row.get("optimizer_step_ms")
    return where if not times else f"{where} (host {times[HOST]:.1f} ms, streamed {times[DEVICE]:.1f} ms)"


def _bytes(value) -> str:
    return "" if value is None else format_bytes(value)


__all__ = ["BASELINE", "fit_table", "prepare_baseline", "run_baseline", "run_fit", "run_fit_bench"]
