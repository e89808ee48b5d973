"""``max_batch``: the largest batch whose planned step fits a memory budget.

The search asks the planner (``compile_offload.explain``), not the device: each probe
plans the step at one batch size, on ``meta``-device tensors when the model can be built
there, so batches far beyond the device's memory cost nothing to try. The budget means
what ``compile_offload.config.memory_budget`` means: peak memory one forward+backward
allocates above what was allocated before it (parameters, gradients and optimizer state
are outside it).
"""

from __future__ import annotations

import inspect
import numbers
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..passes.plan import format_bytes
from ..settings import parse_bytes
from ..torch_api import dynamo

# Without an upper bound the doubling phase stops here, so a planner that finds every
# batch feasible cannot loop forever.
DEFAULT_HIGH = 1 << 16


@dataclass
class Probe:
    batch: int
    predicted_peak_bytes: int
    predicted_step_seconds: float
    fits: bool


@dataclass
class MaxBatch:
    """The answer of ``max_batch``. ``batch`` is None when even ``low`` does not fit."""

    batch: int | None
    budget_bytes: int
    predicted_peak_bytes: int | None
    predicted_step_seconds: float | None
    planned_on: str  # the device the probes were planned on ("meta" when possible)
    measured_step_seconds: float | None = None  # with measure
    measured_peak_bytes: int | None = None  # with measure: the allocator's peak of one step (measure_peak)
    measure_error: str | None = None
    probes: list[Probe] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def largest_fitting(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest ``b`` in ``[low, high]`` with ``fits(b)``, assuming ``fits`` is monotone
    (true up to some batch, false after): doubles from ``low`` until a batch does not fit,
    then bisects. None when ``low`` does not fit."""
    if low < 1 or high < low:
        raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
    if not fits(low):
        return None
    good = low
    bad = None
    while bad is None:
        candidate = min(2 * good, high)
        if candidate == good:
            return good
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def _explain() -> Callable:
    """explain_all: every graph's plan (graph breaks), where explain gives the largest one's.
    Looked up on the package at each call, so tests can stand in for it."""
    import compile_offload

    return compile_offload.explain_all


def _plans(result: Any) -> list:
    if isinstance(result, (list, tuple)):
        return list(result)
    plans = getattr(result, "plans", None)
    return list(plans) if plans is not None else [result]


class FactoryError(TypeError):
    """What ``factory`` returned is not ``(model, inputs)`` or ``(model, inputs, loss_fn)``:
    raised as is, not taken for a model that cannot be built on meta."""


class NotPlanned(ValueError):
    """A probe's graph was partitioned by torch, not planned: no batch can be judged. Raised
    as is, not taken for a model that cannot be planned on meta."""


def _built(factory: Callable, batch: int, device: str) -> tuple[Callable, Any, Callable | None]:
    """``factory(batch, device)`` as ``(model, inputs, loss_fn)``, checked."""
    built = factory(batch, device)
    if not (isinstance(built, (tuple, list)) and len(built) in (2, 3)):
        what = (f"{len(built)} values" if isinstance(built, (tuple, list))
                else f"a value of type {type(built).__name__}")
        raise FactoryError(f"max_batch: factory({batch}, {device!r}) returned {what}; it must return (model, inputs) "
                           "or (model, inputs, loss_fn), with inputs a tuple of positional inputs, a dict of keyword "
                           "inputs or one tensor")
    model, inputs, loss_fn = built[0], built[1], built[2] if len(built) == 3 else None
    if not callable(model):
        raise FactoryError(f"max_batch: factory({batch}, {device!r}) returned a model of type {type(model).__name__}, "
                           "which cannot be called; return (model, inputs) with model an nn.Module or a function")
    if loss_fn is not None and not callable(loss_fn):
        raise FactoryError(f"max_batch: factory({batch}, {device!r}) returned a loss_fn of type "
                           f"{type(loss_fn).__name__}, which cannot be called; return (model, inputs, loss_fn) with "
                           "loss_fn(output) a scalar tensor, or (model, inputs)")
    return model, inputs, loss_fn


def _plan_batch(factory: Callable, batch: int, device: str, budget_bytes: int, options: dict) -> Probe:
    from .explain import positional_call

    model, inputs, loss_fn = _built(factory, batch, device)
    model, args = positional_call(model, inputs)
    if loss_fn is not None:  # the step the answer trains: the loss's memory (a vocabulary's logits) is in it
        module = model

        def model(*call_args):
            return loss_fn(module(*call_args))
    with warnings.catch_warnings():  # a batch over the budget is an answer of the search, not the user's mistake
        warnings.filterwarnings("ignore", message=r".*is below the minimum this planner can reach")
        plans = _plans(_explain()(model, *args, memory_budget=budget_bytes, **options))
    dynamo.reset()
    unplanned = [p for p in plans if getattr(p, "fallback", None) is not None]
    if unplanned:  # torch partitioned it: no prediction (its peaks read 0), so no batch can be judged
        raise NotPlanned(f"max_batch: at batch {batch} {unplanned[0].graph_name} is not planned (torch's partition "
                         f"runs: {unplanned[0].fallback}), so its memory cannot be predicted and no batch can be "
                         "judged against the budget; measure batches with measure_peak instead")
    peak = sum(p.predicted_peak_bytes for p in plans)  # graphs' saved tensors add up
    seconds = sum(p.predicted_step_seconds for p in plans)
    return Probe(batch, peak, seconds, fits=peak <= budget_bytes)


def max_batch(
    factory: Callable[[int, str], Sequence[Any]],
    budget: int | str,
    *,
    low: int = 1,
    high: int | None = None,
    device_profile: str | None = None,
    device: str | torch.device | None = None,
    measure: bool | None = None,
    steps: int = 5,
    warmup: int = 2,
) -> MaxBatch:
    """The largest batch in ``[low, high]`` whose planned step fits ``budget``.

    ``factory(batch, device)`` returns ``(model, example_inputs)`` or
    ``(model, example_inputs, loss_fn)`` built on ``device``; the inputs are a tuple of
    positional inputs, a dict of keyword inputs or one tensor. Probes plan on ``"meta"``
    first and fall back to ``device`` (default: CUDA when available, else CPU) when
    planning on meta fails. ``budget`` is bytes: an int or a string such as ``"6GiB"``.

    When ``measure`` is true (default: when ``device`` is CUDA and this machine has it), the
    answer is also built on ``device``, compiled with ``offload_remat`` at the budget and
    timed over ``steps`` steps after ``warmup``, giving the measured step time, and the peak
    one more step allocates above its start, at the allocator (``measure_peak``).
    """
    if budget is None or isinstance(budget, float):
        raise TypeError(
            f"max_batch(budget={budget!r}): the budget is a number of bytes (an int, or a string such as '6GiB'); "
            "a fraction or None cannot bound a batch: both are relative to the batch being tried"
        )
    budget_bytes = parse_bytes(budget, "budget", label="max_batch(budget)",
                               accepted="an int number of bytes, or a string with units such as '512MiB' or '6GiB'")
    _check_factory(factory)
    if not _whole(low) or low < 1 or (high is not None and (not _whole(high) or high < low)):
        raise ValueError(f"max_batch(low={low!r}, high={high!r}): the batches tried are whole numbers with "
                         "1 <= low <= high (or high=None)")
    low, high = int(low), None if high is None else int(high)
    if measure is not False and (not _whole(steps) or steps < 1 or not _whole(warmup) or warmup < 0):
        raise ValueError(f"max_batch(steps={steps!r}, warmup={warmup!r}): the measure times steps >= 1 steps "
                         "after warmup >= 0")
    device = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        missing = _not_here(torch.device(device))
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"max_batch(device={device!r}) is not a device ({error}); accepted: 'cuda', 'cuda:N', "
                         "'cpu', a torch.device, or None for CUDA when available, else the CPU") from None
    if measure and missing:
        raise ValueError(f"max_batch(measure=True, device={device!r}): {missing}, so nothing can be measured there; "
                         "leave measure unset to plan only")
    options = {} if device_profile is None else {"device_profile": device_profile}
    probes: dict[int, Probe] = {}
    planned_on = ["meta"]

    def fits(batch: int) -> bool:
        if batch not in probes:
            probes[batch] = _probe(batch)
        return probes[batch].fits

    def _probe(batch: int) -> Probe:
        if planned_on[0] == "meta":
            try:
                return _plan_batch(factory, batch, "meta", budget_bytes, options)
            except (FactoryError, NotPlanned):
                raise
            except Exception as error:  # a model or op without meta support: plan on the device
                if missing:
                    raise ValueError(f"max_batch: planning batch {batch} on meta failed ({type(error).__name__}: "
                                     f"{error}), and device={device!r} to plan on instead cannot be used: "
                                     f"{missing}") from error
                planned_on[0] = device
        return _plan_batch(factory, batch, device, budget_bytes, options)

    batch = largest_fitting(fits, low, high if high is not None else max(low, DEFAULT_HIGH))
    best = probes.get(batch) if batch is not None else None
    result = MaxBatch(
        batch=batch,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=best.predicted_peak_bytes if best else None,
        predicted_step_seconds=best.predicted_step_seconds if best else None,
        planned_on=planned_on[0],
        probes=[probes[b] for b in sorted(probes)],
    )
    if batch is None:
        first = probes[low]
        result.notes.append(f"no batch fits: batch {low} (low) is planned to peak at "
                            f"{format_bytes(first.predicted_peak_bytes)}, above the budget of {format_bytes(budget_bytes)}; "
                            "raise the budget or lower low")
    if high is None and batch == DEFAULT_HIGH:
        result.notes.append(f"the search stopped at batch {DEFAULT_HIGH}, where high=None stops it; pass high= "
                            "to search beyond")
    if result.planned_on == "meta" and device_profile is None and torch.device(device).type == "cuda":
        # explain cannot tell which device meta tensors stand for.
        result.notes.append("planned on meta without device_profile: explain's default profile for meta tensors, "
                            "not necessarily the target GPU's; pass device_profile to plan for it")
    if measure is None:
        measure = torch.device(device).type == "cuda" and not missing
        if missing and torch.device(device).type == "cuda":
            result.notes.append(f"not measured: {missing}")
    if measure and batch is not None:
        try:
            result.measured_step_seconds, result.measured_peak_bytes = _measure(
                factory, batch, device, budget_bytes, options, steps, warmup
            )
        except Exception as error:  # report the plan even when the run fails
            result.measure_error = f"{type(error).__name__}: {str(error)[:300]}"
        finally:
            dynamo.reset()
    return result


def _not_here(device: torch.device) -> str | None:
    """Why tensors with values cannot be made on ``device`` in this process, or None."""
    if device.type == "meta":
        return "meta tensors hold no values"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "this machine has no CUDA device (torch.cuda.is_available() is False)"
    return None


def _whole(value: Any) -> bool:
    """A whole number (a numpy integer too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_factory(factory: Any) -> None:
    """``factory`` is called as ``factory(batch, device)``."""
    accepted = "pass a function factory(batch, device) that returns (model, inputs) or (model, inputs, loss_fn)"
    if not callable(factory):
        raise TypeError(f"max_batch(factory=...): got a {type(factory).__name__}, which cannot be called; {accepted}")
    try:
        inspect.signature(factory).bind(1, "meta")
    except TypeError as error:
        raise TypeError(f"max_batch(factory=...): {getattr(factory, '__name__', factory)!r} cannot be called as "
                        f"factory(batch, device) ({error}); {accepted}") from None
    except ValueError:  # no signature to read (a builtin): call it and see
        pass


def _measure(factory, batch, device, budget_bytes, options, steps, warmup) -> tuple[float, int]:
    """Median seconds per step of the compiled step at ``batch``, and the peak bytes one
    more step allocates above its start, at the allocator (``measure_peak``: timing and
    measuring are separate steps because the CPU measure profiles, which adds time)."""
    from ..pipeline.backend import offload_remat
    from ..runtime.memory_tracker import measure_peak

    model, inputs, loss_fn = _built(factory, batch, device)
    loss_fn = loss_fn or (lambda out: out.float().sum())
    compiled = torch.compile(model, backend=offload_remat(memory_budget=budget_bytes, **options))
    on_cuda = torch.device(device).type == "cuda"
    if isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    else:
        args, kwargs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), {}

    def step() -> None:
        loss_fn(compiled(*args, **kwargs)).backward()

    for _ in range(1 + warmup):  # the first call compiles
        step()
    times = []
    for _ in range(steps):
        if on_cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if on_cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    with measure_peak(device) as measured:
        step()
    return statistics.median(times), measured.peak_bytes
