"""Validate ``compile_offload.config`` once, at the top of a compile, into plain values.

The budget travels as bytes (or as a fraction to be turned into bytes once the
unconstrained plan is known) from here on; nothing downstream reads the config module.
"""

from __future__ import annotations

import difflib
import logging
import math
import numbers
import os
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import config
from .passes.cost import BUILTIN_PROFILE_MEMORY_BYTES, BUILTIN_PROFILES
from .passes.plan import format_bytes
from .pipeline.fingerprint import torch_config_hash
from .torch_api.utils import ENVIRONMENT_FLAGS

SOLVERS = ("greedy", "refined", "exact")
INNER_COMPILERS = ("inductor", "eager")
BUDGET_SCOPES = ("graph", "step")
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
    plan_time_limit: float | None = None
    verify_budget: bool = False
    measured_plan_choice: bool = False
    measured_plan_steps: int = 3
    budget_scope: str = "graph"
    shared_h2d_bytes: int = 0
    # Not a knob: the budget loop's compile of the other start's lowest plan, where the budget is
    # below the minimum (``passes.solve.joint.lowest_solution``; None: the model's choice).
    lowest_start: str | None = None
    # Not a knob: measured plan choice's compile of torch's own plan, the saved set torch's
    # partitioner chooses under activation_memory_budget=torch_fraction (``passes.solve.torch_plan``).
    torch_fraction: float | None = None
    # Not a knob: a dynamic graph's size symbols planned at a size other than their hint, by
    # name: sizes its frame was compiled at (``pipeline/dynamic_check.plan_at_largest_sizes``).
    planning_sizes: tuple[tuple[str, int], ...] = ()
    # Not a knob: other sizes its frame was compiled at, none covered by those planned for, at
    # which the plan's predicted peak is checked (``pipeline/dynamic_check.sizes_covering_all``).
    sizes_to_cover: tuple[tuple[tuple[str, int], ...], ...] = ()
    # Not a knob: torch's functorch and Inductor config as the compile began
    # (``pipeline/fingerprint.torch_config_hash``). torch's partitioner and the memory model
    # read it, so it keys the plan cache and the graph records, as it keys AOTAutograd's cache.
    torch_config: str = ""

    @property
    def has_budget(self) -> bool:
        """A memory budget, in bytes or as a fraction: the planner acts, and Inductor compiles
        the graphs so that its code keeps the plan (``inductor_compile.inductor_config_patches``)."""
        return self.budget_bytes is not None or self.budget_fraction is not None

    def describe_budget(self) -> str:
        if self.budget_bytes is not None:
            return format_bytes(self.budget_bytes)
        if self.budget_fraction is not None:
            return f"{self.budget_fraction:g} of the unconstrained activations"
        return "none"


def parse_bytes(value: object, knob: str, label: str | None = None, accepted: str | None = None) -> int:
    """Parse a byte count: an int, or a string such as ``"512MiB"``, ``"6GB"``, ``"1.5 GiB"``.
    Errors name ``label`` (default ``compile_offload.config.<knob>``) and list what ``knob``
    accepts (a budget also takes a fraction; other sizes do not), or ``accepted``."""
    accepted = accepted or (_ACCEPTED_BUDGET if knob == "memory_budget" else _ACCEPTED_SIZE)
    name = label or f"compile_offload.config.{knob}"
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: a bool is not a size; accepted: {accepted}")
    if isinstance(value, numbers.Integral):  # NumPy's integers too
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}={value!r} is negative; accepted: {accepted}")
        return value
    if isinstance(value, str):
        if value.strip().startswith("-"):
            raise ValueError(f"{name}={value!r} is negative; accepted: {accepted}")
        match = _SIZE.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size (unknown unit or syntax); "
                f"accepted units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; accepted: {accepted}"
            )
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
        if not math.isfinite(number):
            raise ValueError(f"{name}={value!r} is too large to be a number of bytes; accepted: {accepted}")
        if _UNITS[match.group(2).lower()] == 1 and not number.is_integer():
            raise ValueError(f"{name}={value!r} is not a whole number of bytes; accepted: {accepted}")
        return int(number)
    raise TypeError(f"{name}={value!r} has type {type(value).__name__}; accepted: {accepted}")


# COMPILE_OFFLOAD_ variables that are no knob: the tests' and the benchmarks' own.
_TOOL_VARIABLES = frozenset({"COMPILE_OFFLOAD_FUZZ_DEVICE", "COMPILE_OFFLOAD_BENCH_TRACEBACK"})


