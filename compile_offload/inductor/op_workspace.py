"""The memory an extern op holds while it runs, beyond its outputs, measured by running it.

On the CPU, ATen's mkldnn convolution allocates temporaries inside the op. Its forward
holds a copy of an input in the layout mkldnn wants and more (a depthwise convolution then a
transposed one at a 2x4x16x16 input: 41 KiB, 2.5 times the larger output, where that step
peaks). ``convolution_backward``:
buffers for the weight gradient before it is written out in the weight's layout, and
oneDNN's scratchpad (measured 2026-11-26, torch 2.13: two weight-sized buffers at the op's
peak, live only while it runs). Inductor calls the op as an
extern kernel, so the step's peak is there, and nothing in the graph says how much: on a
convolution + BatchNorm net with 32 channels at 16x16 it was 72 KiB, 7.5% of the step's
peak. The size depends on the op's implementation, its shapes, layouts and thread count, so
it is measured: the op runs once on zero-filled tensors of the node's shapes, with the
layouts Inductor gives it, under ``measure_peak``; what the allocator held above the outputs
is the workspace. Measured once per signature per process, for the plan
(``op_workspaces``) and for the scheduled peak of Inductor's kernels (``inductor_kernels``,
``measured_workspace`` in the strides Inductor gives the op's arguments). The CPU attention backward
(``_scaled_dot_product_flash_attention_for_cpu_backward``) is measured the same way (in the
traced layouts): it holds per-thread fp32 buffers for the scores and their gradient, which
made an attention block with seq 512 predicted 33% low (to a few bytes with it). So is ATen's
``native_dropout``, which Inductor calls instead of its own random kernels under
``fallback_random`` (and the eager inner compiler calls as traced): it draws its noise into a
temporary of the input's size; a dropout transformer measured 5% over its byte budget
without it. So are the EmbeddingBag and FFT ops Inductor calls as extern kernels, and
ATen's complex ``abs`` (an EmbeddingBag's max-mode backward holds the gradient and max
indices of its non-empty bags, 786 KiB for 512 bags of width 128, and a step peaking there
measured 21% over a byte budget, silently).

Only for static shapes, and on the CPU only where the op's inputs are small enough to copy
(``MAX_INPUT_BYTES``). On a GPU the convolution, its backward and cuDNN attention's backward are
measured the same way (``measured_cuda_workspace``): cuDNN's workspace depends on the
algorithm or plan it picks when the op runs, which for the same shapes and settings is the
same at planning time and in the step; only where the op's tensors take at most a quarter
of the free memory (a GPU that is nearly full is where a budget is used, and a measurement
must not run it out of memory), and read from the allocator's running total, so no peak
statistic is reset. Other GPU ops are not run.

On CUDA one workspace is known from the kernel's source instead of measured: FlashAttention-2's
backward (``mha_bwd``, which ``_scaled_dot_product_flash_attention_backward`` calls) allocates
an fp32 accumulator for the query's gradient, ``batch x round_up(seq_q, 128) x heads x
round_up(head_dim, 32)``, and the fp32 row sums ``batch x heads x round_up(seq_q, 128)``
beside its three outputs, and with fewer key than query heads (grouped-query attention)
key and value gradients at the query's head count, summed down after
(``flash_attention_backward_workspace``). On GPT-8 (batch 8, seq 2048, 16 heads of 128) that
is 129 MiB per attention backward, which a plan whose peak falls there would miss. The rule
counts for the plan (``op_workspaces``) and for Inductor's kernels (``inductor_kernels``, the
scheduled peak). It is read from FlashAttention-2's source, not yet measured on its own
(``tests/test_op_workspace.py`` does that where there is a GPU).

The memory-efficient (cutlass) kernel's backward, which SDPA takes for fp32, or for fp16 and
bf16 with a mask (``_scaled_dot_product_efficient_attention_backward``), is read from its
source the same way (``efficient_attention_backward_workspace``): an fp32 workspace of per
block dq accumulators (and for head dims over 128 in fp16/bf16, dk and dv ones per key
split), and the fp32 ``delta`` row sums. On the contract's GPT-2 (fp32, batch 4, seq 128, 2
heads of 32) that is 266,496 bytes per attention backward, the size of the constant 0.25 MiB
the H200 measured above the plan, but not that gap: it is counted, and the plan is still
that far under the measured peaks (design.md).
No rule for cuDNN attention's backward, which SDPA prefers for fp16/bf16 on sm90/sm100 with
a bundled cuDNN of 9.15.1 or newer (torch 2.11's CUDA 13.0 wheels and later): its workspace
is sized by the plan cuDNN builds at run time, so it is measured on the GPU like the
convolution backward (``MEASURED_CUDA_OPS``; design.md, "cuDNN attention's backward").
Elsewhere no workspace is counted.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from ..runtime.memory_tracker import allocator_block_bytes, measure_peak, profiler_recording
from ..passes.analyze import tensor_value
from ..passes.compat import inductor_channels_last_convolutions

CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
MAX_INPUT_BYTES = 64 * 2**20  # the op's tensor inputs, all together
_measured: dict[tuple, int] = {}  # signature -> workspace bytes
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
# The CPU ops whose workspace is measured by running them. Not the attention forward: its
# measured buffers made the contract's transformer minimum plan 1.99 MiB against 1.95
# measured (2026-11-26), and no measured step needed them.
MEASURED_OPS = frozenset({
    torch.ops.aten.convolution.default,
    torch.ops.aten.convolution_backward.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    torch.ops.aten.native_dropout.default,
    torch.ops.aten._embedding_bag.default,
    torch.ops.aten._embedding_bag_backward.default,
    torch.ops.aten._fft_r2c.default,
    torch.ops.aten._fft_c2r.default,
    torch.ops.aten._fft_c2c.default,
    torch.ops.aten.abs.default,  # on complex tensors only (``COMPLEX_ONLY``)
})
# Measured only on complex inputs, which Inductor does not generate kernels for: ATen's
# complex ``abs`` holds two real temporaries of its output's size (3 x 128 KiB where it
# returns 128 KiB); a real one is fused into Inductor's kernels.
COMPLEX_ONLY = frozenset({torch.ops.aten.abs.default})
# Run with their integer arguments filled with ones, not zeros: a bag of size 0 is empty, and
# the max mode's backward copies the gradient and the max indices of the non-empty bags (an
# EmbeddingBag of 512 bags of width 128: 786 KiB, measured alike with the real indices).
ONES_FILLED = frozenset({torch.ops.aten._embedding_bag_backward.default})


def op_workspaces(nodes: list[fx.Node], inductor: bool = True, measure: bool = True) -> dict[fx.Node, int]:
    """Each CPU ``convolution_backward`` and attention backward, each CUDA FlashAttention and
    memory-efficient attention backward, and on a GPU each convolution, convolution backward and cuDNN
    attention backward (``MEASURED_CUDA_OPS``), of ``nodes`` (a joint graph's) -> the bytes it
    holds while it runs beyond its outputs (omitted where nothing, or where it is not known).
    ``inductor``: the graphs are compiled by Inductor, whose layout optimization decides the
    layouts the op gets; otherwise they run as written, in the traced layouts.
    ``measure=False``: no op is run (host tensors standing in for a GPU's: the CPU kernels'
    workspace says nothing of the GPU's)."""
    found = {}
    for node in nodes:
        nbytes = cuda_workspace(node) or (measure and measured_cuda_workspace(node)) or 0
        if nbytes:
            found[node] = nbytes
    measured = [n for n in nodes if measure and n.op == "call_function" and n.target in MEASURED_OPS]
    if not measured:
        return found
    forward_convolutions = [n for n in nodes if n.op == "call_function"
                            and n.target is torch.ops.aten.convolution.default]
    channels_last = inductor and inductor_channels_last_convolutions(
        [tensor_value(arg) for n in forward_convolutions for arg in n.args[:2] if isinstance(arg, fx.Node)])
    for node in measured:
        # Only the convolution gets Inductor's channels-last layouts (``_measure``).
        nbytes = measured_workspace(node, channels_last and node.target in CONVOLUTIONS)
        if nbytes > 0:
            found[node] = nbytes
    return found


def measured_workspace(node: fx.Node, channels_last: bool = False,
                       strides: dict[fx.Node, tuple[int, ...]] | None = None) -> int:
    """What one CPU op of ``MEASURED_OPS`` holds while it runs beyond its outputs, measured by
    running it (once per signature per process); 0 for any other node, or one whose inputs
    are not static CPU tensors small enough to copy. ``channels_last``: its 4-d arguments in
    channels-last, as Inductor's layout optimization gives a convolution's. ``strides``: the
    strides some arguments have where they differ from the traced ones (the layouts
    Inductor's kernels give the tensors an extern op receives; the op copies an argument
    it needs in another layout, and that copy is part of what it holds)."""
    if node.op != "call_function" or node.target not in MEASURED_OPS:
        return 0
    args = _tensor_args(node)
    if args is None or (node.target in COMPLEX_ONLY and not any(arg.is_complex() for arg in args)):
        return 0
    strides = strides or {}
    key = (node.target, *(_signature(t) for t in args), *(repr(a) for a in _constants(node)),
           channels_last, tuple(sorted((arg.name, stride) for arg, stride in strides.items())),
           torch.get_num_threads())
    if key not in _measured:
        if profiler_recording():  # measuring would end the user's profiler session: not measured, said once
            _warn_not_measured(node)
            return 0
        _measured[key] = _measure(node, channels_last, strides)
    return _measured[key]


_warned_not_measured: set = set()


def _warn_not_measured(node: fx.Node, error: Exception | None = None) -> None:
    """Once per kind of op (a convolution's forward and backward are one): its workspace is
    not counted, as a profiler was recording (``error`` None) or running it here raised."""
    kind = CONVOLUTIONS if node.target in CONVOLUTIONS else node.target
    if (kind, error is None) in _warned_not_measured:  # the two causes' remedies differ: each said
        return
    _warned_not_measured.add((kind, error is None))
    ops = " and ".join(map(str, CONVOLUTIONS)) if kind is CONVOLUTIONS else str(node.target)
    if error is not None:
        warnings.warn(f"compile_offload: the workspace of {ops} could not be measured on the CPU "
                      f"({type(error).__name__}: {error}), and the plan does not count it; the step may peak above "
                      "the plan's prediction by that much", stacklevel=2)
        return
    warnings.warn(f"compile_offload: a torch.profiler was recording while the step compiled, so the workspace of "
                  f"{ops} was not measured (a profiler of our own would end yours) and the plan does not "
                  "count it; compile outside the profiler (a first step before it) to have it counted",
                  stacklevel=2)


def _constants(node: fx.Node) -> list:
    return [a for a in (*node.args, *node.kwargs.values()) if not isinstance(a, fx.Node)]


def _tensor_args(node: fx.Node) -> list[torch.Tensor] | None:
    """The fake values of the op's tensor arguments, when all are static CPU tensors small
    enough to run the op on."""
    nodes = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    values = [tensor_value(arg) for arg in nodes]
    if not values or any(v is None or v.device.type != "cpu" for v in values):
        return None
    if any(isinstance(s, torch.SymInt) for v in values for s in (*v.shape, *v.stride())):
        return None  # dynamic shapes: reading a size would guard on it
    total = sum(v.dtype.itemsize * v.numel() for v in values)
    return values if total <= MAX_INPUT_BYTES else None


def _signature(value: torch.Tensor) -> tuple:
    return tuple(value.shape), tuple(value.stride()), value.dtype


def _measure(node: fx.Node, channels_last: bool, strides: dict[fx.Node, tuple[int, ...]]) -> int:
    """Run the op once to warm it up and once under ``measure_peak``: its peak less its
    outputs. An op that cannot run here counts nothing rather than failing the plan, and
    says so once (``_warn_not_measured``)."""
    from ..torch_api.fake_tensors import unset_fake_temporarily

    def real(arg: fx.Node) -> torch.Tensor:
        value = tensor_value(arg)
        if arg in strides:  # the layout Inductor gives it
            return torch.empty_strided(value.shape, strides[arg], dtype=value.dtype).zero_()
        # Inductor's layout optimization gives the convolution every 4-d argument in
        # channels-last: the activations, and the weight through its channels-last copy
        # (``analyze.layout_copies``), which the backward receives. In another layout
        # the op converts them itself, and that conversion is part of what it holds.
        if channels_last and value.dim() == 4:
            return torch.empty(value.shape, dtype=value.dtype, memory_format=torch.channels_last).zero_()
        made = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
        ones = node.target in ONES_FILLED and not (value.is_floating_point() or value.is_complex())
        return made.fill_(1) if ones else made.zero_()

    try:
        with unset_fake_temporarily(), torch.no_grad():
            made = {arg: real(arg) for arg in (*node.args, *node.kwargs.values()) if isinstance(arg, fx.Node)}
            args = [made.get(a, a) if isinstance(a, fx.Node) else a for a in node.args]
            kwargs = {k: made.get(v, v) if isinstance(v, fx.Node) else v for k, v in node.kwargs.items()}
            node.target(*args, **kwargs)
            with measure_peak("cpu") as measured:
                outputs = node.target(*args, **kwargs)
            outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
            output_bytes = sum(out.untyped_storage().nbytes() for out in outputs if isinstance(out, torch.Tensor))
    except Exception as error:  # noqa: BLE001  any op, any arguments: not measured, said
        _warn_not_measured(node, error)
        return 0
    return max(0, measured.peak_bytes - output_bytes)


def flash_attention_backward_workspace(node: fx.Node) -> int:
    """The bytes a CUDA ``_scaled_dot_product_flash_attention_backward`` node allocates while it
    runs beyond its outputs (module docstring; FlashAttention-2's ``mha_bwd``, not in
    deterministic mode, whose accumulator is split per SM group); 0 for any other node, off
    CUDA, or with shapes not known as integers."""
    if node.op != "call_function" or node.target is not FLASH_BACKWARD:
        return 0
    query, key = (tensor_value(arg) if isinstance(arg, fx.Node) else None for arg in node.args[1:3])
    if query is None or key is None or query.device.type != "cuda" or query.dim() != 4:
        return 0
    if any(isinstance(size, torch.SymInt) for size in (*query.shape, *key.shape)):
        return 0  # dynamic shapes: reading a size would guard on it
    batch, heads, seq_q, head_dim = query.shape
    heads_k, seq_k = key.shape[1], key.shape[2]
    seq_q_rounded = _round_up(seq_q, 128)
    head_dim_rounded = _round_up(head_dim, 32) if head_dim <= 192 else 256
    fp32 = 4
    dq_accum = batch * seq_q_rounded * heads * head_dim_rounded * fp32
    softmax_d = batch * heads * seq_q_rounded * fp32
    expanded = 2 * batch * seq_k * heads * head_dim * query.dtype.itemsize if heads_k != heads else 0
    return dq_accum + softmax_d + expanded


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def efficient_attention_backward_workspace(node: fx.Node) -> int:
    """The bytes a CUDA ``_scaled_dot_product_efficient_attention_backward`` node allocates
    while it runs beyond its outputs; 0 for any other node, off CUDA, or with shapes not known
    as integers. Read from PyTorch's source (its main branch, files under
    ``aten/src/ATen/native/transformers/cuda/``; that torch 2.11 builds the same kernels is
    assumed) for sm80 to sm90 GPUs (A100, H100, H200):

    - ``attention_backward.cu``, ``_efficient_attention_backward`` (which the SDPA op calls on
      the (batch, seq, heads, dim) transposes): after the gradients, ``delta`` (fp32, batch x
      heads x seq_q): ``at::empty`` where the kernel computes it (``kKernelComputesDelta``:
      fp16/bf16), else ``(grad_out.to(kFloat) * out.to(kFloat)).sum(-1).transpose(-2,
      -1).contiguous()``, whose product and sum live to the end of that expression. Then
      ``workspace = at::empty({p.workspace_size()}, Byte)`` (zeroed in place when keys are
      split), held to the op's end.
    - ``mem_eff_attention/kernels/cutlassB.h`` (``dispatch_cutlassB``: dtype and 80 <= cc <
      100 pick ``dispatch_cutlassB_<dtype>_sm80``) and ``generate_kernels.py`` (its order):
      the first aligned kernel whose ``kMaxK`` >= max(head_dim, head_dim_v) runs. fp32: 64x64
      tiles (kBlockSizeI x kBlockSizeJ) up to kMaxK 64, else 128x64. fp16/bf16: 64x64 up to
      64 and 128x128 up to 128, both with the outputs in registers (``kOutputInRF``: kMaxK <=
      kBlockSizeI), else 128x64 without. Assumed: the 128-row kernels fit the GPU's shared
      memory (A100 and H100/H200 do; sm86/89 may fall back to 64x64).
    - ``mem_eff_attention/kernel_backward.h``, ``AttentionBackwardKernel``: ``kEnableSplitKeys``
      (sm >= 70) makes ``kNeedsAccumGradQ`` true; ``kNeedsAccumGradK/V`` only where the output
      is not fp32 and not kept in registers. ``Params::workspace_elements_gq`` = ceil(seq_q /
      kBlockSizeI) x ceil(head_dim / MatmulGradQ::ThreadblockShape::kN (= kBlockSizeJ)) x
      sizeof(GradQTempStorage) / 4, where ``GradQTempStorage`` is 16 bytes (lock, counter,
      pad) and ``AccumTileGmem::kElementsStored`` = kNumThreads x the fragment's elements =
      kBlockSizeI x kBlockSizeJ floats (one 32x32 warp tile per warp);
      ``workspace_elements_gk/gv`` = num_splits_key x kBlockSizeJ x align_up(head_dim[_value],
      kBlockSizeI); ``workspace_strideBH`` rounds their sum up to 4; ``workspace_size`` =
      batch x heads x that x 4 bytes. ``num_splits_key`` (``_efficient_attention_backward``'s
      heuristic, with dk/dv accumulators): min(ceil(seq_k / kBlockSizeJ), 200 // (batch x
      heads)), at least 1; deterministic mode would make it 1: not assumed (the larger).

    Not counted: the copy ``_efficient_attention_backward`` makes of ``grad_out`` when its
    transpose is not contiguous (the traced layouts give it contiguous, as for FlashAttention
    above), batches over 65,535 (run in chunks), older GPUs' kernels."""
    if node.op != "call_function" or node.target is not EFFICIENT_BACKWARD:
        return 0
    query, key, value = (tensor_value(arg) if isinstance(arg, fx.Node) else None for arg in node.args[1:4])
    if query is None or key is None or value is None or query.device.type != "cuda" or query.dim() != 4:
        return 0
    if any(isinstance(size, torch.SymInt) for size in (*query.shape, *key.shape, *value.shape)):
        return 0  # dynamic shapes: reading a size would guard on it
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return 0
    batch, heads, seq_q, head_dim = query.shape
    seq_k, head_dim_v = key.shape[2], value.shape[3]
    half = query.dtype != torch.float32
    max_k = max(head_dim, head_dim_v)
    if max_k <= 64:
        block_i, block_j = 64, 64
    elif max_k <= 128:
        block_i, block_j = (128, 128) if half else (128, 64)
    else:
        block_i, block_j = 128, 64
    fp32 = 4
    grad_q = _ceil_div(seq_q, block_i) * _ceil_div(head_dim, block_j) * (16 // fp32 + block_i * block_j)
    grad_kv = 0
    if half and max_k > block_i:  # fp16/bf16 outputs not kept in registers: dk and dv accumulators
        splits = max(1, min(_ceil_div(seq_k, block_j), 200 // (batch * heads)))
        grad_kv = splits * block_j * (_round_up(head_dim, block_i) + _round_up(head_dim_v, block_i))
    workspace = batch * heads * _round_up(grad_q + grad_kv, 4) * fp32
    delta = batch * heads * seq_q * fp32
    if half:
        return delta + workspace
    product, sums = batch * seq_q * heads * head_dim_v * fp32, batch * seq_q * heads * fp32
    return max(product + sums + delta, delta + workspace)


# The CUDA ops whose workspace is read from the kernel's source: op -> its rule (node -> bytes).
CUDA_WORKSPACES = {
    FLASH_BACKWARD: flash_attention_backward_workspace,
    EFFICIENT_BACKWARD: efficient_attention_backward_workspace,
}


# CUDA ops whose workspace the library sizes at run time, with no rule to read it from:
# cuDNN picks a convolution's algorithm (and with it the workspace) per call, by its
# heuristics or by benchmarking (``torch.backends.cudnn.benchmark``, the timed choice then
# cached), and cuDNN attention's backward builds its execution plan then; without cuDNN the
# native convolution kernels' im2col buffers take its place. Measured on an H200
# (2026-11-27): one cuDNN convolution backward (16 channels, 3x3, batch 8 at 32x32, fp32)
# held a 1,131,875-byte workspace at the step's peak, the budget contract's conv+BN gap;
# cuDNN attention's backward at GPT-8's shape 130 MiB above its gradients. The same shapes
# and settings give the same choice at planning time and in the step, so where the plan is
# made on the GPU they are measured there (``measured_cuda_workspace``); where not, the plan
# names them (``uncounted_cuda_workspaces``, design.md).
CONVOLUTION = torch.ops.aten.convolution.default
CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default
CUDNN_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
# op -> what the plan's notes call it where it is not measured
MEASURED_CUDA_OPS = {CONVOLUTION: "convolution forward", CONVOLUTION_BACKWARD: "convolution backward",
                     CUDNN_ATTENTION_BACKWARD: "cuDNN attention backward"}

# The op's tensors, inputs and outputs, may take at most this share of the GPU's free memory
# while it is measured: planning runs before the step's activations exist, and a measurement
# must never be what runs a GPU out of memory.
CUDA_PROBE_FREE_SHARE = 0.25
_measured_cuda: dict[tuple, int | None] = {}  # signature -> workspace bytes (None: not measurable)


def measured_cuda_workspace(node: fx.Node, strides: dict[fx.Node, tuple[int, ...]] | None = None) -> int | None:
    """What a CUDA op of ``MEASURED_CUDA_OPS`` (the convolution and its backward, cuDNN
    attention's backward) holds while it runs beyond its outputs, measured by running it on this GPU
    (once per signature and cuDNN settings per process), in the traced layouts or those
    ``strides`` gives (as ``measured_workspace``). None where it cannot be measured here: no
    GPU (fake CUDA tensors on a CPU machine), tensors that are not static CUDA (or host)
    tensors, tensors over ``CUDA_PROBE_FREE_SHARE`` of the free memory, or an op that fails
    to run; ``uncounted_cuda_workspaces`` then names it."""
    if node.op != "call_function" or node.target not in MEASURED_CUDA_OPS or not torch.cuda.is_available():
        return None
    values = [tensor_value(a) for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    devices = {v.device.type if v is not None else None for v in values}
    if "cuda" not in devices or not devices <= {"cuda", "cpu"}:  # host scalars (RNG state) may come along
        return None
    if any(isinstance(x, torch.SymInt) for v in values for x in (*v.shape, *v.stride())):
        return None  # dynamic shapes: reading a size would guard on it
    if node.target is CONVOLUTION_BACKWARD and (len(node.args) != 11 or node.kwargs):
        return None
    if node.target is CONVOLUTION and (len(node.args) != 9 or node.kwargs):
        return None
    strides = strides or {}
    backends = torch.backends.cudnn
    key = (node.target, *(str(v.device) for v in values), *(_signature(v) for v in values),
           *(repr(a) for a in _constants(node)), tuple(sorted((arg.name, stride) for arg, stride in strides.items())),
           backends.enabled, backends.benchmark, backends.deterministic, backends.allow_tf32)
    if key not in _measured_cuda:
        _measured_cuda[key] = _measure_cuda(node, strides)
    return _measured_cuda[key]


def _probe_calls(node: fx.Node, args: list, kwargs: dict) -> list[tuple[list, dict]]:
    """The calls whose workspaces the op holds one at a time: the convolution backward's per
    gradient (ATen computes the input's gradient, then the weight's, each with its own
    workspace), any other op's as traced."""
    if node.target is CONVOLUTION_BACKWARD:
        mask = list(args[10])
        return [(args[:10] + [[i == index for i in range(3)]], kwargs) for index in (0, 1) if mask[index]]
    return [(args, kwargs)]


def _measure_cuda(node: fx.Node, strides: dict[fx.Node, tuple[int, ...]]) -> int | None:
    """Run each of ``_probe_calls`` once to warm it up (cuDNN builds, or times, its plan) and
    once to read what the allocator handed out beyond the call's outputs: the difference of
    its running total (``allocated_bytes.all.allocated``), so no peak statistic is reset
    under the user. The op holds the largest."""
    from ..torch_api.fake_tensors import unset_fake_temporarily

    arguments = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    outputs = node.meta.get("val")
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    needed = sum(t.dtype.itemsize * t.numel() for t in (*map(tensor_value, arguments), *outputs)
                 if isinstance(t, torch.Tensor))
    held = 0
    try:
        with unset_fake_temporarily(), torch.no_grad():
            device = next(v.device for v in map(tensor_value, arguments) if v.device.type == "cuda")
            if needed > CUDA_PROBE_FREE_SHARE * torch.cuda.mem_get_info(device)[0]:
                return None

            def zeros(arg: fx.Node) -> torch.Tensor:
                value = tensor_value(arg)
                where = device if value.device.type == "cuda" else value.device
                return torch.empty_strided(value.shape, strides.get(arg, value.stride()), dtype=value.dtype,
                                           device=where).zero_()

            made = {arg: zeros(arg) for arg in arguments}
            args = [made.get(a, a) if isinstance(a, fx.Node) else a for a in node.args]
            kwargs = {k: made.get(v, v) if isinstance(v, fx.Node) else v for k, v in node.kwargs.items()}
            for call_args, call_kwargs in _probe_calls(node, args, kwargs):
                node.target(*call_args, **call_kwargs)
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_stats(device)["allocated_bytes.all.allocated"]
                results = node.target(*call_args, **call_kwargs)
                torch.cuda.synchronize(device)
                allocated = torch.cuda.memory_stats(device)["allocated_bytes.all.allocated"] - before
                results = results if isinstance(results, (tuple, list)) else (results,)
                blocks = sum(allocator_block_bytes(t.untyped_storage().nbytes()) for t in results
                             if isinstance(t, torch.Tensor) and t.device.type == "cuda")
                held = max(held, allocated - blocks)
                del results
            del made, args, kwargs
    except Exception:  # noqa: BLE001  an op that cannot run here counts as not measured
        return None
    return held


def uncounted_cuda_workspaces(nodes) -> list[str]:
    """The kinds of CUDA op among ``nodes`` whose workspace no rule counts and that could not
    be measured here (``MEASURED_CUDA_OPS``, ``measured_cuda_workspace``), each named once, in
    graph order. Meta tensors count as CUDA: a graph is traced on meta only to be planned for
    a GPU (``explain``)."""
    found = []
    for node in nodes:
        kind = MEASURED_CUDA_OPS.get(node.target) if node.op == "call_function" else None
        if kind is None or kind in found or measured_cuda_workspace(node) is not None:
            continue
        args = (arg for arg in node.args if isinstance(arg, fx.Node))
        if any(getattr(tensor_value(arg), "device", None) is not None
               and tensor_value(arg).device.type in ("cuda", "meta") for arg in args):
            found.append(kind)
    return found


def cuda_workspace(node: fx.Node) -> int:
    """What a CUDA op whose workspace is known from its source holds beyond its outputs
    (``CUDA_WORKSPACES``); 0 for any other node."""
    rule = CUDA_WORKSPACES.get(node.target) if node.op == "call_function" else None
    return rule(node) if rule is not None else 0


def _ceil_div(value: int, divisor: int) -> int:
    return -(-value // divisor)
