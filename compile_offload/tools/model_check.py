"""``python -m compile_offload model-check``: the cost model against measured GPU figures,
and the greedy solver against the exact optimum under that model.

Three parts, all on CPU (models are built on the meta device and traced with fake tensors;
nothing runs):

1. **Anchors.** For each H100 measurement in ``benchmarks/anchors/*.jsonl`` (copied from
   the project's reference material: torch 2.11, bf16, one forward+backward of a GPT-style
   stack, see ``benchmarks/anchors/README.md``) the same strategy's plan is built on the
   joint graph and predicted by our simulator and cost model with the ``h100`` profile:

   - ``compile`` (torch.compile default): torch's min-cut saved set
     (``compat.min_cut_saved_values``), simulated with Inductor's fusion.
   - ``compile_budget_F``: the saved set torch's partitioner chooses under
     ``activation_memory_budget=F`` (``compat.budget_saved_values``, the same
     ``choose_saved_values_set`` call with the same budget), read back and evaluated.
   - ``compile_sac_offload``: the model traced with the anchor's selective-checkpoint policy
     (matmul and attention outputs ``MUST_CPU_OFFLOAD``, the rest ``PREFER_RECOMPUTE``) and
     torch's partitioner reading those tags. Nothing is offloaded in the prediction: the
     measured peak (6089 MB, within 1% of the policy's saved set kept on the device) shows
     torch 2.11's partitioner saved those tensors and did not offload them.
   - ``eager``: the model without Inductor's decompositions or fusion, saving every
     forward tensor the backward reads (autograd's saved tensors); ``eager_ckpt``:
     per-block ``torch.utils.checkpoint``, a plan that keeps each block's inputs and
     recomputes the whole block at once when its backward starts. In eager mode each
     parameter gradient is accumulated into ``.grad`` (steady state, the measurement
     zeroes it without freeing) as soon as it is produced, so it is freed at once, where
     a compiled backward returns all gradients together at its end.
   - ``eager_offload`` / ``eager_ckpt_offload`` (``save_on_cpu``, synchronous copies) are
     not modelled: their predictions are null.

   Peaks are "above steady state", as measured, of the step ``bench_anchors.py`` runs: the
   eager loss around the model (its peak measured at the CPU allocator,
   ``loss_peak_bytes``) and, under every measured step but the first, the input gradient
   the step before left (``input_grad_bytes``). The step-time ratio is against the
   ``compile`` row of the same shape, measured and predicted alike.

2. **Calibration.** ``--fit`` refits the ``h100`` profile's constants on the ``compile``
   rows only (``tools.calibrate``); every other row is validation. The built-in ``h100``
   profile holds the result of that fit (``passes.cost.H100_CALIBRATION``).

3. **Optimality.** On small graphs (``OPTIMALITY_GRAPHS``) the greedy joint solver's plan
   (and the same pruned, ``passes.solve.prune``, and refined) at each budget of a sweep against
   the exhaustive optimum
   (``tools.solve_exhaustive``), both predicted under the same model.

4. **Pareto against torch.** At each budget torch's partitioner reaches (its 0.5 and 0.0
   rows), our solver's plan under the predicted peak of torch's plan as a byte budget.

Every figure printed is predicted except the ``measured_*`` ones.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn

from ..passes.inductor.rules import KernelRules, TRITON
from ..passes import compat
from ..passes.analyze import JointAnalysis, analyze_joint, tensor_value
from .calibrate import Fit, FitRow, fit_constants, kernel_terms
from ..passes.cost import BUILTIN_PROFILES, H100_CALIBRATION, H100_DATASHEET, DeviceProfile, node_seconds
from ..passes.memory import Program, compute_steps, fused_nodes, plan_nodes, plan_program, simulate
from ..passes.offload import eligible_for_offload
from ..passes.solve.recompute import SolverError, step_seconds, without_banned_recompute
from ..passes.solve.recompute import pick
from .solve_exhaustive import exhaustive_candidates, greedy_pool
from ..passes.solve.prune import prune_solution
from ..passes.solve.refine import refine_solution
from ..passes.inductor.smaller_matmuls_first import smaller_matmuls_first
from ..passes.inductor.unfused_mm_add import unfused_mm_add
from ..passes.solve.joint import OffloadOptions, solve_joint
from ..torch_api import dynamo, functorch, inductor

MB = 2**20

def _anchor_dir() -> Path:
    from .. import benchmarks  # installed as compile_offload.benchmarks (package data)

    return Path(benchmarks.__file__).resolve().parent / "anchors"


ANCHOR_DIR = _anchor_dir()
SHAPES = {"gpt8": "anchors_gpt8.jsonl", "deep24": "anchors_deep24.jsonl"}
FIT_STRATEGY = "compile"
NOT_MODELLED = {"eager_offload", "eager_ckpt_offload"}


# --- anchors -----------------------------------------------------------------------------


@dataclass
class AnchorShape:
    name: str
    args: dict  # the measurement's command line: layers, d, heads, ff, seq, batch, dtype
    torch_version: str
    device: str
    rows: dict[str, dict]  # strategy -> measured row (ms_median, peak_above_steady_mb)
    bandwidth: dict = field(default_factory=dict)


def load_anchors(directory: Path = ANCHOR_DIR, shapes: Sequence[str] = tuple(SHAPES)) -> list[AnchorShape]:
    """The measured anchors, one per shape; raises ValueError naming a missing or
    malformed file."""
    result = []
    for shape in shapes:
        if shape not in SHAPES:
            raise ValueError(f"unknown anchor shape {shape!r}; known: {', '.join(SHAPES)}")
        path = Path(directory) / SHAPES[shape]
        if not path.is_file():
            raise ValueError(f"anchor file {path} not found")
        header, rows, bandwidth = None, {}, {}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from error
            if "args" in record:
                header = record
            elif "mode" in record:
                rows[record["mode"]] = record
            else:
                bandwidth.update(record)
        if header is None or FIT_STRATEGY not in rows:
            raise ValueError(f"{path}: needs a header line with 'args' and a '{FIT_STRATEGY}' row")
        result.append(AnchorShape(shape, header["args"], header["torch"], header["device"], rows, bandwidth))
    return result


# --- models and joint graphs ---------------------------------------------------------------


def _sac_offload_policy(ctx, op, *args, **kwargs):
    """The anchor's policy (``bench_anchors.offload_policy``), with the CPU attention op a
    CPU trace produces where CUDA produces the flash/efficient/cuDNN ones."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    offloaded = [aten.mm.default, aten.addmm.default]
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            offloaded.append(getattr(aten, name).default)
    return CheckpointPolicy.MUST_CPU_OFFLOAD if op in offloaded else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedDecoder(nn.Module):
    """The anchor model with each block under ``torch.utils.checkpoint`` (``policy``: a
    selective-checkpoint policy, or None for plain per-block checkpointing)."""

    def __init__(self, decoder: nn.Module, policy=None) -> None:
        super().__init__()
        self.blocks, self.policy = decoder.blocks, policy

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        for block in self.blocks:
            if self.policy is None:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                # A functools.partial: Dynamo traces that kind of context_fn, not a lambda.
                x = checkpoint(block, x, use_reentrant=False,
                               context_fn=functools.partial(create_selective_checkpoint_contexts, self.policy))
        return x


