"""A joint graph planned for an H100 and lowered to Inductor's CUDA kernels on fake tensors
(``benchmarks/cuda_schedule``): what the tests that compare a plan with those kernels share.
Needs a CUDA build of torch (the caller skips without one)."""

import warnings

import torch


def plan_on_fake_cuda(joint, num_fwd_outputs: int, settings, keep_plan_order: bool = True):
    """(the planner's ``PartitionResult``, the recorded forward and backward kernels) of
    ``joint`` (a ``compat.JointGraph``) moved to fake CUDA and planned under ``settings``.
    ``compile_fx_inner`` runs without AOTAutograd's context there, so no saved tensor is
    donated to the backward: planned likewise (``donated_buffer`` off). Warnings (a budget
    below the minimum) are silenced."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from compile_offload.pipeline.inductor_compile import inductor_config_patches
    from compile_offload.benchmarks import cuda_schedule
    from compile_offload.pipeline.partitioner import OffloadRematPartitioner

    results = []
    with cuda_schedule.fake_cuda(), warnings.catch_warnings(), torch._functorch.config.patch(donated_buffer=False):
        warnings.simplefilter("ignore")
        gm = cuda_schedule._on_cuda(joint.gm)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda")
                      for n in gm.graph.nodes if n.op == "placeholder" for v in [n.meta["val"]]]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
        partitioner = OffloadRematPartitioner(settings, on_result=results.append)
        forward, backward = partitioner(gm, inputs, num_fwd_outputs=num_fwd_outputs)
        patches = {k: v for k, v in inductor_config_patches(settings, partitioner).items() if k != "custom_partitioner_fn"}
        kernels = [cuda_schedule.cuda_kernels(graph, is_backward, config_patches=patches, keep_plan_order=keep_plan_order)
                   for graph, is_backward in ((forward, False), (backward, True))]
    return results[-1], kernels
