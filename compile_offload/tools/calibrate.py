"""Fit a device profile's free constants to measured step times.

The cost model (``passes.cost``) predicts a step as a sum over the kernels it runs of
``max(flops / (c * peak[dtype]), bytes / (m * bandwidth)) + launch``, where ``c`` and
``m`` are the achieved fractions of the datasheet matmul rate and memory bandwidth and
``launch`` the per-kernel overhead. Given plans whose step time was measured, the fit
chooses ``(c, m, launch)`` that make the predictions match, by a deterministic grid
search (the same inputs always give the same constants):

    minimise  sum over rows of log(predicted / measured)^2
              + PRIOR_WEIGHT * sum over constants of log(value / prior value)^2

The prior term only decides between fits that explain the rows equally well: with fewer
rows than constants (two anchor shapes, three constants) many fits are exact, and the one
closest to the prior (70% of the datasheet FLOP rate, 80% of the bandwidth, 4 µs per
launch) is taken. Link bandwidths are not fitted: copies do not appear in the rows the
fit uses, and they were measured directly.

Each row is reduced once to per-kernel terms (``KernelTerms``), so a candidate
constant set costs one vectorised sum, not a re-run of the cost model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..passes.cost import DeviceProfile, compute_dtype, launches_kernel, node_bytes_accessed, node_flops

PRIOR = {"compute": 0.70, "memory": 0.80, "launch": 4e-6}
PRIOR_WEIGHT = 1e-3
# The grid: achieved fractions of the datasheet rates, and launch overheads in seconds.
COMPUTE_GRID = tuple(round(0.40 + 0.005 * i, 3) for i in range(121))  # 0.40 .. 1.00
MEMORY_GRID = tuple(round(0.40 + 0.01 * i, 2) for i in range(61))  # 0.40 .. 1.00
LAUNCH_GRID = tuple(round(1e-6 * v, 9) for v in (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16))


@dataclass(frozen=True)
class KernelTerms:
    """One plan's kernels, reduced to what the fit varies: each kernel's seconds of
    compute at the datasheet rate and seconds of memory traffic at the datasheet
    bandwidth, and how many kernels launch."""

    compute_seconds: tuple[float, ...]
    memory_seconds: tuple[float, ...]
    launches: int


@dataclass(frozen=True)
class FitRow:
    name: str
    terms: KernelTerms
    measured_seconds: float


@dataclass(frozen=True)
class Fit:
    compute_efficiency: float
    memory_efficiency: float
    launch_overhead_seconds: float
    predicted_seconds: dict[str, float]
    measured_seconds: dict[str, float]

    def profile(self, datasheet: DeviceProfile, name: str | None = None) -> DeviceProfile:
        """``datasheet`` (a profile holding datasheet rates) scaled by the fitted fractions."""
        return dataclasses.replace(
            datasheet,
            name=name or datasheet.name,
            flops_per_second={k: v * self.compute_efficiency for k, v in datasheet.flops_per_second.items()},
            memory_bandwidth=datasheet.memory_bandwidth * self.memory_efficiency,
            launch_overhead_seconds=self.launch_overhead_seconds,
        )


def kernel_terms(nodes: Iterable[fx.Node], datasheet: DeviceProfile, runs_kernel=launches_kernel) -> KernelTerms:
    """The terms of the kernels ``nodes`` launch. ``runs_kernel(node)``: whether the node
    costs a kernel of its own (False for pointwise ops Inductor fuses away)."""
    compute, memory, launches = [], [], 0
    for node in nodes:
        if not launches_kernel(node) or not runs_kernel(node):
            continue
        flops = node_flops(node)
        compute.append(flops / datasheet.peak_flops(compute_dtype(node)) if flops else 0.0)
        memory.append(node_bytes_accessed(node) / datasheet.memory_bandwidth)
        launches += 1
    return KernelTerms(tuple(compute), tuple(memory), launches)


def predicted_seconds(terms: KernelTerms, compute_efficiency: float, memory_efficiency: float,
                      launch_overhead_seconds: float) -> float:
    """The cost model's step time for these terms under the given constants."""
    return sum(max(c / compute_efficiency, m / memory_efficiency) for c, m in zip(terms.compute_seconds, terms.memory_seconds)) \
        + terms.launches * launch_overhead_seconds


def fit_constants(rows: Sequence[FitRow], prior: dict[str, float] = PRIOR, weight: float = PRIOR_WEIGHT) -> Fit:
    """The grid point minimising the objective of the module doc (ties: the first in grid
    order, so the result is reproducible)."""
    if not rows:
        raise ValueError("calibration needs at least one measured row")
    for row in rows:
        if not (row.measured_seconds > 0 and math.isfinite(row.measured_seconds)):
            raise ValueError(f"row {row.name!r}: measured time must be positive, got {row.measured_seconds!r}")
    compute_grid = torch.tensor(COMPUTE_GRID, dtype=torch.float64)
    memory_grid = torch.tensor(MEMORY_GRID, dtype=torch.float64)
    launch_grid = torch.tensor(LAUNCH_GRID, dtype=torch.float64)
    objective = torch.zeros(len(COMPUTE_GRID), len(MEMORY_GRID), len(LAUNCH_GRID), dtype=torch.float64)
    predictions = []
    for row in rows:
        c = torch.tensor(row.terms.compute_seconds, dtype=torch.float64)
        m = torch.tensor(row.terms.memory_seconds, dtype=torch.float64)
        # [compute grid, memory grid]: the sum over kernels of the slower side.
        kernels = torch.maximum(c[None, None, :] / compute_grid[:, None, None],
                                m[None, None, :] / memory_grid[None, :, None]).sum(-1)
        seconds = kernels[:, :, None] + row.terms.launches * launch_grid[None, None, :]
        predictions.append(seconds)
        objective += torch.log(seconds / row.measured_seconds) ** 2
    objective += weight * (torch.log(compute_grid / prior["compute"]) ** 2)[:, None, None]
    objective += weight * (torch.log(memory_grid / prior["memory"]) ** 2)[None, :, None]
    # log(0) for a zero launch overhead: measure its distance to the prior in microseconds + 1.
    launch_distance = torch.log((launch_grid * 1e6 + 1) / (prior["launch"] * 1e6 + 1)) ** 2
    objective += weight * launch_distance[None, None, :]
    best = int(torch.argmin(objective.flatten()))
    i, rest = divmod(best, len(MEMORY_GRID) * len(LAUNCH_GRID))
    j, k = divmod(rest, len(LAUNCH_GRID))
    return Fit(
        compute_efficiency=COMPUTE_GRID[i],
        memory_efficiency=MEMORY_GRID[j],
        launch_overhead_seconds=LAUNCH_GRID[k],
        predicted_seconds={row.name: float(p[i, j, k]) for row, p in zip(rows, predictions)},
        measured_seconds={row.name: row.measured_seconds for row in rows},
    )


__all__ = ["Fit", "FitRow", "KernelTerms", "PRIOR", "fit_constants", "kernel_terms", "predicted_seconds"]