def decoder_on_meta(args: dict, layers: int | None = None) -> tuple[nn.Module, torch.Tensor]:
    """The anchors' model (``benchmarks.workloads.Decoder``, the same block as
    ``bench_anchors.py``) and input, on the meta device."""
    from ..benchmarks.workloads import Decoder

    if args.get("ff", 4 * args["d"]) != 4 * args["d"]:
        raise ValueError(f"the anchor model has ff = 4 * d; got ff {args['ff']} for d {args['d']}")
    dtype = getattr(torch, args.get("dtype", "bfloat16"))
    with torch.device("meta"):
        model = Decoder(layers or args["layers"], args["d"], args["heads"]).to(dtype)
        x = torch.randn(args["batch"], args["seq"], args["d"], dtype=dtype, requires_grad=True)
    return model, x


def capture_joint(model: nn.Module, x: torch.Tensor, decompose: bool = True) -> compat.JointGraph:
    """The prepared joint graph ``torch.compile`` would partition for ``model(x)`` (as
    ``compile_offload.explain`` traces: meta state as empty CPU tensors, graphs run on fake
    tensors only). ``decompose``: with Inductor's decompositions and joint-graph passes
    (compiled strategies; without the passes torch's budget partitioner was read back on
    another graph and chose another saved set); without them the graph has the ops eager
    mode runs."""
    from .explain import _meta_to_cpu, _shape_only, _with_own_code

    captured: dict[str, compat.JointGraph] = {}

    def partition(joint_gm, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **_):
        if decompose:  # compiled: the joint graph after Inductor's passes, which torch's partitioner sees
            joint_gm = compat.inductor_joint_passes(joint_gm, torch.device("cpu"))
        joint = compat.prepare_joint(joint_gm, num_fwd_outputs, static_lifetime_input_indices)
        captured["joint"] = joint
        return compat.extract_forward_backward(joint, compat.min_cut_saved_values(joint))

    def backend(gm, inputs):
        return functorch.aot_module_simplified(gm, inputs, fw_compiler=_shape_only, bw_compiler=_shape_only,
                                     partition_fn=partition,
                                     decompositions=inductor.decomposition_table() if decompose else None)

    state = {name: _meta_to_cpu(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}

    def run(inp):
        return torch.func.functional_call(model, state, (inp,))

    dynamo.reset()
    try:
        torch.compile(_with_own_code(run), backend=backend, fullgraph=True)(_meta_to_cpu(x))
    finally:
        dynamo.reset()
    if "joint" not in captured:
        raise RuntimeError("model-check: no joint graph was captured")
    return captured["joint"]


# --- evaluating a plan -----------------------------------------------------------------------


def seconds_function(a: JointAnalysis, profile: DeviceProfile) -> Callable[[fx.Node], float]:
    """Each node's predicted seconds under ``profile``; with fusion, a pointwise op Inductor
    fuses into its consumers costs nothing of its own (as ``planning.py`` charges it)."""
    fused = fused_nodes(a.position, set(a.fw_outputs) | set(a.bw_outputs)) if a.fusion else set()
    memo: dict[fx.Node, float] = {}

    def seconds(node: fx.Node) -> float:
        if node not in memo:
            memo[node] = 0.0 if node in fused else node_seconds(node, profile)
        return memo[node]

    return seconds


class MeanSquare(nn.Module):
    """The anchors' loss, ``y.float().pow(2).mean()``: run eagerly between the compiled
    forward and backward (``bench_anchors.py`` compiles the model only)."""

    def forward(self, y):
        return y.float().pow(2).mean()


LOSS_PROBE_ELEMENTS = 1 << 16  # the loss is measured on this many output elements and twice as many


def loss_peak_bytes(args: dict) -> int:
    """What the eager loss allocates at its peak (forward and backward, the gradient of the
    model output included) on top of what is alive when the compiled forward returns:
    measured at the CPU allocator for an output of the anchor's size and dtype.

    Measured, not simulated: the loss runs ATen's eager kernels and autograd's C++ formulas,
    which allocate the same buffers on any device, and hold temporaries an FX graph does
    not show (``pow``'s backward, ``grad * (2 * self.pow(1))``, keeps both products alive
    until the whole expression is done: 10 bytes per output byte in bf16, where the traced
    graph frees each one after its last use and gave 6). The CPU allocator does not round;
    the CUDA caching allocator rounds each block up to 512 bytes.

    Every buffer of the loss is either as large as the output or a scalar, and which are
    alive at its peak does not depend on the size: the peak is ``a * n + b`` for ``n``
    output elements. It is measured at two small sizes and extended to the output's, so a
    large anchor shape needs no memory of its size here."""
    dtype = getattr(torch, args.get("dtype", "bfloat16"))
    numel = args["batch"] * args["seq"] * args["d"]
    if numel <= 2 * LOSS_PROBE_ELEMENTS:
        return _loss_peak_measured(numel, dtype)
    small, large = _loss_peak_measured(LOSS_PROBE_ELEMENTS, dtype), _loss_peak_measured(2 * LOSS_PROBE_ELEMENTS, dtype)
    per_element, remainder = divmod(large - small, LOSS_PROBE_ELEMENTS)
    if remainder:
        raise RuntimeError(f"model-check: the eager loss's peak is not linear in its size ({small} bytes "
                           f"for {LOSS_PROBE_ELEMENTS} elements, {large} for twice as many): measure it "
                           "at the output's size")
    return small + per_element * (numel - LOSS_PROBE_ELEMENTS)


def _loss_peak_measured(numel: int, dtype: torch.dtype) -> int:
    from ..runtime.memory_tracker import measure_peak

    y = torch.zeros(numel, dtype=dtype, requires_grad=True)
    with measure_peak("cpu") as measured:
        MeanSquare()(y).backward()
    return measured.peak_bytes


def input_grad_bytes(args: dict) -> int:
    """The model input's gradient, alive under the anchors' measured steps: ``bench_anchors.py``
    sets ``x.grad = None`` once before its timed steps and reads the peak over all of them, so
    from the second step on the gradient the step before left in ``x.grad`` is held while the
    step runs (its new gradient is then added into it). Parameters' gradients are not: they
    are zeroed in place before the baseline is read."""
    dtype = getattr(torch, args.get("dtype", "bfloat16"))
    return args["batch"] * args["seq"] * args["d"] * dtype.itemsize


def forward_end_bytes(a: JointAnalysis, saved) -> int:
    """Device bytes alive when the forward returns: the saved storages and the outputs."""
    roots = {a.roots.get(t, t) for t in saved if tensor_value(t) is not None} | {a.roots.get(o, o) for o in a.fw_outputs}
    return sum(a.bytes_of.get(r, 0) for r in roots if r not in a.steady)


def predicted_peak(a: JointAnalysis, saved, loss_bytes: int = 0, eager: str | None = None) -> int:
    """Predicted peak bytes of the plan saving ``saved``: the larger of the graphs' and the
    eager loss's (``loss_bytes`` on top of what the forward leaves alive). ``eager``: None
    for a compiled plan, "autograd" or "checkpoint" for eager ones (``eager_program``)."""
    saved = set(saved)
    if eager is None:
        program = plan_program(a, saved, fusion=a.fusion)
    else:
        program = eager_program(a, saved, whole_regions=eager == "checkpoint")
    return max(simulate(program).peak_bytes, forward_end_bytes(a, saved) + loss_bytes)


def autograd_saved(a: JointAnalysis) -> set[fx.Node]:
    """What eager autograd keeps for the backward: every forward tensor a backward node
    reads (nothing is recomputed)."""
    return {arg for node in a.bw_nodes for arg in a.inputs[node] if a.is_forward(arg) and arg not in a.steady}


def checkpoint_inputs(a: JointAnalysis) -> set[fx.Node]:
    """Per-block checkpointing keeps each checkpointed region's inputs: forward tensors
    outside a region (another region, or none) that a node of the region reads."""
    saved = set()
    for node in a.fw_nodes:
        region = node.meta.get("ac_graph_id")
        if region is None:
            continue
        for arg in a.inputs[node]:
            if arg not in a.steady and arg.meta.get("ac_graph_id") != region and a.is_forward(arg):
                saved.add(arg)
    return saved


def eager_program(a: JointAnalysis, saved: set[fx.Node], whole_regions: bool) -> Program:
    """The program eager autograd runs: the forward, then the backward with recomputed
    nodes placed before their first backward user, or (``whole_regions``: non-reentrant
    ``checkpoint``) each checkpointed region recomputed whole when the backward first
    needs any of it. Gradients are accumulated into ``.grad`` as produced (freed at once)."""
    nodes = plan_nodes(a, saved)
    computed = compute_steps(a, saved, fusion=False, nodes=nodes)
    steps = [step for _, step in computed.forward if step is not None]
    backward_start = len(steps)
    backward = computed.backward
    if whole_regions:
        backward = _regions_first(a, backward, nodes.recomputed)
    steps += [step for _, step in backward if step is not None]
    outlives = {a.roots.get(n, n) for n in a.fw_outputs}
    return Program(steps, backward_start, outlives)


def _regions_first(a: JointAnalysis, backward, recomputed: set[fx.Node]):
    """Backward steps with each region's recomputed nodes moved, all together and in
    forward order, before the first backward step that reads one of them."""
    region_of = {n: n.meta.get("ac_graph_id", ("node", n)) for n in recomputed}
    members: dict = {}
    for node, step in backward:
        if node in recomputed:
            members.setdefault(region_of[node], []).append((node, step))
    for region in members:
        members[region].sort(key=lambda item: a.position[item[0]])
    emitted, order = set(), []
    for node, step in backward:
        if node in recomputed:
            region = region_of[node]
            if region not in emitted:  # reached before any reader: recompute the region here
                emitted.add(region)
                order.extend(members[region])
            continue
        for arg in a.inputs[node]:
            region = region_of.get(arg)
            if region is not None and region not in emitted:
                emitted.add(region)
                order.extend(members[region])
        order.append((node, step))
    return order


# --- the anchor rows -------------------------------------------------------------------------


@dataclass
class AnchorPrediction:
    strategy: str
    shape: str
    role: str  # "fit" | "validation"
    measured_peak_mb: float | None
    predicted_peak_mb: float | None
    measured_ms: float | None
    predicted_ms: float | None
    measured_ratio: float | None = None
    predicted_ratio: float | None = None
    note: str = ""

    def record(self) -> dict:
        return {"kind": "anchor", "strategy": self.strategy, "shape": self.shape, "role": self.role,
                "measured_peak_mb": _round(self.measured_peak_mb), "predicted_peak_mb": _round(self.predicted_peak_mb),
                "measured_ratio": _round(self.measured_ratio, 3), "predicted_ratio": _round(self.predicted_ratio, 3),
                "measured_ms": _round(self.measured_ms, 2), "predicted_ms": _round(self.predicted_ms, 2),
                "note": self.note}


def _round(value, digits: int = 1):
    return None if value is None else round(float(value), digits)


@dataclass
class Plan:
    """One strategy's plan: the joint graph it runs on, what it saves, how it runs."""

    analysis: JointAnalysis
    saved: set[fx.Node]
    eager: str | None = None  # None (compiled), "autograd" or "checkpoint"


@dataclass
class ShapePlans:
    """A shape's modelled strategies as plans (graphs captured once; the profile only
    enters the step times)."""

    shape: AnchorShape
    plans: dict[str, Plan]
    loss_bytes: int = 0  # the eager loss's peak on top of the forward's result (``loss_peak_bytes``)
    layers: int | None = None  # the depth traced, when not the shape's own
    input_grad_bytes: int = 0  # under every measured step but the first (``input_grad_bytes``)

    @property
    def compiled(self) -> JointAnalysis:
        return self.plans[FIT_STRATEGY].analysis


def torch_plans(shape: AnchorShape, layers: int | None = None, fit_only: bool = False) -> ShapePlans:
    """Capture the shape's graphs and build every modelled strategy's plan (``fit_only``:
    the ``compile`` plan alone, what the calibration needs)."""
    args = shape.args
    model, x = decoder_on_meta(args, layers)
    joint = capture_joint(model, x)
    compiled = analyze_joint(joint, TRITON)  # the H100's (Triton) kernels
    plans = {FIT_STRATEGY: Plan(compiled, set(compat.min_cut_saved_values(joint)))}
    if fit_only:
        return ShapePlans(shape, plans)
    for strategy in shape.rows:
        if strategy.startswith("compile_budget_"):
            budget = float(strategy.rsplit("_", 1)[1])
            plans[strategy] = Plan(compiled, set(compat.budget_saved_values(joint, budget)))
    if "compile_sac_offload" in shape.rows:
        sac = analyze_joint(capture_joint(CheckpointedDecoder(model, _sac_offload_policy), x), TRITON)
        plans["compile_sac_offload"] = Plan(sac, set(compat.min_cut_saved_values(sac.joint)))
    if "eager" in shape.rows:
        eager = analyze_joint(capture_joint(model, x, decompose=False))
        plans["eager"] = Plan(eager, autograd_saved(eager), "autograd")
    if "eager_ckpt" in shape.rows:
        ckpt = analyze_joint(capture_joint(CheckpointedDecoder(model), x, decompose=False))
        plans["eager_ckpt"] = Plan(ckpt, checkpoint_inputs(ckpt), "checkpoint")
    return ShapePlans(shape, plans, loss_peak_bytes(args), layers, input_grad_bytes(args))


def backend_analysis(model: nn.Module, x: torch.Tensor) -> JointAnalysis:
    """``model``'s joint graph as our backend plans it: in its own order (a gradient's
    smaller matmuls first, ``passes.inductor.smaller_matmuls_first``) and with each add Inductor
    would fold a matmul into decided, folded or not (``passes.inductor.unfused_mm_add``), which
    torch's partitioners do not do.
    Our plans are made and predicted on this graph, torch's on the graph as traced. It is
    analysed as our backend compiles under a budget, where Inductor's horizontal fusion
    pulls no kernel ahead (``plan_order_fusion``); the unconstrained plan the optimality
    sweep starts from is predicted under the same rule."""
    joint = capture_joint(model, x)
    unfused_mm_add(smaller_matmuls_first(joint.gm))
    # planned for the H100's (Triton) kernels
    return analyze_joint(joint, KernelRules("triton", fusion_pulls=False))


def default_terms(plans: ShapePlans):
    """The ``compile`` plan's kernels at datasheet rates (what the calibration fits)."""
    a = plans.compiled
    nodes = plan_nodes(a, plans.plans[FIT_STRATEGY].saved)
    fused = fused_nodes(a.position, set(a.fw_outputs) | set(a.bw_outputs)) if a.fusion else set()
    run = [n for n in sorted({*nodes.forward, *nodes.recomputed, *a.bw_nodes}, key=a.position.__getitem__)
           if n.op == "call_function"]
    return kernel_terms(run, H100_DATASHEET, lambda n: n not in fused)


def anchor_predictions(plans: ShapePlans, profile: DeviceProfile) -> list[AnchorPrediction]:
    shape = plans.shape
    predicted: dict[str, tuple[int, float]] = {}
    for strategy, plan in plans.plans.items():
        seconds = step_seconds(plan.analysis, plan.saved, seconds_function(plan.analysis, profile))
        peak = predicted_peak(plan.analysis, plan.saved, plans.loss_bytes, plan.eager) + plans.input_grad_bytes
        predicted[strategy] = (peak, seconds)
    measured_base = shape.rows[FIT_STRATEGY]["ms_median"]
    predicted_base = predicted[FIT_STRATEGY][1]
    result = []
    for strategy, row in shape.rows.items():
        role = "fit" if strategy == FIT_STRATEGY else "validation"
        peak, seconds = predicted.get(strategy, (None, None))
        note = "not modelled (save_on_cpu: synchronous copies)" if strategy in NOT_MODELLED else ""
        if "error" in row:
            note = f"not measured: {row['error']}"
        measured_ms = row.get("ms_median")
        result.append(AnchorPrediction(
            strategy, shape.name, role,
            measured_peak_mb=row.get("peak_above_steady_mb"),
            predicted_peak_mb=None if peak is None else peak / MB,
            measured_ms=measured_ms,
            predicted_ms=None if seconds is None else seconds * 1e3,
            measured_ratio=None if measured_ms is None else measured_ms / measured_base,
            predicted_ratio=None if seconds is None else seconds / predicted_base,
            note=note,
        ))
    return result


def fit_h100(all_plans: Sequence[ShapePlans]) -> Fit:
    """Fit the h100 constants on the ``compile`` rows of ``all_plans`` only."""
    rows = [FitRow(p.shape.name, default_terms(p), p.shape.rows[FIT_STRATEGY]["ms_median"] / 1e3) for p in all_plans]
    return fit_constants(rows)


# --- Pareto against torch --------------------------------------------------------------------


PARETO_TRIES = 6  # solves per torch budget at most, lowering our graph's budget by the loss's overshoot


def pareto_points(plans: ShapePlans, profile: DeviceProfile) -> list[dict]:
    """At the predicted peak of each torch budget plan, our solver's plan (offload on)."""
    compiled = plans.compiled
    a = backend_analysis(*decoder_on_meta(plans.shape.args, plans.layers))
    by_name = {node.name: node for node in a.position}
    seconds = seconds_function(a, profile)
    base = without_banned_recompute(a, {by_name[node.name] for node in plans.plans[FIT_STRATEGY].saved})
    base_seconds = step_seconds(a, base, seconds)
    offload = OffloadOptions(profile, lambda node: eligible_for_offload(node)[0], True)
    points = []
    for strategy in sorted(s for s in plans.plans if s.startswith("compile_budget_")):
        torch_saved = plans.plans[strategy].saved
        torch_peak = predicted_peak(compiled, torch_saved, plans.loss_bytes)
        torch_seconds = step_seconds(compiled, torch_saved, seconds_function(compiled, profile))
        started = time.perf_counter()
        # The budget bounds our solver's graph peak; the eager loss runs around the graph, on
        # top of what the forward leaves. Where the loss takes our plan over torch's peak, the
        # solver is asked again under a budget lowered by the overshoot, until both fit.
        budget = torch_peak
        for _ in range(PARETO_TRIES):
            solution = solve_joint(a, base, seconds, budget, None, offload)  # the backend's default solver
            chosen = solution.chosen
            ours_peak = max(chosen.peak_bytes, forward_end_bytes(a, chosen.saved - chosen.offloaded) + plans.loss_bytes)
            if ours_peak <= torch_peak or not solution.feasible:
                break
            budget -= ours_peak - torch_peak
        ours_seconds = step_seconds(a, chosen.saved, seconds) + (chosen.transfers.added_seconds if chosen.transfers else 0.0)
        points.append({"kind": "pareto", "shape": plans.shape.name, "torch_strategy": strategy,
                       "budget_mb": round(torch_peak / MB, 1),
                       "planned_under_mb": round(budget / MB, 1),
                       "torch_peak_mb": round(torch_peak / MB, 1), "torch_ratio": round(torch_seconds / base_seconds, 3),
                       "ours_peak_mb": round(ours_peak / MB, 1), "ours_ratio": round(ours_seconds / base_seconds, 3),
                       "ours_fits": ours_peak <= torch_peak, "planning_s": round(time.perf_counter() - started, 1)})
    return points


# --- optimality ------------------------------------------------------------------------------


def _tower(width: int = 1024, depth: int = 4, batch: int = 4096):
    """tanh(linear(x)) ``depth`` times in bf16: a chain whose every saved tensor costs a
    matmul to recompute."""
    with torch.device("meta"):
        layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]).to(torch.bfloat16)
        x = torch.randn(batch, width, dtype=torch.bfloat16, requires_grad=True)
    return layers, x


