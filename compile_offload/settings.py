"""Validate ``compile_offload.config`` once, at the top of a compile, into plain values.

The budget travels as bytes (or as a fraction to be turned into bytes once the
unconstrained plan is known) from here on; nothing downstream reads the config module.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from . import config
from .passes.cost import BUILTIN_PROFILE_MEMORY_BYTES, BUILTIN_PROFILES
from .passes.plan import format_bytes

SOLVERS = ("greedy", "exact")
INNER_COMPILERS = ("inductor", "eager")
PROFILE_NAMES = tuple(BUILTIN_PROFILES)

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_ACCEPTED_SIZE = "None, an int number of bytes, or a string with units such as '512MiB', '6GB' or '6GiB'"
_ACCEPTED_BUDGET = _ACCEPTED_SIZE + ", or a float fraction in [0, 1]"


@dataclass(frozen=True)
class Settings:
    """The validated knobs one compile uses (see ``compile_offload.config`` for meanings)."""

    budget_bytes: int | None
    budget_fraction: float | None
    strict_budget: bool
    offload: bool
    prefetch: bool
    debug_force_offload: bool
    solver: str
    exact_max_candidates: int
    dump_dir: str | None
    plan_cache_dir: str | None
    device_profile: str | None
    inner_compiler: str
    pinned_pool_limit: int | None
    suppress_errors: bool = False
    verify_budget: bool = False

    def describe_budget(self) -> str:
        if self.budget_bytes is not None:
            return format_bytes(self.budget_bytes)
        if self.budget_fraction is not None:
            return f"{self.budget_fraction:g} of the unconstrained activations"
        return "none"


def parse_bytes(value: object, knob: str) -> int:
    """Parse a byte count: an int, or a string such as ``"512MiB"``, ``"6GB"``, ``"1.5 GiB"``.
    Errors list what ``knob`` accepts (a budget also takes a fraction; other sizes do not)."""
    accepted = _ACCEPTED_BUDGET if knob == "memory_budget" else _ACCEPTED_SIZE
    if isinstance(value, bool):
        raise TypeError(f"compile_offload.config.{knob}={value!r}: a bool is not a size; accepted: {accepted}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"compile_offload.config.{knob}={value!r} is negative; accepted: {accepted}")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"compile_offload.config.{knob}={value!r} is not a size (unknown unit or syntax); "
                f"accepted units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; accepted: {accepted}"
            )
        number = float(match.group(1))
        return int(number * _UNITS[match.group(2).lower()])
    raise TypeError(f"compile_offload.config.{knob}={value!r} has type {type(value).__name__}; accepted: {accepted}")


def _from_environment(knob: str) -> bool:
    """Whether the knob's value is the environment's, not set in code (a private detail
    of torch's config module, read only here)."""
    from contextvars import ContextVar

    from torch.utils._config_module import _UNSET_SENTINEL

    override = config._config[knob].user_override
    if isinstance(override, ContextVar):  # torch >= 2.12 keeps overrides per thread/context
        override = override.get()
    return override is _UNSET_SENTINEL


def parse_budget(value: object, from_environment: bool = False) -> tuple[int | None, float | None]:
    """``memory_budget`` -> ``(bytes, None)``, ``(None, fraction)`` or ``(None, None)``."""
    if value is None:
        return None, None
    if isinstance(value, bool):
        # torch's config module turns the environment strings "0"/"1" into bools.
        raw = os.environ.get("COMPILE_OFFLOAD_MEMORY_BUDGET")
        if from_environment and raw in ("0", "1"):
            return int(raw), None
        raise TypeError(f"compile_offload.config.memory_budget={value!r}: a bool is not a budget; accepted: {_ACCEPTED_BUDGET}")
    if isinstance(value, float):
        if math.isnan(value) or value < 0.0 or value > 1.0:
            raise ValueError(
                f"compile_offload.config.memory_budget={value!r}: a float budget is a fraction and must lie in "
                f"[0, 1]; for bytes pass an int or a string with units. Accepted: {_ACCEPTED_BUDGET}"
            )
        return None, value
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.lower() in ("none", ""):
            return None, None
        # A plain decimal string from the environment: "0.5" is a fraction, "1000" bytes.
        if re.fullmatch(r"[0-9]*\.[0-9]+|[0-9]+\.", stripped):
            return parse_budget(float(stripped))
    return parse_bytes(value, "memory_budget"), None


def _choice(knob: str, value: object, accepted: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"compile_offload.config.{knob}={value!r} has type {type(value).__name__}; accepted: {', '.join(accepted)}")
    if value not in accepted:
        raise ValueError(f"compile_offload.config.{knob}={value!r} is unknown; accepted: {', '.join(accepted)}")
    return value


def _flag(knob: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"compile_offload.config.{knob}={value!r} has type {type(value).__name__}; accepted: True or False")
    return value


def check_option_names(options: dict) -> None:
    """Reject unknown option names (``torch.compile(options=...)``) instead of ignoring them."""
    known = set(config.get_config_copy())
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"compile_offload: unknown option(s) {unknown}; known options: {', '.join(sorted(known))}")


