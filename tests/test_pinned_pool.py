"""The host buffer pool: size classes, reuse, liveness, limit, steady state (CPU buffers)."""

import gc

import pytest
import torch

from compile_offload.runtime import pinned_pool
from compile_offload.runtime.pinned_pool import (
    CLASS_STEPS,
    MIN_CLASS_BYTES,
    PAGE_BYTES,
    PinnedHostPool,
    PinnedPoolLimitError,
    pinned_bytes,
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
    # CLASS_STEPS classes per power of two above MIN_CLASS_BYTES * CLASS_STEPS (8 KiB),
    # multiples of MIN_CLASS_BYTES below: 64 KiB of sizes map to few distinct buffers.
    below = MIN_CLASS_BYTES * CLASS_STEPS
    assert len(set(classes)) <= below // MIN_CLASS_BYTES + CLASS_STEPS * ((1 << 16) // below).bit_length()


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


def test_buffer_is_not_reused_while_its_storage_object_is_kept():
    """review33c F7: a holder of only the buffer's storage object (a saved-tensor hook that
    keeps storages, not tensors) adds nothing to the storage's use count; the buffer was
    handed out again and the next offload overwrote what the holder reads."""
    pool = PinnedHostPool()
    a = pool.acquire(4096, CPU)
    a.fill_(7)
    kept = a.untyped_storage()
    del a
    b = pool.acquire(4096, CPU)
    b.fill_(1)
    assert b.data_ptr() != kept.data_ptr()
    assert torch.empty(0, dtype=torch.uint8).set_(kept)[0].item() == 7
    del kept, b
    gc.collect()
    assert pool.stats().buffers_in_use == 0 and pool.acquire(4096, CPU) is not None


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


# --- pinned memory that is what it claims (no GPU needed for the logic) ----------------------


@pytest.mark.parametrize("nbytes", [2**16, 2**16 + 1, 100_003, 2**20 + 64, 3 * 2**20 + 7, 2**30 + 1])
def test_pinned_bytes_stay_within_1_1x_of_tensors_of_64_kib_and_more(nbytes):
    held = pinned_bytes([nbytes])
    assert nbytes <= held <= 1.1 * nbytes and held % PAGE_BYTES == 0


def test_pinned_bytes_of_a_saved_set_stay_within_1_1x():
    # A transformer-like saved set: activations of a few shapes, in bf16 and fp32.
    sizes = [b * s * d * e for b in (4, 8) for s in (512, 1000) for d in (768, 3072) for e in (2, 4)]
    assert sum(sizes) <= pinned_bytes(sizes) <= 1.1 * sum(sizes)


def test_torchs_pinned_allocator_is_counted_at_the_power_of_two_it_pins():
    assert pinned_pool._torch_pinned_bytes(3 * 2**20 + 7) == 4 * 2**20
    assert pinned_pool._torch_pinned_bytes(2**20) == 2**20


def test_registration_covers_the_storage_start_that_is_pinned_asks_about(monkeypatch):
    """The registered range starts where the buffer's storage starts (page-aligned), which
    is the address CUDA is asked about by ``is_pinned()``: modelled here by a registry."""
    registered, unregistered = {}, []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self.untyped_storage().data_ptr() in registered)
    buffer = pinned_pool._allocate_registered(3 * PAGE_BYTES, lambda ptr, n: registered.__setitem__(ptr, n),
                                              unregistered.append)
    start = buffer.tensor.untyped_storage().data_ptr()
    assert registered == {start: 3 * PAGE_BYTES} and buffer.registered_ptr == start
    assert start % PAGE_BYTES == 0 and buffer.tensor.numel() == buffer.nbytes == 3 * PAGE_BYTES
    assert buffer.tensor.is_pinned() and unregistered == []
    buffer.tensor.fill_(7)  # writable memory
    assert int(buffer.tensor.sum()) == 7 * 3 * PAGE_BYTES


def test_a_registration_that_does_not_pin_is_undone_and_refused(monkeypatch):
    registered, unregistered = [], []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    with pytest.raises(RuntimeError, match="does not report as pinned"):
        pinned_pool._allocate_registered(PAGE_BYTES, lambda ptr, n: registered.append(ptr), unregistered.append)
    assert registered == unregistered and len(registered) == 1


def test_buffers_are_freed_outside_the_pools_lock(monkeypatch):
    """Freeing synchronises the device; that must not hold up other threads' offloads."""
    pool = PinnedHostPool(limit_bytes=4096)
    lock_held = []
    release = pinned_pool._release
    monkeypatch.setattr(pinned_pool, "_release", lambda released: (lock_held.append(pool._lock.locked()),
                                                                  release(released)))
    a = pool.acquire(4096, CPU)
    del a
    gc.collect()
    pool.acquire(1024, CPU)  # frees the idle 4 KiB buffer (over twice its class) to make room
    assert pool.stats().bytes_held == size_class(1024)
    pool.trim()
    assert lock_held and not any(lock_held)


def test_explain_reports_the_pinned_host_memory_of_its_offloads():
    import compile_offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    plan = compile_offload.explain(model, torch.randn(128, 256), device_profile="h100", debug_force_offload=True)
    offloaded = [d.bytes for d in plan.decisions if d.decision == "offload"]
    assert offloaded, "nothing offloaded"
    (note,) = [n for n in plan.notes if n.startswith("pinned host memory (predicted)")]
    ratio = pinned_bytes(offloaded) / sum(offloaded)
    assert f"({ratio:.3f}x)" in note and 1.0 <= ratio <= 1.1


