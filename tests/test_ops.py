"""The offload custom ops: op contracts, bitwise round trips, gradients, bookkeeping.

The tests that hold on any device are parametrised by device (``cuda`` marked and skipped
without a GPU); GPU-only behaviour (races, streams, pinned memory, Inductor on CUDA) is in
``test_ops_cuda.py``."""

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from compile_offload.runtime import ops
from compile_offload.runtime.ops import OFFLOAD_OPS
from compile_offload.runtime.pinned_pool import get_pool
from compile_offload.passes.offload import host_layout


def _base(dtype, shape=(6, 10)):
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=gen).to(dtype)
    t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    flat = t.view(-1)
    flat[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")], dtype=dtype)
    return t


LAYOUTS = {
    "contiguous": lambda b: b,
    "transposed": lambda b: b.t(),
    "storage_offset": lambda b: b[2:],
    "strided_slice": lambda b: b[:, 1::3],
    "transposed_slice": lambda b: b[1:, ::2].t(),
    "zero_dim": lambda b: b[1, 2],
    "size_zero": lambda b: b[:0],
    "size_one_dims": lambda b: b[None, :, None],
}
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
# Spin the transfer streams before each copy (~3 ms on an H100; a no-op on the CPU, where
# copies are synchronous): only the waits may then order a copy before what follows it.
DELAY_CYCLES = 5_000_000
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8, torch.bool]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Every element's bit pattern, in logical order (NaN == NaN, -0.0 != 0.0)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    assert torch.equal(_bytes(actual), _bytes(expected))


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """offload -> wait -> reload -> wait, the way the pass wires them."""
    contiguous_host, stride = host_layout(x)
    host = ops.wait_offload(ops.offload(x, contiguous_host), x)
    return ops.wait_reload(ops.reload(host, x.device, stride), host)


@pytest.fixture(autouse=True)
def _no_leftover_transfers():
    ops.drain_pending_transfers()
    yield
    leftover = ops.drain_pending_transfers()
    assert leftover == 0, f"{leftover} transfers were started and never waited for"


# --- bitwise round trip ---------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_bitwise_and_keeps_size_and_stride(layout, dtype, device):
    base = _base(dtype).to(device)
    x = LAYOUTS[layout](base)
    expected = x.clone()
    contiguous_host, stride = host_layout(x)
    with ops.inject_transfer_delay(DELAY_CYCLES):
        host = ops.wait_offload(ops.offload(x, contiguous_host), x)
        assert host.device.type == "cpu" and (device == "cpu" or host.numel() == 0 or host.is_pinned())
        base.zero_()  # would corrupt the host copy if the wait had not ordered the copy first
        y = ops.wait_reload(ops.reload(host, x.device, stride), host)
    assert y.shape == x.shape and y.stride() == x.stride() and y.device == x.device
    assert_bitwise_equal(y, expected)
    if x.numel():
        assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "storage_offset"])
def test_dense_tensors_keep_their_layout_on_the_host(layout):
    x = LAYOUTS[layout](_base(torch.float32))
    host = ops.wait_offload(ops.offload(x, False), x)
    assert host.device.type == "cpu" and host.stride() == x.stride() and host.storage_offset() == 0
    assert host.untyped_storage().nbytes() >= x.numel() * x.element_size()


def test_non_dense_tensors_are_stored_compactly():
    x = _base(torch.float32, (64, 64))[:, ::4]  # 1/4 of the base's elements
    host = ops.wait_offload(ops.offload(x, True), x)
    assert host.is_contiguous()
    assert_bitwise_equal(host, x)


def test_host_copy_is_independent_of_the_source():
    x = _base(torch.float32).clone()
    expected = x.clone()
    host = ops.wait_offload(ops.offload(x, False), x)
    x.fill_(0)  # the source's memory is reused after the wait
    assert_bitwise_equal(host, expected)
    y = ops.wait_reload(ops.reload(host, x.device), host)
    assert_bitwise_equal(y, expected)


