"""Where the optimizer steps the state that lives on the host: on the host, or streamed
through the device, whichever the first steps measure faster.

FSDP2's ``CPUOffloadPolicy`` leaves the optimizer step on the host: the optimizer the user
built steps the host shards of the parameters with their host gradients and state. The
device is often faster at the arithmetic, the copies are not free, and which wins depends on
the host's cores, the link and the optimizer. ``OptimizerStep`` runs the step either way:

- **host**: ``optimizer.step()`` as torch runs it;
- **device** (streamed): the parameters whose local tensors are on the host, a group of them
  at a time (``chunk_bytes`` of parameters, gradients and state), are copied to the device,
  stepped there by a copy of the same optimizer with the same hyperparameters, and copied
  back. On CUDA the next group's upload (one copy stream) overlaps this group's step, and its
  download (another) the next group's; each group's step waits for its upload's event, its
  download for the step's, and the step ends with the download stream synchronized, so the
  host tensors are complete before anything reads them. Once the streamed groups are issued,
  the user's ``optimizer.step()`` steps the rest (the parameters already on the device, FSDP2
  groups without offload; host parameters too large for a group, while the device works),
  with the streamed ones' gradients set aside, so that its hooks and LR schedulers see one
  step as usual.

``mode="auto"`` decides by measurement: the first step runs on the host (it creates the
state as torch's optimizer does), the second streams untimed (it pins the host state and
makes the streams, once), then ``TRIALS`` steps each way alternate, timed with the device
synchronized before and after. The streamed step wins where its slowest trial beats
the host's fastest (faster beyond the trials' spread; otherwise torch's own way stays). On N
ranks the times are summed over the ranks first, so that every rank picks the same. Every
trial step is a real step: training is the same either way, within the arithmetic's rounding.

Whichever way it runs, where the optimizer is torch's Adam, AdamW or SGD with its
implementation left to torch (``fused`` and ``foreach`` unset), ``prefer_fused`` sets
``fused=True``: torch's default on the host is its for-loop implementation, several times
slower than the fused one (docs/design.md); with the state on a CUDA device torch's default
for Adam and AdamW (foreach) holds temporaries of the parameters' size that the budget leaves
out, while the fused kernels step in place (SGD is left to torch there). SGD's fused op has no rule for FSDP2's sharded parameters (DTensors), so on
the host its groups holding them get ``foreach=True``. A ``fused`` or ``foreach`` the user
set is kept.

Limits: the streamed path handles torch.optim's own optimizers (the state of a parameter:
tensors of its shape, and scalar step counters kept where the optimizer keeps them); other
optimizers step on the host. A parameter is never split across groups: one whose parameter +
gradient + state exceed ``chunk_bytes`` steps on the host (through the user's optimizer,
while the device steps the rest); where none fits, the whole step stays on the host.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..passes.plan import format_bytes
from ..torch_api import optim

log = logging.getLogger(__name__)

HOST, DEVICE, AUTO = "host", "device", "auto"
MODES = (AUTO, HOST, DEVICE)
TRIALS = 2  # timed steps each way under mode="auto"


# torch.optim's classes with a fused implementation on both the CPU and CUDA.
FUSED_ON_HOST_AND_DEVICE = ("Adam", "AdamW", "SGD")
# Those whose fused op has a DTensor sharding rule (torch 2.11-2.14: aten._fused_adam(w)_, not
# aten._fused_sgd_), so that it steps FSDP2's sharded parameters; the others take foreach.
FUSED_ON_DTENSORS = ("Adam", "AdamW")


def prefer_fused(optimizer: torch.optim.Optimizer, on_host: bool = True) -> str | None:
    """Set ``fused=True`` in each parameter group that leaves the implementation to torch
    (``fused`` and ``foreach`` None, not ``differentiable``, floating-point parameters) of a
    torch.optim Adam, AdamW or SGD; a note saying so, or None where nothing changed.

    ``on_host``: the state steps on the host, where torch's default is its for-loop; groups
    holding FSDP2's sharded parameters (DTensors) whose fused op has no rule for them (SGD)
    get ``foreach=True`` instead. Else all of it is on the device, where torch's default
    (foreach) holds temporaries of the parameters' size that the step's budget does not
    count (Adam's square roots of its second moments), and the fused kernels step in place;
    there SGD is left to torch (its default holds no such temporaries)."""
    cls = type(optimizer)
    if cls.__name__ not in FUSED_ON_HOST_AND_DEVICE or not cls.__module__.startswith("torch.optim"):
        return None
    changed: dict[str, int] = defaultdict(int)
    for group in optimizer.param_groups:
        if (group.get("fused") is None and group.get("foreach") is None and not group.get("differentiable")
                and all(torch.is_floating_point(p) for p in group["params"])):
            sharded = any(hasattr(p, "to_local") for p in group["params"])
            kind = "foreach" if sharded and cls.__name__ not in FUSED_ON_DTENSORS else "fused"
            if not on_host and cls.__name__ not in FUSED_ON_DTENSORS:
                continue  # SGD's default holds no temporaries of the parameters' size (and fused SGD refuses sparse gradients)
            group[kind] = True
            changed[kind] += 1
    if not changed:
        return None
    said = " and ".join(f"{kind}=True in {count}" for kind, count in sorted(changed.items(), reverse=True))
    start = f"{cls.__name__}: {said} of {len(optimizer.param_groups)} parameter group(s) that left the implementation to torch: "
    if not on_host:
        return (start + "its fused kernels step the state on the device in place, where torch's default (foreach) "
                "holds temporaries of the parameters' size that the budget does not count")
    return (start + "its " + ("fused kernels" if "fused" in changed else "foreach kernels")
            + ", not its default for-loop, step the state on the host"
            + ("" if "foreach" not in changed else
               " (foreach where its fused op has no rule for FSDP2's sharded parameters)"))


def fused_without_dtensor_rule(optimizer: torch.optim.Optimizer) -> str | None:
    """The class name of a torch.optim optimizer with ``fused=True`` in a group whose fused op
    has no rule for FSDP2's sharded parameters (not in ``FUSED_ON_DTENSORS``: SGD), else None."""
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim") or cls.__name__ in FUSED_ON_DTENSORS:
        return None
    return cls.__name__ if any(group.get("fused") for group in optimizer.param_groups) else None


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"compile_offload.fit: optimizer_step must be one of {', '.join(map(repr, MODES))}, "
                         f"not {mode!r}")


