"""What an extern op holds while it runs (``op_workspace``): the CPU convolution's backward,
measured by running it and checked against the measured step of a compiled net; CUDA
FlashAttention's and memory-efficient attention's backward, from their source (checked on a
GPU where there is one)."""

import operator
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from compile_offload.benchmarks.budget_contract import ConvBNNet
from compile_offload.inductor.op_workspace import op_workspaces

from .passes.joint_capture import capture_analysis
from .passes.test_in_place import planned_and_measured


def WideConvNet() -> nn.Module:
    """Wide channels at a small size: the weights, and so the backward's temporaries, are
    large against the activations (a tenth of the step's peak)."""
    return ConvBNNet(width=32, blocks=2)


def test_each_convolution_backward_gets_a_measured_workspace():
    torch.manual_seed(0)
    model = WideConvNet()
    analysis, _ = capture_analysis(lambda x: model(x).pow(2).mean(), torch.randn(4, 3, 16, 16))
    found = op_workspaces(list(analysis.position))
    convolutions = [n for n in analysis.bw_nodes if n.target is torch.ops.aten.convolution_backward.default]
    forward = [n for n in analysis.position if n.target is torch.ops.aten.convolution.default]
    assert set(convolutions) <= set(found) <= set(convolutions) | set(forward) and len(convolutions) == 3
    weight_bytes = 32 * 32 * 3 * 3 * 4
    wide = [found[n] for n in convolutions if n.args[2].meta["val"].shape[1] == 32]
    assert len(wide) == 2 and all(bytes_ >= weight_bytes for bytes_ in wide)  # at least the weight gradient's buffer