def warn_unknown_environment() -> None:
    """A ``COMPILE_OFFLOAD_`` variable that names no knob (a typo) would be ignored: one
    warning per such variable, when ``compile_offload`` is imported."""
    import difflib

    known = {f"COMPILE_OFFLOAD_{knob.upper()}" for knob in config.get_config_copy()}
    for name in sorted(n for n in os.environ if n.startswith("COMPILE_OFFLOAD_") and n not in known | _TOOL_VARIABLES):
        # by the upper-case name: COMPILE_OFFLOAD_memory_budget is closest to ..._DUMP_DIR as written
        close = difflib.get_close_matches(name.upper(), sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.warn(f"compile_offload: the environment variable {name} names no knob and is ignored{hint} "
                      "(the knobs: docs/reference.md)", stacklevel=3)


def _from_environment(knob: str) -> bool:
    """Whether the knob's value is the environment's, not set in code (a private detail
    of torch's config module, read only here)."""
    from contextvars import ContextVar

    from .torch_api.utils import UNSET_SENTINEL as _UNSET_SENTINEL

    override = config._config[knob].user_override
    if isinstance(override, ContextVar):  # torch >= 2.12 keeps overrides per thread/context
        override = override.get()
    # An assignment is process-wide (process_config.py), kept outside torch's entry.
    return override is _UNSET_SENTINEL and knob not in getattr(config, "_process_values", {})


def parse_budget(value: object,
                 label: str = "compile_offload.config.memory_budget") -> tuple[int | None, float | None]:
    """``memory_budget`` -> ``(bytes, None)``, ``(None, fraction)`` or ``(None, None)``. From the
    environment it is a string, "0" and "1" included (``config.keep_environment_strings``).
    Errors name ``label`` (``sweep`` names the entry of its list)."""
    if value is None:
        return None, None
    if isinstance(value, bool):
        raise TypeError(f"{label}={value!r}: a bool is not a budget; accepted: {_ACCEPTED_BUDGET}")
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):  # NumPy's float32 too
        value = float(value)
    if isinstance(value, float):
        if math.isnan(value) or value < 0.0 or value > 1.0:
            raise ValueError(
                f"{label}={value!r}: a float budget is a fraction and must lie in "
                f"[0, 1]; for bytes pass an int or a string with units. Accepted: {_ACCEPTED_BUDGET}"
            )
        return None, value
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.lower() == "none":
            return None, None
        if not stripped:
            raise ValueError(f"{label}={value!r} is empty; use None (or leave "
                             f"COMPILE_OFFLOAD_MEMORY_BUDGET unset) for no budget; accepted: {_ACCEPTED_BUDGET}")
        # A plain decimal string (as the environment gives): "0.5" is a fraction, "1000" bytes.
        if re.fullmatch(r"[0-9]*\.[0-9]+|[0-9]+\.", stripped):
            if float(stripped) > 1.0:  # named as written, not as the float it reads as
                raise ValueError(
                    f"{label}={value!r}: a decimal budget is a fraction and must lie in "
                    f"[0, 1]; for bytes give a whole number or a size with units. Accepted: {_ACCEPTED_BUDGET}")
            return parse_budget(float(stripped), label)
        # Exponent notation without a unit: "1e-3" is the fraction 0.001 as "0.001" is,
        # "1e9" is bytes; nothing in between is either.
        if re.fullmatch(r"[0-9]*\.?[0-9]+[eE][+-]?[0-9]+", stripped):
            number = float(stripped)
            if number <= 1.0:
                return parse_budget(number, label)
            if not math.isfinite(number):
                raise ValueError(f"{label}={value!r} is too large to be a number of "
                                 f"bytes; accepted: {_ACCEPTED_BUDGET}")
            if not number.is_integer():
                raise ValueError(
                    f"{label}={value!r} is neither a fraction in [0, 1] nor a whole "
                    f"number of bytes; accepted: {_ACCEPTED_BUDGET}"
                )
    return parse_bytes(value, "memory_budget", label=label), None


def _choice(knob: str, value: object, accepted: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"compile_offload.config.{knob}={value!r} has type {type(value).__name__}; accepted: {', '.join(accepted)}")
    if value not in accepted:
        raise ValueError(f"compile_offload.config.{knob}={value!r} is unknown; accepted: {', '.join(accepted)}")
    return value


