"""The simulator's kernels against the kernels Inductor generates, on the graphs torch partitions.

``passes.inductor.kernel_local.kernel_groups`` models which realized nodes Inductor's scheduler fuses
into one kernel. This compiles a model with ``torch.compile`` (torch's own partitioner, at
``activation_memory_budget`` when given), records the scheduler's fused kernels of each
graph (``inductor_kernels.KernelRecorder``), groups the same partitioned graph with
``kernel_groups``, and counts the pairs of realized nodes that one puts in one kernel and the
other apart. Only nodes that are the origin of exactly one of Inductor's kernels are compared
(a value inlined into several kernels has no single kernel to compare).

    python -m compile_offload.benchmarks.kernel_fidelity                        # the contract's models, torch's 0.5 plans
    python -m compile_offload.benchmarks.kernel_fidelity --models hf_gpt2 --budget none --show 10

What it can tell: how often the kernel model pairs nodes as Inductor's C++ backend does on
this machine, graph by graph. Not what a GPU's Triton kernels hold, nor how the kernels of
our own joint-graph plans compare (those are grouped once per joint graph).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
from dataclasses import dataclass, field

import torch
from torch import fx

from compile_offload.inductor import kernels as inductor_kernels
from compile_offload.passes.analyze import fusable_nodes, inlined_values
from compile_offload.passes.inductor.kernel_local import kernel_groups, realized_nodes
from compile_offload.passes.inductor.loop_ranges import cpu_graph
from compile_offload.torch_api import dynamo, functorch, inductor

from . import budget_contract


@dataclass
class Fidelity:
    model: str
    graph: str  # "forward" or "backward"
    realized: int  # realized nodes the model groups
    compared: int  # pairs of them compared
    mismatches: list[tuple[str, str, bool]] = field(default_factory=list)  # (node, node, Inductor fused them)


def compared_pairs(gm: fx.GraphModule, kernels: inductor_kernels.GraphKernels, model: str, graph: str) -> Fidelity:
    """The pairs of ``gm``'s realized nodes that ``kernel_groups`` and Inductor's ``kernels`` of
    the same graph put together or apart differently."""
    nodes = list(gm.graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    inlined = inlined_values(nodes, fusable_nodes(nodes, lambda node: True))
    groups = kernel_groups(nodes, inlined, position, lambda node: node.op == "placeholder", cpu=cpu_graph(nodes))
    ours: dict[str, set[int]] = {}
    for index, kernel in enumerate(groups.kernels):
        for node in kernel:
            ours.setdefault(node.name, set()).add(index)
    theirs: dict[str, set[int]] = {}
    for index, kernel in enumerate(kernels.kernels):
        for origin in kernel.origins:
            theirs.setdefault(origin, set()).add(index)
    realized = realized_nodes(nodes, inlined)
    single = [n for n in realized if len(theirs.get(n.name, ())) == 1]
    result = Fidelity(model, graph, len(realized), 0)
    for one, other in itertools.combinations(single, 2):
        result.compared += 1
        fused = theirs[one.name] == theirs[other.name]
        if fused != bool(ours.get(one.name, set()) & ours.get(other.name, set())):
            result.mismatches.append((one.name, other.name, fused))
    return result


def measure(model_name: str, budget: float | None) -> list[Fidelity]:
    """Compile ``model_name`` (a contract model) with torch's partitioner and compare both graphs."""
    compile_fx = inductor.compile_fx_module()

    model, inputs, loss = budget_contract.build(model_name)
    captured: dict[str, fx.GraphModule] = {}
    partition = compile_fx.min_cut_rematerialization_partition

    def capturing(joint, joint_inputs, **kwargs):
        forward, backward = partition(joint, joint_inputs, **kwargs)
        captured.update(forward=forward, backward=backward)
        return forward, backward

    recorder = inductor_kernels.KernelRecorder()
    dynamo.reset()
    compile_fx.min_cut_rematerialization_partition = capturing
    try:
        with functorch.config.patch(activation_memory_budget=1.0 if budget is None else budget,
                                           enable_autograd_cache=False), \
                inductor.config.patch(fx_graph_cache=False, **inductor_kernels.recording_patches(recorder)), \
                inductor_kernels.backward_lowered_at_compile():
            loss(torch.compile(model)(*inputs)).backward()
    finally:
        compile_fx.min_cut_rematerialization_partition = partition
        dynamo.reset()
    if recorder.forward() is None or recorder.backward() is None or len(captured) < 2:
        raise RuntimeError(f"kernel_fidelity: {model_name}: Inductor's kernels were not recorded for both graphs")
    return [compared_pairs(captured["forward"], recorder.forward(), model_name, "forward"),
            compared_pairs(captured["backward"], recorder.backward(), model_name, "backward")]


def table(rows: list[Fidelity]) -> str:
    lines = ["| model | graph | realized nodes | pairs compared | pairs grouped unlike Inductor |", "|---|---|---|---|---|"]
    lines += [f"| {r.model} | {r.graph} | {r.realized} | {r.compared} | {len(r.mismatches)} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(budget_contract.MODELS),
                        help=f"comma-separated, from {', '.join(budget_contract.MODELS)}")
    parser.add_argument("--budget", default="0.5", help="torch's activation_memory_budget, or 'none' (default 0.5)")
    parser.add_argument("--show", type=int, default=0, help="list this many mismatched pairs per graph")
    options = parser.parse_args(argv)
    budget = None if options.budget == "none" else float(options.budget)
    if budget is not None and not 0.0 <= budget <= 1.0:
        parser.error(f"--budget must be in [0, 1] or 'none', got {options.budget}")
    names = [name for name in options.models.split(",") if name]
    unknown = [name for name in names if name not in budget_contract.MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(budget_contract.MODELS)}")
    rows = []
    for name in names:
        if not budget_contract.available(name):
            print(f"{name}: skipped (needs transformers)")
            continue
        rows += measure(name, budget)
    print(f"torch {torch.__version__}, {datetime.date.today()}, CPU, Inductor; torch's partitioner at "
          f"activation_memory_budget={options.budget}\n")
    print(table(rows))
    for row in rows:
        for one, other, fused in row.mismatches[:options.show]:
            print(f"  {row.model} {row.graph}: {one}, {other}: Inductor {'fuses' if fused else 'keeps apart'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