def test_an_op_that_raises_when_measured_is_said_not_counted_once(monkeypatch):
    """review31c #6: a CPU probe that raised counted 0 bytes without a word (a conv net planned
    at 4.02 MiB under 4.5 MiB measured 5.10 MiB; nothing said without verify_budget)."""
    from compile_offload.inductor import op_workspace

    monkeypatch.setattr(op_workspace, "_measured", {})
    monkeypatch.setattr(op_workspace, "_warned_not_measured", set())

    def raising(*args, **kwargs):
        raise RuntimeError("cannot run here")

    monkeypatch.setattr(op_workspace, "measure_peak", raising)
    torch.manual_seed(0)
    model = WideConvNet()
    analysis, _ = capture_analysis(lambda x: model(x).pow(2).mean(), torch.randn(4, 3, 16, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = op_workspaces(list(analysis.position))
        op_workspaces(list(analysis.position))
    said = [str(w.message) for w in caught if "could not be measured on the CPU" in str(w.message)]
    assert len(said) == 1 and "RuntimeError: cannot run here" in said[0] and "convolution" in said[0], said
    assert not any(found.values())


def test_nothing_is_measured_off_the_cpu_or_with_symbolic_shapes():
    with torch.device("meta"):
        model = WideConvNet()
    analysis, _ = capture_analysis(lambda x: model(x).pow(2).mean(), torch.randn(4, 3, 16, 16, device="meta"))
    assert op_workspaces(list(analysis.position)) == {}


def test_nothing_is_measured_for_a_gpu_plan_on_host_tensors(monkeypatch):
    """explain with a GPU profile on CPU tensors plans for the GPU: the CPU kernels'
    workspace is not the GPU's, so no CPU op is run for it (the planner asks with
    ``measure=False`` when it plans with Triton's kernel rules)."""
    import importlib

    import compile_offload

    torch.manual_seed(0)
    model = WideConvNet()
    x = torch.randn(4, 3, 16, 16)
    analysis, _ = capture_analysis(lambda x: model(x).pow(2).mean(), x)
    assert op_workspaces(list(analysis.position))  # measured on the CPU ...
    assert op_workspaces(list(analysis.position), measure=False) == {}  # ... unless told not to
    op_workspace = importlib.import_module("compile_offload.inductor.op_workspace")
    measured = []
    run = op_workspace._measure
    monkeypatch.setattr(op_workspace, "_measure", lambda *args: measured.append(args) or run(*args))
    monkeypatch.setattr(op_workspace, "_measured", {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_offload.explain(model, x, memory_budget=0.6, device_profile="h100")
        assert not measured
        compile_offload.explain(model, x, memory_budget=0.6, device_profile="cpu")
    assert measured


@pytest.mark.inductor
@pytest.mark.slow
def test_the_compiled_step_of_a_wide_convolution_net_is_predicted():
    """Measured 2026-11-26 (torch 2.13, CPU): without the workspace the prediction was 12.6%
    low (877 KB against 987 KB: the op's temporaries, and its inputs freed before its outputs
    were allocated); with it, exact to a few bytes."""
    torch.manual_seed(0)
    model = WideConvNet()
    x = torch.randn(4, 3, 16, 16)
    predicted, measured = planned_and_measured(lambda x: model(x).pow(2).mean(), x)
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


class DepthwiseThenTransposed(nn.Module):
    """A depthwise convolution in channels-last, then a transposed one: mkldnn's forward
    kernels hold a copy of their input in another layout and more while they run (measured,
    torch 2.13: 41 KiB at a 2x4x16x16 input, 2.5 times the larger output), and this step
    peaks in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.up = nn.ConvTranspose2d(4, 2, 2, stride=2)

    def forward(self, x):
        y = self.up(F.mish(self.depthwise(x.contiguous(memory_format=torch.channels_last))))
        return F.pad(y, (1, 1, 1, 1)).pow(2).mean()


def test_each_forward_convolution_gets_a_measured_workspace():
    torch.manual_seed(0)
    analysis, _ = capture_analysis(DepthwiseThenTransposed(), torch.randn(2, 4, 16, 16))
    forward = [n for n in analysis.position if n.target is torch.ops.aten.convolution.default]
    found = op_workspaces(list(analysis.position))
    assert len(forward) == 2 and all(found.get(n, 0) > 0 for n in forward)


@pytest.mark.inductor
@pytest.mark.slow
def test_a_step_that_peaks_in_a_forward_convolution_is_predicted():
    """Found by an op-family sweep: without the forward convolutions' workspace this step
    was predicted 41 KiB under the 101 KiB it measured (torch 2.13), and a byte budget in
    between was kept silently over."""
    torch.manual_seed(0)
    model = DepthwiseThenTransposed()
    x = torch.randn(2, 4, 16, 16)
    predicted, measured = planned_and_measured(model, x)
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


class DropoutMLP(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return self.fc2(F.dropout(torch.tanh(self.fc1(x)), 0.1, True)).pow(2).mean()


def test_a_dropout_run_by_aten_holds_its_noise():
    """Under ``fallback_random`` Inductor calls ATen's ``native_dropout``, which draws its
    noise into a temporary of the input's size before writing the mask and the output."""
    torch.manual_seed(0)
    with torch._inductor.config.patch(fallback_random=True):
        analysis, _ = capture_analysis(DropoutMLP(), torch.randn(8, 32, 64))
    dropouts = [n for n in analysis.position if n.target is torch.ops.aten.native_dropout.default]
    found = op_workspaces(list(analysis.position))
    assert len(dropouts) == 1 and found.get(dropouts[0], 0) >= 8 * 32 * 256 * 4


@pytest.mark.inductor
@pytest.mark.slow
def test_the_compiled_step_of_a_dropout_run_by_aten_is_predicted():
    """Found by a parity sweep: with ``fallback_random`` a dropout transformer measured 5%
    over its byte budget, silently (the noise buffers of 8 dropouts were in no prediction)."""
    torch.manual_seed(0)
    model, x = DropoutMLP(), torch.randn(8, 32, 64)
    with torch._inductor.config.patch(fallback_random=True):
        predicted, measured = planned_and_measured(model, x)
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


class Bag(nn.Module):
    """An EmbeddingBag in max mode under a Linear: its backward's peak is where the step peaks."""

    def __init__(self, mode: str = "max") -> None:
        super().__init__()
        self.bag, self.fc = nn.EmbeddingBag(1000, 128, mode=mode), nn.Linear(128, 256)

    def forward(self, indices, offsets):
        return self.fc(self.bag(indices, offsets)).relu().square().mean()


def _bag_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1000, (8192,)), torch.arange(0, 8192, 16)


@pytest.mark.parametrize("mode", ["sum", "max"])
def test_an_embedding_bag_backward_holds_what_it_holds_on_real_indices(mode):
    """The max mode's backward copies the gradient and max indices of the non-empty bags
    (786 KiB here); run on zero-filled sizes every bag is empty and it held nothing."""
    torch.manual_seed(0)
    analysis, _ = capture_analysis(Bag(mode), *_bag_inputs())
    (backward,) = [n for n in analysis.position if n.target is torch.ops.aten._embedding_bag_backward.default]
    found = op_workspaces(list(analysis.position))
    at_least = 512 * 128 * (8 + 4) if mode == "max" else 1000 * 128 // 2
    assert found.get(backward, 0) >= at_least, found.get(backward)


@pytest.mark.inductor
@pytest.mark.slow
def test_the_compiled_step_of_an_embedding_bag_is_predicted():
    """Found by an op-family sweep: the step was predicted 1.44 MiB and measured 2.18 MiB, and
    a byte budget of 1.8 MiB was kept over without a warning."""
    torch.manual_seed(0)
    predicted, measured = planned_and_measured(Bag("max"), *_bag_inputs())
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_abs_is_measured_on_complex_tensors_only():
    """ATen's complex abs holds real temporaries of its output's size; a real abs is one of
    Inductor's fused kernels, not run on its own."""

    class Magnitudes(nn.Module):
        def forward(self, x):
            return torch.fft.fft2(x).abs().sum() + x.abs().sum()

    analysis, _ = capture_analysis(Magnitudes(), torch.randn(4, 8, 32, 32, requires_grad=True))
    found = op_workspaces(list(analysis.position))
    absolutes = [n for n in analysis.position if n.target is torch.ops.aten.abs.default]
    complex_abs = [n for n in absolutes if n.args[0].meta["val"].is_complex()]
    assert len(absolutes) == 2 and len(complex_abs) == 1
    assert found.get(complex_abs[0], 0) >= 4 * 8 * 32 * 32 * 4
    assert not found.get(next(n for n in absolutes if n not in complex_abs), 0)


def _flash_backward_graph(batch, heads, seq, head_dim, heads_k=None, device="cuda", dtype=torch.bfloat16):
    """A graph of one ``_scaled_dot_product_flash_attention_backward`` on fake tensors of
    ``device`` (fake CUDA tensors need no GPU), laid out as SDPA's callers give them: the
    (batch, seq, heads, head_dim) buffers seen through a transpose."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_offload.inductor.op_workspace import FLASH_BACKWARD

    heads_k = heads if heads_k is None else heads_k
    with FakeTensorMode():
        def bshd(h):
            return torch.empty(batch, seq, h, head_dim, device=device, dtype=dtype).transpose(1, 2)

        values = {"grad_out": bshd(heads), "query": bshd(heads), "key": bshd(heads_k), "value": bshd(heads_k),
                  "out": bshd(heads), "logsumexp": torch.empty(batch, heads, seq, device=device),
                  "seed": torch.empty((), dtype=torch.int64, device=device),
                  "offset": torch.empty((), dtype=torch.int64, device=device)}
    return _one_op_graph(values, FLASH_BACKWARD, lambda args: (
        *(args[n] for n in ("grad_out", "query", "key", "value", "out", "logsumexp")),
        None, None, seq, seq, 0.0, True, args["seed"], args["offset"]))


def _one_op_graph(values: dict, target, arguments) -> fx.Node:
    """A graph of placeholders holding ``values`` (name -> fake tensor) and one call of
    ``target`` on ``arguments(placeholders by name)``, whose three outputs it returns."""
    graph = fx.Graph()
    args = {}
    for name, value in values.items():
        args[name] = graph.placeholder(name)
        args[name].meta["val"] = value
    node = graph.call_function(target, arguments(args))
    graph.output(tuple(graph.call_function(operator.getitem, (node, i)) for i in range(3)))
    return node


def test_flash_attention_backward_on_cuda_holds_its_fp32_accumulators():
    """FlashAttention-2's ``mha_bwd``: an fp32 dq accumulator of (batch, seq rounded up to 128,
    heads, head_dim rounded up to 32) and fp32 row sums of (batch, heads, seq rounded up to
    128) beside the gradients; fewer key heads (grouped-query) add key and value gradients at
    the query's head count."""
    node = _flash_backward_graph(batch=2, heads=4, seq=200, head_dim=40)
    accumulator, row_sums = 2 * 256 * 4 * 64 * 4, 2 * 4 * 256 * 4
    assert op_workspaces([node]) == {node: accumulator + row_sums}
    wide = _flash_backward_graph(batch=1, heads=2, seq=128, head_dim=200)  # over 192: rounded to 256
    assert op_workspaces([wide])[wide] == 1 * 128 * 2 * 256 * 4 + 1 * 2 * 128 * 4
    grouped = _flash_backward_graph(batch=2, heads=4, seq=200, head_dim=40, heads_k=2)
    expanded = 2 * (2 * 200 * 4 * 40 * 2)  # dk and dv at 4 heads, bf16
    assert op_workspaces([grouped])[grouped] == accumulator + row_sums + expanded


def test_flash_attention_backward_off_cuda_counts_nothing():
    assert op_workspaces([_flash_backward_graph(2, 4, 200, 40, device="cpu")]) == {}
    assert op_workspaces([_flash_backward_graph(2, 4, 200, 40, device="meta")]) == {}


@pytest.mark.cuda
def test_flash_attention_backward_allocates_what_the_rule_says():
    """On a GPU: what the op holds above its three gradients, at the allocator, is the rule's
    figure (the caching allocator rounds each block; 1 MiB of slack). If torch's SDPA takes
    another kernel for these shapes (FlashAttention-3, cuDNN), this is where it shows."""
    from compile_offload.inductor.op_workspace import FLASH_BACKWARD, flash_attention_backward_workspace

    batch, heads, seq, head_dim = 4, 8, 1000, 72
    node = _flash_backward_graph(batch, heads, seq, head_dim)

    def bshd():
        return torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    query, key, value = bshd(), bshd(), bshd()
    out, logsumexp, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, 0.0, True)
    grad_out = bshd()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = FLASH_BACKWARD(grad_out, query, key, value, out, logsumexp, None, None, seq, seq, 0.0, True, seed, offset)
    torch.cuda.synchronize()
    held = torch.cuda.max_memory_allocated() - before - sum(g.untyped_storage().nbytes() for g in grads)
    expected = flash_attention_backward_workspace(node)
    assert expected > 10 * 2**20
    assert abs(held - expected) <= 2**20, (held, expected)


def _efficient_backward_graph(batch, heads, seq_q, head_dim, seq_k=None, head_dim_v=None, device="cuda",
                               dtype=torch.float32):
    """A graph of one ``_scaled_dot_product_efficient_attention_backward`` on fake tensors of
    ``device``, laid out as SDPA's callers give them (as ``_flash_backward_graph``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_offload.inductor.op_workspace import EFFICIENT_BACKWARD

    seq_k = seq_q if seq_k is None else seq_k
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    with FakeTensorMode():
        def bshd(seq, dim):
            return torch.empty(batch, seq, heads, dim, device=device, dtype=dtype).transpose(1, 2)

        values = {"grad_out": bshd(seq_q, head_dim_v), "query": bshd(seq_q, head_dim), "key": bshd(seq_k, head_dim),
                  "value": bshd(seq_k, head_dim_v), "out": bshd(seq_q, head_dim_v),
                  "logsumexp": torch.empty(batch, heads, -(-seq_q // 32) * 32, device=device),
                  "seed": torch.empty((), dtype=torch.int64, device=device),
                  "offset": torch.empty((), dtype=torch.int64, device=device)}
    return _one_op_graph(values, EFFICIENT_BACKWARD, lambda args: (
        *(args[n] for n in ("grad_out", "query", "key", "value")), None,
        *(args[n] for n in ("out", "logsumexp", "seed", "offset")), 0.0, [True, True, True, False], True))


def test_efficient_attention_backward_on_cuda_holds_its_fp32_workspace():
    """The cutlass kernel's backward (``_efficient_attention_backward``, sm80 to sm90): per
    (batch, head), one GradQTempStorage (16 bytes of lock and counter, then block_i x block_j
    fp32) per block of block_i queries and block_j columns of the head dim; fp16/bf16 above
    head dim 128 add dk and dv accumulators per key split; and the fp32 ``delta`` row sums
    (batch x heads x seq_q)."""
    from compile_offload.inductor.op_workspace import efficient_attention_backward_workspace

    # The contract's GPT-2 (fp32, batch 4, 2 heads, seq 128, head dim 32): the 64x64 kernel
    # (kMaxK 32), 2 query blocks x 1 column block of (16 + 64*64*4) bytes per (batch, head):
    # 262,400 bytes (what the H200 measured, 0.25 MiB), and delta 4*2*128*4. Before the
    # workspace, the fp32 delta's product (4*128*2*32*4) and sums are held: less.
    gpt2 = _efficient_backward_graph(batch=4, heads=2, seq_q=128, head_dim=32)
    workspace, delta = 4 * 2 * 2 * 1 * (16 + 64 * 64 * 4), 4 * 2 * 128 * 4
    assert workspace == 262_400
    assert op_workspaces([gpt2]) == {gpt2: workspace + delta}
    # fp32 above head dim 64: 128x64 tiles; 100 queries are one block, 80 columns two.
    wide = _efficient_backward_graph(batch=2, heads=3, seq_q=100, head_dim=80, seq_k=300)
    assert efficient_attention_backward_workspace(wide) == 2 * 3 * 1 * 2 * (16 + 128 * 64 * 4) + 2 * 3 * 100 * 4
    # bf16 up to head dim 128: 128x128 tiles, dk and dv kept in registers: dq only.
    bf16 = _efficient_backward_graph(batch=2, heads=4, seq_q=200, head_dim=128, dtype=torch.bfloat16)
    assert efficient_attention_backward_workspace(bf16) == 2 * 4 * 2 * 1 * (16 + 128 * 128 * 4) + 2 * 4 * 200 * 4
    # bf16 above 128: 128x64 tiles; dk and dv accumulators of 64 x round_up(256, 128) floats
    # per key split, min(ceil(256 / 64), 200 // (1 * 2)) = 4 splits; dq: 2 x 4 blocks.
    large = _efficient_backward_graph(batch=1, heads=2, seq_q=256, head_dim=256, dtype=torch.bfloat16)
    per_head = 4 * 64 * 256 * 4 * 2 + 2 * 4 * (16 + 128 * 64 * 4)
    assert efficient_attention_backward_workspace(large) == 1 * 2 * per_head + 1 * 2 * 256 * 4
    many_heads = _efficient_backward_graph(batch=16, heads=16, seq_q=256, head_dim=256, dtype=torch.float16)
    per_head = 1 * 64 * 256 * 4 * 2 + 2 * 4 * (16 + 128 * 64 * 4)  # 200 // 256 = 0: one split
    assert efficient_attention_backward_workspace(many_heads) == 16 * 16 * per_head + 16 * 16 * 256 * 4


def test_efficient_attention_backward_off_cuda_counts_nothing():
    assert op_workspaces([_efficient_backward_graph(4, 2, 128, 32, device="cpu")]) == {}
    assert op_workspaces([_efficient_backward_graph(4, 2, 128, 32, device="meta")]) == {}


def _joint_on_cuda(joint):
    """``joint`` (traced on ``meta``) with its values fake CUDA tensors, as a trace on a GPU
    gives them: SDPA on fake CUDA tensors cannot be traced without a GPU (autograd asks the
    device for a stream), so the graph is traced on meta and its values propagated again."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = joint.gm
    cuda = torch.device("cuda")
    for node in gm.graph.nodes:
        node.args = tuple(cuda if isinstance(arg, torch.device) else arg for arg in node.args)
        node.kwargs = {key: cuda if isinstance(value, torch.device) else value for key, value in node.kwargs.items()}
    gm.recompile()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda")
                  if isinstance(v := node.meta["val"], torch.Tensor) else v
                  for node in gm.graph.nodes if node.op == "placeholder"]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    return joint


