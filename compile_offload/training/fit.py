"""``compile_offload.fit``: one device byte budget for the whole training step.

The model as the user has it (typically on the host), a function that builds its optimizer,
a sample batch and one budget. ``fit`` measures the state's sizes and the activations of one
block of each kind (``compile_offload.explain`` at ``memory_budget=0.0``), decides the placement
(``state_plan.plan_step``), prepares the model with torch's own engine where the state goes
to the host (FSDP2's ``fully_shard`` with ``CPUOffloadPolicy`` on the root and on every
block whose state does not fit on the device), compiles every block with this backend under its share of the budget, builds the
optimizer on the prepared parameters and returns a ``Fitted`` whose ``step`` trains as an
ordinary loop would.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..passes.plan import format_bytes
from ..torch_api.utils import parameter_hooks, tree_leaves, tree_map
from .optimizer_state import optimizer_state_bytes
from .optimizer_step import OptimizerStep, check_mode, fused_without_dtensor_rule, prefer_fused
from .state_plan import StateSizes, StepPlan, plan_step

# Times the blocks are compiled again under a lower budget after a measured step over it.
MAX_CORRECTIONS = 2


@dataclass
class Fitted:
    """A model prepared by ``fit``: ``step(*inputs)`` runs forward, loss, backward,
    ``optimizer.step()`` and ``optimizer.zero_grad()`` and returns the loss (detached)."""

    plan: StepPlan
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor] | None
    device: torch.device
    # clips the gradients' total norm after the backward, before any optimizer step
    max_grad_norm: float | None = None
    created_process_group: bool = False
    # the one-rank group fit created that this model trains in (``close`` leaves that one only)
    joined_group: Any = field(default=None, repr=False)
    # steps the optimizer: the host state where the plan says (``optimizer_step.OptimizerStep``)
    optimizer_step: OptimizerStep | None = None
    # measures one whole step's device peak at the allocator (CUDA: ``CudaStepMeter``; None on the CPU)
    meter: Any = None
    steps: int = 0
    closed: bool = False
    # compiles the blocks again under a per-block budget (``fit``'s ``compile_blocks``), and
    # the lowest one they can take (their minimum-memory plan's peak)
    recompile: Callable[[int], None] | None = None
    block_min_bytes: int = 0
    block_kinds: int = 1  # the most kinds of blocks one forward's code is compiled for
    blocks: list[nn.Module] = field(default_factory=list, repr=False)  # the modules compiled one by one
    corrections: int = 0
    settling: int = 0  # steps to run after a recompile before the next measured one
    # fit's sample was a dict of keyword inputs: step(batch) with one dict takes it as step(**batch)
    keyword_sample: bool = False
    # that dict held a "target": the model's input, so step(**batch) gives target= to the model
    target_is_input: bool = False

    def step(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """One training step on ``inputs`` (moved to the device); ``loss_fn(output)``, or
        ``loss_fn(output, target)`` when a target is given; without ``loss_fn`` the model's
        output is the loss (a scalar tensor, an object with a ``.loss``, or a dict with a
        ``"loss"``). Where fit's sample was a dict of keyword inputs, ``step(batch)`` with one
        dict is ``step(**batch)``, as fit took the sample; where that dict held a ``"target"``,
        ``target=`` is the model's keyword input, as it was in the sample."""
        if self.closed:
            raise RuntimeError("compile_offload.fit: step() after close(): this Fitted left its process group; call "
                               "fit again on a new model (or one loaded from this one's state_dict) to train on")
        if self.keyword_sample and len(inputs) == 1 and isinstance(inputs[0], Mapping) and not kwargs:
            inputs, kwargs = (), dict(inputs[0])
        if self.target_is_input and target is not None:
            if "target" in kwargs:  # step(batch, target=t): which one the model takes is not for us to guess
                raise TypeError("compile_offload.fit: step() got the model's input 'target' twice (in the batch and "
                                "as target=); fit's sample has a 'target' key, so target= is the model's input too")
            kwargs, target = {**kwargs, "target": target}, None
        if target is not None and self.loss_fn is None:
            raise TypeError("compile_offload.fit: step(..., target=...) needs fit(..., loss_fn=...): without a loss "
                            "function the model's output is the loss, and the target would be ignored")
        self.steps += 1
        metered = self._measures_this_step()
        if metered:
            self.meter.start()
        output = self.model(*_to(inputs, self.device), **_to(kwargs, self.device))
        if self.loss_fn is not None:
            loss = self.loss_fn(output) if target is None else self.loss_fn(output, _to(target, self.device))
        else:
            loss = output["loss"] if isinstance(output, Mapping) and "loss" in output else getattr(output, "loss", output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("compile_offload.fit: the loss must be a one-element tensor; pass loss_fn= when the "
                            f"model's output is not its loss (got {type(loss).__name__})")
        del output  # the logits (a model output's cache) would stay on the device through the backward and the optimizer step
        loss.backward()
        if self.max_grad_norm is not None:
            clip_grad_norm(self.model.parameters(), self.max_grad_norm)
        # the forward and backward (the blocks' plans) apart from the optimizer step, which no
        # budget of the blocks' lowers
        blocks_peak = self.meter.phase_peak_bytes() if metered else 0
        if self.optimizer_step is None:
            self.optimizer.step()
        else:
            said = self.optimizer_step.describe()
            self.optimizer_step.step()
            # the first steps measured where it steps, or found the parameters too large for a
            # streamed group: the plan says where it steps now, in place of what it said
            if self.optimizer_step.chosen is not None and self.optimizer_step.describe() != said:
                self.plan.optimizer_step = self.optimizer_step.chosen
                notes = self.plan.notes
                at = len(notes) - 1 - notes[::-1].index(said) if said in notes else len(notes)
                notes[at:at + 1] = [self.optimizer_step.describe()]
        self.optimizer.zero_grad()
        if metered:
            self._check(blocks_peak, self.meter.absolute_peak_bytes())
        return loss.detach()

    @property
    def settled(self) -> bool:
        """Whether the first steps' measurements are done: where the optimizer steps, and on
        CUDA the step's device peak with any correction of the blocks' budget. Steps after
        this run what was chosen (a benchmark's timed steps start here)."""
        placed = self.optimizer_step is None or self.optimizer_step.chosen is not None
        return placed and (self.meter is None or self.plan.measured_device_peak_bytes is not None)

    def _measures_this_step(self) -> bool:
        """The first step after the first (which compiles and creates the optimizer state) and
        after the optimizer step's placement is measured is measured at the allocator, once;
        after a correction, the first step after the one that compiled the blocks again."""
        if self.meter is None or self.plan.measured_device_peak_bytes is not None or self.steps < 2:
            return False
        if self.optimizer_step is not None and self.optimizer_step.chosen is None:
            return False
        if self.settling:
            self.settling -= 1
            return False
        return True

    def _check(self, blocks_peak: int, optimizer_peak: int) -> None:
        """The user's contract: the step's device peak within the budget, or one warning that
        names it. Where the forward and backward (``blocks_peak``) are over it, the blocks are
        first compiled again under a budget lowered by the excess shared between their calls
        (at most ``MAX_CORRECTIONS`` times, never below their minimum-memory plan), and the
        step after the recompiling one is measured again. Where only the optimizer step is
        (``optimizer_peak``), no budget of the blocks' lowers it: the warning says so at once."""
        from ..runtime.verify_budget import TOLERANCE

        peak = max(blocks_peak, optimizer_peak)
        self.plan.measured_device_peak_bytes = peak
        budget = self.plan.budget_bytes
        if peak <= budget * (1 + TOLERANCE):
            return
        if blocks_peak <= budget * (1 + TOLERANCE):
            warnings.warn(f"compile_offload.fit: step {self.steps} measured {format_bytes(peak)} ({peak} bytes) at the "
                          f"device's allocator in the optimizer step, above the memory budget {format_bytes(budget)} "
                          f"(+{peak / budget - 1:.1%}; predicted {format_bytes(self.plan.predicted_device_peak_bytes)}), "
                          f"while the forward and backward peaked at {format_bytes(blocks_peak)}: no budget of the "
                          "blocks' lowers it; what the prediction leaves out is in the plan's notes", stacklevel=3)
            return
        per_block = self.plan.per_block_activation_budget_bytes
        calls = self.plan.block_calls or self.plan.blocks  # each call's plan runs under the lowered budget
        lowered = max(self.block_min_bytes, per_block - -(-(blocks_peak - budget) // calls))
        if (self.recompile is not None and self.corrections < MAX_CORRECTIONS and lowered < per_block
                and self._recompile_fits()):
            self.corrections += 1
            self.plan.notes.append(f"step {self.steps} measured {format_bytes(blocks_peak)} at the allocator in its forward "
                                   f"and backward, over the budget by {format_bytes(blocks_peak - budget)}: the blocks "
                                   "compiled again with memory_budget "
                                   f"{format_bytes(lowered)} (was {format_bytes(per_block)})")
            self.recompile(lowered)
            self.plan.per_block_activation_budget_bytes = lowered
            self.plan.measured_device_peak_bytes = None
            self.settling = 1  # the next step compiles (and verify_budget resets the peak counter in it)
            return
        warnings.warn(f"compile_offload.fit: step {self.steps} measured {format_bytes(peak)} ({peak} bytes) at the "
                      f"device's allocator (forward and backward {format_bytes(blocks_peak)}, optimizer step "
                      f"{format_bytes(optimizer_peak)}), above the memory budget {format_bytes(budget)} "
                      f"(+{peak / budget - 1:.1%}; predicted {format_bytes(self.plan.predicted_device_peak_bytes)}) "
                      f"after {self.corrections} correction(s) of the blocks' budget (now "
                      f"{format_bytes(per_block)}, their minimum {format_bytes(self.block_min_bytes)}); what the "
                      "prediction leaves out is in the plan's notes", stacklevel=3)

    def _recompile_fits(self) -> bool:
        """Whether compiling the blocks once more stays within Dynamo's ``recompile_limit``:
        each compile of them adds entries to their forward's code (at least ``block_kinds``;
        as many again as the compiles so far added, where that is more), and past the limit
        the rest would run uncompiled, outside the budget."""
        from ..torch_api.dynamo import compiled_entries, config as dynamo_config

        used = max([compiled_entries(code) for code in _forward_codes(self.blocks)], default=0)
        per_compile = max(self.block_kinds, -(-used // (self.corrections + 1)))
        return max(used, (self.corrections + 1) * self.block_kinds) + per_compile <= dynamo_config.recompile_limit

    def close(self) -> None:
        """Leave the one-rank process group ``fit`` created, destroying it when no other
        ``Fitted`` trains in it (nothing when this one trains in no group of fit's); ``step``
        then raises."""
        self.closed = True
        if self.created_process_group:
            _leave_own_group(self.joined_group)
            self.created_process_group, self.joined_group = False, None


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their total 2-norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_``), whether they are plain tensors or FSDP2's sharded
    ones, and wherever they live: a split placement has gradients on the device and on the
    host. Each device's norm is taken over all ranks' shards (``_norm_over_ranks``). Returns
    the total norm before clipping."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            by_device.setdefault(param.grad.device, []).append(param.grad)
    if not by_device:
        return torch.zeros(())
    norms = [_norm_over_ranks(grads).float().cpu() for grads in by_device.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    scale = max_norm / (float(total) + 1e-6)
    if not scale >= 1.0:  # a NaN norm too: every gradient becomes NaN, as torch.nn.utils.clip_grad_norm_ makes them
        for grads in by_device.values():
            for grad in grads:
                grad.mul_(scale)
    return total


def _norm_over_ranks(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of one device's ``grads``, over all ranks' shards where they are FSDP2's
    (DTensors sharded on a one-dimensional mesh). Their squared norms are summed on the
    mesh's device: the gradients FSDP2 keeps on the host are host tensors, and under an
    NCCL-only process group a collective of host tensors has no backend (torch's
    ``clip_grad_norm_`` fails there: pytorch#148532)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    # decided from the gradients, not from a norm of them: DTensor's norm of several shards
    # already all-reduces their local (host) norms
    if not any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.get_total_norm(grads)
    mesh = grads[0].device_mesh if isinstance(grads[0], DTensor) else None
    if mesh is None or mesh.ndim != 1 or any(not isinstance(g, DTensor) or g.device_mesh != mesh
                                             or not all(isinstance(p, Shard) for p in g.placements) for g in grads):
        return torch.nn.utils.get_total_norm(grads).full_tensor()
    local = torch.nn.utils.get_total_norm([g.to_local() for g in grads])
    if mesh.size() == 1:
        return local
    squared = local.double().square().to(mesh.device_type)  # the current device of that type: the group's
    dist.all_reduce(squared, group=mesh.get_group())
    return squared.sqrt()


def _to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (nested in lists, tuples, dicts) moved to ``device``."""
    return tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, value)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The children with parameters of the model's ``nn.ModuleList``s that hold parameters
    and are not inside another such list, in the model's order (a transformer's blocks; an
    encoder's and a decoder's; a vision tower's and a language model's; a list of
    parameterless modules, such as dropouts or activations, is not blocks); where a list's
    entries are lists themselves (stages of blocks), their entries, in order."""
    # a parameterless entry (an nn.Identity standing for a pruned layer) has nothing to shard,
    # and no graph of its own to plan: it runs as it is (``_parameterless_entries``)
    return [block for _, block in _block_entries(model) if any(True for _ in block.parameters())]


def _parameterless_entries(model: nn.Module) -> list[str]:
    """The entries of the default blocks' lists left out for having no parameters."""
    return [f"{index} ({type(block).__name__})" for index, block in _block_entries(model)
            if not any(True for _ in block.parameters())]


def _block_entries(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(index, module) of the default blocks' lists' entries (indexed by the list's name
    where there are several); a list nested in an entry's place (a stage of blocks: a
    container, never called itself) gives its entries, indexed as ``stage.block``."""

    def entries(modules: nn.ModuleList, prefix: str) -> list[tuple[str, nn.Module]]:
        found = []
        for index, module in enumerate(modules):
            name = f"{prefix}{index}"
            found += entries(module, f"{name}.") if isinstance(module, nn.ModuleList) else [(name, module)]
        return found

    lists = _block_lists(model)
    return [entry for name, modules in lists for entry in entries(modules, f"{name}." if len(lists) > 1 else "")]


def _without_uncalled_lists(model: nn.Module, blocks: list[nn.Module], inputs: tuple,
                            kwargs: dict) -> tuple[list[nn.Module], list[str]]:
    """The default blocks less those of a list after the first whose entries the forward never
    calls on the sample (auxiliary heads used outside training), counted on ``meta``
    (``block_calls``); and those lists' names. As they are where the count cannot run."""
    lists = _block_lists(model)
    if len(lists) < 2:
        return blocks, []
    calls = block_calls(model, blocks, inputs, kwargs)
    if calls is None:
        return blocks, []
    called = {id(block) for block, n in zip(blocks, calls) if n}
    dropped, names = set(), []
    for name, modules in lists[1:]:
        inside = {id(m) for m in modules.modules()}
        entries = [block for block in blocks if id(block) in inside]
        if entries and not any(id(block) in called for block in entries):
            dropped.update(id(block) for block in entries)
            names.append(name)
    return [block for block in blocks if id(block) not in dropped], names


def _block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """(name, list) of the ``nn.ModuleList``s with parameters that no other such list holds."""
    found, inside = [], set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList) and len(module) > 0 and any(True for _ in module.parameters()):
            found.append((name, module))
            inside.update(id(m) for m in module.modules())
    if not found:
        raise ValueError("compile_offload.fit: the model has no nn.ModuleList of blocks with parameters; pass "
                         "blocks=[...], the modules to shard and compile one by one")
    return found


class _Captured(Exception):
    pass


class _NotReached(ValueError):
    pass


def _block_input(model: nn.Module, block: nn.Module, inputs: tuple, kwargs: dict | None = None,
                 as_later_blocks: bool = False) -> tuple[tuple, dict]:
    """The arguments ``block`` receives when the model runs on ``inputs`` (and keyword
    ``kwargs``): the model runs up to the block's call and stops there (nothing after it
    runs), its buffers (BatchNorm's running statistics) and the random generators left as
    they were. ``as_later_blocks``: the floating-point positional arguments require grad, as
    the hidden states do that later blocks receive from trained blocks before them (their
    graphs also compute the input's gradient, which raises their minimum-memory peak above
    that of a first block fed the batch itself)."""
    from ..tools.explain import state_kept

    seen: list = []

    def hook(_module, args, kwargs):
        seen.append((args, kwargs))
        raise _Captured

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with state_kept(model):
            model(*inputs, **(kwargs or {}))
    except _Captured:
        pass
    finally:
        handle.remove()
    if not seen:
        raise _NotReached(f"compile_offload.fit: the sample never reached the block {type(block).__name__}: the "
                          "model's forward does not call it. Check blocks= (without it the blocks are the entries of "
                          "the model's nn.ModuleLists with parameters); pass the modules the forward calls")
    args, block_kwargs = seen[0]

    def detached(value, grad: bool = False):
        if isinstance(value, torch.Tensor):
            return value.detach().clone().requires_grad_(value.requires_grad or (grad and value.is_floating_point()))
        return value

    return (tuple(detached(a, as_later_blocks) for a in args),
            {k: detached(v) for k, v in block_kwargs.items()})


class _WithKwargs(nn.Module):
    def __init__(self, block: nn.Module, kwargs: dict) -> None:
        super().__init__()
        self.block, self.kwargs = block, kwargs

    def forward(self, *args):
        return self.block(*args, **self.kwargs)


def _block_activations(block: nn.Module, args: tuple, kwargs: dict, device: torch.device,
                       options: dict) -> tuple[int, int, int, list[str]]:
    """One block's minimum-memory peak, what that plan holds at its forward's end, and its
    unconstrained peak, planned by ``explain`` (all its graphs summed, should it break)."""
    from ..tools.explain import explain_all

    on_device = block if all(p.device == device for p in block.parameters()) else copy.deepcopy(block).to(device)
    target = _WithKwargs(on_device, _to(kwargs, device)) if kwargs else on_device
    # measured_plan_choice off: it times nothing here, and under a process group it would
    # agree with the other ranks in the middle of fit's own agreement
    plans = explain_all(target, *_to(args, device), memory_budget=0.0, **{**options, "measured_plan_choice": False})
    minimum = sum(max(p.min_peak_bytes, p.predicted_peak_bytes, p.scheduled_peak_bytes or 0) for p in plans)
    saved = sum(p.timeline_bytes[p.backward_start - 1] if 0 < p.backward_start <= len(p.timeline_bytes)
                else max(p.min_peak_bytes, p.predicted_peak_bytes) for p in plans)
    unconstrained = sum(p.baseline_peak_bytes for p in plans)
    notes = [] if len(plans) == 1 else [f"it compiles to {len(plans)} graphs; their peaks are summed"]
    return minimum, min(saved, minimum), max(minimum, unconstrained), notes


def measure(model: nn.Module, blocks: list[nn.Module], optimizer_fn: Callable, inputs: tuple,
            device: torch.device, options: dict, world_size: int, input_kwargs: dict | None = None) -> StateSizes:
    """The sizes ``plan_step`` decides from, measured on the model as it is (before any
    preparation): nothing is moved but one copy of the first block of each kind
    (``distinct_blocks``), to plan its activations."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    placeholders = [nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad) for p in params]
    optimizer = optimizer_fn(placeholders)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("compile_offload.fit: optimizer_fn(params) must return a torch.optim.Optimizer built on "
                        f"params (got {type(optimizer).__name__})")
    given = {id(p) for p in placeholders}
    if any(id(p) not in given for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("compile_offload.fit: optimizer_fn(params) built its optimizer on other parameters than "
                         "the params it was given (parameter groups made from the model before fit?): fit moves or "
                         "shards the model (FSDP2) and calls optimizer_fn with its parameters as they are then, so "
                         "build the groups inside optimizer_fn from params (named groups: "
                         "zip(model.named_parameters(), params) keeps the order)")
    _check_steps_without_closure(optimizer)
    state_bytes, state_note = optimizer_state_bytes(optimizer, _nbytes)
    del optimizer
    model_device = params[0].device if params else torch.device("cpu")
    later_blocks_train = len(blocks) > 1 and any(p.requires_grad for p in params)
    minimum = saved = unconstrained = input_bytes = 0
    notes: list[str] = []
    distinct = distinct_blocks(blocks)
    for index in distinct:  # the largest figures stand for every block
        try:
            args, kwargs = _block_input(model, blocks[index], _to(inputs, model_device),
                                        _to(input_kwargs or {}, model_device), as_later_blocks=later_blocks_train)
        except _NotReached:
            if index == distinct[0]:
                raise
            notes.append(f"block {index} ({type(blocks[index]).__name__}) did not run on the sample: not planned")
            continue
        block_minimum, block_saved, block_unconstrained, block_notes = _block_activations(
            blocks[index], args, kwargs, device, options)
        minimum, saved = max(minimum, block_minimum), max(saved, block_saved)
        unconstrained = max(unconstrained, block_unconstrained)
        input_bytes = max(input_bytes, sum(_nbytes(t) for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)))
        notes += [f"block {index}: {note}" for note in block_notes]
    if len(distinct) > 1:
        notes.append(f"the blocks are of {len(distinct)} kinds (blocks {', '.join(map(str, distinct))} planned); "
                     "the largest figures of theirs stand for every block")
    calls = block_calls(model, blocks, inputs, input_kwargs or {})
    if calls is None:
        notes.append("the blocks' calls were not counted on a meta copy of the model (its forward does not run "
                     "there, or the blocks are not among its modules): one call per block is planned")
    elif any(n > 1 for n in calls):
        repeated = ", ".join(f"block {i} {n} times" for i, n in enumerate(calls) if n > 1)
        notes.append(f"the sample's forward runs the {len(blocks)} blocks {sum(calls)} times ({repeated}): each "
                     "call's activations are planned")
    return StateSizes(
        parameter_bytes=sum(_nbytes(p) for p in params),
        gradient_bytes=sum(_nbytes(p) for p in trainable),
        optimizer_state_bytes=state_bytes,
        buffer_bytes=sum(_nbytes(b) for b in model.buffers()),
        block_parameter_bytes=tuple(sum(_nbytes(p) for p in b.parameters()) for b in blocks),
        block_gradient_bytes=tuple(sum(_nbytes(p) for p in b.parameters() if p.requires_grad) for b in blocks),
        block_activation_min_bytes=minimum,
        block_activation_max_bytes=unconstrained,
        block_saved_min_bytes=saved,
        block_input_bytes=input_bytes,
        world_size=world_size,
        notes=tuple([state_note] if state_note else []) + tuple(notes),
        block_calls=sum(calls) if calls and any(n != 1 for n in calls) else 0,
    )


def block_calls(model: nn.Module, blocks: list[nn.Module], inputs: tuple, kwargs: dict) -> list[int] | None:
    """How many times each block runs in the model's forward on the sample (a block shared
    across layers runs several times), counted on a copy of the model on ``meta``: nothing is
    computed or allocated. None where the forward cannot run there (data-dependent control
    flow reads values meta tensors do not have) or a block is not among the model's modules."""
    import random

    names = {id(module): name for name, module in model.named_modules()}
    if any(id(block) not in names for block in blocks):
        return None
    calls = [0] * len(blocks)
    python_random, torch_random = random.getstate(), torch.random.get_rng_state()
    try:
        # every tensor the model holds (parameters, buffers, plain tensor attributes) as meta
        memo: dict[int, Any] = {}
        for module in model.modules():
            for value in [*module.parameters(recurse=False), *module.buffers(recurse=False), *vars(module).values()]:
                if isinstance(value, torch.Tensor) and id(value) not in memo:
                    empty = torch.empty_like(value, device="meta")
                    memo[id(value)] = nn.Parameter(empty, value.requires_grad) if isinstance(value, nn.Parameter) else empty
        meta = copy.deepcopy(model, memo)
        for i, block in enumerate(blocks):
            meta.get_submodule(names[id(block)]).register_forward_pre_hook(
                lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        with torch.no_grad():
            meta(*_to(inputs, torch.device("meta")), **_to(kwargs, torch.device("meta")))
    except Exception:  # noqa: BLE001  counting is a refinement: the plan then assumes one call per block
        return None
    finally:  # a forward that draws random numbers (LayerDrop) leaves the user's sequences as they were
        random.setstate(python_random)
        torch.random.set_rng_state(torch_random)
    return calls


def distinct_blocks(blocks: list[nn.Module]) -> list[int]:
    """The index of the first block of each kind: blocks are told apart by their class and
    their parameters' names, shapes, dtypes and whether they train (a transformer's layers
    are one kind; a U-Net's levels are several)."""
    first: dict[tuple, int] = {}
    for index, block in enumerate(blocks):
        kind = (type(block), tuple((name, tuple(p.shape), p.dtype, p.requires_grad)
                                   for name, p in block.named_parameters()))
        first.setdefault(kind, index)
    return sorted(first.values())


def _a_fraction(text: str) -> bool:
    """Whether ``text`` is a number below 1 without a unit ("0.5"): a fraction, which fit's
    byte budget is not."""
    try:
        return 0 <= float(text) < 1
    except ValueError:
        return False


# The one-rank process group fit created, and how many ``Fitted`` train in it: two models
# prepared by fit in one process share it, and the last one closed destroys it.
_OWN_GROUP: dict[str, Any] = {"group": None, "users": 0}


def _one_rank_group(device: torch.device) -> str:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _OWN_GROUP.update(group=dist.group.WORLD, users=0)
    return backend


def _in_own_group() -> bool:
    """Whether the process group now is the one-rank group an earlier fit created."""
    import torch.distributed as dist

    return dist.is_initialized() and _OWN_GROUP["group"] is not None and dist.group.WORLD is _OWN_GROUP["group"]


def _leave_own_group(group: Any) -> None:
    """A model leaves ``group``, the one-rank group fit created that it joined; the last to
    leave destroys it. Nothing where that group is gone (destroyed by the user, and perhaps
    another created since, by fit or the user)."""
    import torch.distributed as dist

    if group is None or group is not _OWN_GROUP["group"] or not _in_own_group():
        return
    _OWN_GROUP["users"] -= 1
    if _OWN_GROUP["users"] <= 0:
        dist.destroy_process_group()
        _OWN_GROUP.update(group=None, users=0)


def fit(model: nn.Module, optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], sample: Any, *,
        memory_budget: int | str, loss_fn: Callable[..., torch.Tensor] | None = None,
        blocks: Iterable[nn.Module] | None = None, device: torch.device | str | None = None,
        optimizer_step: str = "auto", max_grad_norm: float | None = None, **options: Any) -> Fitted:
    """Prepare ``model`` to train under ``memory_budget`` bytes of device memory (per rank)
    for parameters, gradients, optimizer state and activations together.

    ``optimizer_fn(params)`` builds the optimizer (after FSDP2 wraps the parameters; a list);
    ``sample``: the model's inputs for one batch (a tensor, a tuple of positional inputs,
    or a dict of keyword inputs, as ``Fitted.step(**batch)`` then takes them), used to plan
    the activations; ``blocks``: the modules sharded and compiled one by one (default: the
    children of the model's ``nn.ModuleList``s, ``default_blocks``); ``device``: default the current CUDA device,
    else the CPU; ``optimizer_step``: where the state on the host steps, ``"auto"`` (measured
    over the first steps), ``"host"`` or ``"device"`` (streamed through it; see
    ``training/optimizer_step.py``); ``max_grad_norm``: clip the gradients' total norm to it
    after each backward, before the optimizer steps (as ``torch.nn.utils.clip_grad_norm_``;
    an optimizer step pre-hook runs too late for the state streamed through the device);
    other keyword ``options`` are the backend's knobs (``inner_compiler=...``).
    The model is prepared in place (``Fitted.model is model``). Without a process group and
    where FSDP2 is needed, a one-rank group is created (``Fitted.close()`` destroys it when
    no other model ``fit`` prepared trains in it).
    Raises ``ValueError`` when the budget cannot hold even the host placement.
    """
    import torch.distributed as dist

    from ..pipeline.backend import offload_remat
    from ..settings import parse_bytes

    # Under a process group every rank checks and measures, then all agree (``_agree_across_ranks``):
    # an error on one rank raises on every rank, where the others would wait for it.
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    budget = None
    try:
        if "memory_budget" in options:
            raise TypeError("compile_offload.fit: memory_budget is fit's own argument")
        if options.get("budget_scope", "graph") != "graph":
            raise ValueError(f"compile_offload.fit: budget_scope={options['budget_scope']!r} does not apply: fit bounds "
                             "the whole step itself (it splits memory_budget between the state it keeps on the device "
                             "and the blocks' compiled graphs, each of which gets its share as its own budget); leave "
                             "budget_scope unset")
        from .. import config

        scope_note = (f"budget_scope={config.budget_scope!r} (config) is not applied to the blocks: fit splits the "
                      "step's budget itself" if config.budget_scope != "graph" else None)
        options = {**options, "budget_scope": "graph"}  # each block's share is its graph's budget, whatever the config
        bytes_only = "memory_budget is bytes (an int or a size such as '20GiB')"
        if memory_budget is None:
            raise TypeError(f"compile_offload.fit: {bytes_only}: fit needs one for the device")
        if isinstance(memory_budget, float):
            what = "a fraction" if 0 <= memory_budget <= 1 else "a float"
            raise TypeError(f"compile_offload.fit: {bytes_only}, not {what} ({memory_budget!r})")
        if isinstance(memory_budget, str) and _a_fraction(memory_budget):
            raise TypeError(f"compile_offload.fit: {bytes_only}, not a fraction ({memory_budget!r})")
        budget = parse_bytes(memory_budget, "fit_budget", label="compile_offload.fit(memory_budget=...)",
                             accepted="an int number of bytes, or a string with units such as '512MiB', '6GB' or '6GiB'")
        _check_model_and_loss(model, sample, loss_fn)
        _check_not_prepared(model)
        _check_optimizer_fn(optimizer_fn)
        _check_not_on_meta(model, sample)
        check_mode(optimizer_step)  # before anything is prepared
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or not max_grad_norm > 0):
            raise ValueError(f"compile_offload.fit: max_grad_norm={max_grad_norm!r} must be a positive number (or None "
                             "for no clipping)")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        device = _usable_device(device)
        options = _blocks_options(options, device)
        if isinstance(sample, Mapping):
            inputs, input_kwargs = (), dict(sample)
        else:
            inputs, input_kwargs = (sample if isinstance(sample, tuple) else (sample,)), {}
        left_out = [] if blocks is not None else _parameterless_entries(model)
        uncalled: list[str] = []
        if blocks is not None:
            blocks = _blocks_of(model, blocks)
        else:
            blocks, uncalled = _without_uncalled_lists(model, default_blocks(model), inputs, input_kwargs)
        listed = len(blocks)
        blocks = list({id(block): block for block in blocks}.values())  # one module listed twice is one block
        block_kinds = _check_recompile_limit(blocks)
        if not blocks:
            raise ValueError("compile_offload.fit: blocks=[] names no blocks to shard and compile; pass the modules "
                             "(such as a transformer's layers), or leave blocks unset for the entries of the model's "
                             "nn.ModuleLists with parameters")
        sizes = measure(model, blocks, optimizer_fn, inputs, device, options, world_size, input_kwargs)
    except Exception as error:
        if world_size > 1:
            _agree_across_ranks(budget, None, error, device)
        raise
    if world_size > 1:
        sizes = _agree_across_ranks(budget, sizes, None, device)
    plan = plan_step(budget, sizes)
    if left_out:
        plan.notes.append(f"the blocks' list's entries {', '.join(left_out)} have no parameters: not blocks, they run "
                          "as they are, uncompiled (their activations are not planned)")
    if uncalled:
        plan.notes.append(f"{', '.join(uncalled)}: an nn.ModuleList the forward does not call on the sample: not "
                          "blocks")
    if listed > len(blocks):
        plan.notes.append(f"the {listed} blocks listed are {len(blocks)} modules (a module listed more than once, "
                          "shared across layers): each is sharded and compiled once")
    if plan.fsdp2:
        _check_no_parameter_shared_across_blocks(model, blocks)
        _check_one_dtype_per_shard(model, blocks)
        _check_steps_sharded_parameters(optimizer_fn, model)
        _check_no_parameter_hooks(model)
        _check_no_sparse_gradients(model)
        _check_contiguous_parameters(model)
    had_group = dist.is_available() and dist.is_initialized()
    joined = None
    try:
        joined = _prepare(model, blocks, plan, device)
        # the blocks' reloads share the host link with FSDP2's parameter uploads (StepPlan.shared_h2d_bytes)
        link = {"shared_h2d_bytes": plan.shared_h2d_bytes} if plan.shared_h2d_bytes else {}

        def compile_blocks(block_budget: int) -> None:
            backend = offload_remat(memory_budget=block_budget, **{**link, **options})
            for block in blocks:
                block.compile(backend=backend)  # in place: the module tree, its names and FSDP2's hooks stay

        stale = _drop_earlier_compiles(blocks, block_kinds)
        if stale:
            plan.notes.append(stale)
        compile_blocks(plan.per_block_activation_budget_bytes)
        # a list, as measure() gives it: an optimizer_fn that reads params twice (one group of
        # the matrices, one of the rest) would find a generator empty the second time
        optimizer = optimizer_fn(list(model.parameters()))
        stepper = None
        if plan.cpu_offload or device.type == "cuda":
            fused_note = prefer_fused(optimizer, on_host=plan.cpu_offload)
            if fused_note:
                plan.notes.append(fused_note)
        if plan.cpu_offload:
            stepper = OptimizerStep(optimizer, device, mode=optimizer_step, chunk_bytes=plan.optimizer_step_chunk_bytes)
            plan.optimizer_step = "measured" if stepper.chosen is None else stepper.chosen
            plan.notes.append(stepper.describe())
        elif optimizer_step != "auto":
            plan.notes.append(f"optimizer_step={optimizer_step!r} changes nothing: no state is on the host, and the "
                              "optimizer steps it on the device")
    except BaseException:
        if joined is not None:  # this model trains in the group fit made: it leaves it
            _leave_own_group(joined)
        elif not had_group and _in_own_group():  # the one-rank group fit made just now, before failing
            dist.destroy_process_group()
            _OWN_GROUP.update(group=None, users=0)
        raise
    plan.notes.append(f"each of the {plan.blocks} blocks compiled with memory_budget "
                      f"{format_bytes(plan.per_block_activation_budget_bytes)}")
    if scope_note:
        plan.notes.append(scope_note)
    meter = None
    if device.type == "cuda":
        from ..runtime.step_budget import CudaStepMeter

        meter = CudaStepMeter(device)
    return Fitted(plan=plan, model=model, optimizer=optimizer, loss_fn=loss_fn, device=device,
                  max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
                  created_process_group=joined is not None, joined_group=joined, optimizer_step=stepper, meter=meter, recompile=compile_blocks,
                  block_min_bytes=sizes.block_activation_min_bytes, block_kinds=block_kinds, blocks=blocks,
                  keyword_sample=isinstance(sample, Mapping),
                  target_is_input=isinstance(sample, Mapping) and "target" in sample)


def _check_not_prepared(model: nn.Module) -> None:
    """``fit`` prepares the model in place (FSDP2's sharding, each block compiled): a model it
    already prepared, or one a user sharded or compiled block by block, cannot be prepared
    again. Refuse it before anything is measured."""
    from torch.distributed.fsdp import FSDPModule

    from ..torch_api.dynamo import compiled_in_place

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) or compiled_in_place(module):
            what = "sharded by FSDP2" if isinstance(module, FSDPModule) else "compiled (Module.compile)"
            raise ValueError(f"compile_offload.fit: the model's module {name or '(the root)'!r} is already {what}: "
                             "fit prepares the model in place, once. Call fit on the model as you built it (a new "
                             "instance, or one loaded from its state_dict), or keep using the Fitted it returned")


def _check_model_and_loss(model: Any, sample: Any, loss_fn: Any) -> None:
    """What fit trains: an ``nn.Module`` with parameters that train, a sample to run it on,
    and a ``loss_fn`` it can call at each step (checked here, not at the first step)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_offload.fit: model is a {type(model).__name__}; fit shards, compiles and trains an "
                        "nn.Module (for a plain function, compile it with torch.compile(fn, backend='offload_remat'))")
    if not any(True for _ in model.parameters()):
        raise ValueError(f"compile_offload.fit: the model ({type(model).__name__}) has no parameters, so there is "
                         "nothing to train, shard or keep under the budget; for its activations alone, compile it "
                         "with torch.compile(model, backend='offload_remat')")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("compile_offload.fit: no parameter of the model requires grad, so there is nothing to "
                         "train; unfreeze the parameters to train (requires_grad_(True))")
    if sample is None:
        raise TypeError("compile_offload.fit: sample=None; pass one batch as the model takes it (a tensor, a tuple "
                        "of positional inputs or a dict of keyword inputs): fit runs the model on it to plan")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"compile_offload.fit: loss_fn={loss_fn!r} is not callable; pass a function "
                        "loss_fn(output) or loss_fn(output, target) returning the loss, or leave it unset when the "
                        "model's output is the loss")


def _blocks_of(model: nn.Module, blocks: Any) -> list[nn.Module]:
    """``blocks=`` as a list of the model's modules (a ``ModuleList`` or ``Sequential`` gives its
    children, a ``ModuleDict`` its values)."""
    accepted = "pass the modules to shard and compile one by one, such as blocks=model.layers (an nn.ModuleList)"
    if isinstance(blocks, nn.ModuleDict):
        blocks = list(blocks.values())
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"compile_offload.fit: blocks is one {type(blocks).__name__}, not a list of modules; "
                        f"{accepted}, or blocks=[module] for one")
    try:
        blocks = list(blocks)
    except TypeError:
        raise TypeError(f"compile_offload.fit: blocks={blocks!r} is not a list of modules; {accepted}") from None
    mine = {id(module) for module in model.modules()}
    for index, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise TypeError(f"compile_offload.fit: blocks[{index}] is a {type(block).__name__} ({block!r}), not a "
                            f"module; {accepted} (model.get_submodule(name) for a module named by a string)")
        if id(block) not in mine:
            raise ValueError(f"compile_offload.fit: blocks[{index}] ({type(block).__name__}) is not one of the "
                             f"model's modules; {accepted}")
        if not any(True for _ in block.parameters()):
            raise ValueError(f"compile_offload.fit: blocks[{index}] ({type(block).__name__}) has no parameters: "
                             "nothing of it to shard or train; leave it out of blocks= (it runs as it is)")
    return blocks


def _check_optimizer_fn(optimizer_fn: Any) -> None:
    """``optimizer_fn`` builds the optimizer from the parameters fit gives it: an optimizer
    already built (on the model's parameters as they were before fit) cannot be rebuilt."""
    if isinstance(optimizer_fn, torch.optim.Optimizer):
        name = type(optimizer_fn).__name__
        raise TypeError(f"compile_offload.fit: optimizer_fn is an optimizer already built ({name}); fit needs a "
                        "function that builds it on the parameters it gives it (after moving or sharding the model), "
                        f"such as lambda params: {name}(params, lr=...), or the class {name} itself for its defaults")
    if not callable(optimizer_fn):
        raise TypeError(f"compile_offload.fit: optimizer_fn={optimizer_fn!r} is not callable; pass a function that "
                        "builds the optimizer from the parameters it is given, such as "
                        "lambda params: torch.optim.AdamW(params, lr=1e-3)")


def _check_steps_without_closure(optimizer: torch.optim.Optimizer) -> None:
    """``Fitted.step`` calls ``optimizer.step()`` once per batch: an optimizer whose step
    needs a closure that evaluates the loss again (LBFGS) cannot step there."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(f"compile_offload.fit: optimizer_fn(params) built a {type(optimizer).__name__}, whose step "
                        "needs a closure that evaluates the loss again; Fitted.step calls optimizer.step() once per "
                        "batch, without one. Use an optimizer that steps without a closure (AdamW, SGD, ...)")


def _check_not_on_meta(model: nn.Module, sample: Any) -> None:
    """fit trains the model's values and runs it on the sample to plan each block: neither
    can be on ``meta`` (shapes without values)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise ValueError(f"compile_offload.fit: the model's {name!r} is on the meta device (a shape without "
                             "values), and fit trains the model as it is; materialize it first "
                             "(model.to_empty(device='cpu'), then load its weights or initialize them), or plan it "
                             "without training with compile_offload.explain, which takes meta models")
    if any(isinstance(leaf, torch.Tensor) and leaf.is_meta for leaf in tree_leaves(sample)):
        raise ValueError("compile_offload.fit: the sample has tensors on the meta device; fit runs the model on the "
                         "sample to plan each block, so pass one real batch (on the host or on the device)")


def _blocks_options(options: dict, device: torch.device) -> dict:
    """The backend's options for the blocks: on CUDA without ``measured_plan_choice``, with a
    warning where it was asked for (in ``options`` or the config). Its trial steps reset the
    device's peak counter, which fit's step meter reads over a whole step, and run candidate
    plans in the steps fit measures."""
    from ..settings import resolve

    if device.type != "cuda" or not resolve(options).measured_plan_choice:
        return options
    warnings.warn("compile_offload.fit: measured_plan_choice is off for the blocks on CUDA: its trial steps reset the "
                  "device's peak counter, which fit's step meter reads over a whole step", stacklevel=3)
    return {**options, "measured_plan_choice": False}


def _usable_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``, checked to exist on this machine: fit trains there."""
    accepted = "accepted: 'cuda', 'cuda:N', 'cpu', a torch.device, or None for the current CUDA device, else the CPU"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"compile_offload.fit: device={device!r} is not a device ({error}); {accepted}") from None
    if parsed.type == "meta":
        raise ValueError(f"compile_offload.fit: device={device!r} cannot train (meta tensors hold no values); "
                         f"{accepted}")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"compile_offload.fit: device={device!r}, but this machine has no CUDA device "
                             "(torch.cuda.is_available() is False); pass device='cpu', or leave device unset for "
                             "the CPU here and the current CUDA device where there is one")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"compile_offload.fit: device={device!r}, but this machine has {count} CUDA "
                             f"device(s), cuda:0 to cuda:{count - 1}")
        current = torch.cuda.current_device()
        if parsed.index is not None and parsed.index != current:
            raise ValueError(f"compile_offload.fit: device={device!r} is not the current CUDA device (cuda:{current}), "
                             "where FSDP2 shards and trains; call torch.cuda.set_device("
                             f"{parsed.index}) before fit (as each rank does with its LOCAL_RANK under torchrun)")
    return parsed


def _check_steps_sharded_parameters(optimizer_fn: Callable, model: nn.Module) -> None:
    """Before anything is prepared: an optimizer whose fused op cannot step FSDP2's sharded
    parameters (``SGD(fused=True)``) would fail at the first optimizer step, with the model
    already sharded in place."""
    probe = optimizer_fn([nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                          for p in model.parameters()])
    name = fused_without_dtensor_rule(probe)
    if name is not None:
        raise ValueError(f"compile_offload.fit: {name}(fused=True) cannot step FSDP2's sharded parameters (torch has "
                         "no DTensor rule for its fused op), and this budget shards the model with FSDP2: leave "
                         "fused unset (fit then takes the foreach kernels), or give a budget that keeps the state "
                         "on the device")


def _check_no_parameter_shared_across_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    """FSDP2 shards each block on its own: a parameter one block shares with another block or
    with the rest of the model would belong to two groups, which FSDP2 refuses at the first
    step, after the model was sharded in place. Refuse it before anything is prepared."""
    owner: dict[int, str] = {}
    for index, block in enumerate(blocks):
        for name, param in block.named_parameters(remove_duplicate=False):
            if owner.setdefault(id(param), f"block {index}") != f"block {index}":
                raise ValueError(f"compile_offload.fit: block {index}'s parameter {name!r} is shared with "
                                 f"{owner[id(param)]}; FSDP2 shards each block on its own and cannot share a "
                                 "parameter between two of them. Tie parameters outside the blocks, or pass "
                                 "blocks= without the blocks that share them")
    for name, param in _parameters_outside(model, blocks):
        if id(param) in owner:
            raise ValueError(f"compile_offload.fit: the model's parameter {name!r} is also {owner[id(param)]}'s; FSDP2 "
                             "shards each block on its own and cannot share a parameter between a block and the rest "
                             "of the model. Tie parameters outside the blocks, or pass blocks= without that block")


def _check_no_parameter_hooks(model: nn.Module) -> None:
    """FSDP2 replaces each parameter by a sharded one: gradient hooks registered on the
    parameters as they were (``register_hook``, ``register_post_accumulate_grad_hook``) would
    never run, and the model would train as if they were not there. Refuse it before anything
    is prepared."""
    hooked = [name for name, param in model.named_parameters() if parameter_hooks(param)]
    if hooked:
        more = f" and {len(hooked) - 3} more" if len(hooked) > 3 else ""
        shown = ", ".join(repr(name) for name in hooked[:3]) + more
        raise ValueError(f"compile_offload.fit: the parameters {shown} have gradient hooks, and this budget shards the "
                         "model with FSDP2, which replaces each parameter by a sharded one: the hooks would not run. "
                         "Remove the hooks, or give a budget that keeps the parameters on the device")


def _check_no_sparse_gradients(model: nn.Module) -> None:
    """FSDP2 reduces dense gradients only: an embedding with ``sparse=True`` would fail at the
    first step, after the model was sharded in place. Refuse it before anything is prepared."""
    sparse = [name for name, module in model.named_modules()
              if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad]
    if sparse:
        raise ValueError(f"compile_offload.fit: {', '.join(repr(name) for name in sparse)} makes sparse gradients "
                         "(sparse=True), and this budget shards the model with FSDP2, which reduces dense gradients "
                         "only: build it with sparse=False, or give a budget that keeps the parameters on the device")


def _check_contiguous_parameters(model: nn.Module) -> None:
    """FSDP2 refuses a non-contiguous parameter (a transposed tensor made a parameter) when it
    reaches its block, after the blocks before were sharded: the model was left half sharded.
    Refuse it before anything is prepared."""
    strided = [name for name, param in model.named_parameters() if not param.is_contiguous()]
    if strided:
        raise ValueError(f"compile_offload.fit: the parameters {', '.join(repr(name) for name in strided)} are not "
                         "contiguous, and this budget shards the model with FSDP2, which shards contiguous "
                         "parameters only: make them contiguous (nn.Parameter(tensor.contiguous())), or give a "
                         "budget that keeps the parameters on the device")


def _check_recompile_limit(blocks: list[nn.Module]) -> int:
    """Blocks of one class but of several kinds (widths) are compiles of one forward's code,
    and past Dynamo's ``recompile_limit`` the rest run uncompiled: outside the budget, while
    the plan says each was compiled under it. Refuse that before anything is prepared; else
    the most kinds of one forward (each correction of the blocks' budget compiles them again)."""
    from ..torch_api.dynamo import config as dynamo_config

    limit = dynamo_config.recompile_limit
    kinds: dict[Any, list[int]] = {}
    for index in distinct_blocks(blocks):
        forward = _forward_of(blocks[index])
        kinds.setdefault(getattr(forward, "__code__", forward), []).append(index)
    for indices in kinds.values():
        # one compiled version per kind, and one more where the first block's input requires no grad
        if len(indices) + 1 > limit:
            raise ValueError(f"compile_offload.fit: the blocks are {len(indices)} kinds of "
                             f"{type(blocks[indices[0]]).__name__} (blocks {', '.join(map(str, indices))}: other "
                             f"shapes), each one more compile of its forward (and one more for a first block fed "
                             f"the batch itself), and past torch._dynamo.config.recompile_limit ({limit}) Dynamo "
                             f"runs the rest uncompiled, outside the budget; raise it to at least "
                             f"{len(indices) + 1} before fit")
    return max(map(len, kinds.values()), default=1)


def _agree_across_ranks(budget: int | None, sizes: StateSizes | None, error: BaseException | None,
                        device: Any = None) -> StateSizes:
    """Under a process group of several ranks: the sizes every rank plans from, so that all
    place the state alike (FSDP2 shards every block on every rank, and the optimizer step's
    collectives run where every rank steps alike). Each rank's sample may differ (an uneven
    batch): the largest figure of all ranks stands for each. Raises on every rank where one
    could not check its arguments or measure (``error`` on that rank) or the budgets differ.
    ``device``: fit's device (NCCL gathers objects through the current CUDA device)."""
    import dataclasses

    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    payload = ("compile_offload.fit", budget, sizes, None if error is None else f"{type(error).__name__}: {error}")
    on_device = device if isinstance(device, torch.device) and device.type == "cuda" else None
    with torch.cuda.device(on_device) if on_device is not None else contextlib.nullcontext():
        dist.all_gather_object(gathered, payload)
    if any(not (isinstance(entry, tuple) and entry[:1] == ("compile_offload.fit",)) for entry in gathered):
        raise RuntimeError("compile_offload.fit: the ranks are out of step: another collective of theirs met fit's "
                           "agreement on the plan")
    gathered = [entry[1:] for entry in gathered]
    failed = [(rank, why) for rank, (_, _, why) in enumerate(gathered) if why is not None]
    if failed:
        if error is not None:
            raise error
        rank, why = failed[0]
        raise RuntimeError(f"compile_offload.fit: rank {rank} could not plan the step ({why}); every rank stops, "
                           "where this one would wait for it at the first collective")
    budgets = [entry[0] for entry in gathered]
    if len(set(budgets)) > 1:
        raise ValueError("compile_offload.fit: memory_budget differs between the ranks ("
                         + ", ".join(f"rank {rank}: {format_bytes(b)}" for rank, b in enumerate(budgets))
                         + "); every rank places the state alike (FSDP2 shards each block on all of them): pass one "
                         "budget, the smallest device's")
    all_sizes = [entry[1] for entry in gathered]
    merged = {}
    for item in dataclasses.fields(StateSizes):
        values = [getattr(each, item.name) for each in all_sizes]
        if item.name == "notes":
            merged[item.name] = tuple(dict.fromkeys(note for each in values for note in each))
        elif isinstance(values[0], tuple):
            merged[item.name] = tuple(max(column) for column in zip(*values))
        else:
            merged[item.name] = max(values)
    if any(dataclasses.replace(each, notes=()) != dataclasses.replace(all_sizes[0], notes=()) for each in all_sizes[1:]):
        merged["notes"] += ("the ranks measured different sizes (their samples differ): every rank plans from the "
                            "largest figure of all ranks",)
    return StateSizes(**merged)


def _forwards(blocks: list[nn.Module]) -> list[Callable[..., Any]]:
    """The blocks' forward functions, once each (by their code object: where Dynamo keeps
    their compiled versions, ``Module.compile`` compiling the forward), with their count of
    kinds of block (``distinct_blocks``) compiled through each."""
    forwards: dict[int, Any] = {}
    for block in blocks:
        forward = _forward_of(block)
        if getattr(forward, "__code__", None) is not None:
            forwards.setdefault(id(forward.__code__), forward)
    return list(forwards.values())


def _forward_of(block: nn.Module) -> Callable[..., Any]:
    """The function ``block``'s calls run: its class's ``forward``, or one set on the
    instance (a bound method or a plain function), whose code then holds the compiled versions."""
    forward = block.forward
    forward = getattr(forward, "__func__", forward)
    # a callable without code of its own (functools.partial): the class's forward, as before
    return forward if getattr(forward, "__code__", None) is not None else type(block).forward


def _forward_codes(blocks: list[nn.Module]) -> list[Any]:
    return [forward.__code__ for forward in _forwards(blocks)]


def _drop_earlier_compiles(blocks: list[nn.Module], block_kinds: int) -> str | None:
    """Where compiling the blocks would pass Dynamo's ``recompile_limit`` on a forward whose
    code holds compiled versions from earlier compiles in this process (an earlier ``fit`` of
    a model of the same blocks: its versions stay in the forward's cache after that model is
    gone), drop those versions: past the limit Dynamo would run this fit's blocks uncompiled,
    outside the budget, while the plan says they were compiled under it. Other live models
    whose layers share that forward compile again at their next call. A note saying so, or
    None. A compile adds one version per kind of block, and one more where the first block's
    input, unlike the later blocks', requires no grad."""
    from ..torch_api.dynamo import compiled_entries, config as dynamo_config, drop_compiled

    limit = dynamo_config.recompile_limit
    dropped = []
    for forward in _forwards(blocks):
        held = compiled_entries(forward.__code__)
        if held and held + block_kinds + 1 > limit:
            dropped.append((forward.__qualname__, drop_compiled(forward.__code__)))
    if not dropped:
        return None
    named = ", ".join(f"{name} ({count})" for name, count in dropped)
    return (f"the blocks' forward had compiled versions from earlier compiles in this process: {named}; compiling "
            f"this fit's blocks would pass torch._dynamo.config.recompile_limit ({limit}), so fit dropped them "
            "(other models whose layers share that forward compile again at their next call)")


def _check_one_dtype_per_shard(model: nn.Module, blocks: list[nn.Module]) -> None:
    """FSDP2 asks the trained parameters of each ``fully_shard`` (each block, and the root with
    the rest of the model) to share one dtype, and asserts so at the first step, after the
    model was sharded in place. Refuse a mix before anything is prepared."""
    groups = [(f"block {index}", list(block.named_parameters())) for index, block in enumerate(blocks)]
    groups.append(("the model outside the blocks", _parameters_outside(model, blocks)))
    for where, named in groups:
        dtypes: dict[torch.dtype, str] = {}
        for name, param in named:
            if param.requires_grad:  # FSDP2 asks one dtype of the parameters it trains (a frozen one may differ)
                dtypes.setdefault(param.dtype, name)
        if len(dtypes) > 1:
            mix = ", ".join(f"{str(dtype).removeprefix('torch.')} ({name!r})" for dtype, name in dtypes.items())
            raise ValueError(f"compile_offload.fit: {where} trains parameters of {len(dtypes)} dtypes: {mix}; this "
                             "budget shards the model with FSDP2, which keeps the trained parameters of each block (and "
                             "of the rest of the model) in one dtype. Cast them to one dtype (autocast computes in another), or give a "
                             "budget that keeps the state on the device")


def _parameters_outside(model: nn.Module, blocks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters reached through modules other than the blocks (by name)."""
    block_ids = {id(block) for block in blocks}
    found: list[tuple[str, nn.Parameter]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            found.append((prefix + name, param))
        for name, child in module.named_children():
            if id(child) not in block_ids:
                walk(child, f"{prefix}{name}.")

    walk(model, "")
    return found


def _prepare(model: nn.Module, blocks: list[nn.Module], plan: StepPlan, device: torch.device) -> Any:
    """Shard with FSDP2 where the plan says so (every block, then the root), else move the
    model to the device. The one-rank process group fit created (now or for an earlier model)
    where the model trains in it, which ``Fitted.close()`` then leaves; else None."""
    import torch.distributed as dist

    created = False
    if plan.fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        if not dist.is_initialized():
            backend = _one_rank_group(device)
            created = True
            plan.notes.append(f"no process group: fit created a one-rank {backend} group (Fitted.close() "
                              "destroys it, once every model that trains in it is closed)")
        elif _in_own_group():
            created = True
            plan.notes.append("trains in the one-rank process group an earlier fit created (Fitted.close() destroys "
                              "it, once every model that trains in it is closed)")
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        pin = device.type == "cuda"
        policy = CPUOffloadPolicy(pin_memory=pin) if plan.cpu_offload else OffloadPolicy()
        for index, block in enumerate(blocks):  # the first blocks_on_device keep their state on the device
            fully_shard(block, mesh=mesh, offload_policy=OffloadPolicy() if index < plan.blocks_on_device else policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        if plan.cpu_offload and not pin:
            plan.notes.append("host memory is not pinned: pinning needs CUDA")
    else:
        model.to(device)
    if created:
        _OWN_GROUP["users"] += 1
    if device.type == "cpu":
        plan.notes.append("on the CPU host and device are one memory: FSDP2's CPU offload moves nothing, and the "
                          "device peak can only be measured on a GPU")
    return _OWN_GROUP["group"] if created else None
