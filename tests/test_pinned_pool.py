"""The host buffer pool: size classes, reuse, liveness, limit, steady state (CPU buffers)."""

import gc

import pytest
import torch

from compile_offload.pinned_pool import (
    CLASS_STEPS,
    MIN_CLASS_BYTES,
    PinnedHostPool,
    PinnedPoolLimitError,
    size_class,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("nbytes", [1, 511, 512, 513, 4095, 4096, 4097, 5000, 2**20 + 1, 3 * 2**20 + 7, 10**9 + 3])
def test_size_class_covers_request_with_bounded_waste(nbytes):
    cls = size_class(nbytes)
    assert cls >= nbytes
    assert cls >= MIN_CLASS_BYTES
    if nbytes > MIN_CLASS_BYTES * CLASS_STEPS:
        assert cls - nbytes < nbytes / CLASS_STEPS  # less than 12.5% waste, not up to 2x


def test_size_classes_are_monotone_and_few():
    sizes = range(1, 1 << 16, 37)
    classes = [size_class(n) for n in sizes]
    assert classes == sorted(classes)
    # Eight classes per power of two above 4 KiB: 64 KiB of sizes map to few distinct buffers.
    assert len(set(classes)) <= 8 * 4 + 8


def test_acquire_returns_exact_size_and_reuses_after_release():
    pool = PinnedHostPool()
    a = pool.acquire(1000, CPU)
    assert a.dtype == torch.uint8 and a.numel() == 1000 and not a.is_pinned()
    ptr = a.data_ptr()
    del a
    b = pool.acquire(900, CPU)  # same class: the released buffer comes back
    assert b.data_ptr() == ptr
    stats = pool.stats()
    assert stats.host_allocations == 1 and stats.reuses == 1


def test_buffer_is_not_reused_while_any_alias_lives():
    pool = PinnedHostPool()
    a = pool.acquire(4096, CPU)
    alias = a.view(torch.float32).as_strided((16, 8), (1, 16))  # what an op would hand on
    ptr = a.data_ptr()
    del a
    b = pool.acquire(4096, CPU)
    assert b.data_ptr() != ptr  # the alias still reads the first buffer
    alias.fill_(1.0)
    b.fill_(7)
    assert torch.all(alias == 1.0)
    del alias, b
    gc.collect()
    assert pool.stats().buffers_in_use == 0


def test_stats_track_bytes_held_and_in_use():
    pool = PinnedHostPool()
    a = pool.acquire(5000, CPU)
    b = pool.acquire(100, CPU)
    stats = pool.stats()
    assert stats.bytes_held == size_class(5000) + size_class(100)
    assert stats.bytes_in_use == stats.bytes_held and stats.buffers_in_use == 2
    del a
    stats = pool.stats()
    assert stats.bytes_in_use == size_class(100) and stats.buffers == 2
    del b


def _simulated_step(pool, sizes, step):
    saved = [pool.acquire(n, CPU) for n in sizes]  # forward: one buffer per offloaded tensor
    for buffer in saved:
        buffer.fill_(step % 256)
    # Returning drops every reference: backward is done and the saved host tensors die.


def test_no_host_allocation_in_steady_state_over_20_steps():
    pool = PinnedHostPool()
    sizes = [3 * 2**20, 70_000, 70_000, 12, 2**16, 5 * 2**20 + 3]
    per_step = []
    for step in range(20):
        _simulated_step(pool, sizes, step)
        per_step.append((pool.stats().host_allocations, pool.stats().bytes_held))
    assert per_step[0][0] == len(sizes)
    assert all(s == per_step[0] for s in per_step)


def test_limit_exceeded_raises_a_clear_error():
    pool = PinnedHostPool(limit_bytes=8192)
    held = pool.acquire(8192, CPU)
    with pytest.raises(PinnedPoolLimitError, match="pinned_pool_limit"):
        pool.acquire(1, CPU)
    del held


def test_limit_frees_idle_buffers_of_other_classes_first():
    pool = PinnedHostPool(limit_bytes=12 * 1024)
    first = pool.acquire(8192, CPU)
    del first  # idle now
    second = pool.acquire(12 * 1024, CPU)  # needs the idle 8 KiB buffer freed
    stats = pool.stats()
    assert stats.bytes_held == 12 * 1024 and stats.buffers == 1
    del second


def test_lowering_the_limit_frees_idle_buffers_only():
    pool = PinnedHostPool()
    kept = pool.acquire(4096, CPU)
    idle = pool.acquire(8192, CPU)
    del idle
    pool.set_limit(4096)
    stats = pool.stats()
    assert stats.bytes_held == 4096 and stats.buffers_in_use == 1
    del kept


def test_trim_frees_idle_buffers():
    pool = PinnedHostPool()
    kept = pool.acquire(600, CPU)
    pool.acquire(5000, CPU)  # dropped at once
    freed = pool.trim()
    assert freed == size_class(5000)
    assert pool.stats().buffers == 1
    del kept


@pytest.mark.parametrize("bad", [-1, 1.5, "1GiB", True])
def test_set_limit_rejects_non_byte_counts(bad):
    with pytest.raises(ValueError):
        PinnedHostPool(limit_bytes=bad)


def test_acquire_rejects_empty_requests():
    with pytest.raises(ValueError):
        PinnedHostPool().acquire(0, CPU)