def test_a_cuda_plan_holds_the_efficient_attention_backward_workspace():
    """A traced joint graph with the memory-efficient attention on CUDA: the analysis the
    planner builds (``planning``: ``op_workspaces`` with ``measure=False`` for a GPU) counts
    the workspace, and the plan's simulated peak holds it while the backward runs."""
    from compile_offload.inductor.op_workspace import EFFICIENT_BACKWARD
    from compile_offload.passes import compat, memory
    from compile_offload.passes.analyze import analyze_joint

    from .passes.joint_capture import capture

    def hook(joint, _):
        _joint_on_cuda(joint)
        analysis = analyze_joint(joint, workspaces=lambda nodes: op_workspaces(nodes, measure=False))
        return analysis, compat.min_cut_saved_values(joint)

    def attention(q, k, v):
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0].sum()

    with torch.device("meta"):
        q, k, v = (torch.empty(4, 128, 2, 32, requires_grad=True).transpose(1, 2) for _ in range(3))
    (analysis, saved), _ = capture(attention, q, k, v, hook=hook)
    backward = [n for n in analysis.bw_nodes if n.target is EFFICIENT_BACKWARD]
    assert len(backward) == 1 and analysis.bw_nodes[0].meta["val"].device.type == "cuda"
    assert analysis.workspace_bytes == {backward[0]: 262_400 + 4 * 2 * 128 * 4}
    held = memory.simulate(memory.plan_program(analysis, set(saved))).peak_bytes
    analysis.workspace_bytes.clear()
    assert held - memory.simulate(memory.plan_program(analysis, set(saved))).peak_bytes == 262_400 + 4 * 2 * 128 * 4


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (Inductor's CUDA lowering)")
def test_the_recorded_efficient_attention_backward_kernel_holds_its_workspace():
    """The scheduled peak counts it as the plan does: Inductor's fallback kernel for the op,
    recorded on fake CUDA (``benchmarks/cuda_schedule``), allocates the rule's bytes."""
    from compile_offload.benchmarks import cuda_schedule

    with cuda_schedule.fake_cuda():
        node = _efficient_backward_graph(batch=4, heads=2, seq_q=128, head_dim=32)
        kernels = cuda_schedule.cuda_kernels(fx.GraphModule({}, node.graph), is_backward=True)
    held = [b.bytes for kernel in kernels.kernels for b in kernel.allocates if b.name.endswith("_workspace")]
    assert held == [op_workspaces([node])[node]] == [262_400 + 4 * 2 * 128 * 4]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 32), (torch.float32, 80), (torch.bfloat16, 128),
                                             (torch.bfloat16, 256)])
