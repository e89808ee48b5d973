"""Inductor's own CUDA kernels for the anchors' compiled plans, on a machine without a GPU.

The anchors (``../shared/anchors``) were measured on an H100; this project's machines have
no GPU. What Inductor would run there is decided before any kernel is compiled: lowering,
fusion, the order of the fused kernels and the wrapper's memory plan. This script makes
Inductor do exactly that for each compiled anchor plan on fake CUDA tensors (a CUDA build of
torch runs on a CPU-only machine; no kernel is launched): torch's partition of the
meta-device joint graph (``model_check.torch_plans``), each graph moved to the ``cuda``
device and compiled by ``compile_fx_inner`` with the kernel recorder
(``compile_offload.inductor.kernels``) until the generated module would be loaded (Triton
would need a driver there). The recorded kernels become a program
(``scheduled_peak.scheduled_program``) and its peak gets the same terms as ``model-check``'s
predictions: the eager loss on top of the forward's end, the input's gradient under the
step.

The table puts three figures side by side for each row: measured on the H100, predicted
by ``model-check`` (our simulator on the joint graph) and simulated on Inductor's CUDA
kernels. Where the last matches the measurement and ours does not, what is missing is in
how ``passes/inductor/kernel_local.py`` groups kernels, not in the plan or the terms.

    python -m compile_offload.benchmarks.cuda_schedule              # every shape
    python -m compile_offload.benchmarks.cuda_schedule --shapes gpt8
    python -m compile_offload.benchmarks.cuda_schedule --shapes gpt8 --ours 0.5,3GiB   # our plans too

Needs a CUDA build of torch (``pip install torch==2.11.0``, as the anchors were measured
with; the CPU wheel has no CUDA lowering). The device is faked for the duration of a
compile only (``fake_cuda``: the CUDA queries Inductor makes answered as an H100 would,
restored afterwards); these are private torch details, kept in this file alone and checked
on torch 2.11.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import types
from collections.abc import Iterator
from unittest import mock

import torch
from torch import fx

from compile_offload.inductor import kernels as inductor_kernels, plan_order_fusion
from compile_offload.tools import model_check
from compile_offload.inductor.scheduled_peak import scheduled_program
from compile_offload.passes import compat
from compile_offload.passes.cost import BUILTIN_PROFILES
from compile_offload.passes.memory import simulate
from compile_offload.torch_api import dynamo, fake_tensors, inductor, utils

MB = 2**20

# What an H100 SXM answers to the queries Inductor makes while lowering and fusing.
H100 = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, total_memory=80 * 2**30,
    max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32,
    regs_per_multiprocessor=65536, shared_memory_per_block_optin=232448, L2_cache_size=50 * 2**20,
    gcnArchName="", uuid="fake-h100")


class _Stop(Exception):
    """Raised where Inductor would load the generated module (its Triton kernels need a driver)."""


def _needs_cuda_build() -> None:
    if torch.version.cuda is None:
        raise RuntimeError("cuda_schedule needs a CUDA build of torch (this one is CPU-only: "
                           f"{torch.__version__}); e.g. pip install torch==2.11.0 in a venv of its own")


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """CUDA as Inductor sees it on an H100, without a driver, until the block ends."""
    _needs_cuda_build()
    triton_codegen = inductor.triton_codegen()
    graph_lowering = inductor.graph()
    scheduler = inductor.scheduler()
    fake_tensor = fake_tensors.fake_tensor
    triton_utils = utils.triton_utils()
    device_interface = dynamo.device_interface
    hints = inductor.hints

    def stop(*args, **kwargs):
        raise _Stop

    properties = hints.DeviceProperties(
        type="cuda", index=0, multi_processor_count=H100.multi_processor_count, cc=90, major=9,
        regs_per_multiprocessor=H100.regs_per_multiprocessor,
        max_threads_per_multi_processor=H100.max_threads_per_multi_processor,
        max_threads_per_block=H100.max_threads_per_block, warp_size=H100.warp_size)
    cuda = device_interface.CudaInterface
    patches = [
        (torch.cuda, "is_available", lambda: True), (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "current_device", lambda: 0), (torch.cuda, "get_device_capability", lambda d=None: (9, 0)),
        (torch.cuda, "get_device_properties", lambda d=None: H100), (torch.cuda, "get_device_name", lambda d=None: H100.name),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8)),
        (torch.cuda, "set_rng_state", lambda *a, **k: None), (torch.cuda, "_exchange_device", lambda index: 0),
        (torch.cuda, "_maybe_exchange_device", lambda index: 0), (torch.cuda, "set_device", lambda *a, **k: None),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (fake_tensor, "init_gpu_context", lambda device: None),
        (hints.DeviceProperties, "create", classmethod(lambda cls, device: properties)),
        (cuda, "get_device_properties", staticmethod(lambda d=None: H100)),
        (cuda, "get_compute_capability", staticmethod(lambda d=None: 90)),
        (cuda, "is_available", staticmethod(lambda: True)), (cuda, "current_device", staticmethod(lambda: 0)),
        (cuda, "device_count", staticmethod(lambda: 1)),
        (triton_utils, "has_triton", lambda: True), (scheduler, "has_triton", lambda: True),
        (triton_utils, "triton_hash_with_backend", lambda: "fake-h100"),
        (graph_lowering.GraphLowering, "_compile_to_module_lines", stop),
    ]
    if hasattr(triton_codegen, "triton_hash_with_backend"):
        patches.append((triton_codegen, "triton_hash_with_backend", lambda: "fake-h100"))
    with contextlib.ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value))
        yield


def _on_cuda(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with the CPU or meta device its graph was traced on (``model_check.capture_joint``,
    ``planning_time.capture_joint``) made ``cuda``."""
    cuda = torch.device("cuda")
    on_cpu = lambda value: isinstance(value, torch.device) and value.type in ("cpu", "meta")  # noqa: E731
    for node in gm.graph.nodes:
        node.args = tuple(cuda if on_cpu(arg) else arg for arg in node.args)
        node.kwargs = {key: cuda if on_cpu(value) else value for key, value in node.kwargs.items()}
    gm.recompile()
    return gm


