"""Which DeviceProfile the cost model uses: a built-in by name, or the current GPU measured once.

``resolve_profile(None)`` on a CUDA machine runs a few micro-benchmarks (matmuls per dtype,
a device copy, pinned copies each way, tiny-kernel launches; well under a few seconds) and
caches the result as JSON in the user cache dir, keyed by device name, torch version and
float32 matmul precision, so later processes read it instead of measuring again.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ..passes.cost import BUILTIN_PROFILES, DeviceProfile
# The planner may run inside a compile where a FakeTensorMode or another dispatch mode is
# active; the benchmarks must run real kernels (outside them).
from ..torch_api.utils import disable_current_modes as _disable_current_modes

CACHE_FORMAT = 1
_measured_in_process: dict[str, DeviceProfile] = {}


def device_of(values: Iterable[object]) -> torch.device:
    """Where a graph runs: the first device among the tensors in ``values`` that is neither
    the CPU nor ``meta`` (parameters are inputs too), else the CPU."""
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta"):
            return value.device
    return torch.device("cpu")


def resolve_profile(name: str | None, device: torch.device | None = None) -> DeviceProfile:
    """The profile to plan with.

    ``name`` picks a built-in profile (case-insensitive). ``None`` measures the CUDA device
    the graph runs on (``device``, else the current CUDA device), reading and writing the
    on-disk cache; a CPU device, or a machine without CUDA, gets the built-in ``"cpu"``.
    """
    if name is not None:
        return builtin_profile(name)
    cuda = _cuda_device_for(device)
    if cuda is None:
        return BUILTIN_PROFILES["cpu"]
    return cached_measured_profile(cuda)


def measuring_device(name: str | None, device: torch.device | None) -> str | None:
    """The device whose measured costs may price a graph planned with ``resolve_profile(name,
    device)``: the one it runs on, by name (``"cpu"``, or the GPU's name); None where ``name``
    asks for a built-in profile or the device is not here (``explain`` for a GPU without one)."""
    if name is not None:
        return None
    cuda = _cuda_device_for(device)
    if cuda is not None:
        return cuda_device_name(cuda)
    return "cpu" if device is None or device.type == "cpu" else None


def builtin_profile(name: str) -> DeviceProfile:
    key = name.strip().lower()
    if key not in BUILTIN_PROFILES:
        raise ValueError(
            f"unknown device profile {name!r}: built-in profiles are {', '.join(sorted(BUILTIN_PROFILES))}; "
            "None measures the current GPU"
        )
    return BUILTIN_PROFILES[key]


def _cuda_device_for(device: torch.device | None) -> torch.device | None:
    """The CUDA device to measure, or None when the graph does not run on one.

    A ``meta`` (or absent) device says nothing about where the model will run, so it means
    the current CUDA device when there is one.
    """
    device = None if device is None else torch.device(device)
    if device is not None and device.type not in ("cuda", "meta"):
        return None
    if not torch.cuda.is_available():
        if device is not None and device.type == "cuda":  # fake CUDA tensors on a CPU-only machine
            warnings.warn("compile_offload: device_profile=None cannot measure a CUDA device on a machine "
                          f"without CUDA; using the 'cpu' profile (name one of {', '.join(sorted(BUILTIN_PROFILES))} "
                          "to plan for a GPU)", stacklevel=3)
        return None
    if device is not None and device.type == "cuda" and device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


# --------------------------------------------------------------------------------------------
# The on-disk cache.

def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/compile_offload``, else ``~/.cache/compile_offload``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "compile_offload"


def cache_key(device_name: str) -> str:
    """What a measurement depends on: the device, the torch build and whether fp32 matmuls
    may use TF32."""
    return f"{device_name}|torch {torch.__version__}|fp32 matmul {torch.get_float32_matmul_precision()}"


def cache_path(device_name: str) -> Path:
    stem = re.sub(r"[^A-Za-z0-9.+-]+", "_", cache_key(device_name)).strip("_")
    return cache_dir() / f"device_profile-{stem}.json"


def read_cached_profile(device_name: str) -> DeviceProfile | None:
    """The cached profile, or None when there is none; a corrupt file warns and returns None."""
    path = cache_path(device_name)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        expected = (CACHE_FORMAT, cache_key(device_name))
        if not isinstance(data, dict) or (data.get("format"), data.get("key")) != expected:
            raise ValueError("format or key does not match")
        return DeviceProfile.from_dict(data["profile"])
    except (OSError, ValueError, KeyError) as error:  # JSONDecodeError is a ValueError
        warnings.warn(f"compile_offload: ignoring corrupt device profile cache {path} ({error}); re-measuring",
                      stacklevel=3)
        return None


def write_cached_profile(device_name: str, profile: DeviceProfile) -> None:
    """Write atomically (a concurrent reader never sees half a file); failure only warns."""
    path = cache_path(device_name)
    record = {"format": CACHE_FORMAT, "key": cache_key(device_name), "profile": profile.to_dict()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(record, indent=2))
        os.replace(partial, path)
    except OSError as error:
        warnings.warn(f"compile_offload: could not cache the device profile in {path} ({error})", stacklevel=3)


def cuda_device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def cached_measured_profile(device: torch.device) -> DeviceProfile:
    """The measured profile of ``device``: from this process, else the disk cache, else measured now."""
    name = cuda_device_name(device)
    key = cache_key(name)
    if key not in _measured_in_process:
        profile = read_cached_profile(name)
        if profile is None:
            profile = measure_device_profile(device)
            write_cached_profile(name, profile)
        _measured_in_process[key] = profile
    return _measured_in_process[key]


# --------------------------------------------------------------------------------------------
# The micro-benchmarks (CUDA only).

MATMUL_SIZES = {torch.bfloat16: 4096, torch.float16: 4096, torch.float32: 4096, torch.float64: 2048}
COPY_BYTES = 128 * 2**20
LAUNCHES = 200


def measure_device_profile(device: torch.device | int | str | None = None) -> DeviceProfile:
    """Measure a CUDA device: matmul FLOP/s per dtype, device copy and pinned copy bandwidths,
    and the time of a tiny kernel. About 0.5 GB of device memory for well under a second of GPU
    time (plus CUDA and cuBLAS start-up)."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_device_profile needs a CUDA device; use a built-in profile instead")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    with _disable_current_modes(), torch.no_grad(), torch.cuda.device(device):
        flops = {str(dtype).removeprefix("torch."): _matmul_flops_per_second(device, dtype, n)
                 for dtype, n in MATMUL_SIZES.items()}
        return DeviceProfile(
            name=f"measured:{cuda_device_name(device)}",
            flops_per_second=flops,
            memory_bandwidth=_device_copy_bandwidth(device),
            d2h_bandwidth=_pinned_copy_bandwidth(device, "d2h"),
            h2d_bandwidth=_pinned_copy_bandwidth(device, "h2d"),
            launch_overhead_seconds=_launch_seconds(device),
        )