def test_efficient_attention_backward_allocates_what_the_rule_says(dtype, head_dim):
    """On a GPU: what the op holds above its gradients, at the allocator, is the rule's figure
    (the caching allocator rounds each block up to 512 bytes: 4 KiB of slack). The first case
    is the contract's GPT-2 attention, measured 0.25 MiB above the plan on an H200. Where it
    fails, the kernel picked (tiles, key splits) is not the one the rule reads for this GPU."""
    from compile_offload.inductor.op_workspace import EFFICIENT_BACKWARD, efficient_attention_backward_workspace

    batch, heads, seq = (4, 2, 128) if head_dim == 32 else (2, 4, 300)
    node = _efficient_backward_graph(batch, heads, seq, head_dim, dtype=dtype)

    def bshd():
        return torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)

    query, key, value = bshd(), bshd(), bshd()
    out, logsumexp, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, True)
    grad_out = bshd()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = EFFICIENT_BACKWARD(grad_out, query, key, value, None, out, logsumexp, seed, offset, 0.0,
                               [True, True, True, False], True)
    torch.cuda.synchronize()
    held = torch.cuda.max_memory_allocated() - before - sum(
        g.untyped_storage().nbytes() for g in grads if isinstance(g, torch.Tensor) and g.numel())
    expected = efficient_attention_backward_workspace(node)
    assert expected > 0
    assert abs(held - expected) <= 4096, (held, expected)


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("batch, seq, width, heads", [(2, 512, 32, 2), (4, 256, 64, 4)])
def test_the_compiled_step_of_an_attention_block_is_predicted(batch, seq, width, heads):
    """The CPU attention kernels hold per-thread buffers while they run (measured like the
    convolution's). Measured 2026-11-26 (torch 2.13, CPU): before the simulator held a
    tuple op's inputs while its outputs are allocated, (2, 512, 32, 2) was predicted 50% low;
    with that, 33% low; with the attention backward's measured workspace, to a few bytes."""
    from .passes.test_memory import Attention

    torch.manual_seed(0)
    model = Attention(width, heads)
    x = torch.randn(batch, seq, width, requires_grad=True)
    analysis, _ = capture_analysis(lambda x: model(x), x)
    measured_ops = {node.target for node in op_workspaces(list(analysis.position))}
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default in measured_ops
    predicted, measured = planned_and_measured(lambda x: model(x), x)
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