class _StagingFailed(Exception):
    """A group ran out of device memory, copied to the device (``OptimizerStep._stage_or_stop``)
    or stepped there (``OptimizerStep._step_or_stop``), with nothing of it written to the host."""

    def __init__(self, doing: str):
        super().__init__(doing)
        self.doing = doing  # "staging" or "stepping"


def _ms(seconds: list[float]) -> str:
    return ", ".join(f"{1e3 * s:.2f}" for s in seconds)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a tensor aliasing its storage), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class _Staged:
    """One group of host parameters with their device copies."""

    params: list[nn.Parameter]
    shadows: list[nn.Parameter]  # the device copies, with their gradients
    states: list[dict]  # per parameter: its state, tensors of its shape on the device
    ready: torch.cuda.Event | None = None


@dataclass
class OptimizerStep:
    """``step()`` steps ``optimizer``, its host state where ``mode`` says (module docstring).

    ``device``: where the streamed step runs; ``chunk_bytes``: the most device memory one
    group of parameters may take (three groups are in flight at once on CUDA: uploading,
    stepping, downloading); ``timer``: the clock the trials read."""

    optimizer: torch.optim.Optimizer
    device: torch.device
    mode: str = AUTO
    chunk_bytes: int = 0
    timer: Callable[[], float] = time.perf_counter
    chosen: str | None = None  # where the host state steps; None while measuring
    times: dict[str, list[float]] = field(default_factory=lambda: {HOST: [], DEVICE: []})
    why: str = ""  # why the step stays on the host, when it does without measuring
    too_large: str = ""  # which host parameters step on the host even when the rest streams
    checked: bool = False
    stepped: bool = False  # whether a step has run
    warned_hooks: bool = False  # the step pre-hooks' warning was given
    warmed: bool = False  # the untimed streamed step before the trials has run

    def __post_init__(self) -> None:
        check_mode(self.mode)
        self.device = torch.device(self.device)
        self._streams = None
        if self.mode == HOST:
            self.chosen = HOST
        elif not type(self.optimizer).__module__.startswith("torch.optim"):
            self.chosen, self.why = HOST, (f"{type(self.optimizer).__name__} is not one of torch.optim's optimizers, "
                                           "whose state the streamed step knows")
        elif self.mode == AUTO and self.device.type != "cuda":
            self.chosen, self.why = HOST, "on the CPU the host is the device: streaming would copy memory to itself"
        elif self.mode == DEVICE:
            self.chosen = DEVICE

    # ------------------------------------------------------------------ the step

    def step(self) -> None:
        if not self.optimizer.state and not self.stepped:
            self.stepped = True
            self.optimizer.step()  # the first step creates the state, as torch's optimizer does
            return
        self.stepped = True  # an optimizer without state (SGD without momentum) goes on from here too
        if not self.checked:  # the first step with state: can every rank stream its parameters?
            self.checked = True
            if self.chosen != HOST and not self._fits_on_every_rank():
                self.chosen = HOST
        if self.chosen is not None:
            self._streamed() if self.chosen == DEVICE else self.optimizer.step()
            return
        if not self.warmed:  # the first streamed step pins the host state and makes its streams: not timed
            self.warmed = True
            self._streamed()
            return
        where = DEVICE if len(self.times[DEVICE]) <= len(self.times[HOST]) else HOST
        self._synchronize()
        start = self.timer()
        self._streamed() if where == DEVICE else self.optimizer.step()
        self._synchronize()
        self.times[where].append(self.timer() - start)
        if min(len(t) for t in self.times.values()) >= TRIALS:
            self._choose()

    def _fits(self) -> bool:
        """Whether any host parameter fits one group (those that do not step on the host)."""
        host = self._host_params()
        streamed = self._streamable(host)
        too_large = [p for p in host if id(p) not in streamed]
        if too_large:
            largest = max(self._footprint(p) for p in too_large)
            self.too_large = (f"{len(too_large)} of {len(host)} host parameters step on the host: with its gradient "
                              f"and state each takes more than one group's {format_bytes(self.chunk_bytes)} (the "
                              f"largest {format_bytes(largest)})")
        if not streamed:
            self.why = self.too_large
            return False
        return True

    def _fits_on_every_rank(self) -> bool:
        """Whether every rank has host parameters that fit a group (ranks hold shards of
        different sizes; all must take the same path, or the trials' sums would wait on each
        other)."""
        fits = self._fits()
        if self._summed_over_ranks([0.0 if fits else 1.0])[0] > 0 and fits:
            self.why = "on another rank no parameter's shard with its gradient and state fits one group"
            return False
        return fits

    def _streamable(self, params: list[nn.Parameter]) -> set[int]:
        return {id(p) for p in params if self._footprint(p) <= self.chunk_bytes}

    def _summed_over_ranks(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return values
        summed = torch.tensor(values, dtype=torch.float64, device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(summed)
        return summed.tolist()

    def _choose(self) -> None:
        host, device = self._summed_over_ranks([min(self.times[HOST]), max(self.times[DEVICE])])
        self.chosen = DEVICE if device < host else HOST  # streamed only where faster beyond the trials' spread
        log.info("compile_offload.fit: optimizer step measured, host %s ms, streamed through the device %s ms: %s",
                 _ms(self.times[HOST]), _ms(self.times[DEVICE]), self.chosen)

    def describe(self) -> str:
        """Where the host state steps, and why, in one line (for the plan's notes)."""
        if self.chosen is None:
            return (f"optimizer step: measuring, host against streamed through the device ({TRIALS} steps each, "
                    "after a first step on the host and an untimed streamed one)")
        where = "on the host" if self.chosen == HOST else (
            f"streamed through the device, {format_bytes(self.chunk_bytes)} of parameters, gradients and state "
            "at a time")
        partly = f"; {self.too_large}" if self.chosen == DEVICE and self.too_large else ""
        if self.times[HOST] and self.times[DEVICE]:
            host, device = (sum(t) / len(t) * 1e3 for t in (self.times[HOST], self.times[DEVICE]))
            return f"optimizer step {where}: measured host {host:.2f} ms, streamed {device:.2f} ms{partly}"
        return f"optimizer step {where}" + (f" ({self.why})" if self.why and self.chosen == HOST else "") + partly

    # ------------------------------------------------------------------ streamed through the device

    def _host_params(self) -> list[nn.Parameter]:
        """The parameters with a gradient whose local tensors are on the host (all of them on
        a CPU device, where the streamed step copies memory to itself)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]
                if p.grad is not None and (self.device.type == "cpu" or _local(p).device.type == "cpu")]

    def _footprint(self, param: nn.Parameter) -> int:
        state = self.optimizer.state.get(param, {})
        tensors = [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return _nbytes(_local(param)) * 2 + sum(_nbytes(_local(v)) for v in tensors)

    def _streamed(self) -> None:
        """The host parameters that fit a group streamed through the device (issued first: on
        CUDA asynchronous), then the user's ``optimizer.step()`` for the rest with the streamed
        ones' gradients set aside (the parameters on the device, host parameters too large for
        a group: on the host this runs while the device works; the hooks and the schedulers'
        count), then the downloads waited for."""
        # A parameter without state yet where others have theirs (its first gradient: unfrozen,
        # or unused until now) steps on the host, where the optimizer creates its state, as
        # every first step does. An optimizer without state (SGD without momentum) streams all.
        host = self._host_params()
        if any(self.optimizer.state.get(p) for p in host):
            host = [p for p in host if self.optimizer.state.get(p)]
        streamed = self._streamable(host)
        if streamed and not self.warned_hooks and optim.step_pre_hook_count(self.optimizer):
            self.warned_hooks = True
            warnings.warn("compile_offload.fit: the optimizer has step pre-hooks; streamed through the device "
                          f"({len(streamed)} host parameters), the host state is stepped before optimizer.step() "
                          "runs them, so a pre-hook that changes gradients (clipping) does not reach those "
                          "parameters. Clip with fit(..., max_grad_norm=...), or pass optimizer_step='host'",
                          stacklevel=4)
        stepped: set[int] = set()
        try:
            with torch.no_grad():
                for group in self.optimizer.param_groups:
                    chunks = self._chunks([p for p in group["params"] if id(p) in streamed])
                    self._step_chunks(group, chunks, stepped)
        except _StagingFailed as failed:  # the groups not stepped yet step on the host, below
            self._synchronize_streams()  # the downloads written, the failed group's uploads done reading
            # measured faster, the streamed step stays on the host from now on: a shortage of
            # device memory between steps recurs, and each out-of-memory empties the allocator's
            # cache. While measuring the trials go on (every rank must time the same steps), and
            # a forced "device" keeps trying.
            settled = self.mode == AUTO and self.chosen == DEVICE
            warnings.warn(f"compile_offload.fit: the streamed optimizer step ran out of device memory {failed.doing} a "
                          f"group of parameters ({failed.__cause__}); the {len(streamed) - len(stepped)} host "
                          "parameters not stepped yet stepped on the host this step"
                          + ("; the optimizer steps on the host from now on" if settled else ""), stacklevel=4)
            if settled:
                self.chosen, self.why = HOST, "the streamed step ran out of device memory"
            streamed = stepped
        except BaseException:
            self._synchronize_streams()  # nothing reads or writes host tensors under a copy after this
            raise
        set_aside = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) in streamed:
                    set_aside[p], p.grad = p.grad, None
        try:
            if self._streams is not None and (optim.step_pre_hook_count(self.optimizer)
                                              or optim.step_post_hook_count(self.optimizer)):
                # step hooks run inside optimizer.step(): they read (an EMA, a norm logged) or
                # change (a clamp) the host tensors the downloads are writing
                self._streams[1].synchronize()
            self.optimizer.step()
        finally:
            for p, grad in set_aside.items():
                p.grad = grad
            if self._streams is not None:
                self._streams[1].synchronize()  # the host tensors complete before anything reads them

    def _chunks(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        chunks: list[list[nn.Parameter]] = []
        used = 0
        for p in params:
            size = self._footprint(p)
            if not chunks or used + size > self.chunk_bytes:
                chunks.append([])
                used = 0
            chunks[-1].append(p)
            used += size
        return chunks

    def _moves(self, value: object, group: dict) -> bool:
        """Whether a state entry goes to the device: tensors of the parameter's shape, and
        scalar step counters only where the optimizer keeps them on the device (fused,
        capturable)."""
        if not isinstance(value, torch.Tensor):
            return False
        return value.dim() > 0 or bool(group.get("fused") or group.get("capturable"))

    def _synchronize_streams(self) -> None:
        for stream in self._streams or ():
            stream.synchronize()

    def _step_chunks(self, group: dict, chunks: list[list[nn.Parameter]], stepped: set[int]) -> None:
        """Stream ``chunks`` through the device, adding each stepped parameter's id to
        ``stepped``; ``_StagingFailed`` where a group ran out of device memory, copied there or
        stepped (the groups before it stepped, it and those after it untouched on the host)."""
        if not chunks:
            return
        cuda = self.device.type == "cuda"
        if cuda and self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        compute = torch.cuda.current_stream(self.device) if cuda else None
        staged = self._stage_or_stop(chunks[0], group)
        for index in range(len(chunks)):
            current = staged
            staged = self._stage_or_stop(chunks[index + 1], group) if index + 1 < len(chunks) else None
            if current.ready is not None:
                compute.wait_event(current.ready)
            self._step_or_stop(current, group)
            self._unstage(current, group)
            stepped.update(map(id, current.params))

    def _stage_or_stop(self, params: list[nn.Parameter], group: dict) -> _Staged:
        """``_stage``; out of device memory there, nothing of the group has been stepped (its
        host tensors are only read), so the host can step it: ``_StagingFailed``."""
        try:
            return self._stage(params, group)
        except torch.OutOfMemoryError as error:
            raise _StagingFailed("staging") from error

    def _step_or_stop(self, staged: _Staged, group: dict) -> None:
        """Step ``staged`` on the device with a copy of the optimizer (same class and defaults,
        none of the user's hooks: the global ones run once, in the user's optimizer.step()).
        Out of device memory there, the host's step counters the step shares (scalars kept on
        the host) are put back, so nothing of the group has changed on the host and the host
        can step it: ``_StagingFailed``."""
        inner = copy.copy(self.optimizer)
        inner.param_groups = [{**group, "params": staged.shadows}]
        inner.state = defaultdict(dict, zip(staged.shadows, staged.states))
        shared = [(value, value.clone()) for state in staged.states for value in state.values()
                  if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not self._moves(value, group)]
        try:
            optim.step_without_hooks(inner)
        except torch.OutOfMemoryError as error:
            with torch.no_grad():
                for value, before in shared:
                    value.copy_(before)
            raise _StagingFailed("stepping") from error

    def _stage(self, params: list[nn.Parameter], group: dict) -> _Staged:
        cuda = self.device.type == "cuda"
        shadows, states = [], []
        upload = None
        if cuda:
            upload = self._streams[0]
            upload.wait_stream(torch.cuda.current_stream(self.device))  # the memory may be the last group's
        for p in params:
            shadow = nn.Parameter(self._to_device(_local(p), upload), requires_grad=p.requires_grad)
            shadow.grad = self._to_device(_local(p.grad), upload)
            state = self.optimizer.state[p]
            if cuda:
                self._pin(state, group)
            shadows.append(shadow)
            states.append({k: self._to_device(_local(v), upload) if self._moves(v, group) else v
                           for k, v in state.items()})
        ready = upload.record_event() if cuda else None
        return _Staged(params=params, shadows=shadows, states=states, ready=ready)

    def _unstage(self, staged: _Staged, group: dict) -> None:
        cuda = self.device.type == "cuda"
        context = contextlib.nullcontext()
        if cuda:
            compute, download = torch.cuda.current_stream(self.device), self._streams[1]
            download.wait_stream(compute)  # after this group's step
            context = torch.cuda.stream(download)
        with context:
            for p, shadow, state in zip(staged.params, staged.shadows, staged.states):
                _local(p).copy_(shadow.detach(), non_blocking=cuda)
                host_state = self.optimizer.state[p]
                for key, value in state.items():
                    if self._moves(host_state[key], group):
                        _local(host_state[key]).copy_(value, non_blocking=cuda)
                if cuda:  # allocated on the step's stream, written by the upload's (recorded then), read by the download's
                    for tensor in (shadow, shadow.grad, *(v for v in state.values() if isinstance(v, torch.Tensor))):
                        if tensor.device.type == "cuda":
                            tensor.record_stream(download)

    def _to_device(self, tensor: torch.Tensor, upload: Any = None) -> torch.Tensor:
        """A copy of ``tensor`` on the device (a copy even where the device is the host), made
        on the ``upload`` stream where there is one. Its memory is allocated on the current
        (the step's) stream, whose pool serves the next forward once the group is done: on
        the upload stream's it would stay cached beside the budget, unseen by the allocated
        bytes the step's meter reads."""
        out = torch.empty_like(tensor, device=self.device)
        if upload is None:
            out.copy_(tensor)
            return out
        with torch.cuda.stream(upload):
            out.copy_(tensor, non_blocking=True)
        out.record_stream(upload)
        return out

    def _pin(self, state: dict, group: dict) -> None:
        """Pin the host state that moves once, so that its copies are asynchronous (torch's
        optimizer makes it with ``zeros_like``, which does not pin), the fused kernels' step
        counters with it: a pageable one makes its non-blocking copies synchronous."""
        for value in state.values():
            if self._moves(value, group):
                local = _local(value)
                if local.device.type == "cpu" and not local.is_pinned():
                    local.data = local.pin_memory()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