def _flag(knob: str, value: object, from_environment: bool = False) -> bool:
    if isinstance(value, str) and from_environment:
        # torch's config module turns only "0"/"1" into bools; "false", "True", "off" stay strings.
        word = value.strip().lower()
        if word in ENVIRONMENT_FLAGS:
            return ENVIRONMENT_FLAGS[word]
        raise ValueError(f"COMPILE_OFFLOAD_{knob.upper()}={value!r} (compile_offload.config.{knob}) is not a flag; "
                         f"accepted: {', '.join(ENVIRONMENT_FLAGS)}")
    if not isinstance(value, bool):
        raise TypeError(f"compile_offload.config.{knob}={value!r} has type {type(value).__name__}; accepted: True or False")
    return value


def parse_time_limit(value: object) -> float | None:
    """``plan_time_limit``: None, or seconds >= 0 (an int, a float, or a number string from
    the environment)."""
    accepted = "None or a number of seconds >= 0 (such as 30 or 2.5)"
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():  # as for memory_budget: an empty value would silently mean no limit
            raise ValueError(f"compile_offload.config.plan_time_limit={value!r} is empty; use None (or leave "
                             f"COMPILE_OFFLOAD_PLAN_TIME_LIMIT unset) for no limit; accepted: {accepted}")
        if value.strip().lower() == "none":
            return None
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"compile_offload.config.plan_time_limit={value!r} is not a number; accepted: {accepted}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"compile_offload.config.plan_time_limit={value!r} has type {type(value).__name__}; "
                        f"accepted: {accepted}")
    try:
        seconds = float(value)
    except OverflowError:  # an int past a float's range (10**400): no limit a float can hold
        raise ValueError(f"compile_offload.config.plan_time_limit={value!r} is too large; accepted: {accepted} "
                         "(None for no limit)") from None
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"compile_offload.config.plan_time_limit={value!r}: accepted: {accepted}")
    return seconds


def check_option_names(options: dict, other_names: Iterable[str] = ()) -> None:
    """Reject unknown option names (``torch.compile(options=...)``) instead of ignoring them.
    ``other_names``: names accepted elsewhere (Inductor's options), offered as corrections too."""
    known = set(config.get_config_copy())
    unknown = sorted(set(options) - known, key=str)
    if unknown:
        names = sorted(known | set(other_names))
        close = {name: difflib.get_close_matches(name, names, n=1) for name in unknown if isinstance(name, str)}
        hints = "; ".join(f"{name!r}: did you mean {match[0]!r}?" for name, match in close.items() if match)
        elsewhere = " (and Inductor's options, torch._inductor.config)" if other_names else ""
        raise ValueError(f"compile_offload: unknown option(s) {unknown}{f' ({hints})' if hints else ''}; "
                         f"known options: {', '.join(sorted(known))}{elsewhere}")


# What was already said about torch's activation_memory_budget (said once per value pair).
_TORCH_BUDGET_ANNOUNCED: set[tuple] = set()


def torch_activation_budget() -> float | None:
    """``torch._functorch.config.activation_memory_budget`` when it asks for less than all
    activations (a float in [0, 1)); None when it is 1.0 (torch's default) or unusable."""
    from .torch_api.functorch import config as functorch_config

    value = getattr(functorch_config, "activation_memory_budget", 1.0)
    if not _usable_torch_budget(value):
        if ("unusable", repr(value)) not in _TORCH_BUDGET_ANNOUNCED:
            _TORCH_BUDGET_ANNOUNCED.add(("unusable", repr(value)))
            warnings.warn(f"compile_offload: torch._functorch.config.activation_memory_budget={value!r} is not a "
                          "fraction in [0, 1]: ignored (no budget from it)", stacklevel=4)
        return None
    return float(value) if value < 1.0 else None  # 1.0 and above: torch saves every activation


_CONFIGURED = object()


def torch_budget_taken(memory_budget: Any = _CONFIGURED) -> float | None:
    """The fraction a compile now takes from torch's ``activation_memory_budget``: None where
    ``memory_budget`` (default: the config's) is set (ours wins; a value it refuses counts as
    set) or torch's value asks for no budget. Said nothing of: the config guard reads it at
    every call."""
    from .torch_api.functorch import config as functorch_config

    try:
        ours = SPELLED_KNOBS["memory_budget"](config.memory_budget if memory_budget is _CONFIGURED else memory_budget)
    except (TypeError, ValueError):
        return None
    value = getattr(functorch_config, "activation_memory_budget", 1.0)
    if ours != (None, None) or not _usable_torch_budget(value) or value >= 1.0:
        return None
    return float(value)