def cuda_kernels(gm: fx.GraphModule, is_backward: bool, host_inputs: frozenset[str] = frozenset(),
                 config_patches: dict | None = None, keep_plan_order: bool = False) -> inductor_kernels.GraphKernels:
    """Inductor's kernels for one partitioned graph on the (faked) CUDA device, in the order
    the generated code runs them (after its peak-memory reordering, where that is on), with
    the wrapper's reuses. ``host_inputs``: placeholders that stay host tensors (an offload's
    host copy, received by the backward). ``config_patches``: Inductor config the graph
    compiles under (the backend's, for our plans); ``keep_plan_order``: with the backend's
    fusion rule under a budget (``plan_order_fusion``). Call inside ``fake_cuda()``.

    ``compile_fx_inner`` runs here without AOTAutograd's tracing context, so no saved tensor
    is donated to a backward: its kernels never write into one, where the backend's may
    (``compat.inductor_overwrites_saved``). Plan with ``donated_buffer`` off to compare a
    plan with them exactly (``tests/passes/test_memory.py``)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = _on_cuda(gm)
    mode = fake_tensors.FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype,
                                      device="cpu" if node.name in host_inputs else "cuda")
                  if isinstance(v := node.meta["val"], torch.Tensor) else v
                  for node in gm.graph.nodes if node.op == "placeholder"]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    recorder = inductor_kernels.KernelRecorder()
    inner_compile = inductor_kernels.naming_outputs_before_passes(inductor.compile_fx_inner)
    if keep_plan_order:
        inner_compile = plan_order_fusion.keeping_plan_order(inner_compile)
    with inductor.config.patch(**(config_patches or {}), **inductor_kernels.recording_patches(recorder),
                               fx_graph_cache=False, compile_threads=1), \
            inductor_kernels.recording_reordered(recorder):
        try:
            with mode:  # outputs named as the other graph knows them (our plans save some through aliases)
                inner_compile(gm, inputs, is_backward=is_backward)
        except _Stop:
            pass
        except Exception as error:  # Inductor wraps what a lowering raises
            if not isinstance(getattr(error, "inner_exception", None), _Stop) and "_Stop" not in repr(error):
                raise
    recorder.read_reuses()
    if len(recorder.graphs) != 1:
        raise RuntimeError(f"cuda_schedule: expected one recorded graph, got {len(recorder.graphs)}")
    return recorder.graphs[0]


def scheduled_peak(plans: model_check.ShapePlans, strategy: str) -> int:
    """The peak of ``strategy``'s plan run as Inductor's CUDA kernels, with ``model-check``'s terms."""
    plan = plans.plans[strategy]
    joint = plan.analysis.joint
    forward, backward = compat.extract_forward_backward(joint, [n for n in joint.gm.graph.nodes if n in plan.saved])
    with fake_cuda():
        program = scheduled_program(cuda_kernels(forward, False), cuda_kernels(backward, True))
    forward_end = model_check.forward_end_bytes(plan.analysis, plan.saved)
    return max(simulate(program).peak_bytes, forward_end + plans.loss_bytes) + plans.input_grad_bytes


