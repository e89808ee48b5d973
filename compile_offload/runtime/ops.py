"""Custom ops that move a saved tensor to host memory in forward and back in backward.

Graph pattern (inserted by ``passes.offload.insert_offloads`` after partitioning)::

    forward:   host  = compile_offload.offload(x, contiguous_host)       # D2H starts
               ...   (x's remaining forward uses)
               saved = compile_offload.wait_offload(host, x)             # returned as the saved value
    backward:  dev   = compile_offload.reload(saved, device, stride)    # H2D starts
               ...   (one or more backward nodes)
               x_    = compile_offload.wait_reload(dev, saved)           # replaces x in backward

Streams and events (CUDA). Each device has two transfer streams (``transfer_stream``), one
per direction of the link: offloads (device to host) run on one, reloads (host to device)
on the other, so a reload never queues behind the forward's offloads or the other way
round. That is what the transfer model (``passes/transfer.py``) assumes: one FIFO per
direction, the two directions overlapping each other and compute.

* ``offload`` makes the offload stream wait for the current (compute) stream, so the copy
  starts after ``x`` was produced, copies ``x`` into a pinned buffer from
  ``compile_offload.runtime.pinned_pool`` with ``non_blocking=True`` and records a completion event.
  ``x`` stays referenced by the pending entry until the wait (as well as by the wait's
  argument), so even a step that fails before the wait cannot free it under the copy.
* ``wait_offload`` makes the compute stream wait for that event. It takes ``x`` as an
  argument although it only keeps it alive: that data edge makes ``x`` live in the graph
  (for Inductor's buffer reuse and ``del`` as much as for the caching allocator) until the
  wait, and every kernel after the wait is ordered after the copy on the compute stream. So
  ``x``'s memory is neither freed nor reused before the copy has finished, without
  ``record_stream``. Its result is an alias of the host tensor (declared in the schema), and
  the forward returns it as the saved value, so the wait cannot be dead-code-eliminated
  and nothing can use the saved value before the wait.
* ``reload`` allocates the device tensor on the compute stream, makes the reload stream
  wait for the compute stream (the fresh block may still be read by earlier kernels), copies
  and records an event. The reload is ordered after its offload through the compute stream:
  the compute stream waited for the offload's event at the forward's ``wait_offload``, and
  the reload stream waits for everything queued on the compute stream before the reload, so
  the host data is complete when the reload starts.
* ``wait_reload`` makes the compute stream wait for the reload's event, keeping the host
  tensor alive until then (the CPU does not wait: the pool is told the reload's event, and
  the next offload into the host buffer, from whatever stream, waits for it on the GPU); its result (an alias of the reloaded tensor) replaces the saved
  tensor's uses in backward, so no use can be scheduled ahead of it.

Correctness therefore rests on data edges only; nothing relies on timing or on Inductor keeping
the graph order. Overlap does rest on the order: the backend compiles graphs with these ops
without Inductor's reordering passes (``compile_offload/inductor/copy_order.py``). The ops are tagged ``cudagraph_unsafe`` where torch knows the tag: their
Python-side bookkeeping would not be replayed by a CUDA graph.

Events travel from a copy to its wait through ``_pending``, keyed by the ``data_ptr`` of
the tensor the copy returned (the host tensor for an offload, the device tensor for a
reload). The key is unique while the copy is pending because that tensor stays alive until
its wait, which removes the entry; so running the same graph again and again leaves nothing
behind (``pending_transfer_count()`` is 0 after a full step). A wait for a tensor with
elements and without an entry raises ``RuntimeError``: the tensor it received is not the one
its copy returned (a layout copy, an alias at an offset, a changed code generation) or the
copy was already waited for, and returning would let compute read memory a copy may still
be writing. (Zero-element tensors have no copy and no entry.) An entry keeps both ends of its
copy alive, with the copy's device-side temporaries, so a step that raises between a copy
and its wait leaks them instead of letting the allocator or the pinned pool reuse memory a
copy still reads or writes. A copy and its wait are in one graph (the forward's offload and
wait, the backward's reload and wait), so the entries a graph call leaves when it raises (an
out-of-memory error a training loop catches to try a smaller batch) can never be waited for:
``forgetting_copies_on_error`` wraps each compiled graph that has copies, and on an exception
waits for that call's copies and forgets them (the entries record the innermost call that
made them, per thread). The backend also wraps each graph's forward as Dynamo calls it, so
a forward served by AOTAutograd's cache, whose Inductor code was not compiled here, is
covered too; such a graph's backward is not. ``drain_pending_transfers()`` finishes and
forgets every leftover, of any call.

Layouts. The round trip preserves size, stride and every element bitwise; the reloaded
tensor has storage offset 0.

* ``offload(x, contiguous_host=False)``: the host tensor has ``x``'s size and stride and
  holds exactly ``numel`` elements where ``x`` is non-overlapping and dense (contiguous,
  permuted, or a view with a storage offset), so the copy is one memcpy of exactly the
  bytes needed. Where it is not (a buffer Inductor padded on a GPU, dense when planned),
  it is gathered as with ``contiguous_host=True``; the fake kernel, which Inductor runs
  again on its real layouts, decides alike.
* ``offload(x, contiguous_host=True)`` (any non-overlapping layout, e.g. a slice with a
  step): ``x`` is first gathered into a contiguous temporary on the compute stream (kept
  alive until the wait) and the host tensor is contiguous.
* ``reload(host, device, stride)`` allocates ``empty_strided(host.shape, stride)`` (``stride``
  None: the host tensor's stride). When that differs from the host layout it copies into a
  temporary laid out like the host tensor and scatters it into the result on the transfer
  stream, so every cross-device copy is a plain memcpy.
* Overlapping layouts (expanded, stride 0) cannot be restored by a copy and are refused.

``passes.offload.host_layout`` picks both arguments from the graph's metadata.

CPU tensors: the same ops run as synchronous copies into another host buffer (from the
pool), so graphs with offload nodes run and are tested without a GPU.

Test hook: ``inject_transfer_delay(cycles)`` makes the transfer stream spin
(``torch.cuda._sleep``) before each copy, to provoke races.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..passes import compat
from ..passes.offload import OffloadOps, is_non_overlapping
from ..torch_api import cuda as torch_cuda
from ..torch_api.utils import saved_tensors_hooks_active

from . import pinned_pool

NAMESPACE = "compile_offload"

# --- private torch APIs used here (behind torch_api and compat) ------------------------------


_is_dense = compat.is_non_overlapping_and_dense  # a permutation of a contiguous layout
_below_autograd = torch_cuda.below_autograd


_CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _custom_op(name: str):
    """``torch.library.custom_op``, with the tags where this torch accepts them."""
    if "tags" in inspect.signature(torch.library.custom_op).parameters:
        return torch.library.custom_op(name, mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
    return torch.library.custom_op(name, mutates_args=())

# --- transfer streams, delay hook, pending transfers ----------------------------------------

_lock = threading.Lock()
_transfer_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
_delay_cycles = {"offload": 0, "reload": 0}
DIRECTIONS = ("offload", "reload")  # device to host, host to device


def transfer_stream(device: torch.device, direction: str = "offload") -> torch.cuda.Stream:
    """The stream that runs every copy of ``device`` in ``direction`` ("offload": device to
    host, "reload": host to device)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"transfer_stream: direction must be one of {DIRECTIONS}, got {direction!r}")
    with _lock:
        stream = _transfer_streams.get((device, direction))
        if stream is None:
            stream = _transfer_streams[(device, direction)] = torch.cuda.Stream(device=device)
        return stream


