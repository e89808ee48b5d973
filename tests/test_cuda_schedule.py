"""benchmarks/cuda_schedule.py: Inductor's CUDA kernels for a plan, on a machine without a GPU.

The machinery needs a CUDA build of torch (it runs without a driver); on the CPU wheel only
its refusal is checked. Checked here with torch 2.11.0+cu130 (docs/benchmarks.md)."""

import pytest
import torch

from compile_offload.tools import model_check
from compile_offload.benchmarks import cuda_schedule

needs_cuda_build = pytest.mark.skipif(torch.version.cuda is None,
                                      reason="needs a CUDA build of torch (the CPU wheel has no CUDA lowering)")
TINY = {"layers": 2, "d": 64, "heads": 2, "seq": 128, "batch": 2, "dtype": "bfloat16"}


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build: the machinery runs instead")
def test_on_a_cpu_build_it_says_what_it_needs():
    with pytest.raises(RuntimeError, match="needs a CUDA build of torch"):
        with cuda_schedule.fake_cuda():
            pass
    with pytest.raises(RuntimeError, match="needs a CUDA build of torch"):  # before planning anything
        cuda_schedule.ours_scheduled("gpt8", "0.5")


@needs_cuda_build
def test_a_plan_is_lowered_for_cuda_and_the_device_is_restored():
    shape = model_check.AnchorShape("tiny", TINY, torch.__version__, "none", {"compile": {}})
    plans = model_check.torch_plans(shape, fit_only=True)
    available, properties = torch.cuda.is_available, torch.cuda.get_device_properties
    plan = plans.plans["compile"]
    joint = plan.analysis.joint
    forward, backward = model_check.compat.extract_forward_backward(
        joint, [n for n in joint.gm.graph.nodes if n in plan.saved])
    with cuda_schedule.fake_cuda():
        kernels = [cuda_schedule.cuda_kernels(forward, False), cuda_schedule.cuda_kernels(backward, True)]
    assert torch.cuda.is_available is available and torch.cuda.get_device_properties is properties
    assert [graph.is_backward for graph in kernels] == [False, True]
    assert all(graph.kernels and graph.reuses is not None for graph in kernels)
    # Triton kernels fuse several nodes (the CPU backend's would be named the same way, but
    # the graphs were traced on the CPU device: only the cuda lowering ran here)
    assert any("_op" in kernel.name for graph in kernels for kernel in graph.kernels)
    peak = cuda_schedule.scheduled_peak(plans, "compile")
    assert peak >= model_check.forward_end_bytes(plan.analysis, plan.saved) > 0


@needs_cuda_build
def test_a_flash_attention_backward_kernel_holds_its_workspace_in_the_record():
    """The scheduled peak counts what FlashAttention's backward allocates beside its outputs,
    as the plan does (``op_workspace``): the recorded fallback kernel allocates it, and the
    program holds it with the three gradients."""
    import torch.fx as fx

    from compile_offload.inductor.scheduled_peak import scheduled_program
    from compile_offload.inductor.op_workspace import op_workspaces
    from compile_offload.passes.memory import simulate

    from .test_op_workspace import _flash_backward_graph

    with cuda_schedule.fake_cuda():
        node = _flash_backward_graph(batch=2, heads=4, seq=200, head_dim=40)
        kernels = cuda_schedule.cuda_kernels(fx.GraphModule({}, node.graph), is_backward=True)
    workspace = op_workspaces([node])[node]
    held = [b.bytes for kernel in kernels.kernels for b in kernel.allocates if b.name.endswith("_workspace")]
    assert held == [workspace]
    gradients = 3 * 2 * 200 * 4 * 40 * 2
    assert simulate(scheduled_program(kernels, None)).peak_bytes >= gradients + workspace
