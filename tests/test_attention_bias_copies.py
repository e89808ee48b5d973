"""Inductor's whole copy of a broadcast attention bias that a CUDA graph computes
(``passes/inductor/attention_bias_copies.py``): planned where the plan recomputes the mask, and as
Inductor's CUDA kernels make it (those checked on fake CUDA where torch has a CUDA build)."""

import pytest
import torch

from compile_offload.passes.inductor.rules import TRITON
from compile_offload.passes import compat, memory
from compile_offload.passes.analyze import analyze_joint
from compile_offload.passes.inductor.attention_bias_copies import COPYING_OPS

from .passes.joint_capture import capture
from .test_op_workspace import _joint_on_cuda

BATCH, HEADS, SEQ, HEAD_DIM = 4, 2, 128, 32
WHOLE_BIAS = BATCH * HEADS * SEQ * SEQ * 4  # fp32, batch x heads x queries x keys


def _masked_attention(q, k, v, mask):
    bias = (~mask).float() * -1e4  # as SDPA's bool mask becomes a bias, broadcast over the heads
    expanded = bias.expand(BATCH, HEADS, SEQ, SEQ)
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, expanded, True)[0].sum()


def _analysis():
    """The joint graph of ``_masked_attention`` on fake CUDA values, analysed for Inductor,
    with torch's min-cut saved set."""

    def hook(joint, _):
        _joint_on_cuda(joint)
        return joint, analyze_joint(joint, TRITON), compat.min_cut_saved_values(joint)

    with torch.device("meta"):
        q, k, v = (torch.empty(BATCH, SEQ, HEADS, HEAD_DIM, requires_grad=True).transpose(1, 2) for _ in range(3))
        mask = torch.empty(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    (joint, analysis, saved), _ = capture(_masked_attention, q, k, v, mask, hook=hook)
    return joint, analysis, set(saved)


def _bias_copies(program: memory.Program) -> list[int]:
    return [nbytes for step in program.steps for key, nbytes in step.allocates
            if isinstance(key, tuple) and key[0] == "bias copy"]


def test_the_efficient_attention_backward_copies_the_mask_it_recomputes_and_not_the_one_it_receives():
    _, analysis, min_cut = _analysis()
    ((kernel, (view, nbytes)),) = analysis.bias_copies.items()
    assert kernel.target in COPYING_OPS and nbytes == WHOLE_BIAS
    base = view.args[0]
    assert view in min_cut and base not in min_cut  # torch's min-cut saves the broadcast mask
    received = memory.plan_program(analysis, min_cut, fusion=True)
    recomputed = memory.plan_program(analysis, min_cut - {view}, fusion=True)
    saved_base = memory.plan_program(analysis, min_cut - {view} | {base}, fusion=True)
    assert _bias_copies(received) == _bias_copies(saved_base) == [] and _bias_copies(recomputed) == [WHOLE_BIAS]
    # The copy is alive while the kernel and its outputs are: at the last output's step
    # the plan that recomputes the mask holds the copy on top of what the plan that
    # receives it holds (the recomputed mask in place of the saved one).
    def live_at_last_output(program):
        index = max(i for i, s in enumerate(program.steps) if s.label in {u.name for u in kernel.users})
        return memory.simulate(program).live_bytes[index], memory.live_at(program, index)

    with_copy, alive = live_at_last_output(recomputed)
    assert ("bias copy", kernel.name) in alive
    without_copy, _ = live_at_last_output(received)
    assert with_copy - without_copy == WHOLE_BIAS


def test_a_bias_the_forward_computes_is_not_copied_by_the_efficient_attention_forward():
    _, analysis, _ = _analysis()
    assert all(kernel.target is not torch.ops.aten._scaled_dot_product_efficient_attention.default
               for kernel in analysis.bias_copies)


def test_without_inductor_nothing_is_copied():
    def hook(joint, _):
        _joint_on_cuda(joint)
        return analyze_joint(joint)

    with torch.device("meta"):
        q, k, v = (torch.empty(BATCH, SEQ, HEADS, HEAD_DIM, requires_grad=True).transpose(1, 2) for _ in range(3))
        mask = torch.empty(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    analysis, _ = capture(_masked_attention, q, k, v, mask, hook=hook)
    assert analysis.bias_copies == {}


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (Inductor's CUDA lowering)")
@pytest.mark.parametrize("save_the_mask", [False, True])
def test_inductors_cuda_kernels_copy_the_bias_where_the_plan_says(save_the_mask):
    """The backward Inductor generates for each plan (on fake CUDA, ``benchmarks/cuda_schedule``)
    allocates a buffer of the whole bias exactly when the plan's program has the copy."""
    from compile_offload.benchmarks import cuda_schedule

    joint, analysis, min_cut = _analysis()
    ((_, (view, _)),) = analysis.bias_copies.items()
    saved = min_cut if save_the_mask else min_cut - {view}
    planned = _bias_copies(memory.plan_program(analysis, saved, fusion=True))
    # The backward receives the inputs it recomputes from (the bool mask). The default
    # partition that runs after the capture hook leaves the joint module with a graph of
    # its own: the saved values by name.
    names = {n.name for n in saved | analysis.steady}
    ordered = [n for n in joint.gm.graph.nodes if n.name in names]
    assert len(ordered) == len(names)
    _, backward = compat.extract_forward_backward(joint, ordered)
    with cuda_schedule.fake_cuda():
        kernels = cuda_schedule.cuda_kernels(backward, is_backward=True)
    made = [b.bytes for kernel in kernels.kernels for b in kernel.allocates if b.bytes == WHOLE_BIAS]
    assert made == planned == ([] if save_the_mask else [WHOLE_BIAS])


def test_cudnn_attention_copies_the_mask_its_forward_computes():
    """cuDNN attention's forward always computes the mask here (from the bool input), so its
    copy is made whatever the plan; its backward copies only a mask it recomputes."""

    def attention(q, k, v, mask):
        bias = ((~mask).float() * -1e4).expand(BATCH, HEADS, SEQ, SEQ)
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, False)[0].sum()

    def hook(joint, _):
        _joint_on_cuda(joint)
        return analyze_joint(joint, TRITON), compat.min_cut_saved_values(joint)

    with torch.device("meta"):
        q, k, v = (torch.empty(BATCH, SEQ, HEADS, HEAD_DIM, requires_grad=True).transpose(1, 2) for _ in range(3))
        mask = torch.empty(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    (analysis, min_cut), _ = capture(attention, q, k, v, mask, hook=hook)
    kernels = {kernel.target: view for kernel, (view, nbytes) in analysis.bias_copies.items() if nbytes == WHOLE_BIAS}
    assert set(kernels) == {torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                            torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default}
    forward_kernel, backward_kernel = sorted(analysis.bias_copies, key=analysis.position.__getitem__)
    view = analysis.bias_copies[backward_kernel][0]

    def copied(saved):
        return {step.label for step in memory.plan_program(analysis, saved, fusion=True).steps
                for key, _ in step.allocates if isinstance(key, tuple) and key[0] == "bias copy"}

    assert copied(set(min_cut) | {view}) == {forward_kernel.name}
    assert copied(set(min_cut) - _view_chain(analysis, view)) == {forward_kernel.name, backward_kernel.name}


def _view_chain(analysis, view) -> set:
    chain = set()
    while view is not None:
        chain.add(view)
        view = analysis.alias_parent[view]
    return chain


def test_a_symbolic_shape_sizes_the_copy_from_its_hints():
    """Dynamic shapes: the bias's sizes and strides are read as hints (no guard is added)."""
    with torch.device("meta"):
        q, k, v = (torch.empty(BATCH, SEQ, HEADS, HEAD_DIM, requires_grad=True).transpose(1, 2) for _ in range(3))
        mask = torch.empty(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    analysis, _ = capture(_masked_attention, q, k, v, mask, dynamic=True,
                          hook=lambda joint, _: analyze_joint(joint, TRITON))
    assert any(isinstance(s, torch.SymInt) for n in analysis.position if (val := n.meta.get("val")) is not None
               and isinstance(val, torch.Tensor) for s in val.shape)
    assert [nbytes for _, nbytes in analysis.bias_copies.values()] == [WHOLE_BIAS]
