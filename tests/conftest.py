"""Shared pytest set-up: CUDA skipping, a clean Dynamo per test, deterministic seeds.

Markers (declared in pyproject.toml): ``cuda`` tests skip cleanly on machines without a
CUDA GPU; ``inductor`` and ``slow`` only label tests so they can be deselected
(``-m "not inductor"``).
"""

from __future__ import annotations

import random

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts and ends with empty Dynamo caches, so one test's compiled code,
    guards or recompile counts never leak into the next."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def seeded():
    """Seed Python's and torch's global RNGs, so random inputs and initialisations are the
    same on every run."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def fallback_random():
    """Make compiled graphs call the same aten random ops as eager (Inductor otherwise
    decomposes dropout into its own RNG), so dropout masks match eager under one seed.
    ``tests.models.check_training_parity`` sets this itself; use the fixture for tests
    that compile outside the harness."""
    with torch._inductor.config.patch(fallback_random=True):
        yield


@pytest.fixture
def deterministic_inductor():
    """Inductor's deterministic mode, for tests that compare compiled programs bitwise.
    Without it Inductor may pick among Triton reduction configs by timing them on the device
    at first call, and the configs sum in different orders. It does not make two separately
    compiled programs sum alike: the graph with offload fuses differently from the graph
    without (each copy is a fallback reading a materialised buffer), and on an H200 one
    forward sum of the two differed in its last bit in deterministic mode too (2026-11-27,
    two leases). Race checks therefore compare a program with itself, undelayed
    (``test_ops_cuda.py``), or programs whose kernels coincide
    (``torch._inductor.config.deterministic``, in every torch version we support)."""
    with torch._inductor.config.patch(deterministic=True):
        yield


@pytest.fixture
def captured_plans():
    """The Plan of every graph the offload_remat partitioner partitions during the test,
    in order (``partition_results.partitions``). Inductor's and AOTAutograd's caches are off
    while it lasts: a compile they serve skips the partitioner or compiles nothing after it,
    so the plan captured would not be the one that runs (its scheduled peak unset), and what
    a test saw would depend on what an earlier run left in the cache folder. A test about
    those caches turns them on inside its own block."""
    from .partition_results import partitions

    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), partitions() as found:
        yield found.plans
