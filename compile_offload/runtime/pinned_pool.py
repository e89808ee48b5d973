"""A bounded pool of host buffers for offloaded tensors, reused across training steps.

Why a pool: page-locking host memory (``cudaHostAlloc``/``cudaHostRegister``) is slow and
serializing (milliseconds per call), so allocating one pinned buffer per offloaded tensor per
step would dominate the step. The pool keeps every buffer it ever made and hands an idle one
out again, so in steady state a step makes no host allocation (``PoolStats.host_allocations``
stays constant; the tests assert it).

Size classes. A request of ``n`` bytes is served from a buffer of ``size_class(n)`` bytes:
``n`` rounded up to a multiple of ``2**floor(log2(n)) / 16`` (at least ``MIN_CLASS_BYTES``),
so a buffer wastes less than 1/16 (6.25%) of its size, instead of up to 50% with
power-of-two classes (reliability.md §2.2: 20.4 GiB requested became 32 GiB pinned).
Pinned buffers are whole pages, which adds less than one page: for tensors of 64 KiB and
more the pinned bytes stay below 1.1x the bytes offloaded (``pinned_bytes``; ``explain``
reports the predicted figure, ``profile_step`` the measured one). Requests that differ by a
few bytes still share a class, which keeps reuse high when shapes vary a little.

Pinning. On CUDA the buffers are page-locked. By default the pool maps fresh anonymous
memory (``mmap``: page-aligned, pages of its own) of exactly the class size, makes a tensor
whose storage starts at the mapping (``torch.frombuffer``) and page-locks the whole mapping
with ``cudaHostRegister`` (the way ``torch.distributed.checkpoint`` stages state dicts),
because torch's own pinned allocator (``pin_memory=True``) rounds every allocation up to a
power of two again. The registered range starts at the storage's start, which is the
address CUDA is asked about when torch checks ``is_pinned()`` and decides whether a
``non_blocking`` copy may run asynchronously; and two buffers never share a locked page.
If registration is unavailable or fails, the pool falls back to
``torch.empty(..., pin_memory=True)``, says so once, and counts the power of two torch pins
for it in ``bytes_held``. For CPU tensors (tests, CPU CI) the pool hands out ordinary host
memory.

When is a buffer idle? The pool keeps one tensor per buffer and hands out views of it. A
buffer is idle again when nothing but the pool references its storage: every handed-out
view, and every view or alias made from those (Inductor's ``reinterpret_tensor``, autograd's
saved tensors, ...), has died, and nobody keeps its Python storage object
(``untyped_storage()``). That is read from the storage's use count (a private torch
counter, see ``_storage_use_count``) and the storage object's reference count, so a buffer
is never handed out twice while an offloaded tensor still lives in it, whatever order
tensors die in. Where the counter does
not exist the pool still works but never reuses (it warns once).

Stream safety of reuse: see ``compile_offload.runtime.ops``. A buffer only becomes idle
after the host tensor died, which happens after the wait that follows its last copy (a copy
in flight keeps its host tensor referenced until its wait). Copies into a buffer (offloads)
run on one FIFO stream per device, so a new offload into a reused buffer runs after the
earlier ones. Copies out of it (reloads) run on another stream, and the host tensor may die
as soon as a compute stream was told to wait for the reload: a new offload issued from
another compute stream (another thread, another model) is not ordered after that reload.
So each reload hands its completion event to the pool (``note_read``), and an offload into a
reused buffer first makes its stream wait for that event (``read_event``): ordered on the
GPU, so the CPU running ahead of it neither waits nor pins more buffers.

Reuse across classes: without a limit, a request no idle buffer of its class serves takes
an idle buffer of the smallest larger class up to twice its class, before a new buffer is
pinned, so sizes that vary from step to step (dynamic shapes: batch or sequence lengths)
reuse the buffers of the larger sizes they saw. (Under a limit a small request must not take
the room a larger one needs: a class's own buffers only, idle ones of other classes freed.)

Without a limit, the pool holds at most ``AUTO_HELD_FACTOR`` times the most bytes its
buffers held live tensors at once (as read when a buffer is allocated): beyond that, idle
buffers are freed, smallest first, down to half that, before a new one is pinned, so sizes
that keep growing (a sequence-length curriculum) do not keep every earlier size's buffers
page-locked, and the device synchronization a free costs comes every few growths, not at
each.

Limit: ``limit_bytes`` (``compile_offload.config.pinned_pool_limit``) bounds the bytes the
pool holds. When a new buffer would exceed it, idle buffers of other classes are freed
first (the device is synchronised before their memory goes back, outside the pool's lock,
so other threads' offloads are not held up behind it; page-locking a new buffer also runs
outside the lock); if the buffers that hold live tensors alone leave no room, ``acquire`` raises
``PinnedPoolLimitError`` (there is no silent fallback: offloading to pageable memory would
make the copies synchronous and the plan's timing wrong).
"""

