"""The calibration fit (compile_offload/tools/calibrate.py): deterministic, and it recovers known constants."""

from __future__ import annotations

import pytest

from compile_offload.tools.calibrate import COMPUTE_GRID, FitRow, KernelTerms, fit_constants, predicted_seconds
from compile_offload.passes.cost import H100_DATASHEET


def rows_made_with(compute: float, memory: float, launch: float) -> list[FitRow]:
    """Three plans of different make-up (matmul-heavy, bandwidth-heavy, many small kernels)
    whose "measured" times are the model's under the given constants."""
    shapes = {
        "matmuls": KernelTerms((4e-3, 2e-3, 1e-5), (1e-4, 1e-4, 3e-3), 3),
        "streams": KernelTerms((1e-4, 0.0, 0.0), (2e-4, 3e-3, 2e-3), 3),
        "launches": KernelTerms((1e-6,) * 400, (2e-6,) * 400, 400),
    }
    return [FitRow(name, terms, predicted_seconds(terms, compute, memory, launch)) for name, terms in shapes.items()]


def test_fit_recovers_the_constants_that_made_the_rows():
    fit = fit_constants(rows_made_with(0.85, 0.9, 5e-6))
    assert (fit.compute_efficiency, fit.memory_efficiency, fit.launch_overhead_seconds) == (0.85, 0.9, 5e-6)
    for name, seconds in fit.predicted_seconds.items():
        assert seconds == pytest.approx(fit.measured_seconds[name], rel=1e-9)


def test_fit_is_reproducible_and_its_profile_scales_the_datasheet():
    rows = rows_made_with(0.6, 0.75, 3e-6)
    first, second = fit_constants(rows), fit_constants(list(rows))
    assert first == second
    profile = first.profile(H100_DATASHEET, "h100-fitted")
    assert profile.name == "h100-fitted"
    assert profile.peak_flops("bfloat16") == pytest.approx(H100_DATASHEET.peak_flops("bfloat16") * first.compute_efficiency)
    assert profile.memory_bandwidth == pytest.approx(H100_DATASHEET.memory_bandwidth * first.memory_efficiency)
    assert (profile.d2h_bandwidth, profile.h2d_bandwidth) == (H100_DATASHEET.d2h_bandwidth, H100_DATASHEET.h2d_bandwidth)


def test_with_fewer_rows_than_constants_the_fit_nearest_the_prior_wins():
    # One row: every (compute, memory, launch) on a curve explains it; the prior decides.
    terms = KernelTerms((1e-3,), (1e-5,), 1)
    row = FitRow("one", terms, predicted_seconds(terms, 0.70, 0.80, 4e-6))
    fit = fit_constants([row])
    assert (fit.compute_efficiency, fit.memory_efficiency, fit.launch_overhead_seconds) == (0.70, 0.80, 4e-6)
    assert 0.70 in COMPUTE_GRID


def test_fit_rejects_bad_rows():
    with pytest.raises(ValueError, match="at least one"):
        fit_constants([])
    with pytest.raises(ValueError, match="positive"):
        fit_constants([FitRow("bad", KernelTerms((1.0,), (1.0,), 1), 0.0)])