@contextlib.contextmanager
def inject_transfer_delay(cycles: int, *, offload: bool = True, reload: bool = True):
    """Test hook: spin the transfer stream for ``cycles`` GPU cycles before each copy."""
    saved = dict(_delay_cycles)
    _delay_cycles["offload"] = cycles if offload else 0
    _delay_cycles["reload"] = cycles if reload else 0
    try:
        yield
    finally:
        _delay_cycles.update(saved)


@dataclass
class _Pending:
    event: torch.cuda.Event | None  # None: the copy was synchronous (CPU)
    device: torch.device
    keepalive: tuple  # temporaries the copy reads or writes, freed once waited for
    call: object | None = None  # the graph call that made it (``forgetting_copies_on_error``)


_pending: dict[int, _Pending] = {}
_calls = threading.local()  # .running: the graph calls under way on this thread, innermost last


def _register_pending(key_tensor: torch.Tensor, pending: _Pending) -> None:
    running = getattr(_calls, "running", None)
    pending.call = running[-1] if running else None
    with _lock:
        _pending[key_tensor.data_ptr()] = pending


def _pop_pending(key_tensor: torch.Tensor, wait: str) -> _Pending | None:
    """The pending copy that returned ``key_tensor``, removed; None for a zero-element
    tensor (no copy was made). Raises when a tensor with elements has none (module doc)."""
    if key_tensor.numel() == 0:
        return None
    with _lock:
        pending = _pending.pop(key_tensor.data_ptr(), None)
    if pending is None:
        copy = "offload" if wait == "wait_offload" else "reload"
        raise RuntimeError(
            f"compile_offload.{wait}: no {copy} is in flight for the tensor it received (size "
            f"{tuple(key_tensor.shape)}, stride {key_tensor.stride()}, {key_tensor.device}, data_ptr "
            f"{key_tensor.data_ptr():#x}). A wait must receive the very tensor its {copy} returned; this one "
            "differs from it (a copy, or a view at another offset) or was already waited for. Waiting for "
            "nothing would let compute read memory the copy may still be writing."
        )
    return pending