def _gpt2_block(layers: int = 1):
    """GPT-2 small's block shapes (d 768, 12 heads, seq 1024, batch 8, bf16)."""
    return decoder_on_meta({"layers": layers, "d": 768, "heads": 12, "seq": 1024, "batch": 8, "dtype": "bfloat16"})


OPTIMALITY_GRAPHS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "tower4": _tower,
    "gpt2-block": _gpt2_block,
}
SWEEP_POINTS = 12


def optimality_points(graph: str, profile: DeviceProfile, max_plans: int, points: int = SWEEP_POINTS) -> list[dict]:
    """The planner's greedy plan (the backend's default) against the exhaustive optimum at
    ``points`` budgets evenly spaced between the lowest peak the exhaustive search finds and
    the unconstrained peak; ``pruned_*``: the greedy's plan after ``passes.solve.prune`` (the
    undos that are no slower and no higher under the model; not the default: measured, the
    plans it changes peak above their predictions, docs/benchmarks.md); ``refined_*``: the
    greedy's plan after refinement (``solver="refined"``)."""
    model, x = OPTIMALITY_GRAPHS[graph]()
    a = backend_analysis(model, x)
    seconds = seconds_function(a, profile)
    base = without_banned_recompute(a, compat.min_cut_saved_values(a.joint))
    offload = OffloadOptions(profile, lambda node: eligible_for_offload(node)[0], True)
    base_seconds = step_seconds(a, base, seconds)
    pool = greedy_pool(a, base, seconds, offload)
    unconstrained = solve_joint(a, base, seconds, None, None, offload).baseline.peak_bytes
    # The search, then the greedy at each budget of the sweep; if a plan saves a storage
    # outside the pool, the search runs again with it, so the exhaustive space always
    # contains every plan the greedy (refined or not) chose.
    exact_all = exhaustive_candidates(a, base, seconds, offload, pool, max_plans)
    lowest = min(c.peak_bytes for c in exact_all)
    budgets = [int(lowest + (unconstrained - lowest) * i / (points - 1)) for i in range(points)]
    solved = {}
    extra_pool = set()
    for budget in budgets:
        greedy = solve_joint(a, base, seconds, budget, None, offload)
        pruned = prune_solution(a, greedy, base, seconds, offload)[0]
        refined = refine_solution(a, greedy, base, seconds, offload)[0]
        solved[budget] = (greedy, pruned, refined)
        for solution in (greedy, pruned, refined):
            extra_pool |= {a.roots.get(t, t) for t in solution.chosen.saved if tensor_value(t) is not None}
    if not extra_pool <= pool:
        exact_all = exhaustive_candidates(a, base, seconds, offload, pool | extra_pool, max_plans)
    result = []
    for budget in budgets:
        greedy, pruned, refined = solved[budget]
        exact, exact_fits = pick(exact_all, budget)
        exact_seconds = base_seconds + exact.extra_seconds
        pruned_seconds = base_seconds + pruned.chosen.extra_seconds
        refined_seconds = base_seconds + refined.chosen.extra_seconds
        greedy_seconds = base_seconds + greedy.chosen.extra_seconds
        result.append({"kind": "optimality", "graph": graph, "budget": budget, "budget_mb": round(budget / MB, 2),
                       "greedy_step_ms": _ms(greedy_seconds) if greedy.feasible else None,
                       "exact_step_ms": _ms(exact_seconds) if exact_fits else None,
                       "gap": _gap(greedy_seconds, exact_seconds) if greedy.feasible and exact_fits else None,
                       "greedy_peak_mb": round(greedy.chosen.peak_bytes / MB, 2),
                       "exact_peak_mb": round(exact.peak_bytes / MB, 2),
                       "pruned_step_ms": _ms(pruned_seconds) if pruned.feasible else None,
                       "pruned_gap": _gap(pruned_seconds, exact_seconds) if pruned.feasible and exact_fits else None,
                       "pruned_peak_mb": round(pruned.chosen.peak_bytes / MB, 2),
                       "refined_step_ms": _ms(refined_seconds) if refined.feasible else None,
                       "refined_gap": _gap(refined_seconds, exact_seconds) if refined.feasible and exact_fits else None,
                       "refined_peak_mb": round(refined.chosen.peak_bytes / MB, 2),
                       "plans_searched": len(exact_all)})
    return result


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def _gap(seconds: float, optimum_seconds: float) -> float:
    return round(seconds / optimum_seconds - 1, 4)


