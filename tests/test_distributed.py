"""Distributed training with the offload_remat backend, on CPU: 2 ranks with gloo on localhost.

The scenarios run in one spawn per module (``torch.multiprocessing`` with the spawn start
method, a free TCP port, a deadline after which the ranks are killed: starting the ranks
and importing torch costs more than most scenarios), and their results are checked by
several tests:

* **DDP** with Dynamo's DDPOptimizer, buckets small enough that it compiles one graph per
  block: losses and gradients equal eager DDP over three optimizer steps with every saved
  tensor recomputed or offloaded where it can be; a byte budget B split evenly over the N
  bucket graphs (B // N each), the measured step peak within B when every bucket plan fits
  (the step is bounded by the sum of the bucket graphs' peaks), gradients equal eager DDP,
  and the fallback (whole budget per graph, one warning) when N cannot be found; with
  ``optimize_ddp=False`` one graph, and the budget bounds the step.
* **FSDP2** (``fully_shard``): losses and sharded gradients equal eager FSDP2. On torch
  2.13 FSDP2's hooks (its all-gathers and reduce-scatters) run outside the compiled graphs
  (they are ``torch._dynamo.disable``d), so the graphs see unsharded parameters as inputs:
  never offloaded, never recomputed, and freed by FSDP2 after the forward although the
  backward graph holds them.
* **Collectives inside a graph** (functional all-gathers, as a hand-written FSDP does):
  never recomputed, the all-gathered parameters never offloaded, gradients equal eager.

Memory is measured with ``compile_offload.runtime.memory_tracker.measure_peak`` (the CPU allocator) on rank 0
(exact tensor bytes of the compiled code's allocations).

Also here: the ``examples/train_ddp.py`` example run under ``torchrun`` on 2 CPU ranks, and
a 1-rank NCCL run (``cuda``; skipped without a GPU).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD_SIZE = 2
SPAWN_TIMEOUT_S = 150  # per spawn (about 20 s on an idle 2-core machine) and per torchrun
REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


# --------------------------------------------------------------------------- spawning


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank: int, scenario, port: int, folder: str) -> None:
    torch.set_num_threads(1)  # 2 ranks on as few as 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=SPAWN_TIMEOUT_S))
    try:
        torch.manual_seed(0)
        result = scenario(rank)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        dist.barrier()  # see examples/train_ddp.py: gloo's thread frees the last work first
    finally:
        dist.destroy_process_group()


def _spawn(scenario, folder: Path) -> list[dict]:
    """Run ``scenario(rank)`` on 2 gloo ranks; its return values, per rank."""
    context = mp.start_processes(_rank_entry, args=(scenario, _free_port(), str(folder)), nprocs=WORLD_SIZE,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{scenario.__name__} did not finish within {SPAWN_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


def _run_bounded(command: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run ``command`` (torchrun and its ranks) in its own session; past the deadline kill
    the whole session, ranks included, and fail."""
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=SPAWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(command)} did not finish within {SPAWN_TIMEOUT_S} s:\n{(stdout + stderr)[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


class _Capture:
    """While entered: every plan the backend makes in this process, with the joint graph's
    collectives and the forward and backward graphs' collectives and offloaded tensors."""

    def __enter__(self) -> _Capture:
        from compile_offload.pipeline import partitioner

        self.graphs: list[dict] = []
        self._original = plan_partition = partitioner.plan_partition
        capture = self

        def plan_and_capture(joint_gm, *args, **kwargs):
            joint = _collectives(joint_gm)  # before planning prepares the graph
            result = plan_partition(joint_gm, *args, **kwargs)
            capture.graphs.append({
                "plan": result.plan,
                "joint_collectives": joint,
                "partitioned_collectives": sorted(_collectives(result.fw_gm) + _collectives(result.bw_gm)),
                "offloaded": _offloaded_sources(result.fw_gm),
            })
            return result

        partitioner.plan_partition = plan_and_capture
        return self

    def __exit__(self, *exc) -> None:
        from compile_offload.pipeline import partitioner

        partitioner.plan_partition = self._original

    def plans(self):
        return [g["plan"] for g in self.graphs]


def _collectives(gm: torch.fx.GraphModule) -> list[str]:
    from compile_offload.passes.analyze import is_collective

    return sorted(str(n.target) for n in gm.graph.nodes if is_collective(n))


def _offloaded_sources(fw_gm: torch.fx.GraphModule) -> list[dict]:
    """For each offload op of the forward graph: what it copies (placeholder? collective?)."""
    from compile_offload.passes.analyze import collective_source

    found = []
    for node in fw_gm.graph.nodes:
        if node.meta.get("offload", {}).get("role") == "offload":
            source = node.args[0]
            base = source
            while base.op == "call_function" and getattr(base.target, "is_view", False):
                base = base.args[0]
            found.append({"name": source.name, "input_or_view_of_input": base.op == "placeholder",
                          "collective": collective_source(source) is not None})
    return found


# --------------------------------------------------------------------------- models


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc2(F.gelu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, width: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(rank: int, step: int, tokens: int = 64, width: int = 32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)  # different data per rank
    return torch.randn(tokens, width, generator=generator)


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _ddp(model: nn.Module, bucket_bytes: int) -> nn.parallel.DistributedDataParallel:
    # DDPOptimizer requires the first bucket (1 MiB by default) to be no larger than the
    # others; a tiny model needs a tiny first bucket to be split at all.
    dist._DEFAULT_FIRST_BUCKET_BYTES = bucket_bytes
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_bytes / 2**20)


def _train(forward, model: nn.Module, rank: int, steps: int = 3) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = forward(_batch(rank, step)).square().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: _local(p.grad).clone() for n, p in model.named_parameters()})
        optimizer.step()
    return {"losses": losses, "grads": grads, "params": {n: _local(p).detach().clone() for n, p in model.named_parameters()}}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# --------------------------------------------------------------------------- DDP