def ours_scheduled(shape: str, budget: str) -> tuple[int, int]:
    """Our backend's plan of ``shape`` (``model_check.SHAPES``) under ``memory_budget=budget``
    (h100 profile, offload on): (its predicted peak, the peak of Inductor's CUDA kernels for
    the graphs it builds, compiled under the backend's Inductor config). Graph peaks only: no
    loss, no input gradient (the plan's own figure)."""
    from compile_offload import settings as settings_mod
    from compile_offload.pipeline.inductor_compile import inductor_config_patches
    from compile_offload.benchmarks import planning_time
    from compile_offload.inductor.copy_order import has_copy_ops, order_keeping_patches
    from compile_offload.runtime.ops import NAMESPACE
    from compile_offload.pipeline.partitioner import OffloadRematPartitioner

    _needs_cuda_build()
    args = model_check.load_anchors(shapes=[shape])[0].args
    joint, inputs, num_fwd_outputs = planning_time.capture_joint(
        args["layers"], {"gpt8": "gpt", "deep24": "deep"}[shape])
    settings = settings_mod.resolve({"memory_budget": budget, "device_profile": "h100"})
    results: list = []
    # Planned for Triton's kernels, as for the GPU the graphs are compiled for (the step is
    # traced on CPU tensors, whose device would give the C++ backend's rules).
    partitioner = OffloadRematPartitioner(settings, on_result=results.append, accelerator=True)
    forward, backward = partitioner(joint, inputs, num_fwd_outputs=num_fwd_outputs)
    # The host copies the forward hands the backward stay on the host: the backward's inputs
    # that only its reload ops read.
    host = frozenset(n.name for n in backward.graph.nodes if n.op == "placeholder" and n.users
                     and all(getattr(user.target, "namespace", None) == NAMESPACE for user in n.users))
    patches = {k: v for k, v in inductor_config_patches(settings, partitioner).items() if k != "custom_partitioner_fn"}
    with fake_cuda():
        kernels = [cuda_kernels(graph, is_backward, host,
                                {**patches, **(order_keeping_patches() if has_copy_ops(graph) else {})},
                                keep_plan_order=settings.has_budget)
                   for graph, is_backward in ((forward, False), (backward, True))]
    return results[-1].plan.predicted_peak_bytes, simulate(scheduled_program(*kernels)).peak_bytes


def rows(shapes: list[str]) -> Iterator[dict]:
    for shape in model_check.load_anchors(shapes=shapes):
        plans = model_check.torch_plans(shape)
        # (peaks do not depend on the profile's rates)
        predicted = {p.strategy: p.predicted_peak_mb for p in model_check.anchor_predictions(plans, BUILTIN_PROFILES["h100"])}
        for strategy, plan in plans.plans.items():
            if plan.eager is not None:
                continue
            print(f"cuda_schedule: {shape.name} {strategy}", file=sys.stderr, flush=True)
            measured = shape.rows[strategy].get("peak_above_steady_mb")
            yield {"shape": shape.name, "strategy": strategy, "measured_peak_mb": measured,
                   "predicted_peak_mb": round(predicted[strategy], 1),
                   "scheduled_peak_mb": round(scheduled_peak(plans, strategy) / MB, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(model_check.SHAPES), help="anchor shapes, comma-separated")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--ours", default="", metavar="BUDGETS",
                        help="also our backend's plans under these memory_budget values (comma-separated, "
                             "e.g. 0.5,3GiB): predicted peak against Inductor's CUDA kernels, graphs only")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}; Inductor's CUDA kernels on fake H100 tensors; peaks in MiB",
          file=sys.stderr)
    if not args.json:
        print("| shape | strategy | measured (H100) | predicted (model-check) | Inductor's CUDA kernels |")
        print("|---|---|---|---|---|")
    for row in rows(args.shapes.split(",")):
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        measured = row["measured_peak_mb"]
        cells = [f"{row[k]:.1f}" + (f" ({row[k] / measured - 1:+.1%})" if measured else "")
                 for k in ("predicted_peak_mb", "scheduled_peak_mb")]
        measured_cell = "-" if measured is None else f"{measured:.1f}"
        print(f"| {row['shape']} | {row['strategy']} | {measured_cell} | {cells[0]} | {cells[1]} |", flush=True)
    budgets = [b for b in args.ours.split(",") if b]
    if budgets and not args.json:
        print("\n| shape | our plan's budget | predicted peak (the plan) | Inductor's CUDA kernels |\n|---|---|---|---|")
    for shape in args.shapes.split(",") if budgets else ():
        for budget in budgets:
            print(f"cuda_schedule: {shape} ours at {budget}", file=sys.stderr, flush=True)
            predicted, scheduled = ours_scheduled(shape, budget)
            if args.json:
                print(json.dumps({"shape": shape, "strategy": f"ours_{budget}", "predicted_peak_mb": round(predicted / MB, 1),
                                  "scheduled_peak_mb": round(scheduled / MB, 1)}), flush=True)
            else:
                print(f"| {shape} | {budget} | {predicted / MB:.1f} | {scheduled / MB:.1f} "
                      f"({scheduled / predicted - 1:+.1%}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
