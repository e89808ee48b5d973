"""Planning time against depth: torch's partitioners and ours on the same joint graphs.

For each depth a GPT-style decoder stack is built on the meta device and traced once; its
joint forward+backward graph is then partitioned, each partitioner on its own copy, in one
process, by torch's default min-cut partitioner, torch's min-cut partitioner with
``activation_memory_budget=0.5``, and ours (``device_profile="h100"``, offload on) with no
budget, a budget of 0.5 and one of 2 GiB, planned for the GPU's (Triton) kernels as
``compile_offload.explain`` plans for a GPU profile on tensors that are not on one (the
step is traced on empty CPU tensors, so the graph's values say CPU). Times are seconds of
the partition call alone (our planner's analysis, solve and graph building included), made
as torch.compile makes it: with lazy graph modules, whose Python code is generated when
first needed. The last row gives the growth factor per doubling of depth (the time at each
depth over that at half of it, when both were run). ``--clock cpu`` (the default) counts
the process's CPU seconds, which other jobs on a shared machine do not inflate; ``--clock
wall`` counts wall-clock seconds.

    python -m compile_offload.benchmarks.planning_time --depths 2,4,8,16
    python -m compile_offload.benchmarks.planning_time --shape deep --depths 24,48,96 --only ours-0.5,torch-0.5
    python -m compile_offload.benchmarks.planning_time --shape deep --depths 24,48 --repeat 3   # least of 3 runs
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from collections.abc import Callable

import torch

from compile_offload.torch_api import dynamo, functorch, inductor
from compile_offload.torch_api.utils import use_lazy_graph_module

from .workloads import Decoder

SHAPES = {  # width, heads, seq, batch
    "gpt": (2048, 16, 2048, 8),
    "deep": (1024, 16, 4096, 4),
}
COLUMNS = ("torch-default", "torch-0.5", "ours-none", "ours-0.5", "ours-2GiB")
HEADERS = {
    "torch-default": "torch default min-cut",
    "torch-0.5": "torch `activation_memory_budget=0.5`",
    "ours-none": "ours, no budget",
    "ours-0.5": "ours, 0.5",
    "ours-2GiB": "ours, 2 GiB",
}


def capture_joint(layers: int, shape: str):
    """(joint graph, joint inputs, num_fwd_outputs) of one training step of the stack."""
    width, heads, seq, batch = SHAPES[shape]
    with torch.device("meta"):
        model = Decoder(layers, width, heads).to(torch.bfloat16)
        x = torch.randn(batch, seq, width, dtype=torch.bfloat16, requires_grad=True)
    state = {name: torch.empty_like(t, device="cpu") for name, t in model.named_parameters()}
    captured = {}

    def shape_only(gm, inputs):
        # The captured step then runs on fake tensors (explain's shapes-only "compiler"):
        # running the forward for real would spend minutes of CPU matmuls on every depth.
        from compile_offload.tools.explain import _shape_only

        return _shape_only(gm, inputs)

    def capture(joint, joint_inputs, **kwargs):
        captured.update(joint=copy.deepcopy(joint), inputs=joint_inputs, num_fwd_outputs=kwargs["num_fwd_outputs"])
        return functorch.default_partition(joint, joint_inputs, **kwargs)

    def backend(gm, inputs):
        return functorch.aot_module_simplified(gm, inputs, fw_compiler=shape_only, bw_compiler=shape_only,
                                               partition_fn=capture, decompositions=inductor.decomposition_table())

    def run(inputs):
        return torch.func.functional_call(model, state, (inputs,))

    dynamo.reset()
    torch.compile(run, backend=backend)(torch.empty_like(x, device="cpu").requires_grad_())
    return captured["joint"], captured["inputs"], captured["num_fwd_outputs"]


def partitioners() -> dict[str, Callable]:
    from compile_offload import settings as settings_mod
    from compile_offload.pipeline.partitioner import OffloadRematPartitioner

    def torch_min_cut(budget: float):
        def partition(joint, inputs, num_fwd_outputs):
            with functorch.config.patch(activation_memory_budget=budget):
                return functorch.min_cut_rematerialization_partition(joint, inputs, compiler="inductor",
                                                                     num_fwd_outputs=num_fwd_outputs)
        return partition

    def ours(budget):
        settings = settings_mod.resolve({"memory_budget": budget, "device_profile": "h100"})

        def partition(joint, inputs, num_fwd_outputs):
            # The h100 profile plans a GPU's step: Triton's kernels, not the C++ backend's
            # calls (the traced values say CPU).
            return OffloadRematPartitioner(settings, accelerator=True)(joint, inputs, num_fwd_outputs=num_fwd_outputs)
        return partition

    return {
        "torch-default": torch_min_cut(1.0),
        "torch-0.5": torch_min_cut(0.5),
        "ours-none": ours(None),
        "ours-0.5": ours(0.5),
        "ours-2GiB": ours("2GiB"),
    }


def time_depths(depths: list[int], shape: str, columns: list[str], clock=time.process_time,
                repeat: int = 1, progress: Callable[[str], None] | None = None) -> dict[int, tuple[int, dict[str, float]]]:
    """depth -> (joint nodes, column -> seconds): each column's partition of its own copy of
    the depth's joint graph, the least of ``repeat`` runs. With ``repeat`` > 1 every depth and
    column takes its turn in each round, so a slow stretch of a shared machine (they last
    longer than a run) falls on all of them rather than on one depth: the growth per
    doubling is a ratio of two depths' times. ``progress`` gets a line per run."""

    joints = {layers: capture_joint(layers, shape) for layers in depths}
    table = partitioners()
    times: dict[int, dict[str, float]] = {layers: {} for layers in depths}
    for round_ in range(repeat):
        for layers in depths:
            joint, inputs, num_fwd_outputs = joints[layers]
            for column in columns:
                graph = copy.deepcopy(joint)
                # As under torch.compile, which runs the partitioner inside Dynamo's frame compile:
                # graph modules made there generate their Python code only when first called or
                # read (Dynamo's ``use_lazy_graph_module``, on by default), and Inductor reads graphs.
                with use_lazy_graph_module(dynamo.config.use_lazy_graph_module):
                    started = clock()
                    table[column](graph, inputs, num_fwd_outputs)
                    elapsed = clock() - started
                times[layers][column] = min(elapsed, times[layers].get(column, elapsed))
                if progress is not None:
                    progress(f"run {round_ + 1}/{repeat}, {layers} layers, {column}: {elapsed:.2f} s")
    return {layers: (len(joints[layers][0].graph.nodes), times[layers]) for layers in depths}