def ddp_scenario(rank: int, capture: _Capture) -> dict:
    import compile_offload
    from compile_offload.runtime.memory_tracker import measure_peak

    model = Net()
    bucket = _bytes(model.blocks[0])  # a block per bucket: 3 graphs (the head joins the last block)
    eager_model = copy.deepcopy(model)
    eager_ddp = _ddp(eager_model, bucket)
    eager = _train(eager_ddp, eager_model, rank)

    # Everything the planner may do at once: the minimum-memory plan, and every eligible
    # saved tensor offloaded.
    compiled_model = copy.deepcopy(model)
    backend = compile_offload.offload_remat(memory_budget=0.0, debug_force_offload=True, inner_compiler="eager",
                                            device_profile="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = _train(torch.compile(_ddp(compiled_model, bucket), backend=backend), compiled_model, rank)
    parity_graphs = list(capture.graphs)

    # Memory: one step of a larger batch, measured after two warm-up steps (DDP rebuilds its
    # buckets on the second), gradients set to None first as the plans assume. Also kept:
    # the gradients of that step, the warnings and the compile_offload INFO lines.
    import compile_offload.pipeline.ddp as ddp_support

    x = _batch(rank, 0, tokens=512)

    def measure(ddp_module, budget, optimize_ddp, scope="graph"):
        torch._dynamo.reset()
        capture.graphs.clear()
        torch._dynamo.config.optimize_ddp = optimize_ddp
        step = torch.compile(ddp_module, backend=compile_offload.offload_remat(
            memory_budget=budget, offload=False, inner_compiler="eager", device_profile="cpu", budget_scope=scope))
        with _logged() as (info, caught):
            for _ in range(2):
                step(x).square().mean().backward()
            ddp_module.zero_grad(set_to_none=True)
            with measure_peak("cpu") as tracker:
                step(x).square().mean().backward()
        return {"measured": tracker.peak_bytes, "plans": capture.plans(), "warnings": [str(w.message) for w in caught],
                "info": info, "grads": {n: p.grad.clone() for n, p in ddp_module.module.named_parameters()}}

    memory_model = copy.deepcopy(model)
    memory_ddp = _ddp(memory_model, bucket)
    split = {0.0: measure(memory_ddp, 0.0, True)}
    # Byte budgets under DDPOptimizer, split evenly over the N bucket graphs: one whose share
    # every bucket graph's minimum-memory plan fits (the step must stay within it), and 1 MiB,
    # whose share is below every bucket graph's minimum.
    minima = [p.min_peak_bytes for p in split[0.0]["plans"]]
    fitting = len(minima) * int(1.02 * max(minima))
    for budget in (fitting, 2**20):
        split[budget] = measure(memory_ddp, budget, True)
    # The fallback when the bucket graphs cannot be counted: the whole budget per graph.
    counter = ddp_support.bucket_graph_count
    ddp_support.bucket_graph_count = lambda: None
    try:
        uncounted = measure(memory_ddp, fitting, True)
    finally:
        ddp_support.bucket_graph_count = counter
    # budget_scope="step": the same budget split between the bucket graphs by what each needs
    # (their minimum-memory plans in the first step, then each compiled again under its share).
    step_scope = measure(memory_ddp, fitting, True, scope="step")
    single = {budget: measure(memory_ddp, budget, False) for budget in (0.0, 0.75)}
    torch._dynamo.config.optimize_ddp = True

    # Eager DDP's gradients for the measured batch (the measured model is never stepped).
    reference_model = copy.deepcopy(model)
    reference_ddp = _ddp(reference_model, bucket)  # held: a collected DDP all-reduces nothing
    reference_ddp(x).square().mean().backward()
    reference_grads = {n: p.grad.clone() for n, p in reference_model.named_parameters()}
    return {"eager": eager, "compiled": compiled, "graphs": parity_graphs,
            "warnings": [str(w.message) for w in caught], "split": split, "uncounted": uncounted,
            "fitting": fitting, "single": single, "step_scope": step_scope, "reference_grads": reference_grads}


@contextlib.contextmanager
def _logged():
    """The compile_offload INFO lines and the warnings raised inside the block:
    ``(handler.messages, caught)``."""
    handler, logger = _ListHandler(), logging.getLogger("compile_offload")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield handler.messages, caught
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def all_scenarios(rank: int) -> dict:
    results = {}
    for name, scenario in (("ddp", ddp_scenario), ("fsdp", fsdp_scenario)):
        torch._dynamo.reset()
        with _Capture() as capture:
            results[name] = scenario(rank, capture)
    results["plan_trials"] = plan_trials_scenario(rank)
    return results


def plan_trials_scenario(rank: int) -> dict:
    """Measured plan choice on two ranks that disagree: candidate "a" is slow on rank 0 only,
    "b" less slow on rank 1 only. Alone, rank 0 would choose "b" and rank 1 "a"; over the
    ranks "a" is the slower (0.3 s against 0.1 s on its slowest rank), so both run "b"."""
    from compile_offload.passes.plan import Plan
    from compile_offload.runtime.plan_trials import PlanTrials, Trial

    from .models import CompiledFunction

    plan = Plan(feasible=True, budget_bytes=1 << 30, predicted_peak_bytes=0, predicted_step_seconds=0.0,
                baseline_peak_bytes=0, baseline_step_seconds=0.0, min_peak_bytes=0)
    delays = {"a": (0.3, 0.0), "b": (0.0, 0.1)}
    chosen = []
    trials = [Trial(name, (lambda x, d=delay[rank]: CompiledFunction.apply(x, d)), plan)
              for name, delay in delays.items()]
    runner = PlanTrials(trials, 1 << 30, torch.device("cpu"), "graph_0_0", steps=2,
                        on_chosen=lambda trial, _: chosen.append(trial.name))
    x = torch.ones(4, requires_grad=True)
    for _ in range(len(runner.schedule)):
        runner(x).sum().backward()
    return {"chosen": chosen, "seconds": {t.name: t.seconds for t in trials}}


def test_measured_plan_choice_ranks_choose_the_same_plan(results):
    chosen = [r["plan_trials"]["chosen"] for r in results]
    assert chosen == [["b"], ["b"]], results[0]["plan_trials"]
    assert results[0]["plan_trials"]["seconds"] == results[1]["plan_trials"]["seconds"]  # the ranks' agreed figures


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return _spawn(all_scenarios, tmp_path_factory.mktemp("distributed"))


@pytest.fixture(scope="module")
def ddp_results(results) -> list[dict]:
    return [r["ddp"] for r in results]


def test_ddp_optimizer_compiles_one_graph_per_bucket(ddp_results):
    for result in ddp_results:
        names = [g["plan"].graph_name for g in result["graphs"]]
        assert len(names) >= 3, names
        assert len(set(names)) == len(names) and all("_bucket" in n for n in names), names
        # every graph was planned (no fallback), and the planner acted on it
        assert all(g["plan"].decisions for g in result["graphs"])
        assert any(g["offloaded"] for g in result["graphs"])


def test_ddp_gradients_match_eager_ddp(ddp_results):
    for result in ddp_results:
        eager, compiled = result["eager"], result["compiled"]
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled["grads"], eager["grads"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled["params"], eager["params"], rtol=1e-5, atol=1e-6)
    # all-reduced: both ranks hold the same gradients, although their batches differ
    assert not torch.equal(ddp_results[0]["compiled"]["losses"][0], ddp_results[1]["compiled"]["losses"][0])
    torch.testing.assert_close(ddp_results[0]["compiled"]["grads"], ddp_results[1]["compiled"]["grads"])


def test_ddp_never_offloads_inputs(ddp_results):
    for result in ddp_results:
        for graph in result["graphs"]:
            assert not any(o["input_or_view_of_input"] for o in graph["offloaded"]), graph["offloaded"]


def test_ddp_budget_under_ddp_optimizer_does_not_warn_when_the_bucket_graphs_are_counted(ddp_results):
    """A fraction applies to each bucket graph as it is: no warning (the old one-time
    warning is kept for the fallback, below)."""
    for result in ddp_results:
        assert not [m for m in result["warnings"] if "DDPOptimizer" in m], result["warnings"]
        for run in result["split"].values():
            assert not [m for m in run["warnings"] if "DDPOptimizer" in m], run["warnings"]


def test_ddp_byte_budget_is_split_evenly_over_the_bucket_graphs(ddp_results):
    """docs/integrations.md: under DDPOptimizer a byte budget B gives each of the N bucket
    graphs B // N (their names say ``bucket<k>of<N>``), said once in an INFO line; a
    fraction is not split."""
    from compile_offload.passes.plan import format_bytes

    for result in ddp_results:
        byte_budgets = [b for b in result["split"] if isinstance(b, int)]
        assert len(byte_budgets) == 2, list(result["split"])
        for budget in byte_budgets:
            run = result["split"][budget]
            plans = run["plans"]
            n = len(plans)
            assert n >= 3, [p.graph_name for p in plans]
            assert [p.budget_bytes for p in plans] == [budget // n] * n, (budget, [p.budget_bytes for p in plans])
            assert all(p.graph_name.endswith(f"of{n}") for p in plans), [p.graph_name for p in plans]
            said = [m for m in run["info"] if "split evenly" in m]
            assert len(said) == 1, run["info"]
            assert f"{n} bucket graphs" in said[0] and format_bytes(budget) in said[0], said[0]
            assert format_bytes(budget // n) in said[0], said[0]
        fraction = result["split"][0.0]
        assert not [m for m in fraction["info"] if "split evenly" in m], fraction["info"]


def test_ddp_split_byte_budget_bounds_the_step_when_every_bucket_plan_fits(ddp_results):
    """The split's point: every bucket graph's plan within B/N, so the step (at most the sum
    of their peaks) stays within B. Measured on rank 0, with the tolerance of the other
    memory tests."""
    fitting = ddp_results[0]["fitting"]
    run = ddp_results[0]["split"][fitting]
    assert all(p.feasible for p in run["plans"]), [p.summary() for p in run["plans"]]
    assert sum(p.predicted_peak_bytes for p in run["plans"]) <= fitting
    assert run["measured"] <= 1.1 * fitting, (fitting, run["measured"])


def test_ddp_split_byte_budget_below_the_bucket_minimum_warns_per_graph(ddp_results):
    """A share below a bucket graph's minimum gives that graph's below-the-minimum warning
    (naming its share and ``bucket<k>of<N>``): per graph, as ``strict_budget`` is."""
    run = ddp_results[0]["split"][2**20]
    plans = run["plans"]
    assert not any(p.feasible for p in plans), [p.summary() for p in plans]
    below = [m for m in run["warnings"] if "below the minimum" in m]
    assert len(below) == len(plans), run["warnings"]
    for plan in plans:
        assert any(plan.graph_name in m for m in below), (plan.graph_name, below)


def test_ddp_split_byte_budget_gradients_match_eager_ddp(ddp_results):
    for result in ddp_results:
        for budget, run in result["split"].items():
            torch.testing.assert_close(run["grads"], result["reference_grads"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["uncounted"]["grads"], result["reference_grads"], rtol=1e-5, atol=1e-6)


def test_ddp_budget_falls_back_to_per_graph_with_a_warning_when_bucket_graphs_cannot_be_counted(ddp_results):
    """Without the count (a torch whose DDPOptimizer we cannot read): every bucket graph gets
    the whole budget, as before, with one warning that the step may exceed it."""
    run = ddp_results[0]["uncounted"]
    budget = ddp_results[0]["fitting"]
    assert [p.budget_bytes for p in run["plans"]] == [budget] * len(run["plans"])
    assert not any(p.graph_name.endswith(f"of{len(run['plans'])}") for p in run["plans"])
    messages = [m for m in run["warnings"] if "DDPOptimizer" in m]
    assert len(messages) == 1, run["warnings"]
    assert "optimize_ddp = False" in messages[0]


def test_ddp_step_scope_splits_the_budget_between_bucket_graphs_by_need(ddp_results):
    """``budget_scope="step"`` under DDPOptimizer: the bucket graphs run their minimum-memory
    plans in the first step, then each is planned under its share of its own range (not B // N),
    the shares sum to at most B, the measured step stays within B, and gradients equal eager."""
    fitting = ddp_results[0]["fitting"]
    for result in ddp_results:
        run = result["step_scope"]
        plans = run["plans"]
        assert len(plans) >= 6 and len(plans) % 2 == 0, [p.summary() for p in plans]
        minimum, shared = plans[:len(plans) // 2], plans[len(plans) // 2:]
        assert all(p.budget_bytes == 0 for p in minimum), [p.summary() for p in plans]  # memory_budget 0.0
        shares = {p.graph_name: p for p in shared}
        assert len(shares) == len(minimum), [p.summary() for p in plans]
        assert set(shares) == {p.graph_name for p in minimum}
        budgets = [p.budget_bytes for p in shares.values()]
        assert sum(budgets) <= fitting, (budgets, fitting)
        assert len(set(budgets)) > 1 and budgets != [fitting // len(budgets)] * len(budgets), budgets
        for low in minimum:  # each share lies in its graph's range, its minimum first
            assert low.min_peak_bytes <= shares[low.graph_name].budget_bytes, (low.summary(), budgets)
        assert all(p.feasible for p in shares.values()), [p.summary() for p in shares.values()]
        assert not [m for m in run["warnings"] if "split evenly" in m or "DDPOptimizer" in m], run["warnings"]
        assert [m for m in run["info"] if "split over" in m], run["info"]
        torch.testing.assert_close(run["grads"], result["reference_grads"], rtol=1e-5, atol=1e-6)
    measured = ddp_results[0]["step_scope"]["measured"]
    assert measured <= 1.1 * fitting, (measured, fitting)


def test_ddp_step_peak_is_bounded_by_the_sum_of_the_bucket_graphs_peaks(ddp_results):
    """docs/integrations.md: under DDPOptimizer each graph's plan bounds that graph; the step
    is bounded by the sum of the graphs' predicted peaks, not by any one of them."""
    for budget, run in ddp_results[0]["split"].items():
        peaks = [p.predicted_peak_bytes for p in run["plans"]]
        assert len(peaks) >= 3
        assert run["measured"] <= 1.1 * sum(peaks), (budget, run["measured"], peaks)
        assert run["measured"] > max(peaks), (budget, run["measured"], peaks)


def test_ddp_bucket_graphs_cannot_lower_what_earlier_buckets_hold(ddp_results):
    """docs/integrations.md's limit: a bucket graph's own peak is in its own backward, where
    its saved tensors are needed anyway, so even the minimum-memory plans of the bucket
    graphs leave the step above one graph's minimum-memory plan."""
    split, single = ddp_results[0]["split"], ddp_results[0]["single"]
    assert split[0.0]["measured"] > 1.2 * single[0.0]["measured"], (split[0.0]["measured"], single[0.0]["measured"])


def test_ddp_one_graph_budget_bounds_the_step(ddp_results):
    """With ``torch._dynamo.config.optimize_ddp = False`` the model is one graph: its
    budget bounds the whole forward+backward, as the plan predicts."""
    single = ddp_results[0]["single"]
    for budget, run in single.items():
        (plan,) = run["plans"]
        assert abs(run["measured"] - plan.predicted_peak_bytes) <= 0.1 * plan.predicted_peak_bytes, (budget, run)
        if budget == 0.75:
            assert plan.feasible and plan.budget_bytes < plan.baseline_peak_bytes
            assert run["measured"] <= 1.1 * plan.budget_bytes
    assert single[0.0]["measured"] < 0.8 * single[0.0]["plans"][0].baseline_peak_bytes


def test_ddp_bucket_graph_count_is_the_number_of_submodules_ddp_optimizer_compiles():
    """No process group needed: DDPOptimizer run directly on a traced 3-block model with one
    bucket per block calls the backend once per bucket graph, and from inside each call
    ``bucket_graph_count`` finds 3; outside DDPOptimizer it finds nothing."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    from compile_offload.pipeline.ddp import bucket_graph_count

    model = Net(blocks=3)
    gm = torch.fx.symbolic_trace(model)
    # What Dynamo's graphs carry and DDPOptimizer copies to the bucket graphs (private).
    x = torch.randn(8, 32)
    for node in gm.graph.find_nodes(op="placeholder"):
        node._dynamo_source, node.meta["example_value"] = None, x
    gm._param_name_to_source = {}
    counts = []

    def backend(submodule, example_inputs, **_):
        counts.append(bucket_graph_count())
        return submodule.forward

    bucket = _bytes(model.blocks[0])
    split = DDPOptimizer(bucket_bytes_cap=bucket, backend_compile_fn=backend, first_bucket_cap=bucket)
    compiled = split.compile_fn(gm, [x])
    assert len(split.buckets) == 3 and counts == [3, 3, 3], (len(split.buckets), counts)
    assert bucket_graph_count() is None
    torch.testing.assert_close(compiled(x), model(x))


def test_budget_per_ddp_bucket_splits_bytes_keeps_fractions_and_falls_back_with_one_warning(monkeypatch, caplog):
    import compile_offload.pipeline.ddp as ddp_module
    from compile_offload import settings as settings_mod

    monkeypatch.setattr(ddp_module, "_warned_ddp_split", False)
    monkeypatch.setattr(ddp_module, "_logged_ddp_splits", set())
    caplog.set_level(logging.INFO, logger="compile_offload")
    split = ddp_module.budget_per_bucket
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing warns while the bucket graphs are counted
        three_mib = settings_mod.resolve({"memory_budget": "3MiB", "strict_budget": True})
        assert split(three_mib, 3).budget_bytes == 2**20
        assert split(three_mib, 3).strict_budget  # strict_budget then applies per graph
        assert split(settings_mod.resolve({"memory_budget": 10}), 3).budget_bytes == 3  # floor: the sum stays <= B
        half = settings_mod.resolve({"memory_budget": 0.5})
        assert split(half, 3) == half  # a fraction scales with each graph already
        unbounded = settings_mod.resolve({"memory_budget": None})
        assert split(unbounded, 3) == unbounded and split(unbounded, None) == unbounded
    said = [r.getMessage() for r in caplog.records]  # once per budget and count, not per graph
    assert len(said) == 3, said
    assert "3 bucket graphs: memory_budget 3.00 MiB is split evenly, 1.00 MiB per bucket graph" in said[0], said
    assert "memory_budget 0.5" in said[2] and "applies to each of them unsplit" in said[2], said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert split(three_mib, None) == three_mib and split(half, None) == half
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "optimize_ddp = False" in messages[0], messages


# --------------------------------------------------------------------------- FSDP2


def fsdp_scenario(rank: int, capture: _Capture) -> dict:
    import compile_offload
    import torch.distributed._functional_collectives as fc
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = Net()

    def shard(module: Net) -> Net:
        for block in module.blocks:
            fully_shard(block)
        return fully_shard(module)

    eager_model = shard(copy.deepcopy(model))
    eager = _train(eager_model, eager_model, rank)

    compiled_model = shard(copy.deepcopy(model))
    backend = compile_offload.offload_remat(memory_budget=0.0, debug_force_offload=True, inner_compiler="eager",
                                            device_profile="cpu")
    step = torch.compile(compiled_model, backend=backend)
    compiled = _train(step, compiled_model, rank)
    fsdp_graphs = list(capture.graphs)

    # After a compiled forward, before the backward: has FSDP2 resharded the blocks (their
    # unsharded parameters freed) although the backward graphs saved them?
    output = step(_batch(rank, 0))
    resharded = all(isinstance(p, DTensor) for block in compiled_model.blocks for p in block.parameters())
    unsharded_storage = []
    for block in compiled_model.blocks:
        group = getattr(block._get_fsdp_state(), "_fsdp_param_group", None)  # private: best effort
        for fsdp_param in getattr(group, "fsdp_params", []):
            unsharded_storage.append(fsdp_param._unsharded_param.untyped_storage().size())
    output.square().mean().backward()

    # budget_scope="step": the parameters FSDP2 gathers for the step are held back from the
    # split (the INFO line says how much), with one warning that its gradients are not.
    step_model = shard(copy.deepcopy(model))
    step_scope = torch.compile(step_model, backend=compile_offload.offload_remat(
        memory_budget="4MiB", budget_scope="step", inner_compiler="eager", device_profile="cpu"))
    with _logged() as (info, step_warnings):
        step_scoped = _train(step_scope, step_model, rank)
    step_run = {"trained": step_scoped, "info": info, "warnings": [str(w.message) for w in step_warnings],
                "block_bytes": _bytes(model.blocks[0]), "model_bytes": _bytes(model)}

    # Collectives inside the graph: a hand-written FSDP all-gathering two weight shards.
    capture.graphs.clear()
    torch._dynamo.reset()
    full = [torch.randn(32, 16), torch.randn(32, 32)]
    shards = [nn.Parameter(w.chunk(WORLD_SIZE)[rank].clone()) for w in full]

    def gathered(x, s1, s2):
        w1 = fc.all_gather_tensor_autograd(s1, 0, dist.group.WORLD)
        h = F.gelu(x @ w1.t())
        w2 = fc.all_gather_tensor_autograd(s2, 0, dist.group.WORLD)
        return torch.tanh(h @ w2.t()).square().mean()

    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(rank))
    in_graph = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_tensor_autograd's new name varies by version
        for name, fn in (("eager", gathered), ("compiled", torch.compile(gathered, backend=backend))):
            loss = fn(x, *shards)
            loss.backward()
            in_graph[name] = {"loss": loss.detach(), "grads": [s.grad.clone() for s in shards]}
            for s in shards:
                s.grad = None
    return {"eager": eager, "compiled": compiled, "graphs": fsdp_graphs, "resharded": resharded,
            "unsharded_storage": unsharded_storage, "in_graph": in_graph, "in_graph_graphs": list(capture.graphs),
            "step_scope": step_run}


@pytest.fixture(scope="module")
def fsdp_results(results) -> list[dict]:
    return [r["fsdp"] for r in results]


def test_fsdp2_gradients_match_eager_fsdp2(fsdp_results):
    for result in fsdp_results:
        eager, compiled = result["eager"], result["compiled"]
        assert result["graphs"], "nothing was compiled"
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled["grads"], eager["grads"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled["params"], eager["params"], rtol=1e-5, atol=1e-6)


def test_fsdp2_step_scope_holds_the_gathered_parameters_back_from_the_split(fsdp_results):
    """Under ``budget_scope="step"`` the unsharded parameters FSDP2 all-gathers (graph inputs,
    in no graph's peak) are found at run time (their storage is freed by the step's end) and
    the most of them alive at once is taken off the budget before it is split: at least one
    block's, at most the whole model's. On the CPU the gradients FSDP2 reduce-scatters are
    not measured: one warning says so. Training equals eager FSDP2."""
    import re

    for result in fsdp_results:
        run = result["step_scope"]
        said = [m for m in run["info"] if "of parameters gathered outside the graphs (FSDP2)" in m]
        assert said, run["info"]
        held = re.search(r"less ([\d.]+) KiB of parameters gathered", said[0])
        assert held, said[0]
        held_bytes = float(held.group(1)) * 1024
        assert run["block_bytes"] * 0.99 <= held_bytes <= run["model_bytes"], (held_bytes, run["block_bytes"], said)
        gradients = [m for m in run["warnings"] if "not the gradients FSDP2 reduce-scatters" in m]
        assert len(gradients) == 1, run["warnings"]
        eager = result["eager"]
        torch.testing.assert_close(run["trained"]["losses"], eager["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(run["trained"]["params"], eager["params"], rtol=1e-5, atol=1e-6)


def test_fsdp2_collectives_stay_outside_the_graphs_and_parameters_are_inputs(fsdp_results):
    """torch 2.13 runs FSDP2's hooks eagerly: no collective reaches our partitioner, so
    the unsharded parameters are graph inputs, which are never offloaded or recomputed."""
    for result in fsdp_results:
        for graph in result["graphs"]:
            assert graph["joint_collectives"] == [], graph["joint_collectives"]
            assert graph["offloaded"], "debug_force_offload offloaded nothing"
            assert not any(o["input_or_view_of_input"] for o in graph["offloaded"]), graph["offloaded"]


def test_fsdp2_frees_unsharded_parameters_after_a_compiled_forward(fsdp_results):
    """The backward graph holds the unsharded parameters it needs, as eager autograd does;
    FSDP2 frees their storage after the forward anyway (resize to 0) and all-gathers them
    again before the backward."""
    for result in fsdp_results:
        assert result["resharded"]
        assert result["unsharded_storage"] and not any(result["unsharded_storage"]), result["unsharded_storage"]


def test_collectives_in_a_graph_are_never_recomputed_and_gathered_weights_never_offloaded(fsdp_results):
    for result in fsdp_results:
        (graph,) = result["in_graph_graphs"]
        joint = graph["joint_collectives"]
        assert "_c10d_functional.all_gather_into_tensor.default" in joint
        # every collective of the joint graph appears exactly once in the partitioned graphs
        assert graph["partitioned_collectives"] == joint
        assert graph["offloaded"], "debug_force_offload offloaded nothing"
        assert not any(o["collective"] for o in graph["offloaded"]), graph["offloaded"]
        kept = [d for d in graph["plan"].decisions if d.decision == "keep"]
        assert kept, "the all-gathered weight the backward reads should be kept"
        assert any("collective" in d.reason for d in kept), [d.reason for d in kept]
        compiled, eager = result["in_graph"]["compiled"], result["in_graph"]["eager"]
        torch.testing.assert_close(compiled["loss"], eager["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled["grads"], eager["grads"], rtol=1e-5, atol=1e-6)


def test_collective_outputs_are_banned_from_recompute_and_offload():
    """No process group needed: a hand-built graph all-gathering a weight shard. The
    all-gather and its wait are never recomputed; the gathered weight and views of it are
    never offloaded; the wait returns the all-gather's buffer (no second allocation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_offload.passes.analyze import recompute_ban_reason, storage_roots
    from compile_offload.passes.offload import eligible_for_offload

    c10d = torch.ops._c10d_functional
    graph = torch.fx.Graph()
    shard, x = graph.placeholder("shard"), graph.placeholder("x")
    gathered = graph.call_function(c10d.all_gather_into_tensor.default, (shard, WORLD_SIZE, "0"))
    weight = graph.call_function(c10d.wait_tensor.default, (gathered,))
    transposed = graph.call_function(torch.ops.aten.permute.default, (weight, [1, 0]))
    product = graph.call_function(torch.ops.aten.mm.default, (x, transposed))
    graph.output((product,))
    with FakeTensorMode():
        values = {shard: torch.empty(4, 8), x: torch.empty(3, 8)}
        for node in [n for n in graph.nodes if n.op == "call_function"]:
            values[node] = node.target(*[values.get(a, a) if isinstance(a, torch.fx.Node) else a for a in node.args])
    for node, value in values.items():
        node.meta["val"] = value

    assert recompute_ban_reason(gathered) == recompute_ban_reason(weight) == "collective"
    assert storage_roots(graph)[weight] is gathered and storage_roots(graph)[transposed] is gathered
    for node in (weight, transposed):
        ok, reason = eligible_for_offload(node)
        assert not ok and "collective" in reason, reason
    assert eligible_for_offload(product) == (True, "eligible")


# --------------------------------------------------------------------------- example


@pytest.mark.inductor
def test_train_ddp_example_under_torchrun():
    """The example as a user runs it (Inductor, DDPOptimizer's bucket graphs), 2 CPU ranks,
    checked against eager DDP by its own --check."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), str(REPO / "examples" / "train_ddp.py"),
               "--steps", "2", "--budget", "0.5", "--blocks", "2", "--tokens", "128", "--check"]
    done = _run_bounded(command, env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "2 rank(s), gloo on cpu" in done.stdout, done.stdout
    assert done.stdout.count("plan: graph_") >= 2 and "_bucket1" in done.stdout, done.stdout  # one per bucket
    assert done.stdout.count("step 1 loss") == 1, done.stdout  # printed by rank 0 only
    assert "gradients match eager DDP" in done.stdout, done.stdout


@pytest.mark.cuda
def test_ddp_one_rank_nccl(tmp_path):
    """The 1-rank path on a GPU: NCCL, DDP, the example's model, gradients equal eager DDP."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
               "--master-port", str(_free_port()), str(REPO / "examples" / "train_ddp.py"),
               "--steps", "3", "--budget", "0.5", "--check"]
    done = _run_bounded(command, env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "nccl" in done.stdout and "gradients match eager DDP" in done.stdout, done.stdout
