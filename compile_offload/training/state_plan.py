"""Where the training state lives under one device byte budget: a pure function of sizes.

``plan_step(budget_bytes, sizes)`` decides, from byte figures alone (no tensor, no device),
whether parameters, gradients and optimizer state stay on the device or go to the host, and
what is left of the budget for the compiled graphs' activations. ``compile_offload.fit``
measures the sizes (``StateSizes``) and follows the ``StepPlan`` this returns.

The rule
--------
*Everything on the device* when parameters + gradients + optimizer state + buffers + the
activations' minimum fit the budget. The rest of the budget goes to the activations. On N
ranks the state is sharded by FSDP2 (without offload), so a rank holds a 1/N share of it plus
the unsharded parameters and gradients FSDP2 gathers at a time (as below).

*Otherwise the first blocks' state on the device, the rest on the host*: FSDP2 shards every
block, the first ``k`` without offload (their parameters, gradients and optimizer state stay
on the device, a 1/N share of each on N ranks), the others and the root with
``CPUOffloadPolicy`` (as below). ``k`` is the largest count of blocks, fewer than all, whose
state fits beside what the host placement holds and the activations' minimum; a block's
optimizer state is counted in proportion to its parameters, and its gradients with its
state (they stay until the optimizer step). Its optimizer step runs where its state lives.

*Otherwise all three on the host* (``k`` = 0), through FSDP2's ``CPUOffloadPolicy``: the sharded
parameters, the sharded gradients and the optimizer state live in (pinned) host memory and
the optimizer steps that state on the host or streamed through the device
(``optimizer_step.py``: the first steps measure which is faster; a streamed group takes at
most ``optimizer_step_chunk_bytes``, a third of what the budget leaves beside the state held,
which the activations have freed by then). The device holds, at a time:

- the unsharded parameters of the two neighbouring blocks largest together (FSDP2 prefetches
  one block ahead), plus the block's unsharded gradients (see below: they are counted in the
  block's activations);
- the parameters and gradients outside the blocks (the root's FSDP2 group: embeddings, a
  head), unsharded for the whole step (FSDP2 does not reshard the root after its forward);
- the buffers (FSDP2 moves buffers to the device and never offloads them).

The rest of the budget goes to the activations.

The activations, either way: each block is its own compiled graph. Their minimum is what the
step holds with every block at its minimum-memory plan (``explain`` at ``memory_budget=0.0``):
in the backward of the first block, the saved tensors of the N - 1 others (of every other
call, where a block runs more than once in a forward: counted on a meta copy; each plan's bytes
live at its forward's end) + that block's own peak (``Plan.min_peak_bytes``; it counts the
gradients its backward produces) + the block inputs the step holds (each block's input is a
graph input of its compiled graph: never counted in its budget, never offloaded). With the
state on the device, the N - 1 blocks' gradients, produced earlier in the backward, stay
until the optimizer step and are added; on the host FSDP2 reduces and offloads each block's
gradients after its backward, so only one block's are on the device (in its peak). The budget
left beyond that minimum is split evenly: each block's compiled graph gets its minimum peak +
1/N of the slack (1/calls; ``per_block_activation_budget_bytes``).

*Neither fits*: ``ValueError`` with the figures and the smallest budget the host placement
can meet.

Limits of the rule
------------------
- By block, not by kind: a block's parameters, gradients and optimizer state live together;
  parameters are not kept on the device while only their optimizer state goes to the host.
- The blocks on the device are the first ones, not the ones whose host copies would cost
  the most time.
- One figure for all blocks: the largest of the kinds' activations (``fit.distinct_blocks``) stands for every block's.
- Not counted: FSDP2's communication buffers (the reduce-scatter's input and output, the
  all-gather's copy-in on N ranks), the activations outside the blocks (an embedding's
  output, a head's logits, the loss), the caching allocator's fragmentation, the CUDA
  context. ``predicted_device_peak_bytes`` is the sum of the figures counted, not a
  measurement.
- The minimum is a bound for the minimum-memory plans. Above it, each graph's budget bounds
  that graph's peak, not what it saves for its backward, so the step's peak under the shares of
  the slack is predicted (assuming each block's saved bytes grow by at most its share), not
  bounded; the sum of the per-block budgets, which would bound it, counts every block's
  gradients and backward as if at once and would keep a model larger than the device off it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..passes.plan import format_bytes

DEVICE = "device"
HOST = "host"
SPLIT = "split"  # the first ``blocks_on_device`` blocks' on the device, the rest on the host


@dataclass(frozen=True)
class StateSizes:
    """The byte figures ``plan_step`` decides from (all unsharded, for the whole model)."""

    parameter_bytes: int
    gradient_bytes: int  # of the parameters that require grad
    optimizer_state_bytes: int
    buffer_bytes: int
    block_parameter_bytes: tuple[int, ...]  # one entry per block, in order
    block_gradient_bytes: tuple[int, ...]
    block_activation_min_bytes: int  # one block's minimum-memory peak (explain, memory_budget=0.0)
    block_activation_max_bytes: int  # one block's unconstrained peak (what torch.compile saves)
    block_saved_min_bytes: int  # what one block's minimum-memory plan holds at its forward's end
    block_input_bytes: int  # the tensors one block receives (held as its graph's inputs)
    world_size: int = 1
    notes: tuple[str, ...] = ()  # what measuring the sizes assumed (an unknown optimizer)
    # the blocks' calls in one forward where some block runs other than once (layers sharing
    # weights, blocks the forward skips); 0: one call per block
    block_calls: int = 0

    @property
    def blocks(self) -> int:
        return len(self.block_parameter_bytes)

    @property
    def outside_parameter_bytes(self) -> int:
        return max(0, self.parameter_bytes - sum(self.block_parameter_bytes))

    @property
    def outside_gradient_bytes(self) -> int:
        return max(0, self.gradient_bytes - sum(self.block_gradient_bytes))


@dataclass
class StepPlan:
    """Where each kind of training state lives, and what the activations get (per rank)."""

    budget_bytes: int
    parameters_on: str  # "device", "host", or "split" (by block: ``blocks_on_device``)
    gradients_on: str
    optimizer_state_on: str
    parameter_bytes: int  # unsharded, the whole model
    gradient_bytes: int
    optimizer_state_bytes: int
    state_on_device_bytes: int  # what the device holds of parameters, gradients, state, buffers at a time
    # (the blocks' gradients excepted: they are counted in the activations' figures)
    activation_budget_bytes: int  # the budget left for the compiled graphs' activations
    per_block_activation_budget_bytes: int  # each block's compiled graph's memory_budget
    activation_min_bytes: int  # the activations' minimum for the step (module docstring)
    predicted_device_peak_bytes: int  # state on the device + the activations the plans may use
    blocks: int
    world_size: int = 1
    # the blocks' calls in one forward where some block runs other than once (0: one per
    # block); a measured excess is shared between them
    block_calls: int = 0
    fsdp2: bool = False  # the model is sharded with fully_shard
    cpu_offload: bool = False  # ... with CPUOffloadPolicy (the root, and the blocks after ``blocks_on_device``)
    blocks_on_device: int = 0  # the first blocks whose parameters, gradients and state stay on the device
    # What FSDP2 uploads from the host as a block's backward starts (the next block's parameter
    # shard, the largest of the host blocks'): the blocks' reloads share the link with it.
    shared_h2d_bytes: int = 0
    # Where the host state's optimizer step runs: "host", "device" (streamed through it, a group
    # of parameters at a time) or "measured" (decided by timing both over the first steps;
    # ``Fitted.step`` writes the winner here); "device" when the state is all on the device.
    optimizer_step: str = "device"
    # The most device memory one group of the streamed step takes (a third of what the budget
    # leaves beside the state held: three groups are in flight at once).
    optimizer_step_chunk_bytes: int = 0
    # The device peak of one whole step measured at the allocator (CUDA), once the first steps
    # have compiled and settled where the optimizer steps; None until then, and on the CPU.
    measured_device_peak_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        b = format_bytes
        def where(on: str) -> str:
            if on != SPLIT:
                return f"on the {on}"
            return f"on the device for {_first_blocks(self.blocks_on_device)}, on the host for the rest"

        lines = [
            f"StepPlan: device budget {b(self.budget_bytes)} per rank, {self.world_size} rank(s), {self.blocks} blocks",
            f"  parameters       {b(self.parameter_bytes):>12}  {where(self.parameters_on)}",
            f"  gradients        {b(self.gradient_bytes):>12}  {where(self.gradients_on)}",
            f"  optimizer state  {b(self.optimizer_state_bytes):>12}  {where(self.optimizer_state_on)}",
            f"  held on the device at a time (state): {b(self.state_on_device_bytes)}",
            f"  activations: {b(self.activation_budget_bytes)} left, {b(self.per_block_activation_budget_bytes)} "
            f"per block's compiled graph (minimum {b(self.activation_min_bytes)})",
            f"  predicted device peak: {b(self.predicted_device_peak_bytes)}"
            + ("" if self.measured_device_peak_bytes is None
               else f", measured {b(self.measured_device_peak_bytes)} (one whole step, at the allocator)"),
            *([f"  optimizer step of the host state: {self._optimizer_step_text()}"] if self.cpu_offload else []),
            *([f"  host link: {b(self.shared_h2d_bytes)} of parameters uploaded as each block's backward starts, "
               "ahead of the activations' reloads"] if self.shared_h2d_bytes else []),
            "  prepared with: " + ("FSDP2 fully_shard, CPUOffloadPolicy after the first "
                                   f"{self.blocks_on_device} blocks" if self.parameters_on == SPLIT
                                   else "FSDP2 fully_shard with CPUOffloadPolicy" if self.cpu_offload
                                   else "FSDP2 fully_shard" if self.fsdp2 else "the model on the device"),
        ]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


    def _optimizer_step_text(self) -> str:
        streamed = f"streamed through the device, {format_bytes(self.optimizer_step_chunk_bytes)} groups"
        return {"host": "on the host", "device": streamed,
                "measured": f"on the host or {streamed}, whichever the first steps measure faster"}.get(
                    self.optimizer_step, self.optimizer_step)


def _held_unsharded(sizes: StateSizes) -> tuple[int, str]:
    """Parameters FSDP2 holds unsharded on the device at a time: the root's (outside the
    blocks) all step, and two neighbouring blocks' (each block's prefetched while the one
    before it runs): the largest such pair. (bytes, how)."""
    block_params = list(sizes.block_parameter_bytes)
    if len(block_params) == 1:
        pair, which = block_params[0], "the one block"
    else:
        first = max(range(len(block_params) - 1), key=lambda i: block_params[i] + block_params[i + 1])
        pair, which = block_params[first] + block_params[first + 1], f"blocks {first} and {first + 1}"
    how = f"outside the blocks {format_bytes(sizes.outside_parameter_bytes)} + {which} {format_bytes(pair)}"
    return sizes.outside_parameter_bytes + pair, how


def _first_blocks(count: int) -> str:
    return "block 0" if count == 1 else f"blocks 0-{count - 1}"


def plan_step(budget_bytes: int, sizes: StateSizes) -> StepPlan:
    """The placement for ``sizes`` under a device budget of ``budget_bytes`` (per rank); the
    rule and its limits are in this module's docstring. Raises ``ValueError`` when even the
    host placement does not fit."""
    if sizes.blocks == 0:
        raise ValueError("compile_offload.fit: no blocks to shard and compile")
    if budget_bytes <= 0:
        raise ValueError(f"compile_offload.fit: memory_budget must be a positive number of bytes, not {budget_bytes}")
    n = sizes.blocks
    calls = max(n, sizes.block_calls)  # each call of a block saves its activations
    ranks = max(1, sizes.world_size)
    inputs_held = calls * sizes.block_input_bytes
    max_block_grads = max(sizes.block_gradient_bytes)
    # every block at its minimum-memory plan, in the first block's backward (module docstring)
    host_activation_min = (calls - 1) * sizes.block_saved_min_bytes + sizes.block_activation_min_bytes + inputs_held
    # on one rank the blocks' gradients stay unsharded until the optimizer step
    device_activation_min = host_activation_min + ((n - 1) * max_block_grads if ranks == 1 else 0)
    notes = list(sizes.notes)
    whole_state = sizes.parameter_bytes + sizes.gradient_bytes + sizes.optimizer_state_bytes
    held_params, held_how = _held_unsharded(sizes)
    held_grads = sizes.outside_gradient_bytes  # the blocks' are in their graphs' peaks
    notes.append(f"the blocks' gradients ({format_bytes(sum(sizes.block_gradient_bytes))}) are outputs of their "
                 "compiled backward graphs: counted in the activations' figures, not in the state held")

    if ranks == 1:
        on_device = whole_state - sum(sizes.block_gradient_bytes) + sizes.buffer_bytes
    else:  # FSDP2 without offload: a 1/N share, plus what it gathers at a time
        on_device = -(-whole_state // ranks) + held_params + held_grads + sizes.buffer_bytes
    activation_min = device_activation_min
    if on_device + activation_min <= budget_bytes:
        where, fsdp2, offload = DEVICE, ranks > 1, False
        state_on_device = on_device
        notes.append(f"parameters, gradients and optimizer state fit the budget with the activations' minimum: "
                     f"{format_bytes(on_device)} + {format_bytes(activation_min)} <= {format_bytes(budget_bytes)}")
    else:
        state_on_device = held_params + held_grads + sizes.buffer_bytes
        activation_min = host_activation_min
        if state_on_device + activation_min > budget_bytes:
            raise ValueError(
                f"compile_offload.fit: memory_budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below "
                f"what training needs on the device even with parameters, gradients and optimizer state on the host: "
                f"unsharded parameters held {format_bytes(held_params)} ({held_how}), the gradients outside the "
                f"blocks {format_bytes(held_grads)}, buffers {format_bytes(sizes.buffer_bytes)}, and the activations' "
                f"minimum {format_bytes(activation_min)} (one block's peak {format_bytes(sizes.block_activation_min_bytes)}"
                f" + {calls - 1} x {format_bytes(sizes.block_saved_min_bytes)} saved by the other calls + block inputs "
                f"{format_bytes(inputs_held)}) = {format_bytes(state_on_device + activation_min)} "
                f"({state_on_device + activation_min} bytes). A budget of at least that fits; so would smaller "
                f"blocks (more of them) or a smaller sample (batch). All on the device would need "
                f"{format_bytes(on_device + device_activation_min)}.")
        where, fsdp2, offload = HOST, True, True
        kept, kept_bytes = _blocks_that_fit(budget_bytes - state_on_device - activation_min, sizes, ranks)
        too_much = (f"parameters + gradients + optimizer state + activations' minimum "
                    f"({format_bytes(on_device + device_activation_min)}) exceed the budget")
        held = (f"{format_bytes(held_params)} of unsharded parameters ({held_how}) and {format_bytes(held_grads)} of "
                "gradients outside the blocks")
        if kept:
            where = SPLIT
            state_on_device += kept_bytes
            notes.append(f"{too_much}: {_first_blocks(kept)} {'keeps its' if kept == 1 else 'keep theirs'} on the "
                         f"device ({format_bytes(kept_bytes)}), the other {n - kept} and the parameters outside the "
                         f"blocks go to the host through FSDP2's CPUOffloadPolicy; besides the blocks kept, the "
                         f"device holds {held}")
        else:
            notes.append(f"{too_much}: all three on the host through FSDP2's CPUOffloadPolicy; the device holds {held}")

    host_blocks = sizes.block_parameter_bytes[kept:] if where == SPLIT else sizes.block_parameter_bytes
    shared_h2d = -(-max(host_blocks) // ranks) if offload else 0  # each rank uploads its shard, then all-gathers
    activation_budget = budget_bytes - state_on_device
    slack = activation_budget - activation_min
    per_block = sizes.block_activation_min_bytes + slack // calls
    room = max(0, sizes.block_activation_max_bytes - sizes.block_activation_min_bytes)
    predicted_peak = state_on_device + activation_min + min(slack, calls * room)
    notes.append("not counted in the predicted peak: FSDP2's communication buffers, activations outside the blocks "
                 "(embedding output, head, loss), allocator fragmentation, the CUDA context")
    return StepPlan(
        budget_bytes=budget_bytes, parameters_on=where, gradients_on=where, optimizer_state_on=where,
        parameter_bytes=sizes.parameter_bytes, gradient_bytes=sizes.gradient_bytes,
        optimizer_state_bytes=sizes.optimizer_state_bytes, state_on_device_bytes=state_on_device,
        activation_budget_bytes=activation_budget, per_block_activation_budget_bytes=per_block,
        activation_min_bytes=activation_min, predicted_device_peak_bytes=predicted_peak, blocks=n,
        world_size=ranks, block_calls=sizes.block_calls, fsdp2=fsdp2, cpu_offload=offload,
        blocks_on_device=n if where == DEVICE else kept if where == SPLIT else 0, shared_h2d_bytes=shared_h2d,
        optimizer_step="measured" if offload else "device",
        optimizer_step_chunk_bytes=max(0, budget_bytes - state_on_device) // 3 if offload else 0, notes=notes)


def _blocks_that_fit(room: int, sizes: StateSizes, ranks: int) -> tuple[int, int]:
    """The most first blocks, fewer than all, whose parameters, gradients and optimizer state
    (in proportion to its trainable parameters, whose bytes its gradients' are: a frozen
    parameter has no state; a 1/``ranks`` share of each) fit in ``room`` bytes, and their
    bytes."""
    kept, used = 0, 0
    for params, grads in list(zip(sizes.block_parameter_bytes, sizes.block_gradient_bytes))[:-1]:
        state = sizes.optimizer_state_bytes * grads // max(1, sizes.gradient_bytes)
        cost = -(-(params + grads + state) // ranks)
        if used + cost > room:
            break
        kept, used = kept + 1, used + cost
    return kept, used