def test_non_dense_source_without_contiguous_host_is_gathered():
    """A source dense when planned can reach the op padded (Inductor pads buffers on GPUs):
    it raised mid-forward; it is gathered to a contiguous host tensor, and the fake kernel
    (run again on Inductor's real layouts) says so too."""
    x = _base(torch.float32)[:, ::2]
    host = ops.wait_offload(ops.offload(x, False), x)
    assert host.is_contiguous()
    assert_bitwise_equal(ops.wait_reload(ops.reload(host, x.device, x.stride()), host), x)
    with FakeTensorMode() as mode:
        fake = ops._offload_fake(mode.from_tensor(x), False)
    assert fake.stride() == host.stride()


def test_reload_refuses_an_overlapping_stride():
    host = ops.wait_offload(ops.offload(_base(torch.float32)[0], False), _base(torch.float32)[0])
    with pytest.raises(ValueError, match="overlaps"):
        ops.reload(host.expand(3, 10).contiguous(), torch.device("cpu"), [0, 1])


# --- op contracts ---------------------------------------------------------------------------


WAIT_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "storage_offset", "strided_slice", "zero_dim", "size_zero"])
def test_opcheck_offload_and_reload(layout, dtype, device):
    # No NaN here: opcheck compares eager and compiled results with assert_close.
    base = _base(dtype).nan_to_num(0.0, 0.0, 0.0) if dtype.is_floating_point else _base(dtype)
    x = LAYOUTS[layout](base.to(device))
    contiguous_host, stride = host_layout(x)
    for requires_grad in (False, True) if dtype.is_floating_point else (False,):
        src = x.detach().requires_grad_(requires_grad)
        torch.library.opcheck(ops.offload, (src, contiguous_host))
        host = ops.offload(x, contiguous_host).requires_grad_(requires_grad)
        torch.library.opcheck(ops.reload, (host, x.device, stride))
    ops.drain_pending_transfers()  # opcheck ran the copies without their waits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "strided_slice", "zero_dim", "size_zero"])
def test_opcheck_waits(layout, device, monkeypatch):
    """Schema (the result aliases the waited tensor), autograd and fake checks.

    ``test_aot_dispatch_dynamic`` is left out: functionalization rejects custom ops with
    aliasing outputs, and the waits are only ever inserted after AOTAutograd has
    functionalized and partitioned the graph. opcheck calls each wait several times with
    the same tensors, where the runtime raises (a second wait has no copy to wait for): the
    waits after the first find a finished copy instead."""
    def pop_or_finished(tensor, wait):
        with ops._lock:
            entry = ops._pending.pop(tensor.data_ptr(), None)
        return entry or ops._Pending(None, tensor.device, ())

    monkeypatch.setattr(ops, "_pop_pending", pop_or_finished)
    x = LAYOUTS[layout](_base(torch.float32).to(device))
    contiguous_host, stride = host_layout(x)
    for requires_grad in (False, True):
        src = x.detach().requires_grad_(requires_grad)
        host = ops.offload(src.detach(), contiguous_host).requires_grad_(requires_grad)
        torch.library.opcheck(ops.wait_offload, (host, src), test_utils=WAIT_CHECKS)
        reloaded = ops.reload(host.detach(), x.device, stride).requires_grad_(requires_grad)
        torch.library.opcheck(ops.wait_reload, (reloaded, host), test_utils=WAIT_CHECKS)
    ops.drain_pending_transfers()


def test_fake_kernels_describe_the_real_results():
    x = _base(torch.float32)[:, 1::3]
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        host = ops.offload(fx, True)
        assert host.device.type == "cpu" and host.is_contiguous()
        back = ops.reload(host, torch.device("cpu"), list(x.stride()))
        assert back.stride() == x.stride()
        waited = ops.wait_reload(back, host)
        # The wait returns its input (an alias): same storage, same layout.
        assert waited.untyped_storage()._cdata == back.untyped_storage()._cdata
        assert (waited.shape, waited.stride()) == (back.shape, back.stride())


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided_slice"])
def test_gradcheck_through_offload_and_reload(layout):
    x = _base(torch.float64, (4, 6)).nan_to_num(0.0, 0.0, 0.0).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: round_trip(LAYOUTS[layout](t)), (x,))