from __future__ import annotations

import itertools
import mmap
import sys
import threading
import warnings
from dataclasses import dataclass

import torch

from ..torch_api import cuda as torch_cuda

MIN_CLASS_BYTES = 512
CLASS_STEPS = 16  # size classes per power of two: waste < 1 / CLASS_STEPS
LARGER_CLASS_REUSE = 2  # an idle buffer up to this many times a request's class serves it
AUTO_HELD_FACTOR = 8  # without a limit: bytes held at most this many times the most in use at once
PAGE_BYTES = mmap.PAGESIZE


def size_class(nbytes: int) -> int:
    """The buffer size that serves a request of ``nbytes`` bytes (see the module docstring)."""
    if nbytes < 0:
        raise ValueError(f"size_class: negative size {nbytes}")
    if nbytes <= MIN_CLASS_BYTES:
        return MIN_CLASS_BYTES
    step = max(MIN_CLASS_BYTES, (1 << (nbytes.bit_length() - 1)) // CLASS_STEPS)
    return -(-nbytes // step) * step


def _pinned_class(nbytes: int) -> int:
    """Pinned buffers are whole pages: page-locking works on pages."""
    cls = size_class(nbytes)
    return -(-cls // PAGE_BYTES) * PAGE_BYTES


def pinned_bytes(tensor_bytes) -> int:
    """Pinned host bytes the pool holds for offloaded tensors of ``tensor_bytes`` bytes
    each, alive together (one buffer each), when registration works."""
    return sum(_pinned_class(n) for n in tensor_bytes if n > 0)


def _torch_pinned_bytes(nbytes: int) -> int:
    """What torch's pinned allocator (``pin_memory=True``) page-locks for ``nbytes``: the
    next power of two (its host caching allocator's block sizes)."""
    return 1 << max(nbytes - 1, 0).bit_length()


class PinnedPoolLimitError(RuntimeError):
    """The pool would have to hold more than ``compile_offload.config.pinned_pool_limit``."""


@dataclass(frozen=True)
class PoolStats:
    bytes_held: int  # bytes of all buffers the pool owns (idle or not)
    bytes_in_use: int  # bytes of buffers that still hold a live tensor
    buffers: int
    buffers_in_use: int
    host_allocations: int  # buffers ever allocated (a steady state leaves this constant)
    reuses: int  # requests served by an idle buffer
    limit_bytes: int | None


# --- private torch API (behind torch_api.cuda) -----------------------------------------------


_storage_use_count_fn = torch_cuda.storage_use_count_fn
_register_fns = torch_cuda.pin_memory_fns
_empty_host_cache = torch_cuda.empty_host_cache


# -------------------------------------------------------------------------------------------


class _Buffer:
    """One host allocation handing out ``size`` bytes and holding ``nbytes`` (what it
    page-locks: more than ``size`` only in torch's pinned allocator), page-locked by us
    when ``registered_ptr`` is set."""

    def __init__(self, tensor: torch.Tensor, nbytes: int, owner, registered_ptr: int | None,
                 from_torch_pinned: bool = False):
        self.tensor = tensor  # uint8, the bytes handed out, the pool's own reference
        self.nbytes = nbytes
        self.owner = owner  # the memory ``tensor`` lives in (an mmap for registered buffers)
        self.registered_ptr = registered_ptr
        self.from_torch_pinned = from_torch_pinned
        # torch keeps one Python storage object per storage while the storage lives: holding it
        # adds nothing to the storage's use count, so whoever keeps only that object (a hook
        # that saves storages, not tensors) shows in its Python reference count instead
        self.storage = tensor.untyped_storage()
        self.idle_refs = sys.getrefcount(self.storage)
        self.idle_use_count = _use_count(tensor)
        self.last_read = None  # the event of the latest copy out of it (a reload)

    def in_use(self) -> bool:
        count = _use_count(self.tensor)
        # Without the counter we cannot tell; such buffers are never kept (see acquire).
        return count is None or count > self.idle_use_count or sys.getrefcount(self.storage) > self.idle_refs

    def release(self) -> None:
        """Free the memory. The caller made sure no copy still uses it (see ``_release``)."""
        if self.registered_ptr is not None:
            _register_fns()[1](self.registered_ptr)
            self.registered_ptr = None
        self.tensor = self.storage = self.owner = None  # the last references: the mapping is unmapped


def _use_count(tensor: torch.Tensor) -> int | None:
    fn = _storage_use_count_fn()
    if fn is None:
        return None
    # The temporary storage object adds the same one reference each time this is measured.
    return int(fn(tensor.untyped_storage()._cdata))


class PinnedHostPool:
    """Host buffers for offloaded tensors: ``acquire(nbytes, device)`` returns ``nbytes`` bytes.

    ``device`` is the device the tensor lives on: CUDA devices get page-locked memory, CPU
    plain memory. Thread-safe (the autograd engine runs CUDA backward on its own thread).
    """

    def __init__(self, limit_bytes: int | None = None, *, use_host_register: bool = True):
        self._lock = threading.Lock()
        self._buffers: dict[tuple[str, int], list[_Buffer]] = {}
        self._next: dict[tuple[str, int], int] = {}  # where the next scan of a class starts
        self._by_storage: dict[int, _Buffer] = {}  # a buffer by its storage's address (note_read)
        self._bytes_held = 0  # bytes of the buffers in ``_buffers``
        self._peak_in_use = 0  # the most bytes in use at once, as read when allocating
        self._reserved = 0  # bytes of buffers being allocated right now (outside the lock)
        self._limit, self._set_by = None, ""
        self.set_limit(limit_bytes)
        self._use_host_register = use_host_register
        self._host_allocations = 0
        self._reuses = 0
        self._warned: set[str] = set()

    # --- configuration ---------------------------------------------------------------------

    @property
    def limit_bytes(self) -> int | None:
        return self._limit

    def set_limit(self, limit_bytes: int | None, set_by: str = "compile_offload.config.pinned_pool_limit") -> None:
        """Bound the bytes held (None: unbounded). Idle buffers above a lowered limit are freed.
        ``set_by``: where the limit comes from, which its error names."""
        if limit_bytes is not None and (isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0):
            raise ValueError(f"pinned pool limit must be None or a non-negative int of bytes, got {limit_bytes!r}")
        with self._lock:
            self._limit, self._set_by = limit_bytes, set_by
            released = self._free_idle_until(limit_bytes) if limit_bytes is not None else []
        _release(released)

    # --- use -------------------------------------------------------------------------------

    def acquire(self, nbytes: int, device: torch.device | str) -> torch.Tensor:
        """A uint8 host tensor of exactly ``nbytes`` bytes (64-byte aligned), for ``device``'s data.

        The memory is the caller's until the returned tensor and every alias of it died.
        """
        device = torch.device(device)
        if nbytes <= 0:
            raise ValueError(f"acquire: need a positive byte count, got {nbytes}")
        pinned = device.type == "cuda"
        cls = _pinned_class(nbytes) if pinned else size_class(nbytes)
        key = (str(device) if pinned else "cpu", cls)
        with self._lock:
            buffer = self._idle_buffer(key) or (self._idle_larger_buffer(key) if self._limit is None else None)
            if buffer is not None:
                self._reuses += 1
                return buffer.tensor[:nbytes]
            released = self._make_room(cls) if self._limit is not None else self._auto_room(cls)
            self._reserved += cls  # counted against the limit while allocated outside the lock
        try:
            _release(released)
            buffer = self._allocate(cls, pinned)
        finally:
            with self._lock:
                self._reserved -= cls
        with self._lock:
            self._host_allocations += 1
            if buffer.idle_use_count is not None:
                self._add(key, buffer)
            else:
                self._warn_once("no-count", "compile_offload: this torch has no storage use counter; "
                                "the pinned pool allocates every buffer anew (no reuse)")
            return buffer.tensor[:nbytes]

    def note_read(self, host: torch.Tensor, event) -> None:
        """A copy out of ``host`` (a reload on its own stream) completes at ``event``: the
        next copy into the buffer holding ``host``, whatever stream it is issued from, waits
        for it (``read_event``; the module docstring)."""
        with self._lock:
            buffer = self._by_storage.get(host.untyped_storage().data_ptr())
            if buffer is not None:
                buffer.last_read = event

    def read_event(self, host: torch.Tensor):
        """The event of the latest copy out of the buffer holding ``host`` (None: none noted),
        which a copy into it must wait for. Asked right after ``acquire``: the buffer is the
        caller's, so no other reload of it can be noted since."""
        with self._lock:
            buffer = self._by_storage.get(host.untyped_storage().data_ptr())
            return None if buffer is None else buffer.last_read

    def stats(self) -> PoolStats:
        with self._lock:
            buffers = [b for bucket in self._buffers.values() for b in bucket]
            in_use = [b for b in buffers if b.in_use()]
            return PoolStats(
                bytes_held=sum(b.nbytes for b in buffers),
                bytes_in_use=sum(b.nbytes for b in in_use),
                buffers=len(buffers),
                buffers_in_use=len(in_use),
                host_allocations=self._host_allocations,
                reuses=self._reuses,
                limit_bytes=self._limit,
            )

    def trim(self) -> int:
        """Free every idle buffer; returns the bytes freed. Buffers holding live tensors stay."""
        with self._lock:
            released = self._free_idle_until(0)
        _release(released)
        return sum(buffer.nbytes for _, buffer in released)

    # --- internals (called with the lock held) ---------------------------------------------

    def _idle_buffer(self, key: tuple[str, int]) -> _Buffer | None:
        """An idle buffer of ``key``'s class. The scan starts after the one handed out last,
        where the next idle one usually is: a step's offloads take a class's buffers in turn,
        and a scan from the start made n offloads of one size cost n**2 / 2 reads."""
        bucket = self._buffers.get(key, ())
        start = self._next.get(key, 0)
        for index in itertools.chain(range(start, len(bucket)), range(min(start, len(bucket)))):
            if not bucket[index].in_use():
                self._next[key] = index + 1
                return bucket[index]
        return None

    def _idle_larger_buffer(self, key: tuple[str, int]) -> _Buffer | None:
        """An idle buffer of the smallest larger class up to ``LARGER_CLASS_REUSE`` times
        ``key``'s, of the same device."""
        device, cls = key
        larger = sorted(other for other in self._buffers
                        if other[0] == device and cls < other[1] <= LARGER_CLASS_REUSE * cls)
        for other in larger:
            buffer = self._idle_buffer(other)
            if buffer is not None:
                return buffer
        return None

    def _add(self, key: tuple[str, int], buffer: _Buffer) -> None:
        self._buffers.setdefault(key, []).append(buffer)
        self._by_storage[buffer.tensor.untyped_storage().data_ptr()] = buffer
        self._bytes_held += buffer.nbytes

    def _remove(self, key: tuple[str, int], buffer: _Buffer) -> None:
        self._buffers[key].remove(buffer)
        if not self._buffers[key]:
            del self._buffers[key]
            self._next.pop(key, None)
        self._by_storage.pop(buffer.tensor.untyped_storage().data_ptr(), None)
        self._bytes_held -= buffer.nbytes

    def _held(self) -> int:
        return self._bytes_held + self._reserved

    def _auto_room(self, nbytes: int) -> list[tuple[tuple[str, int], _Buffer]]:
        """Without a limit: idle buffers to free, smallest first, so that the pool holds at
        most ``AUTO_HELD_FACTOR`` times the most bytes in use at once (module docstring)."""
        if self._held() + nbytes <= AUTO_HELD_FACTOR * self._peak_in_use:
            return []  # the common case reads no buffer's count
        in_use = sum(b.nbytes for bucket in self._buffers.values() for b in bucket if b.in_use())
        self._peak_in_use = max(self._peak_in_use, in_use + nbytes)
        return self._free_idle_until(AUTO_HELD_FACTOR * self._peak_in_use // 2 - nbytes, smallest_first=True)

    def _free_idle_until(self, target_bytes: int, smallest_first: bool = False) -> list[tuple[tuple[str, int], _Buffer]]:
        """Take idle buffers out of the pool, largest first (or smallest), until at most
        ``target_bytes`` are held; returns them (key, buffer) for ``_release`` once the lock
        is let go."""
        if self._held() <= target_bytes:
            return []
        idle = sorted(
            ((key, b) for key, bucket in self._buffers.items() for b in bucket if not b.in_use()),
            key=lambda kb: kb[1].nbytes if smallest_first else -kb[1].nbytes,
        )
        released = []
        for key, buffer in idle:
            if self._held() <= target_bytes:
                break
            self._remove(key, buffer)
            released.append((key, buffer))
        return released

    def _make_room(self, nbytes: int) -> list[tuple[tuple[str, int], _Buffer]]:
        """Idle buffers to free so that ``nbytes`` more fit the limit (taken out of the pool),
        or ``PinnedPoolLimitError``."""
        if self._limit is None:
            return []
        released = self._free_idle_until(self._limit - nbytes)
        held = self._held()
        if held + nbytes > self._limit:
            self._restore(released)
            in_use = sum(b.nbytes for bucket in self._buffers.values() for b in bucket if b.in_use())
            raise PinnedPoolLimitError(
                f"compile_offload: offloading needs a {nbytes}-byte host buffer, but the pinned pool "
                f"already holds {held} bytes of its {self._limit}-byte limit ({in_use} bytes hold "
                f"offloaded tensors that are still alive). The limit was set by {self._set_by} (the pool is one per "
                "process: the latest compile with offload on sets it for every model). Raise it (None: no "
                "limit) or offload less (a larger memory_budget)."
            )
        return released

    def _restore(self, taken: list[tuple[tuple[str, int], _Buffer]]) -> None:
        """Put buffers ``_free_idle_until`` took back (the room they made was not enough)."""
        for key, buffer in taken:
            self._add(key, buffer)

    def _allocate(self, nbytes: int, pinned: bool) -> _Buffer:
        if not pinned:
            tensor = torch.empty(nbytes, dtype=torch.uint8)
            return _Buffer(tensor, nbytes, tensor, None)
        fns = _register_fns() if self._use_host_register else None
        if fns is not None:
            try:
                return _allocate_registered(nbytes, *fns)
            except RuntimeError as error:
                self._warn_once("register", f"compile_offload: cudaHostRegister failed ({error}); "
                                "using torch's pinned allocator, which rounds sizes up to powers of two")
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return _Buffer(tensor, _torch_pinned_bytes(nbytes), tensor, None, from_torch_pinned=True)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)


def _allocate_registered(nbytes: int, register, unregister) -> _Buffer:
    """``nbytes`` (whole pages) of fresh anonymous memory, page-locked by ``register``.

    The tensor's storage starts at the mapping's first byte, which is where the registered
    range starts: ``is_pinned()`` asks CUDA about the storage's start, so it holds exactly
    when the registration took."""
    mapping = mmap.mmap(-1, nbytes)  # page-aligned; its pages are this buffer's alone
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    register(tensor.data_ptr(), nbytes)
    if not tensor.is_pinned():
        # A non_blocking copy into pageable memory would not be asynchronous: refuse.
        unregister(tensor.data_ptr())
        raise RuntimeError("registered memory does not report as pinned")
    return _Buffer(tensor, nbytes, mapping, tensor.data_ptr())


def _release(released: list[tuple[tuple[str, int], _Buffer]]) -> None:
    """Free buffers taken out of a pool; called without the pool's lock held.

    An idle buffer's last copy may still be running on the GPU (the host tensor can die as
    soon as the compute stream was told to wait for it), so every copy of its device is
    finished before the memory goes back to the system. This only happens under limit
    pressure, past the bound without a limit, or on an explicit trim or lower limit, never
    in a steady state."""
    if not released:
        return
    for device in {key[0] for key, _ in released if key[0] != "cpu"}:
        torch.cuda.synchronize(device)
    from_torch = any(buffer.from_torch_pinned for _, buffer in released)
    for _, buffer in released:
        buffer.release()
    if from_torch:
        _empty_host_cache()  # torch keeps freed pinned blocks cached otherwise


_default_pool = PinnedHostPool()


def get_pool() -> PinnedHostPool:
    """The pool the offload ops draw from."""
    return _default_pool


def set_limit(limit_bytes: int | None, set_by: str = "compile_offload.config.pinned_pool_limit") -> None:
    """Set the default pool's limit (the backend passes ``Settings.pinned_pool_limit``, and
    where it was set: the config, or a compile's options)."""
    _default_pool.set_limit(limit_bytes, set_by)