def _usable_torch_budget(value: object) -> bool:
    return not (isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or value < 0.0)


def _with_torch_budget(budget_bytes: int | None, budget_fraction: float | None) -> float | None:
    """The fraction budget, taking torch's ``activation_memory_budget`` when ours is unset.

    Our backend replaces torch's partitioner, which is what reads torch's knob: without
    this, a user's ``activation_memory_budget = 0.5`` would vanish silently. It measures the
    same thing as our fraction (the share of the activations the unconstrained plan saves),
    so it is used as is, and said once in the log. When both are set ours wins, with one
    warning if they differ."""
    theirs = torch_activation_budget()
    if theirs is None:
        return budget_fraction
    ours = budget_fraction if budget_fraction is not None else budget_bytes
    key = (ours, theirs)
    first_time = key not in _TORCH_BUDGET_ANNOUNCED
    _TORCH_BUDGET_ANNOUNCED.add(key)
    if ours is None:
        if first_time:
            logging.getLogger("compile_offload").info(
                "compile_offload: using torch._functorch.config.activation_memory_budget=%g as the memory budget "
                "(compile_offload.config.memory_budget is None; the same fraction of the activations)", theirs)
        return theirs
    if first_time and ours != theirs:
        described = f"{ours:g} (a fraction)" if budget_fraction is not None else format_bytes(budget_bytes)
        warnings.warn(
            f"compile_offload: torch._functorch.config.activation_memory_budget={theirs:g} is ignored: "
            f"compile_offload.config.memory_budget={described} is set and wins (set one of them)",
            stacklevel=4,
        )
    return budget_fraction


def _says_none(value: object) -> bool:
    """``"none"`` in any case: None, as the environment spells it (every knob whose value may be
    None reads it so; a budget's "none" is no budget, set, as in code)."""
    return isinstance(value, str) and value.strip().lower() == "none"


def _folder(knob: str, folder: object) -> str | None:
    """A folder knob: None, or a path that is (or can be made) a writable folder, a leading
    ``~`` expanded to the home folder. An empty
    path would silently mean the current folder; a file, or a folder that cannot be created
    or written, would fail in the middle of a compile. The dump asked for is an error; the
    plan cache only saves time, so for it a warning, and the plan cache writes nothing."""
    if folder is None or _says_none(folder):
        return None
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"compile_offload.config.{knob}={folder!r}: accepted: None or a folder path")
    path = os.path.expanduser(os.fspath(folder))  # "~/dumps" is the home folder's, as in a shell
    if not path.strip():
        raise ValueError(f"compile_offload.config.{knob}={folder!r} is an empty path; use None for no "
                         f"{'dump' if knob == 'dump_dir' else 'plan cache'}, or name a folder ('.' for this one)")
    problem = folder_problem(path)
    if problem is None:
        return path
    message = f"compile_offload.config.{knob}={path!r}: {problem}"
    if knob == "dump_dir":
        raise ValueError(message + "; name a folder that can be written, or None for no dump")
    import warnings

    warnings.warn(message + "; plans will not be cached", stacklevel=3)
    return None


def folder_problem(path: str) -> str | None:
    """Why ``path`` cannot be used as a folder to write into, or None when it can. The
    folder is created if missing (as the first write would) and a file is created and
    removed in it: permission bits do not tell (root, read-only mounts, /proc)."""
    import tempfile

    if os.path.exists(path) and not os.path.isdir(path):
        return "it is a file, not a folder"
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        where = f" ({error.filename!r})" if error.filename and error.filename != path else ""
        return f"cannot write into it: {reason}{where}"
    return None


def _positive_int(knob: str, value: object) -> int:
    if isinstance(value, str) and value.strip().isdigit():  # from the environment
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"compile_offload.config.{knob}={value!r}: accepted: a positive int")
    return value


def _device_profile(value: object) -> str | None:
    """"H100" is "h100", as ``device_profile.builtin_profile`` reads it."""
    if value is None or _says_none(value):
        return None
    if isinstance(value, str) and value.strip().lower() in PROFILE_NAMES:
        return value.strip().lower()
    return _choice("device_profile", value, PROFILE_NAMES)  # refused, naming the value as given