def test_ops_are_listed_for_the_pass_and_tagged():
    assert OFFLOAD_OPS.offload is torch.ops.compile_offload.offload.default
    assert OFFLOAD_OPS.wait_offload is torch.ops.compile_offload.wait_offload.default
    assert OFFLOAD_OPS.reload is torch.ops.compile_offload.reload.default
    assert OFFLOAD_OPS.wait_reload is torch.ops.compile_offload.wait_reload.default
    for op in (OFFLOAD_OPS.wait_offload, OFFLOAD_OPS.wait_reload):
        returns = op._schema.returns[0]
        assert returns.alias_info is not None and not returns.alias_info.is_write
    if hasattr(torch.Tag, "cudagraph_unsafe"):
        assert all(torch.Tag.cudagraph_unsafe in op.tags for op in vars(OFFLOAD_OPS).values())


def test_waits_survive_dead_code_elimination():
    def f(x):
        host = OFFLOAD_OPS.offload(x, False)
        OFFLOAD_OPS.wait_offload(host, x)  # result unused
        return x + 1

    gm = torch.fx.symbolic_trace(f)
    gm.graph.eliminate_dead_code()
    targets = [n.target for n in gm.graph.nodes]
    assert OFFLOAD_OPS.wait_offload in targets and OFFLOAD_OPS.offload in targets


# --- bookkeeping across steps ----------------------------------------------------------------


def test_each_wait_clears_its_pending_transfer():
    x = _base(torch.float32)
    host = ops.offload(x, False)
    assert ops.pending_transfer_count() == 1
    host = ops.wait_offload(host, x)
    assert ops.pending_transfer_count() == 0
    reloaded = ops.reload(host, x.device)
    assert ops.pending_transfer_count() == 1
    ops.wait_reload(reloaded, host)
    assert ops.pending_transfer_count() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_wait_without_its_copy_raises(device):
    """A wait that receives a tensor other than the one its copy returned, or waits twice,
    raises instead of silently not synchronising (reliability.md)."""
    x = _base(torch.float32).to(device)
    host = ops.offload(x, False)
    with pytest.raises(RuntimeError, match=r"wait_offload: no offload is in flight .* differs from it"):
        ops.wait_offload(host[1:], x)  # an alias at another offset
    with pytest.raises(RuntimeError, match=r"wait_offload: no offload is in flight"):
        ops.wait_offload(host.clone(), x)  # a copy
    host = ops.wait_offload(host, x)  # the tensor the copy returned: waits
    with pytest.raises(RuntimeError, match=r"wait_offload: no offload is in flight .* already waited for"):
        ops.wait_offload(host, x)  # twice
    reloaded = ops.reload(host, x.device)
    with pytest.raises(RuntimeError, match=r"wait_reload: no reload is in flight"):
        ops.wait_reload(reloaded.clone(), host)
    assert_bitwise_equal(ops.wait_reload(reloaded, host), x)
    assert ops.pending_transfer_count() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_graph_call_that_raises_forgets_its_own_copies_only(device):
    """``forgetting_copies_on_error``: the copies a failing call started (an offload and a
    reload in a nested call) are forgotten when it raises; a copy started outside it, or by
    the enclosing call that is still running, is kept for its wait."""
    x = _base(torch.float32).to(device)
    outside = ops.offload(x, False)

    def inner(args: list):
        ops.offload(args[0], False)
        ops.reload(ops.wait_offload(ops.offload(args[0], False), args[0]), x.device)
        raise RuntimeError("out of memory in the inner graph")

    def outer(args: list):
        kept = ops.offload(args[0], False)  # still in flight while the inner call fails
        with pytest.raises(RuntimeError, match="inner graph"):
            ops.forgetting_copies_on_error(inner)([args[0]])
        assert ops.pending_transfer_count() == 2  # the outside copy and this call's
        assert_bitwise_equal(ops.wait_offload(kept, args[0]), x)
        ops.offload(args[0], False)
        raise RuntimeError("out of memory in the outer graph")

    run = ops.forgetting_copies_on_error(outer)
    assert run._boxed_call
    with pytest.raises(RuntimeError, match="outer graph"):
        run([x])
    assert ops.pending_transfer_count() == 1
    assert_bitwise_equal(ops.wait_offload(outside, x), x)