def resolve(overrides: dict | None = None) -> Settings:
    """Read ``compile_offload.config`` (with ``overrides`` on top) and validate every knob."""
    values = config.get_config_copy()
    if overrides:
        check_option_names(overrides)
        values.update(overrides)
    budget_from_env = not (overrides and "memory_budget" in overrides) and _from_environment("memory_budget")
    budget_bytes, budget_fraction = parse_budget(values["memory_budget"], budget_from_env)
    profile = values["device_profile"]
    if profile is not None:  # "H100" is "h100", as device_profile.builtin_profile reads it
        profile = _choice("device_profile", profile.strip().lower() if isinstance(profile, str) else profile,
                          PROFILE_NAMES)
    folders = {}
    for knob in ("dump_dir", "plan_cache_dir"):
        folder = values[knob]
        if folder is not None and not isinstance(folder, (str, os.PathLike)):
            raise TypeError(f"compile_offload.config.{knob}={folder!r}: accepted: None or a folder path")
        folders[knob] = None if folder is None else os.fspath(folder)
    exact_max = values["exact_max_candidates"]
    if isinstance(exact_max, str) and exact_max.strip().isdigit():  # from the environment
        exact_max = int(exact_max)
    if isinstance(exact_max, bool) or not isinstance(exact_max, int) or exact_max < 1:
        raise ValueError(f"compile_offload.config.exact_max_candidates={exact_max!r}: accepted: a positive int")
    pool_limit = values["pinned_pool_limit"]
    if pool_limit is not None:
        pool_limit = parse_bytes(pool_limit, "pinned_pool_limit")
    settings = Settings(
        budget_bytes=budget_bytes,
        budget_fraction=budget_fraction,
        strict_budget=_flag("strict_budget", values["strict_budget"]),
        offload=_flag("offload", values["offload"]),
        prefetch=_flag("prefetch", values["prefetch"]),
        debug_force_offload=_flag("debug_force_offload", values["debug_force_offload"]),
        solver=_choice("solver", values["solver"], SOLVERS),
        exact_max_candidates=exact_max,
        dump_dir=folders["dump_dir"],
        plan_cache_dir=folders["plan_cache_dir"],
        device_profile=profile,
        inner_compiler=_choice("inner_compiler", values["inner_compiler"], INNER_COMPILERS),
        pinned_pool_limit=pool_limit,
        suppress_errors=_flag("suppress_errors", values["suppress_errors"]),
        verify_budget=_flag("verify_budget", values["verify_budget"]),
    )
    return settings


def device_memory(settings: Settings, device) -> tuple[int, str] | None:
    """(bytes, what) of the memory a graph on ``device`` plans within: the CUDA device's
    total memory, else that of the GPU a named profile describes; None when unknown (CPU
    graphs under the ``cpu`` profile or none)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        return properties.total_memory, f"cuda:{index} ({properties.name})"
    if settings.device_profile in BUILTIN_PROFILE_MEMORY_BYTES:
        return BUILTIN_PROFILE_MEMORY_BYTES[settings.device_profile], f"the {settings.device_profile!r} device profile's GPU"
    return None


def check_budget_fits_device(settings: Settings, device) -> None:
    """A byte budget larger than the device's memory is a mistake (a wrong unit, a budget
    meant for another GPU): it could never bind, so nothing the user asked for would be
    enforced. Raise a ``ValueError`` naming both numbers."""
    if settings.budget_bytes is None:
        return
    memory = device_memory(settings, device)
    if memory is not None and settings.budget_bytes > memory[0]:
        raise ValueError(
            f"compile_offload.config.memory_budget={format_bytes(settings.budget_bytes)} is more than the "
            f"{format_bytes(memory[0])} of memory of {memory[1]}; a budget bounds the peak memory of one "
            "compiled step on that device (check the unit: 'GiB', 'MiB'), or use None for no budget"
        )


def warn_if_profile_does_not_match(settings: Settings, device, graph_name: str = "graph") -> None:
    """Compiling for training on a non-CUDA device with a GPU profile: the plan stays
    correct (gradients never depend on the profile) but its time trade-offs, and what an
    offload saves, are the GPU's, not this device's. A warning, not an error: planning for
    a GPU on a CPU-only machine is deliberate in ``explain()`` and in CPU smoke runs of a
    GPU configuration."""
    import warnings

    import torch

    device = torch.device(device)
    if settings.device_profile in BUILTIN_PROFILE_MEMORY_BYTES and device.type not in ("cuda", "meta"):
        warnings.warn(
            f"compile_offload: {graph_name}: device_profile={settings.device_profile!r} describes a GPU but this "
            f"graph runs on {device.type}; the plan is correct but its recompute/offload trade-offs are made for "
            f"that GPU (use device_profile=None or 'cpu' to plan for {device.type})",
            stacklevel=3,
        )