def time_depth(layers: int, shape: str, columns: list[str], clock=time.process_time,
               repeat: int = 1) -> tuple[int, dict[str, float]]:
    """``time_depths`` of one depth: (joint nodes, column -> seconds)."""
    return time_depths([layers], shape, columns, clock, repeat)[layers]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="2,4,8", help="comma-separated layer counts (default: 2,4,8)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--only", default=",".join(COLUMNS), help=f"columns to run, of {','.join(COLUMNS)}")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each partitioner per depth, the depths taking turns; the least time is "
                             "reported (default: 1)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: at least 1")
    depths = [int(d) for d in args.depths.split(",")]
    columns = [c for c in args.only.split(",") if c]
    unknown = sorted(set(columns) - set(COLUMNS))
    if unknown:
        parser.error(f"unknown columns {unknown}; accepted: {', '.join(COLUMNS)}")
    import warnings

    warnings.filterwarnings("ignore", message="compile_offload")  # below-minimum budgets: not the point here
    warnings.filterwarnings("ignore", category=FutureWarning)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    time_depth(1, args.shape, columns, clock)  # warm-up: first calls import and initialise, not plan
    width, heads, seq, batch = SHAPES[args.shape]
    print(f"{args.shape}: d{width}, {heads} heads, seq {seq}, batch {batch}, bf16, meta device, profile h100; "
          f"torch {torch.__version__}, {platform.machine()} {platform.node()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.clock} seconds of the partition call"
          + (f", the least of {args.repeat} runs, the depths taking turns" if args.repeat > 1 else "") + "\n")
    print("| layers | joint nodes | " + " | ".join(HEADERS[c] for c in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    results: dict[int, dict[str, float]] = {}
    if args.repeat == 1:  # each row as soon as it is timed
        measured = ((layers, time_depth(layers, args.shape, columns, clock)) for layers in depths)
    else:  # the depths take turns in each round: rows at the end, a line per run on stderr
        measured = time_depths(depths, args.shape, columns, clock, args.repeat,
                               progress=lambda line: print(line, file=sys.stderr, flush=True)).items()
    for layers, (nodes, times) in measured:
        results[layers] = times
        cells = " | ".join(f"{times[c]:.2f} s" for c in columns)
        print(f"| {layers} | {nodes:,} | {cells} |", flush=True)
    growth = []
    for column in columns:
        ratios = [results[d][column] / results[d // 2][column] for d in depths if d % 2 == 0 and d // 2 in results]
        growth.append(" ".join(f"{r:.1f}x" for r in ratios) or "-")
    print("| growth per doubling | | " + " | ".join(growth) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
