"""The cost model: device profiles and the predicted time of each node of an aten FX graph.

Each kernel-launching node costs a roofline estimate, ``max(flops / peak[dtype],
bytes / memory_bandwidth)``, plus the device's launch overhead. FLOPs come from
``torch.utils.flop_counter`` (matmuls, convolutions, attention); every other op counts as
bandwidth-bound. The estimate is per op: pointwise chains that Inductor fuses into one
kernel read and write their intermediates once, so summing their per-op times is an upper
bound on the fused kernel's time.

Nodes must carry ``meta["val"]`` (fake tensors, as in AOTAutograd's joint graph); symbolic
sizes are replaced by their size hints. Nothing here runs a real kernel: FLOPs are counted by
running the op on ``meta`` tensors, once per distinct (op, argument shapes, dtypes).
"""

from __future__ import annotations

import logging
import math
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from .compat import HigherOrderOperator, OpOverload, size_hint, tree_flatten
from .compat import outside_dispatch_modes as _outside_dispatch_modes

log = logging.getLogger("compile_offload")

aten = torch.ops.aten

# Private torch names (OpOverload, HigherOrderOperator, tree_flatten, and _disable_current_modes:
# the planner may run inside a compile where a FakeTensorMode or a user's dispatch mode is
# active, and our meta-tensor flop counting must not be seen by them) come from compat.

FALLBACK_DTYPE = "float32"