class _CudaEvent:
    """Stands for an offload's CUDA event on the CPU: notes when the CPU waits for it."""

    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def _offloaded_as_on_cuda(monkeypatch) -> tuple[torch.Tensor, torch.Tensor, _CudaEvent]:
    """(source, host tensor, its event): an offload pending as on CUDA, its stream wait a no-op."""
    monkeypatch.setattr(ops, "_wait", lambda pending: None)
    x = _base(torch.float32)
    host = ops.offload(x, False)
    event = _CudaEvent()
    ops._pending[host.data_ptr()].event = event
    return x, host, event


def test_a_wait_keeping_another_tensor_alive_than_its_offload_read_raises(monkeypatch):
    """Where generated code handed offload and wait_offload different copies of the source,
    the memory the copy read was kept alive by nothing and could be reused under the copy on
    CUDA: the host tensor may be torn, so the wait raises instead of returning it."""
    x, host, _ = _offloaded_as_on_cuda(monkeypatch)
    with pytest.raises(RuntimeError, match=r"wait_offload: the tensor it keeps alive .* is not the memory its offload read"):
        ops.wait_offload(host, x.clone())
    x, host, _ = _offloaded_as_on_cuda(monkeypatch)
    assert_bitwise_equal(ops.wait_offload(host, x[1:]), x)  # a view of the memory read: the same storage
    assert ops.pending_transfer_count() == 0


def test_under_saved_tensor_hooks_the_cpu_waits_for_the_offload(monkeypatch):
    """save_on_cpu's pack hook copies the saved host tensor on the CPU as the forward
    returns: before the copy into it had finished on CUDA, it read a torn tensor."""
    x, host, event = _offloaded_as_on_cuda(monkeypatch)
    ops.wait_offload(host, x)
    assert event.synchronized == 0  # no hooks: the compute stream's wait is enough
    x, host, event = _offloaded_as_on_cuda(monkeypatch)
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        ops.wait_offload(host, x)
    assert event.synchronized == 1


@pytest.mark.parametrize("op", ["offload", "reload"])
def test_copies_refuse_a_cuda_graph_capture(monkeypatch, op):
    """Captured, a copy's Python bookkeeping ran once: every replay copied into host buffers
    the pool had since handed to other copies."""
    x = _base(torch.float32)
    host = ops.wait_offload(ops.offload(x, False), x)
    monkeypatch.setattr(ops, "_capturing", lambda device: True)
    with pytest.raises(RuntimeError, match=rf"compile_offload.{op}: a CUDA graph is being captured"):
        ops.offload(x, False) if op == "offload" else ops.reload(host, x.device)
    assert ops.pending_transfer_count() == 0


def test_a_zero_element_wait_has_nothing_to_wait_for():
    x = _base(torch.float32)[:0]
    host = ops.wait_offload(ops.offload(x, False), x)
    back = ops.wait_reload(ops.reload(host, x.device), host)
    assert back.shape == x.shape and ops.pending_transfer_count() == 0


def test_the_copy_source_stays_referenced_until_its_wait():
    """The offload's pending entry holds its source, so a step that fails between the copy
    and its wait cannot free the source under the copy; the wait lets it go."""
    import weakref

    x = _base(torch.float32)
    source = weakref.ref(x)
    host = ops.offload(x, False)
    keepalive = torch.empty(0)
    del x
    gc.collect()
    assert source() is not None
    ops.wait_offload(host, keepalive)
    gc.collect()
    assert source() is None


def _training_step(x: torch.Tensor) -> torch.Tensor:
    # Several saved tensors of different sizes, alive together like a forward's saved set.
    saved = [(t, ops.wait_offload(ops.offload(t, False), t)) for t in (x, x[1:], x.t(), x * 2)]
    return sum(ops.wait_reload(ops.reload(host, t.device), host).sum() for t, host in saved)


def test_repeated_steps_make_no_host_allocation_and_leave_nothing_pending():
    pool = get_pool()
    x = _base(torch.float32, (64, 33))
    _training_step(x)
    gc.collect()
    before = pool.stats()
    for _ in range(20):
        _training_step(x)
    after = pool.stats()
    assert after.host_allocations == before.host_allocations
    assert after.bytes_held == before.bytes_held
    assert ops.pending_transfer_count() == 0


def test_injected_delay_is_a_no_op_on_cpu():
    x = _base(torch.float32)
    with ops.inject_transfer_delay(10**6):
        assert_bitwise_equal(round_trip(x), x)