# --- command line ----------------------------------------------------------------------------


def add_model_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of tables")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"anchor shapes to predict (of {', '.join(SHAPES)})")
    parser.add_argument("--anchors", default=str(ANCHOR_DIR), help="directory of the anchor .jsonl files")
    parser.add_argument("--fit", action="store_true",
                        help="refit the h100 constants on the torch.compile rows and predict with the fitted profile")
    parser.add_argument("--skip-optimality", action="store_true", help="skip the greedy-vs-exact sweep")
    parser.add_argument("--optimality-graphs", default=",".join(OPTIMALITY_GRAPHS),
                        help=f"small graphs for the exact search (of {', '.join(OPTIMALITY_GRAPHS)})")
    parser.add_argument("--max-plans", type=int, default=200_000, help="the exhaustive search's limit")
    parser.add_argument("--pareto-shapes", default="gpt8",
                        help="shapes on which our solver plans at torch's budgets ('' for none; deep24 takes minutes)")


def _table_head(*columns: str) -> list[str]:
    """A blank line, then a markdown table's header and rule."""
    return ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def run_model_check(args: argparse.Namespace) -> int:
    out = sys.stdout
    shapes = [s for s in args.shapes.split(",") if s]
    # no anchor shape: only the optimality table (greedy against the exact optimum), where it is asked for
    if not shapes and (args.skip_optimality or args.fit or not [g for g in args.optimality_graphs.split(",") if g]):
        why = "--fit fits the anchors" if args.fit else "and no optimality graph: an empty report"
        raise SystemExit(f"model-check: --shapes {args.shapes!r}: names no anchor shape ({why}); accepted: one or "
                         f"more of {', '.join(SHAPES)}, comma-separated")
    if args.max_plans < 1:  # the exhaustive search's space has at least one plan
        raise SystemExit(f"model-check: --max-plans {args.max_plans}: the most plans the exhaustive search may "
                         "evaluate; accepted: a whole number >= 1")
    graphs = [g for g in args.optimality_graphs.split(",") if g]
    for graph in graphs:
        if graph not in OPTIMALITY_GRAPHS:
            raise SystemExit(f"model-check: unknown graph {graph!r}; known: {', '.join(OPTIMALITY_GRAPHS)}")
    pareto_shapes = {s for s in args.pareto_shapes.split(",") if s}
    unknown = sorted(pareto_shapes - set(SHAPES))
    if unknown:
        raise SystemExit(f"model-check: --pareto-shapes: unknown anchor shape {unknown[0]!r}; known: {', '.join(SHAPES)}")
    try:
        anchors = load_anchors(Path(args.anchors), shapes) if shapes else []
    except ValueError as error:
        raise SystemExit(f"model-check: {error}") from error
    profile = BUILTIN_PROFILES["h100"]
    header = {"kind": "header", "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "profile": "h100", "calibration": dict(H100_CALIBRATION),
              "measured_on": sorted({f"{s.device}, torch {s.torch_version}" for s in anchors})}
    all_plans = [torch_plans(shape) for shape in anchors]
    if args.fit:
        fit = fit_h100(all_plans)
        header["calibration"] = {"compute": fit.compute_efficiency, "memory": fit.memory_efficiency,
                                 "launch": fit.launch_overhead_seconds}
        header["fit_predicted_ms"] = {k: round(v * 1e3, 2) for k, v in fit.predicted_seconds.items()}
        profile = fit.profile(H100_DATASHEET, "h100")
    records: list[dict] = [header]
    records += [p.record() for plans in all_plans for p in anchor_predictions(plans, profile)]
    for plans in all_plans:
        if plans.shape.name in pareto_shapes:
            records += pareto_points(plans, profile)
    if not args.skip_optimality:
        for graph in graphs:
            try:
                records += optimality_points(graph, profile, args.max_plans)
            except SolverError as error:
                records.append({"kind": "optimality", "graph": graph, "error": str(error)})
    if args.json:
        for record in records:
            print(json.dumps(record), file=out, flush=True)
    else:
        print(format_tables(records), file=out)
    return 0