def _conv_net(x, w1, w2):
    return F.conv2d(F.conv2d(x, w1, padding=1).relu(), w2, padding=1).sum()


def _plan_conv_net(device: str, budget):
    """``_conv_net``'s joint graph, traced on ``device`` ("cuda": on meta, then given fake
    CUDA values), planned for ``h100`` under ``budget`` through ``plan_partition``."""
    from compile_offload.pipeline.planning import plan_partition
    from compile_offload.settings import resolve

    from .passes.joint_capture import capture

    def hook(joint, joint_inputs):
        if device == "cuda":
            _joint_on_cuda(joint)
        settings = resolve({"memory_budget": budget, "device_profile": "h100"})
        # On CUDA values the graph's device says, as in the backend (and the planner measures
        # what it can on a GPU); elsewhere host tensors stand in for a GPU's, as in ``explain``.
        return plan_partition(joint.gm, joint_inputs, settings, num_fwd_outputs=joint.num_fwd_outputs,
                              accelerator=None if device == "cuda" else True)

    with torch.device("meta" if device == "cuda" else device):
        x = torch.zeros(8, 16, 32, 32)
        w1, w2 = (torch.zeros(16, 16, 3, 3, requires_grad=True) for _ in range(2))
    result, _ = capture(_conv_net, x, w1, w2, hook=hook)
    return result