# The knobs with several spellings of one value, each with the reader that turns a spelling
# into that value (raising TypeError or ValueError for what is not one). ``resolve`` reads
# them so, and so does the guard that recompiles a graph when a knob changes (config_guard):
# ``0.5`` and ``"0.5"``, ``"1MiB"`` and ``1048576`` are one value to both.
SPELLED_KNOBS: dict[str, Callable[[object], Any]] = {
    "memory_budget": parse_budget,
    "plan_time_limit": parse_time_limit,
    "pinned_pool_limit": lambda value: None if value is None or _says_none(value) else parse_bytes(
        value, "pinned_pool_limit"),
    "shared_h2d_bytes": lambda value: parse_bytes(
        value, "shared_h2d_bytes", accepted="an int number of bytes (0: none), or a string with units such as '512MiB'"),
    "device_profile": _device_profile,
}


def resolve(overrides: dict | None = None) -> Settings:
    """Read ``compile_offload.config`` (with ``overrides`` on top) and validate every knob."""
    values = config.get_config_copy()
    if overrides:
        check_option_names(overrides)
        values.update(overrides)

    def from_environment(knob: str) -> bool:
        return not (overrides and knob in overrides) and _from_environment(knob)

    try:
        settings = _validated(values, from_environment)
    except (TypeError, ValueError) as error:
        raise _naming_the_variable(error, from_environment) from None
    if settings.debug_force_offload and not settings.offload:
        raise ValueError("compile_offload.config.debug_force_offload=True needs offload=True: with offload=False "
                         "nothing may be offloaded, so the forced offload would be dropped")
    return settings


def _naming_the_variable(error: Exception, from_environment: Callable[[str], bool]) -> Exception:
    """``error`` about ``compile_offload.config.<knob>``, led by the environment variable
    that set the knob (the user set the variable, not the knob in code)."""
    named = re.match(r"compile_offload\.config\.(\w+)", str(error))
    if named is None or named[1] not in config._config or not from_environment(named[1]):
        return error
    variable = f"COMPILE_OFFLOAD_{named[1].upper()}"
    return type(error)(f"{variable}={os.environ.get(variable)!r} (the environment): {error}")


def _validated(values: dict, from_environment: Callable[[str], bool]) -> Settings:
    read = {knob: reader(values[knob]) for knob, reader in SPELLED_KNOBS.items()}
    budget_bytes, budget_fraction = read["memory_budget"]
    budget_fraction = _with_torch_budget(budget_bytes, budget_fraction)
    if budget_fraction == 1.0:  # every activation torch.compile saves: no limit (torch's knob at 1.0 is off too)
        budget_fraction = None
    folders = {knob: _folder(knob, values[knob]) for knob in ("dump_dir", "plan_cache_dir")}
    exact_max = _positive_int("exact_max_candidates", values["exact_max_candidates"])
    return Settings(
        plan_time_limit=read["plan_time_limit"],
        budget_bytes=budget_bytes,
        budget_fraction=budget_fraction,
        strict_budget=_flag("strict_budget", values["strict_budget"], from_environment("strict_budget")),
        offload=_flag("offload", values["offload"], from_environment("offload")),
        prefetch=_flag("prefetch", values["prefetch"], from_environment("prefetch")),
        debug_force_offload=_flag("debug_force_offload", values["debug_force_offload"], from_environment("debug_force_offload")),
        solver=_choice("solver", values["solver"], SOLVERS),
        exact_max_candidates=exact_max,
        dump_dir=folders["dump_dir"],
        plan_cache_dir=folders["plan_cache_dir"],
        device_profile=read["device_profile"],
        inner_compiler=_choice("inner_compiler", values["inner_compiler"], INNER_COMPILERS),
        pinned_pool_limit=read["pinned_pool_limit"],
        suppress_errors=_flag("suppress_errors", values["suppress_errors"], from_environment("suppress_errors")),
        verify_budget=_flag("verify_budget", values["verify_budget"], from_environment("verify_budget")),
        measured_plan_choice=_flag("measured_plan_choice", values["measured_plan_choice"],
                                   from_environment("measured_plan_choice")),
        measured_plan_steps=_positive_int("measured_plan_steps", values["measured_plan_steps"]),
        budget_scope=_choice("budget_scope", values["budget_scope"], BUDGET_SCOPES),
        shared_h2d_bytes=read["shared_h2d_bytes"],
        torch_config=torch_config_hash(),
    )


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