def pending_transfer_count() -> int:
    """Copies started and not yet waited for (0 after a complete forward and backward)."""
    with _lock:
        return len(_pending)


def drain_pending_transfers() -> int:
    """Block until every pending copy finished and forget them; returns how many there were.

    For recovery after a step that raised between a copy and its wait, and for tests that
    call the ops one by one."""
    with _lock:
        pending = list(_pending.values())
        _pending.clear()
    for entry in pending:
        if entry.event is not None:
            entry.event.synchronize()
    return len(pending)


def forgetting_copies_on_error(compiled: Callable[..., Any], boxed: bool = True) -> Callable[..., Any]:
    """``compiled`` (a graph's boxed callable; with ``boxed=False`` a plain one, such as the
    callable a Dynamo backend returns) whose calls, when they raise, first wait for the
    copies they started and left without their waits, and forget them (module doc)."""

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        call = object()
        running = _calls.__dict__.setdefault("running", [])
        running.append(call)
        try:
            return compiled(*args, **kwargs)
        except BaseException:
            _forget_copies_of(call)
            raise
        finally:
            running.pop()

    if boxed:
        run._boxed_call = True
    return run


def _forget_copies_of(call: object) -> int:
    with _lock:
        keys = [key for key, entry in _pending.items() if entry.call is call]
        left = [_pending.pop(key) for key in keys]
    for entry in left:
        if entry.event is not None:
            entry.event.synchronize()
    return len(left)


def _wait(pending: _Pending | None) -> None:
    if pending is not None and pending.event is not None:
        torch.cuda.current_stream(pending.device).wait_event(pending.event)
    # Dropping ``pending`` frees its temporaries. On CUDA they belong to the compute stream,
    # which from here on runs after the copy, so the allocator may reuse them at once.