def test_a_cuda_convolution_plan_names_the_workspace_it_could_not_measure(monkeypatch):
    """cuDNN sizes the convolution backward's workspace when it runs (1.08 MiB at the
    contract's conv+BN peak on an H200). Where it cannot be measured (here: no GPU to run
    it on, as when CUDA is faked), the plan says so in its notes, and under a budget one
    warning per process says the peak can exceed the budget by it."""
    from compile_offload.inductor import op_workspace
    from compile_offload.pipeline import planning
    from compile_offload.inductor.op_workspace import uncounted_cuda_workspaces

    monkeypatch.setattr(planning, "_warned_uncounted", set())
    monkeypatch.setattr(op_workspace, "_measured_cuda", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _plan_conv_net("cuda", 2**20).plan
        second = _plan_conv_net("cuda", 2**20).plan
        unbudgeted = _plan_conv_net("cuda", None).plan
    for plan in (first, second, unbudgeted):
        notes = [n for n in plan.notes if n.startswith(planning.UNCOUNTED_WORKSPACE_NOTE)]
        assert len(notes) == 1 and "convolution forward, convolution backward" in notes[0], plan.notes
    warned = [str(w.message) for w in caught if "does not count the workspace" in str(w.message)]
    assert len(warned) == 1 and "convolution forward, convolution backward" in warned[0], warned
    assert "verify_budget" in warned[0]
    assert uncounted_cuda_workspaces([_flash_backward_graph(2, 2, 128, 64)]) == []


def test_a_convolution_planned_for_a_gpu_on_meta_names_it_too_and_on_the_cpu_not(monkeypatch):
    """``explain`` plans for a GPU on meta tensors: the same note. On the CPU the convolution
    backward's workspace is measured (above): nothing to name, nothing to warn about."""
    from compile_offload.pipeline import planning

    monkeypatch.setattr(planning, "_warned_uncounted", set())
    meta = _plan_conv_net("meta", None).plan
    assert [n for n in meta.notes if n.startswith(planning.UNCOUNTED_WORKSPACE_NOTE)], meta.notes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu = _plan_conv_net("cpu", 2**20).plan
    assert not [n for n in cpu.notes if n.startswith(planning.UNCOUNTED_WORKSPACE_NOTE)], cpu.notes
    assert not [w for w in caught if "does not count the workspace" in str(w.message)]


def _assert_the_op_holds_what_was_measured(node: fx.Node, measured: int) -> None:
    """``node`` run on zero-filled CUDA tensors of its shapes, every output at once: what it
    holds above its outputs at the allocator is ``measured`` (512-byte blocks and an unsplit
    cached block: 1% + 64 KiB of slack)."""
    from compile_offload.runtime.memory_tracker import measure_peak
    from compile_offload.inductor.op_workspace import tensor_value

    def real(value):
        return torch.zeros(value.shape, dtype=value.dtype, device="cuda" if value.device.type == "cuda" else "cpu")

    args = [real(tensor_value(a)) if isinstance(a, fx.Node) else a for a in node.args]
    kwargs = {k: real(tensor_value(v)) if isinstance(v, fx.Node) else v for k, v in node.kwargs.items()}
    node.target(*args, **kwargs)  # warm-up
    with measure_peak("cuda") as peak:
        outputs = node.target(*args, **kwargs)
    held = peak.peak_bytes - sum(t.untyped_storage().nbytes() for t in outputs
                                 if isinstance(t, torch.Tensor) and t.is_cuda)
    assert abs(held - measured) <= 0.01 * measured + 64 * 1024, (node.target, held, measured)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_convolution_backward_workspace_is_measured_and_planned(monkeypatch):
    """On a GPU the planner runs each convolution backward once per gradient and counts the
    larger workspace, and each convolution once: the plan holds it at the op (no note names it), and it is what the op
    holds above its outputs when it computes both gradients."""
    from compile_offload.inductor import op_workspace
    from compile_offload.pipeline import planning

    monkeypatch.setattr(op_workspace, "_measured_cuda", {})
    result = _plan_conv_net("cuda", 2**20)
    convolutions = [n for n in result.analysis.bw_nodes if n.target is torch.ops.aten.convolution_backward.default]
    assert len(convolutions) == 2
    assert not [n for n in result.plan.notes if n.startswith(planning.UNCOUNTED_WORKSPACE_NOTE)], result.plan.notes
    forward = [n for n in result.analysis.position if n.target is torch.ops.aten.convolution.default]
    assert len(forward) == 2
    for node in (*convolutions, *forward):
        measured = op_workspace.measured_cuda_workspace(node)
        assert measured is not None and result.analysis.workspace_bytes.get(node, 0) == measured
        _assert_the_op_holds_what_was_measured(node, measured)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="needs a CUDA GPU that runs cuDNN attention (sm80 or newer)")
def test_cudnn_attention_backward_workspace_is_measured(monkeypatch):
    """cuDNN attention (what SDPA takes for bf16 on H100/H200 under torch >= 2.11): its
    backward's workspace, measured by the planner, is what the op holds. GPT-8's attention
    shape held 136,314,880 bytes above its gradients on an H200 (2026-11-27)."""
    from compile_offload.inductor import op_workspace

    from .passes.joint_capture import capture_analysis

    monkeypatch.setattr(op_workspace, "_measured_cuda", {})

    def attention(q, k, v):
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)[0].float().sum()

    q, k, v = (torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    analysis, _ = capture_analysis(attention, q, k, v)
    (node,) = [n for n in analysis.bw_nodes if n.target is op_workspace.CUDNN_ATTENTION_BACKWARD]
    measured = op_workspace.measured_cuda_workspace(node)
    assert measured is not None and measured > 0
    assert op_workspaces([node]) == {node: measured}
    _assert_the_op_holds_what_was_measured(node, measured)