def _seconds_per_call(fn: Callable[[], object], iterations: int, warmup: int = 2) -> float:
    """GPU time of one ``fn()`` call, averaged over ``iterations`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iterations


def _matmul_flops_per_second(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    # Enough calls for ~10 ms at the expected rate, without running long on slow dtypes.
    iterations = 20 if dtype in (torch.bfloat16, torch.float16) else 5
    seconds = _seconds_per_call(lambda: torch.mm(a, b, out=out), iterations, warmup=1)
    return 2 * n**3 / seconds


def _device_copy_bandwidth(device: torch.device) -> float:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _seconds_per_call(lambda: dst.copy_(src), iterations=10)
    return 2 * COPY_BYTES / seconds  # a copy reads and writes every byte


def _pinned_copy_bandwidth(device: torch.device, direction: str) -> float:
    gpu = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    src, dst = (gpu, host) if direction == "d2h" else (host, gpu)
    seconds = _seconds_per_call(lambda: dst.copy_(src, non_blocking=True), iterations=5)
    return COPY_BYTES / seconds


def _launch_seconds(device: torch.device) -> float:
    """Time per tiny kernel when launched back to back: the launch-bound floor of one op."""
    x = torch.zeros(1, device=device)
    return _seconds_per_call(lambda: x.add_(1), iterations=LAUNCHES, warmup=10)


__all__ = [
    "builtin_profile",
    "cache_dir",
    "cache_path",
    "cached_measured_profile",
    "cuda_device_name",
    "measure_device_profile",
    "read_cached_profile",
    "resolve_profile",
    "write_cached_profile",
]