def _cell(value, fmt: str = "{}") -> str:
    return "–" if value is None else fmt.format(value)


def format_tables(records: list[dict]) -> str:
    header = next(r for r in records if r["kind"] == "header")
    c = header["calibration"]
    anchors = [r for r in records if r["kind"] == "anchor"]
    measured = f"measured on {'; '.join(header['measured_on'])}. " if header["measured_on"] else ""
    lines = [f"model-check {header['date']}, torch {header['torch']}, profile h100 calibrated "
             f"(compute {c['compute']}, memory {c['memory']}, launch {c['launch'] * 1e6:g} µs); "
             f"{measured}Every 'predicted' figure is a prediction."]
    if anchors:
        lines += _table_head("shape", "strategy", "role", "measured peak MiB", "predicted peak MiB", "peak error",
                             "measured ratio", "predicted ratio", "ratio error")
    for r in anchors:
        peak_error = (None if r["predicted_peak_mb"] is None or not r["measured_peak_mb"]
                      else r["predicted_peak_mb"] / r["measured_peak_mb"] - 1)
        ratio_error = (None if r["predicted_ratio"] is None or r["measured_ratio"] is None
                       else r["predicted_ratio"] - r["measured_ratio"])
        lines.append(f"| {r['shape']} | {r['strategy']} | {r['role']} | {_cell(r['measured_peak_mb'], '{:.0f}')} | "
                     f"{_cell(r['predicted_peak_mb'], '{:.0f}')} | {_cell(peak_error, '{:+.1%}')} | "
                     f"{_cell(r['measured_ratio'], '{:.3f}')} | {_cell(r['predicted_ratio'], '{:.3f}')} | "
                     f"{_cell(ratio_error, '{:+.3f}')} |")
    pareto = [r for r in records if r["kind"] == "pareto"]
    if pareto:
        lines += _table_head("shape", "torch plan", "budget (its predicted peak) MiB", "our graph planned under MiB",
                             "torch predicted ratio", "ours predicted peak MiB", "ours predicted ratio", "fits")
        for r in pareto:
            lines.append(f"| {r['shape']} | {r['torch_strategy']} | {r['budget_mb']:.0f} | {r['planned_under_mb']:.0f} | "
                         f"{r['torch_ratio']:.3f} | {r['ours_peak_mb']:.0f} | {r['ours_ratio']:.3f} | "
                         f"{'yes' if r['ours_fits'] else 'no'} |")
    optimality = [r for r in records if r["kind"] == "optimality"]
    if optimality:
        lines += _table_head("graph", "budget MiB", "greedy predicted ms", "exact predicted ms", "gap",
                             "greedy + prune ms", "gap after prune", "greedy + refine ms", "gap after refine",
                             "plans searched")
        for r in optimality:
            if "error" in r:
                lines.append(f"| {r['graph']} | – | – | – | {r['error']} | – | – | – | – | – |")
                continue
            lines.append(f"| {r['graph']} | {r['budget_mb']:.2f} | {_cell(r['greedy_step_ms'], '{:.3f}')} | "
                         f"{_cell(r['exact_step_ms'], '{:.3f}')} | {_cell(r['gap'], '{:.2%}')} | "
                         f"{_cell(r['pruned_step_ms'], '{:.3f}')} | {_cell(r['pruned_gap'], '{:.2%}')} | "
                         f"{_cell(r['refined_step_ms'], '{:.3f}')} | {_cell(r['refined_gap'], '{:.2%}')} | "
                         f"{r['plans_searched']} |")
    return "\n".join(lines)