def _capturing(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def _refuse_capture(device: torch.device, op: str) -> None:
    """A copy's bookkeeping (its host buffer from the pool, its event, the pending entry) runs
    in Python, once while a CUDA graph is captured and never at its replays: each replay
    would copy into host buffers the pool has since handed to other copies."""
    if _capturing(device):
        raise RuntimeError(
            f"compile_offload.{op}: a CUDA graph is being captured (torch.cuda.graph, make_graphed_callables), "
            "and offloaded copies cannot be replayed by one: their host buffers and events are kept in Python. "
            "Capture a step compiled with compile_offload.config.offload = False, or let torch.compile's "
            "mode='reduce-overhead' capture it (offload is then turned off for you)")


def _normalize(device: torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _copy(dst: torch.Tensor, src: torch.Tensor, device: torch.device, kind: str,
          after: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
    """``dst.copy_(src)``: synchronous on CPU; on CUDA on the transfer stream, after the
    work already queued on the compute stream (and ``after``), returning the completion event."""
    if device.type != "cuda":
        dst.copy_(src)
        return None
    stream = transfer_stream(device, kind)
    stream.wait_stream(torch.cuda.current_stream(device))
    if after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        if _delay_cycles[kind]:
            torch_cuda.sleep(_delay_cycles[kind])
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


# --- layouts ---------------------------------------------------------------------------------


def _contiguous_stride(size: Sequence[int]) -> list[int]:
    return list(torch.empty(size, device="meta").stride())


def _host_stride(src: torch.Tensor, contiguous_host: bool) -> list[int]:
    return _contiguous_stride(src.shape) if contiguous_host else list(src.stride())


def _host_tensor(src: torch.Tensor, stride: list[int]) -> torch.Tensor:
    """Host memory for ``src``'s elements with ``stride`` (which must be dense)."""
    nbytes = src.numel() * src.element_size()
    if nbytes == 0:
        return torch.empty_strided(src.shape, stride, dtype=src.dtype, device="cpu")
    raw = pinned_pool.get_pool().acquire(nbytes, src.device)
    return raw.view(src.dtype).as_strided(src.shape, stride)


# --- offload ---------------------------------------------------------------------------------


@_custom_op(f"{NAMESPACE}::offload")
def offload(src: torch.Tensor, contiguous_host: bool) -> torch.Tensor:
    """Start copying ``src`` to host memory; returns the host tensor (not readable before
    ``wait_offload``). See the module docstring for ``contiguous_host``."""
    _refuse_capture(src.device, "offload")
    contiguous_host = _gathers(src, contiguous_host)
    payload = src.contiguous() if contiguous_host else src  # gathered on the compute stream
    host = _host_tensor(src, _host_stride(src, contiguous_host))
    if host.numel() == 0:
        return host
    device = _normalize(src.device)
    # a reused pinned buffer: after the last reload that read it, whatever stream issued that one
    event = _copy(host, payload, device, "offload", after=pinned_pool.get_pool().read_event(host))
    # Both ends stay referenced until the wait: the source (and its gathered copy) so its
    # memory is not reused under the copy, the host tensor so its pinned buffer is not
    # handed out again while the copy writes it (module doc).
    _register_pending(host, _Pending(event, device, (src, payload, host) if payload is not src else (src, host)))
    return host


@offload.register_fake
def _offload_fake(src: torch.Tensor, contiguous_host: bool) -> torch.Tensor:
    return torch.empty_strided(src.shape, _host_stride(src, _gathers(src, contiguous_host)), dtype=src.dtype,
                               device="cpu")


def _gathers(src: torch.Tensor, contiguous_host: bool) -> bool:
    """Whether the host copy is contiguous: where asked, and where ``src`` is not dense after
    all (a buffer Inductor padded on a GPU, whose fake value at planning time was dense). The
    fake kernel runs again on Inductor's real layout, so both kernels decide alike."""
    return contiguous_host or not _is_dense(src)


def _offload_setup(ctx, inputs, output) -> None:
    ctx.device = inputs[0].device


def _offload_backward(ctx, grad: torch.Tensor):
    return grad.to(ctx.device), None


torch.library.register_autograd(offload, _offload_backward, setup_context=_offload_setup)


# --- reload ----------------------------------------------------------------------------------


def _check_restorable(size: Sequence[int], stride: Sequence[int]) -> None:
    if not is_non_overlapping(size, stride):
        raise ValueError(f"compile_offload.reload: stride {list(stride)} overlaps for size {list(size)}; cannot restore by copy")


@_custom_op(f"{NAMESPACE}::reload")
def reload(host: torch.Tensor, device: torch.device, stride: Sequence[int] | None = None) -> torch.Tensor:
    """Start copying ``host`` to a fresh tensor on ``device`` with ``stride`` (None: the host
    tensor's own stride); returns it (not readable before ``wait_reload``)."""
    device = _normalize(device)
    _refuse_capture(device, "reload")
    if stride is None:
        stride = host.stride()
    else:
        _check_restorable(host.shape, stride)
    out = torch.empty_strided(host.shape, stride, dtype=host.dtype, device=device)
    if out.numel() == 0:
        return out
    if device.type == "cuda" and list(stride) != list(host.stride()) and host.numel() > 1:
        # One memcpy into a temporary laid out like the host tensor, then a strided scatter,
        # both on the transfer stream: a cross-device copy between different layouts would
        # make torch stage through temporaries it does not keep alive for us.
        staging = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        event = _copy_then_scatter(out, staging, host, device)
        keepalive = (staging,)
    else:
        event, keepalive = _copy(out, host, device, "reload"), ()
    if event is not None:  # the next offload into the buffer waits for this copy to have read it
        pinned_pool.get_pool().note_read(host, event)
    # ``out`` itself is kept too: if a failing step dropped it before its wait, the allocator
    # must not hand its memory out while the copy still writes into it; and ``host``, whose
    # pinned buffer the copy reads.
    _register_pending(out, _Pending(event, device, (out, host, *keepalive)))
    return out


def _copy_then_scatter(out: torch.Tensor, staging: torch.Tensor, host: torch.Tensor, device: torch.device):
    stream = transfer_stream(device, "reload")
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        if _delay_cycles["reload"]:
            torch_cuda.sleep(_delay_cycles["reload"])
        staging.copy_(host, non_blocking=True)
        out.copy_(staging)
        event = torch.cuda.Event()
        event.record(stream)
    return event


@reload.register_fake
def _reload_fake(host: torch.Tensor, device: torch.device, stride: Sequence[int] | None = None) -> torch.Tensor:
    return torch.empty_strided(host.shape, host.stride() if stride is None else stride, dtype=host.dtype, device=device)


def _reload_setup(ctx, inputs, output) -> None:
    pass


def _reload_backward(ctx, grad: torch.Tensor):
    return grad.to("cpu"), None, None


torch.library.register_autograd(reload, _reload_backward, setup_context=_reload_setup)


# --- waits: aliasing schemas, so defined with torch.library.Library ---------------------------

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_lib.define("wait_offload(Tensor(a) host, Tensor source) -> Tensor(a)", tags=_CUDAGRAPH_UNSAFE)
_lib.define("wait_reload(Tensor(a) reloaded, Tensor host) -> Tensor(a)", tags=_CUDAGRAPH_UNSAFE)


# The kernels return an alias (a new tensor sharing the storage), not the input object
# itself: the dispatcher forbids kernels below autograd from returning their inputs.


def _wait_offload_impl(host: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Compute stream waits for ``host``'s copy; ``source`` was kept alive until here.

    Two checks on CUDA. ``source`` must be the memory the offload read: where a code
    generation handed the two ops different copies of it, the one the offload read was kept
    alive by nothing and could be reused under the copy, so this raises rather than return
    a host tensor that may be torn. And where saved-tensor hooks are set (``save_on_cpu``,
    a compressing pack hook), the host tensor returned here reaches them on the CPU as the
    forward returns, before the compute stream has reached the copy's end: the CPU waits
    for the copy first."""
    pending = _pop_pending(host, "wait_offload")
    if pending is not None and pending.event is not None:
        read = pending.keepalive[0]
        if source.untyped_storage().data_ptr() != read.untyped_storage().data_ptr():
            pending.event.synchronize()  # the entry kept both ends alive: they die only after the copy
            raise RuntimeError(
                f"compile_offload.wait_offload: the tensor it keeps alive (size {tuple(source.shape)}, data_ptr "
                f"{source.data_ptr():#x}) is not the memory its offload read (data_ptr {read.data_ptr():#x}): the "
                "generated code passed the two ops different copies, so the memory the copy read was kept alive "
                "by nothing and may have been reused under it. Set compile_offload.config.offload = False for "
                "this model, and please report it")
        if saved_tensors_hooks_active():
            pending.event.synchronize()
    _wait(pending)
    return torch.ops.aten.alias.default(host)


def _wait_reload_impl(reloaded: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """Compute stream waits for ``reloaded``'s copy; ``host`` was kept alive until here."""
    _wait(_pop_pending(reloaded, "wait_reload"))
    return torch.ops.aten.alias.default(reloaded)


# One kernel for every device: the arguments mix devices (host tensor and device tensor).
_lib.impl("wait_offload", _wait_offload_impl, "CompositeExplicitAutograd")
_lib.impl("wait_reload", _wait_reload_impl, "CompositeExplicitAutograd")


def _wait_offload_fake(host: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.alias.default(host)


def _wait_reload_fake(reloaded: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.alias.default(reloaded)


torch.library.register_fake(f"{NAMESPACE}::wait_offload", _wait_offload_fake, lib=_lib)
torch.library.register_fake(f"{NAMESPACE}::wait_reload", _wait_reload_fake, lib=_lib)


class _WaitFunction(torch.autograd.Function):
    """Gradient of a wait: the identity for the waited tensor, none for the keepalive.

    ``torch.library.register_autograd`` refuses aliasing schemas, hence this manual Autograd
    kernel (used by gradcheck; the compiled graphs run without autograd)."""

    @staticmethod
    def forward(ctx, op, tensor, keepalive):
        with _below_autograd():
            return op(tensor, keepalive)

    @staticmethod
    def backward(ctx, grad):
        return None, grad, None


wait_offload = torch.ops.compile_offload.wait_offload.default
wait_reload = torch.ops.compile_offload.wait_reload.default


def _autograd_or_below(op, tensor: torch.Tensor, keepalive: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (tensor.requires_grad or keepalive.requires_grad):
        return _WaitFunction.apply(op, tensor, keepalive)
    with _below_autograd():  # compiled graphs run here: skip the autograd.Function overhead
        return op(tensor, keepalive)


def _wait_offload_autograd(host: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return _autograd_or_below(wait_offload, host, source)


def _wait_reload_autograd(reloaded: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    return _autograd_or_below(wait_reload, reloaded, host)


_lib.impl("wait_offload", _wait_offload_autograd, "Autograd")
_lib.impl("wait_reload", _wait_reload_autograd, "Autograd")

# FX's dead-code elimination must keep a wait even if its result were unused.
torch.fx.node.has_side_effect(wait_offload)
torch.fx.node.has_side_effect(wait_reload)

OFFLOAD_OPS = OffloadOps(
    offload=torch.ops.compile_offload.offload.default,
    wait_offload=wait_offload,
    reload=torch.ops.compile_offload.reload.default,
    wait_reload=wait_reload,
)