def test_the_latest_offloading_compile_sets_the_process_pool_limit():
    """The pool is one per process: a compile with offload on sets its limit; one with
    offload off does not use the pool and leaves the limit the offloading model relies on."""
    import compile_offload

    before = pinned_pool.get_pool().limit_bytes
    try:
        def compile_once(**options):
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=compile_offload.offload_remat(inner_compiler="eager", **options))
            compiled(torch.randn(4, 8, requires_grad=True)).sum().backward()

        compile_once(offload=True, pinned_pool_limit="3MiB")
        assert pinned_pool.get_pool().limit_bytes == 3 * 2**20
        compile_once(offload=False, pinned_pool_limit="5MiB")
        assert pinned_pool.get_pool().limit_bytes == 3 * 2**20
        compile_once(offload=True, pinned_pool_limit="5MiB")
        assert pinned_pool.get_pool().limit_bytes == 5 * 2**20
        # fuzz34a F2: the error of another model's step named the config's knob, which the
        # options of the compile that set the limit override
        held = pinned_pool.get_pool().acquire(5 * 2**20, CPU)
        with pytest.raises(PinnedPoolLimitError, match=r"the options of a compile \(pinned_pool_limit=5242880\)"):
            pinned_pool.get_pool().acquire(2**20, CPU)
        del held
        with compile_offload.config.patch(pinned_pool_limit="1MiB"):
            compile_once(offload=True)
        held = pinned_pool.get_pool().acquire(2**20, CPU)
        with pytest.raises(PinnedPoolLimitError, match=r"limit was set by compile_offload\.config\.pinned_pool_limit \("):
            pinned_pool.get_pool().acquire(2**20, CPU)
        del held
    finally:
        pinned_pool.set_limit(before)
        torch._dynamo.reset()


def test_a_reused_buffer_hands_over_the_event_of_the_reload_that_read_it():
    """review33c F1: the host tensor dies once a compute stream was told to wait for its
    reload, before the reload ran; an offload issued from another stream into the reused
    buffer was ordered after nothing. The reload's event now goes with the buffer, and the
    offload's stream waits for it (ops.offload; on the GPU: the CPU does not wait, and no
    other buffer is pinned meanwhile, review33d P1)."""
    pool = PinnedHostPool()
    host = pool.acquire(4096, CPU)
    ptr = host.data_ptr()
    event = object()  # a reload's completion event
    pool.note_read(host[1024:], event)  # a view of the buffer: the same storage
    del host
    again = pool.acquire(4096, CPU)
    assert again.data_ptr() == ptr and pool.read_event(again) is event
    assert pool.stats().host_allocations == 1
    assert pool.read_event(torch.empty(8)) is None  # not the pool's


def test_under_a_limit_a_request_takes_no_larger_idle_buffer():
    """review33d P2: a small request that took an idle buffer twice its size left no room
    for the larger one after it, where exact classes fitted the limit."""
    pool = PinnedHostPool(limit_bytes=size_class(8192) + size_class(4096))
    first = [pool.acquire(8192, CPU), pool.acquire(4096, CPU)]
    del first
    again = [pool.acquire(4096, CPU), pool.acquire(8192, CPU)]
    assert pool.stats().host_allocations == 2 and len(again) == 2


def test_a_step_of_many_same_size_offloads_reads_each_buffer_a_few_times(monkeypatch):
    """review33c F5: every acquire scanned its class from the start, reading the use count
    of each buffer in use: n offloads of one size cost n**2 / 2 reads a step (1000 offloads:
    345 ms a step on the CPU)."""
    pool = PinnedHostPool()
    reads = []
    in_use = pinned_pool._Buffer.in_use
    monkeypatch.setattr(pinned_pool._Buffer, "in_use", lambda self: reads.append(1) or in_use(self))
    n = 300
    for step in range(3):
        reads.clear()
        _simulated_step(pool, [8192] * n, step)
    assert pool.stats().host_allocations == n
    assert len(reads) <= 3 * n, len(reads)


def test_sizes_that_vary_reuse_the_buffers_of_larger_ones():
    """review33c F2: a buffer served its own size class only, so sizes varying from step to
    step (dynamic batch or sequence lengths) pinned a set of buffers per size, forever."""
    pool = PinnedHostPool()
    base = [70_000, 3 * 2**16, 2**20]
    _simulated_step(pool, [4 * n for n in base], 0)
    allocated = pool.stats().host_allocations
    for step, scale in enumerate([3.9, 2.5, 2.1, 3.3, 2.0], start=1):
        _simulated_step(pool, [int(scale * n) for n in base], step)
    assert pool.stats().host_allocations == allocated


def test_without_a_limit_growing_sizes_do_not_keep_every_size_pinned(monkeypatch):
    """review33c F2: sizes growing step by step (batch 64 to 128) held 12.8 times the
    most bytes one step had in use, every earlier size's buffers pinned for good."""
    pool = PinnedHostPool()
    most_in_use, frees, release = 0, [], pinned_pool._release
    monkeypatch.setattr(pinned_pool, "_release", lambda released: (frees.append(1) if released else None,
                                                                  release(released)))
    steps = range(64, 257, 2)
    for batch in steps:
        saved = [pool.acquire(batch * 1024 * width, CPU) for width in (1, 4, 4, 1)]
        most_in_use = max(most_in_use, pool.stats().bytes_in_use)
        del saved
    stats = pool.stats()
    assert stats.bytes_held <= pinned_pool.AUTO_HELD_FACTOR * most_in_use, (stats, most_in_use)
    assert stats.buffers_in_use == 0
    # each free synchronizes the device: freed down to half the bound, not at every growth (review33d P4)
    assert 0 < len(frees) <= len(steps) // 4, len(frees)