@dataclass(frozen=True)
class DeviceProfile:
    """What the cost model needs to know about a device; all rates are achievable, not datasheet.

    ``flops_per_second`` maps dtype names ("bfloat16", "float32", ...) to the matmul rate;
    a dtype not listed uses the ``float32`` rate (see :meth:`peak_flops`). Transfer
    bandwidths are for pinned host memory. ``shared_h2d_bytes``: what another user of the
    link copies host->device at the start of each backward (FSDP2 uploading the next
    module's offloaded parameters): the graph's reloads queue behind it.
    """

    name: str
    flops_per_second: dict[str, float]
    memory_bandwidth: float  # bytes/s, device memory (read + write traffic)
    d2h_bandwidth: float  # bytes/s, device -> pinned host
    h2d_bandwidth: float  # bytes/s, pinned host -> device
    launch_overhead_seconds: float
    shared_h2d_bytes: int = 0
    _frozen_flops: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        flops = {_dtype_name(k): float(v) for k, v in dict(self.flops_per_second).items()}
        if not flops:
            raise ValueError(f"DeviceProfile {self.name!r}: flops_per_second is empty")
        rates = dict(flops, memory_bandwidth=self.memory_bandwidth, d2h_bandwidth=self.d2h_bandwidth,
                     h2d_bandwidth=self.h2d_bandwidth)
        for what, value in rates.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"DeviceProfile {self.name!r}: {what} must be a positive finite number, got {value!r}")
        overhead = self.launch_overhead_seconds
        if not (isinstance(overhead, (int, float)) and math.isfinite(overhead) and overhead >= 0):
            raise ValueError(f"DeviceProfile {self.name!r}: launch_overhead_seconds must be >= 0, got {overhead!r}")
        shared = self.shared_h2d_bytes
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"DeviceProfile {self.name!r}: shared_h2d_bytes must be an int >= 0, got {shared!r}")
        # A private copy, so that mutating the caller's dict cannot change a frozen profile.
        object.__setattr__(self, "flops_per_second", flops)
        object.__setattr__(self, "_frozen_flops", tuple(sorted(flops.items())))

    def __hash__(self) -> int:  # the generated hash would fail on the dict field
        return hash((self.name, self._frozen_flops, self.memory_bandwidth, self.d2h_bandwidth,
                     self.h2d_bandwidth, self.launch_overhead_seconds, self.shared_h2d_bytes))

    def peak_flops(self, dtype: torch.dtype | str) -> float:
        """FLOP/s for matmuls in ``dtype``.

        Unlisted dtypes (integers, fp8 where the profile has no entry, complex) fall back to
        the ``float32`` rate: the non-tensor-core rate, a conservative guess for most of them.
        """
        name = _dtype_name(dtype)
        if name in self.flops_per_second:
            return self.flops_per_second[name]
        if FALLBACK_DTYPE in self.flops_per_second:
            return self.flops_per_second[FALLBACK_DTYPE]
        return min(self.flops_per_second.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` rebuilds an equal profile (``shared_h2d_bytes``
        only where it is not 0, so that a device's stored profile reads the same)."""
        data = {
            "name": self.name,
            "flops_per_second": dict(self.flops_per_second),
            "memory_bandwidth": self.memory_bandwidth,
            "d2h_bandwidth": self.d2h_bandwidth,
            "h2d_bandwidth": self.h2d_bandwidth,
            "launch_overhead_seconds": self.launch_overhead_seconds,
        }
        if self.shared_h2d_bytes:
            data["shared_h2d_bytes"] = self.shared_h2d_bytes
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceProfile:
        """Inverse of :meth:`to_dict`; raises ValueError on a malformed dict (e.g. a corrupt cache)."""
        if not isinstance(data, dict):
            raise ValueError(f"a device profile must be a dict, got {type(data).__name__}")
        expected = {"name", "flops_per_second", "memory_bandwidth", "d2h_bandwidth", "h2d_bandwidth",
                    "launch_overhead_seconds"}
        if set(data) - {"shared_h2d_bytes"} != expected:
            raise ValueError(f"device profile keys {sorted(data)} differ from {sorted(expected)}")
        if not isinstance(data["name"], str) or not isinstance(data["flops_per_second"], dict):
            raise ValueError("device profile: 'name' must be a string and 'flops_per_second' a dict")
        try:
            return cls(**data)
        except TypeError as error:  # e.g. None where a number belongs
            raise ValueError(f"malformed device profile: {error}") from error


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# Built-in profiles. Datasheet peaks are scaled to what large, well-shaped kernels achieve.
# The h100 profile's fractions are fitted to measurements (H100_CALIBRATION below); the
# others use these priors: cuBLAS bf16 GEMMs reach ~70% of the dense tensor-core peak on H100/A100 (a GPT-8 step of
# ~46 TFLOP in 76.3 ms on H100 is ~600 TFLOP/s end to end, see docs/benchmarks.md), and
# streaming kernels reach ~80% of the HBM/GDDR datasheet bandwidth. Pinned-copy figures are
# measured values already (PCIe 5 x16 on the H100 machine; ~25 GB/s is typical for PCIe 4 x16).
# fp32 matmuls use the non-tensor-core rate: torch's default float32_matmul_precision is
# "highest", so cuBLAS does not use TF32 unless the user allows it.
COMPUTE_EFFICIENCY = 0.70
MEMORY_EFFICIENCY = 0.80
GPU_LAUNCH_OVERHEAD_SECONDS = 4e-6  # CUDA launch latency of a small kernel without CUDA graphs
TERA = 1e12
GIGA = 1e9


def _gpu_profile(name: str, datasheet_tflops: dict[str, float], hbm_tb_per_s: float,
                 d2h_gb_per_s: float, h2d_gb_per_s: float, compute_efficiency: float = COMPUTE_EFFICIENCY,
                 memory_efficiency: float = MEMORY_EFFICIENCY,
                 launch_overhead_seconds: float = GPU_LAUNCH_OVERHEAD_SECONDS) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        flops_per_second={k: v * TERA * compute_efficiency for k, v in datasheet_tflops.items()},
        memory_bandwidth=hbm_tb_per_s * TERA * memory_efficiency,
        d2h_bandwidth=d2h_gb_per_s * GIGA,
        h2d_bandwidth=h2d_gb_per_s * GIGA,
        launch_overhead_seconds=launch_overhead_seconds,
    )


class GpuDatasheet(typing.NamedTuple):
    """A GPU's datasheet: dense matmul TFLOP/s per dtype and memory TB/s; the pinned-copy
    GB/s each way are measured (or typical) figures."""

    tflops: dict[str, float]
    hbm_tb_per_s: float
    d2h_gb_per_s: float
    h2d_gb_per_s: float


GPU_DATASHEETS: dict[str, GpuDatasheet] = {
    # H100 SXM5 80GB (dense): bf16/fp16 989 TFLOP/s, fp8 1979, fp32 67 (non-tensor), fp64 67
    # (tensor core); HBM3 3.35 TB/s. Pinned copies measured: d2h 55.1, h2d 54.9 GB/s.
    "h100": GpuDatasheet({"bfloat16": 989.0, "float16": 989.0, "float8_e4m3fn": 1979.0, "float8_e5m2": 1979.0,
                          "float32": 67.0, "float64": 67.0}, 3.35, 55.1, 54.9),
    # H200 SXM 141GB (dense): the H100's chip and rates, HBM3e 4.8 TB/s; the same PCIe 5 x16
    # host link, so the H100's measured pinned-copy figures (not measured on an H200).
    "h200": GpuDatasheet({"bfloat16": 989.0, "float16": 989.0, "float8_e4m3fn": 1979.0, "float8_e5m2": 1979.0,
                          "float32": 67.0, "float64": 67.0}, 4.8, 55.1, 54.9),
    # A100 SXM4 80GB (dense): bf16/fp16 312 TFLOP/s, fp32 19.5, fp64 19.5 (tensor core);
    # HBM2e 2.04 TB/s; PCIe 4 x16 pinned copies ~25 GB/s. No fp8.
    "a100": GpuDatasheet({"bfloat16": 312.0, "float16": 312.0, "float32": 19.5, "float64": 19.5}, 2.04, 25.0, 25.0),
    # RTX 4090 (dense, fp32 accumulate): bf16/fp16 165.2 TFLOP/s, fp8 330.3, fp32 82.6, fp64
    # 1.29 (1/64 rate); GDDR6X 1.01 TB/s; PCIe 4 x16 ~25 GB/s.
    "rtx4090": GpuDatasheet({"bfloat16": 165.2, "float16": 165.2, "float8_e4m3fn": 330.3, "float8_e5m2": 330.3,
                             "float32": 82.6, "float64": 1.29}, 1.01, 25.0, 25.0),
}
H100_DATASHEET = _gpu_profile("h100-datasheet", *GPU_DATASHEETS["h100"], compute_efficiency=1.0,
                              memory_efficiency=1.0)
# The h100 profile's constants, fitted to measured steps (``tools.calibrate``; run
# ``python -m compile_offload model-check --fit``, docs/benchmarks.md "Calibration"): the
# achieved fraction of the datasheet matmul rate and of the HBM bandwidth, and the
# per-kernel overhead, chosen so that the torch.compile-default steps of the two H100 anchor
# shapes (GPT-8 76.3 ms, deep-24 90.5 ms; torch 2.11, bf16) are predicted from their plans.
# Fitted on those two rows only; the torch-budget and checkpointing rows validate it.
# The link bandwidths are measured values, not fitted.
# Result (2026-11-23, torch 2.13 CPU trace of the torch 2.11 H100 anchors): 80% of the bf16
# datasheet rate, 100% of the HBM datasheet bandwidth (the grid's upper bound: the per-op
# byte counts overstate traffic, see docs/benchmarks.md), 3 µs per kernel; predicted 75.6 ms
# (GPT-8) and 91.7 ms (deep-24) against 76.3 and 90.5 measured. Before: the prior, 0.70 /
# 0.80 / 4 µs (GPT-8 predicted 88.1 ms). Refitted 2026-11-25 after the simulator's fusion
# rule began to follow Inductor's store-or-inline choice (more kernels of their own):
# 79.5%, 99%, 3 µs; predicted 75.5 ms and 91.5 ms. Refitted again the same day after
# `full`, `select_scatter` and `slice_scatter` became pointwise to the simulator (Inductor
# inlines them: no kernel and no traffic of their own): 74.5%, 98%, 3 µs.
H100_CALIBRATION = {"compute": 0.745, "memory": 0.98, "launch": 3e-6}


# The h200 profile: the H100's chip, so the h100's fitted compute fraction and per-kernel
# overhead; its HBM3e fraction fitted to the torch.compile steps of the H200 runs in
# docs/benchmarks.md ("Measured on a GPU", torch 2.11, bf16): 0.75 predicts 75.1 ms (GPT-8)
# and 89.4 ms (deep-24). The h100's 0.98 would predict 72.8 and 85.8 ms: those steps ran no
# faster on the H200 than on the H100 (76.3, 90.5 ms), whose fit's memory fraction is not
# a physical efficiency (its byte counts overstate traffic, above).
H200_MEASURED_COMPILE_MS = {"gpt8": (74.6, 76.9), "deep24": (88.3, 90.5)}  # the range over the runs
H200_CALIBRATION = {"compute": H100_CALIBRATION["compute"], "memory": 0.75, "launch": H100_CALIBRATION["launch"]}

# Fitted constants per profile (the others use the priors above).
_FITTED = {name: {"compute_efficiency": fit["compute"], "memory_efficiency": fit["memory"],
                  "launch_overhead_seconds": fit["launch"]}
           for name, fit in (("h100", H100_CALIBRATION), ("h200", H200_CALIBRATION))}

BUILTIN_PROFILES: dict[str, DeviceProfile] = {
    **{name: _gpu_profile(name, *sheet, **_FITTED.get(name, {})) for name, sheet in GPU_DATASHEETS.items()},
    # A modest multi-core CPU: ~100 GFLOP/s fp32 GEMM (half that for bf16/fp16/fp64 without
    # AMX), ~20 GB/s DRAM; a "transfer" is a memcpy, which reads and writes: ~10 GB/s.
    # Per-op overhead is a compiled kernel call, not a CUDA launch.
    "cpu": DeviceProfile(
        name="cpu",
        flops_per_second={"float32": 100 * GIGA, "bfloat16": 50 * GIGA, "float16": 50 * GIGA,
                          "float64": 50 * GIGA},
        memory_bandwidth=20 * GIGA,
        d2h_bandwidth=10 * GIGA,
        h2d_bandwidth=10 * GIGA,
        launch_overhead_seconds=1e-6,
    ),
}

# Device memory of the GPUs the built-in profiles describe (the 80 GB H100 and A100 parts,
# the 141 GB H200), nominal: on the GPU itself the budget check uses the total CUDA reports,
# a little less (an "80 GB" H100 reports about 79.2 GiB, an H200 140.4 GiB). The cpu profile
# has none.
BUILTIN_PROFILE_MEMORY_BYTES: dict[str, int] = {"h100": 80 * 2**30, "h200": 141 * 2**30, "a100": 80 * 2**30,
                                                "rtx4090": 24 * 2**30}


# --------------------------------------------------------------------------------------------
# Which nodes launch a kernel.
# Ops whose output is a view or an allocation without a kernel: reading their inputs is free.
# _unsafe_view's schema does not say "alias", but it reinterprets a fresh buffer (Inductor
# lowers it to a view).
_FREE_PACKETS = frozenset(
    getattr(aten, name)
    for name in ("_unsafe_view", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided")
    if hasattr(aten, name)
)


def launches_kernel(node: fx.Node) -> bool:
    """True for nodes that run a device kernel; placeholders, outputs, views, getitem and
    symbolic-int arithmetic do not."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, HigherOrderOperator):
        return True
    if not isinstance(target, OpOverload):
        return False  # operator.getitem, SymInt arithmetic, Python builtins
    if getattr(target, "is_view", False) or target.overloadpacket in _FREE_PACKETS:
        return False
    return target._schema.is_mutable or next(_tensors(node.meta.get("val")), None) is not None


# --------------------------------------------------------------------------------------------
# Bytes.

def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):  # most values; ``tree_flatten`` leaves a reference
        return iter((value,))           # cycle per call (its recursive helper) for the collector
    leaves, _ = tree_flatten(value)
    return (leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


def _hinted(values: Iterable[Any]) -> tuple[int, ...]:
    return tuple(size_hint(v) for v in values)


def tensor_bytes(value: torch.Tensor) -> int:
    """Bytes a kernel touches in ``value``: its elements, or fewer when strides overlap
    (an expanded tensor reads its storage once)."""
    sizes = _hinted(value.shape)
    if any(s == 0 for s in sizes):
        return 0
    numel = math.prod(sizes)
    try:
        strides = _hinted(value.stride())
    except (RuntimeError, NotImplementedError):  # sparse or nested layouts have no strides
        return numel * value.element_size()
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(sizes, strides))
    return min(numel, span) * value.element_size()


def node_bytes_accessed(node: fx.Node) -> int:
    """Bytes read plus bytes written by one node's kernel (0 for nodes that launch none).

    Each input node is read once even when passed twice (``mul(x, x)``); outputs are the
    tensors in the node's ``meta["val"]``.
    """
    if not launches_kernel(node):
        return 0
    read = sum(tensor_bytes(t) for arg in node.all_input_nodes for t in _tensors(arg.meta.get("val")))
    written = sum(tensor_bytes(t) for t in _tensors(node.meta.get("val")))
    return read + written


# --------------------------------------------------------------------------------------------
# FLOPs.

def _aliased_formulas() -> dict[Any, Any]:
    """Formulas for ops torch's registry misses but whose math equals a registered op's.

    On CPU, SDPA traces to ``_scaled_dot_product_flash_attention_for_cpu[_backward]``, which
    take (query, key, value, ...) and (grad_out, query, key, value, ...) like the CUDA flash ops.
    """
    from torch.utils.flop_counter import flop_registry

    aliases = {
        "_scaled_dot_product_flash_attention_for_cpu": aten._scaled_dot_product_flash_attention,
        "_scaled_dot_product_flash_attention_for_cpu_backward": aten._scaled_dot_product_flash_attention_backward,
    }
    mapping = {}
    for name, same_math in aliases.items():
        if hasattr(aten, name) and same_math in flop_registry:
            formula = flop_registry[same_math]  # already takes tensors (shape-wrapped)

            def raw(*args, _formula=formula, **kwargs):
                return _formula(*args, **kwargs)

            raw._get_raw = True  # tell FlopCounterMode not to shape-wrap it a second time
            mapping[getattr(aten, name)] = raw
    return mapping


class _FlopCounter:
    """One FlopCounterMode and a memo of FLOPs per (op, argument signature).

    ``entered`` counts how many ops were actually run under the counter (tests use it to
    check the memo).
    """

    def __init__(self) -> None:
        self.mode = FlopCounterMode(display=False, custom_mapping=_aliased_formulas())
        self.registry = self.mode.flop_registry  # ops with a formula, ours included
        self.memo: dict[tuple, int] = {}
        self.entered = 0

    def has_formula(self, target: Any) -> bool:
        return _registry_key(target) in self.registry

    def flops(self, node: fx.Node) -> int:
        key = (node.target, _signature(node.args), _signature(node.kwargs))
        if key not in self.memo:
            self.memo[key] = self._count(node)
        return self.memo[key]

    def _count(self, node: fx.Node) -> int:
        with _outside_dispatch_modes():
            args, kwargs = _meta_arguments(node.args), _meta_arguments(node.kwargs)
            if isinstance(node.target, OpOverload):
                try:
                    self.entered += 1
                    with self.mode:
                        node.target(*args, **kwargs)
                    return self.mode.get_total_flops()
                except Exception as error:  # an op without a meta kernel: use its formula directly
                    log.debug("flop count: running %s on meta failed (%s); using its formula", node.target, error)
            # Higher-order ops (flex attention) need their subgraphs to run: the formula only
            # needs the tensors' shapes, and the node's own meta value is the output.
            out = _meta_arguments(node.meta.get("val"))
            try:
                return int(self.registry[_registry_key(node.target)](*args, out_val=out, **kwargs))
            except Exception as error:
                log.debug("flop count: no FLOPs for %s (%s)", node.target, error)
                return 0


def _registry_key(target: Any) -> Any:
    return target.overloadpacket if isinstance(target, OpOverload) else target


def _signature(value: Any) -> Any:
    """A hashable description of arguments: tensors by shape, stride and dtype."""
    if isinstance(value, fx.Node):
        return _signature(value.meta.get("val"))
    if isinstance(value, torch.Tensor):
        return ("tensor", _hinted(value.shape), _hinted(value.stride()), value.dtype)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return size_hint(value) if isinstance(value, torch.SymInt) else str(value)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _meta_arguments(value: Any) -> Any:
    """Arguments with every tensor replaced by an empty ``meta`` tensor of the same shape."""
    if isinstance(value, fx.Node):
        return _meta_arguments(value.meta.get("val"))
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(_hinted(value.shape), _hinted(value.stride()), dtype=value.dtype, device="meta")
    if isinstance(value, torch.SymInt):
        return size_hint(value)
    if isinstance(value, tuple):
        return tuple(_meta_arguments(v) for v in value)
    if isinstance(value, list):  # includes FX's immutable_list
        return [_meta_arguments(v) for v in value]
    if isinstance(value, dict):
        return {k: _meta_arguments(v) for k, v in value.items()}
    return value


_counter: _FlopCounter | None = None


def flop_counter() -> _FlopCounter:
    """The process-wide counter (built lazily: FlopCounterMode's registry is read once)."""
    global _counter
    if _counter is None:
        _counter = _FlopCounter()
    return _counter


def clear_flop_cache() -> None:
    """Forget memoized FLOP counts (and the ``entered`` count)."""
    global _counter
    _counter = None


def node_flops(node: fx.Node) -> int:
    """FLOPs of one node, as ``torch.utils.flop_counter`` counts them (0 for ops it has no
    formula for: pointwise ops, reductions, views, placeholders, getitem, output)."""
    if node.op != "call_function":
        return 0
    counter = flop_counter()
    if not counter.has_formula(node.target):
        return 0
    return counter.flops(node)


# --------------------------------------------------------------------------------------------
# Time.

def compute_dtype(node: fx.Node) -> torch.dtype:
    """The dtype whose peak rate applies: the first floating-point input, else the output's."""
    for arg in node.all_input_nodes:
        for t in _tensors(arg.meta.get("val")):
            if t.dtype.is_floating_point:
                return t.dtype
    for t in _tensors(node.meta.get("val")):
        return t.dtype
    return torch.float32


def node_seconds(node: fx.Node, profile: DeviceProfile) -> float:
    """Predicted run time of one node: ``max(flops / peak[dtype], bytes / memory_bandwidth)``
    plus the launch overhead; 0 for nodes that launch no kernel.

    Per op: a pointwise op that Inductor fuses into a neighbour is charged its own memory
    traffic and launch, so a fused chain's estimate is an upper bound.
    """
    if not launches_kernel(node):
        return 0.0
    flops = node_flops(node)
    compute = flops / profile.peak_flops(compute_dtype(node)) if flops else 0.0
    memory = node_bytes_accessed(node) / profile.memory_bandwidth
    return max(compute, memory) + profile.launch_overhead_seconds


def transfer_seconds(nbytes: int, profile: DeviceProfile, direction: Literal["d2h", "h2d"]) -> float:
    """Time of one pinned-memory copy of ``nbytes``: bytes / bandwidth plus one launch
    overhead (0 for an empty copy, which is skipped)."""
    if direction == "d2h":
        bandwidth = profile.d2h_bandwidth
    elif direction == "h2d":
        bandwidth = profile.h2d_bandwidth
    else:
        raise ValueError(f"transfer direction must be 'd2h' or 'h2d', got {direction!r}")
    if nbytes <= 0:
        return 0.0
    return nbytes / bandwidth + profile.launch_overhead_seconds


def graph_seconds(graph: fx.GraphModule | fx.Graph | Iterable[fx.Node], profile: DeviceProfile) -> float:
    """Sum of :func:`node_seconds` over a GraphModule's, a Graph's or an iterable's nodes."""
    if isinstance(graph, fx.GraphModule):
        graph = graph.graph
    nodes = graph.nodes if isinstance(graph, fx.Graph) else graph
    return sum(node_seconds(node, profile) for node in nodes)


__all__ = [
    "BUILTIN_PROFILE_MEMORY_BYTES",
    "BUILTIN_PROFILES",
    "COMPUTE_EFFICIENCY",
    "DeviceProfile",
    "H100_CALIBRATION",
    "H100_DATASHEET",
    "H200_CALIBRATION",
    "H200_MEASURED_COMPILE_MS",
    "MEMORY_EFFICIENCY",
    "clear_flop_cache",
    "compute_dtype",
    "graph_seconds",
    "launches_kernel",
    "node_bytes_accessed",
    "node_flops",
    "node_seconds",
    "tensor_bytes",
    "transfer_seconds",
]
