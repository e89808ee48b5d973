"""Where the host state's optimizer step runs (compile_offload/training/optimizer_step.py):
the streamed step updates parameters and state as torch's optimizer does on the host,
group by group; the measured choice keeps the faster; what cannot stream stays on the host."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import compile_offload
from compile_offload.torch_api import optim
from compile_offload.training.optimizer_step import AUTO, DEVICE, HOST, TRIALS, OptimizerStep
from tests.test_fit import BUDGET, Net, assert_trains_like_an_eager_loop, batch, loss_fn, optimizer_fn

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "adam-amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True, weight_decay=0.1),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, centered=True, momentum=0.5),
}


def _train(model: nn.Module, step_fn, steps: int, scheduler=None) -> list[torch.Tensor]:
    losses = []
    for step in range(steps):
        loss = loss_fn(model(batch(step)))
        loss.backward()
        step_fn()
        if scheduler is not None:
            scheduler.step()
        for p in model.parameters():
            p.grad = None
        losses.append(loss.detach())
    return losses


def _chunk(optimizer: torch.optim.Optimizer, parameters: int) -> int:
    """Room for ``parameters`` of the largest parameter's footprint (parameter, gradient, state)."""
    largest = max(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"])
    return parameters * largest * 5  # AdamW with amsgrad: parameter + gradient + 3 state tensors


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_streamed_step_trains_like_the_host_step(name):
    """Several groups of parameters at a time, a learning-rate schedule: the parameters and
    the state after 4 steps equal torch's optimizer stepping them in place."""
    torch.manual_seed(0)
    model, reference = Net(), None
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](reference.parameters())
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (optimizer, reference_optimizer)]
    stepper = OptimizerStep(optimizer, torch.device("cpu"), mode=DEVICE, chunk_bytes=_chunk(optimizer, 2))
    streamed = []
    real = stepper._step_chunks
    stepper._step_chunks = lambda group, chunks, stepped: streamed.append(len(chunks)) or real(group, chunks, stepped)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _train(model, stepper.step, 4, schedules[0])
    expected = _train(reference, reference_optimizer.step, 4, schedules[1])
    # the scheduler saw the optimizer step (torch warns when lr_scheduler.step() comes first)
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]

    assert stepper.chosen == DEVICE and len(streamed) == 3 and all(n > 1 for n in streamed), streamed
    torch.testing.assert_close(losses, expected)
    for (label, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=label)
        for key, value in reference_optimizer.state[q].items():
            torch.testing.assert_close(optimizer.state[p][key], value, msg=f"{label} {key}")


def _two_steps_each(mode: str):
    """A model stepped twice by ``OptimizerStep`` (one parameter a group; under "auto" as if
    the streamed step had measured faster), and its copy by torch's AdamW."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](reference.parameters())
    stepper = OptimizerStep(optimizer, torch.device("cpu"), mode=mode, chunk_bytes=_chunk(optimizer, 1))
    if mode == AUTO:
        stepper.chosen = DEVICE  # on the CPU "auto" stays on the host
    _train(model, stepper.step, 2)
    _train(reference, reference_optimizer.step, 2)
    return model, optimizer, stepper, reference, reference_optimizer


def test_a_group_that_cannot_be_staged_steps_on_the_host_with_the_rest(monkeypatch):
    """review33c F3: out of device memory staging the third group, the step raised with two
    groups stepped and the rest not (a retry stepped the first ones twice), and on CUDA the
    downloads still writing the host tensors. The groups not stepped now step on the host:
    one whole step, as the reference's, with a warning."""
    model, optimizer, stepper, reference, reference_optimizer = _two_steps_each(DEVICE)
    staged = []
    real = OptimizerStep._stage

    def stage(self, params, group):
        staged.append(len(params))
        if len(staged) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, params, group)

    monkeypatch.setattr(OptimizerStep, "_stage", stage)
    with pytest.warns(UserWarning, match=r"ran out of device memory staging a group .* stepped on the host"):
        _train(model, stepper.step, 1)
    _train(reference, reference_optimizer.step, 1)
    assert len(staged) == 3 and len(list(model.parameters())) > 3
    _assert_like(model, optimizer, reference, reference_optimizer)


def test_the_first_step_runs_on_the_host_and_creates_the_state():
    torch.manual_seed(0)
    model = Net()
    optimizer = optimizer_fn(model.parameters())
    stepper = OptimizerStep(optimizer, torch.device("cpu"), mode=DEVICE, chunk_bytes=_chunk(optimizer, 1))
    stepper._streamed = lambda: pytest.fail("the first step streamed")
    _train(model, stepper.step, 1)
    assert len(optimizer.state) == len(list(model.parameters()))


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_a_parameter_first_trained_after_the_first_step_gets_its_state_on_the_host(name):
    """Progressive unfreezing: the head has no gradient in the first step, so no state. Its
    first step runs on the host, where the optimizer creates its state (streamed, the new
    state had nowhere to go back to: KeyError), and it streams from then on."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](reference.parameters())
    stepper = OptimizerStep(optimizer, torch.device("cpu"), mode=DEVICE, chunk_bytes=_chunk(optimizer, 2))
    head = list(model.parameters())[-1]
    for net in (model, reference):
        list(net.parameters())[-1].requires_grad_(False)
    _train(model, stepper.step, 1)
    _train(reference, reference_optimizer.step, 1)
    assert head not in optimizer.state
    for net in (model, reference):
        list(net.parameters())[-1].requires_grad_(True)
    losses = _train(model, stepper.step, 3)
    expected = _train(reference, reference_optimizer.step, 3)
    assert stepper.chosen == DEVICE and head in optimizer.state
    torch.testing.assert_close(losses, expected)
    for (label, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=label)


def test_an_optimizer_without_state_streams_every_parameter():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)  # no momentum: no state, ever
    stepper = OptimizerStep(optimizer, torch.device("cpu"), mode=DEVICE, chunk_bytes=_chunk(optimizer, 2))
    streamed: list[int] = []
    real = stepper._step_chunks
    stepper._step_chunks = lambda group, chunks, stepped: streamed.append(sum(map(len, chunks))) or real(group, chunks, stepped)
    _train(model, stepper.step, 3)
    assert not any(optimizer.state.values()) and streamed
    assert all(n == len(list(model.parameters())) for n in streamed)


def test_the_global_step_hooks_run_once_per_step_however_many_groups_stream():
    """Hooks registered for every optimizer (torch.optim.optimizer.register_optimizer_step_pre_hook
    and _post_hook) see the user's optimizer.step() once per step: the copies of the optimizer
    that step the streamed groups run without them (each group's step ran them before)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper = OptimizerStep(optimizer, torch.device("cpu"), mode=DEVICE, chunk_bytes=_chunk(optimizer, 1))
    groups: list[int] = []
    real = stepper._step_chunks
    stepper._step_chunks = lambda group, chunks, stepped: groups.append(len(chunks)) or real(group, chunks, stepped)
    seen: list[tuple[str, int]] = []
    handles = [register_optimizer_step_pre_hook(lambda opt, *_: seen.append(("pre", id(opt)))),
               register_optimizer_step_post_hook(lambda opt, *_: seen.append(("post", id(opt))))]
    try:
        with pytest.warns(UserWarning, match="the optimizer has step pre-hooks"):
            _train(model, stepper.step, 3)
    finally:
        for handle in handles:
            handle.remove()
    assert stepper.chosen == DEVICE and max(groups) > 1  # several groups streamed in one step
    assert seen == [("pre", id(optimizer)), ("post", id(optimizer))] * 3


class _SubclassedAdamW(torch.optim.AdamW):
    def step(self, closure=None):  # through the base class's hooked step as well
        return super().step(closure)


def test_a_step_without_hooks_sets_the_global_ones_aside_even_through_super_and_puts_them_back():
    """review29d: skipping the class's hook wrapper was not enough where a subclass's step calls
    super().step(): the base class's wrapper ran the global hooks."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from compile_offload.torch_api.optim import step_without_hooks

    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # AdamW's own step is hooked too
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    optimizer = _SubclassedAdamW([p], lr=0.1)
    seen: list[str] = []
    handles = [register_optimizer_step_pre_hook(lambda *_: seen.append("pre")),
               register_optimizer_step_post_hook(lambda *_: seen.append("post"))]
    try:
        step_without_hooks(optimizer)
        assert seen == [] and optimizer.state[p]["step"] == 1
        optimizer.step()  # back, in their order
        assert seen == ["pre", "pre", "post", "post"]  # the subclass's wrapper and AdamW's, each
    finally:
        for handle in handles:
            handle.remove()
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    assert not _global_optimizer_pre_hooks  # the handles still removed them


@pytest.mark.parametrize("streamed_costs,expected", [((1.0, 1.0, 1.0), DEVICE), ((1.0, 1.0, 3.5), HOST),
                                                     ((10.0, 1.0, 1.0), DEVICE)])
def test_auto_times_both_and_keeps_the_streamed_step_only_where_faster_beyond_the_spread(streamed_costs, expected):
    """With a stand-in clock under which the host step takes 3 s and the streamed one
    ``streamed_costs`` (in turn): the first step and the first streamed one untimed, then
    TRIALS of each alternating, then the chosen one; a streamed trial slower than a host one
    keeps the host step; every step's update is right. The first streamed step pins the host
    state and makes the streams (10 s here): timed, it kept the host step where streaming
    was 3 times faster."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer = optimizer_fn(model.parameters())
    stepper = OptimizerStep(optimizer, torch.device("cpu"), mode="auto", chunk_bytes=_chunk(optimizer, 4))
    assert stepper.chosen == HOST and "on the CPU" in stepper.why
    stepper.chosen = None  # measure here as on a GPU
    ran, now, streaming = [], [0.0], [False]
    stepper.timer = lambda: now[0]
    real_streamed, real_host = stepper._streamed, optimizer.step

    def streamed():
        ran.append(DEVICE)
        streaming[0] = True
        real_streamed()
        streaming[0] = False
        now[0] += streamed_costs[min(ran.count(DEVICE), len(streamed_costs)) - 1]

    def host_step():
        if streaming[0]:  # the streamed step's own optimizer.step() (the parameters on the device: none)
            return real_host()
        ran.append(HOST)
        real_host()
        now[0] += 3.0

    stepper._streamed, optimizer.step = streamed, host_step

    _train(model, stepper.step, 2 + 2 * TRIALS + 2)
    reference_optimizer = optimizer_fn(reference.parameters())
    _train(reference, reference_optimizer.step, 2 + 2 * TRIALS + 2)

    assert stepper.chosen == expected
    assert ran[:2] == [HOST, DEVICE] and ran[2:2 + 2 * TRIALS] == [DEVICE, HOST] * TRIALS
    assert ran[2 + 2 * TRIALS:] == [expected] * 2, ran
    assert [stepper.times[w] for w in (HOST, DEVICE)] == [[3.0] * TRIALS, list(streamed_costs[1:1 + TRIALS])]
    assert "measured host" in stepper.describe()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_where_no_parameter_fits_a_group_the_step_stays_on_the_host():
    torch.manual_seed(0)
    model = Net()
    optimizer = optimizer_fn(model.parameters())
    stepper = OptimizerStep(optimizer, torch.device("cpu"), mode=DEVICE, chunk_bytes=16)
    _train(model, stepper.step, 2)
    assert stepper.chosen == HOST and "18 of 18 host parameters step on the host" in stepper.why, stepper.why


def test_parameters_too_large_for_a_group_step_on_the_host_while_the_rest_streams():
    """A group too small for the weights (parameter + gradient + AdamW's two moments) but
    large enough for the biases: the biases stream, the weights step through the user's
    optimizer, the plan's note says so, and training is unchanged."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer = optimizer_fn(model.parameters())
    largest_bias = max(4 * p.numel() * p.element_size() for name, p in model.named_parameters() if "bias" in name)
    stepper = OptimizerStep(optimizer, torch.device("cpu"), mode=DEVICE, chunk_bytes=largest_bias)
    streamed = []
    real = stepper._step_chunks
    stepper._step_chunks = lambda group, chunks, stepped: streamed.extend(p for chunk in chunks for p in chunk) or real(
        group, chunks, stepped)
    _train(model, stepper.step, 3)
    reference_optimizer = optimizer_fn(reference.parameters())
    _train(reference, reference_optimizer.step, 3)

    names = {id(p): name for name, p in model.named_parameters()}
    assert stepper.chosen == DEVICE and streamed
    assert {names[id(p)].rsplit(".", 1)[-1] for p in streamed} == {"bias"}
    assert "step on the host" in stepper.describe() and "of 18 host parameters" in stepper.describe()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_an_optimizer_outside_torch_optim_steps_on_the_host():
    class Mine(torch.optim.SGD):
        pass

    Mine.__module__ = "my_project.optim"
    stepper = OptimizerStep(Mine(Net().parameters(), lr=0.1), torch.device("cpu"), mode=DEVICE, chunk_bytes=1 << 30)
    assert stepper.chosen == HOST and "Mine" in stepper.why


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="optimizer_step must be one of"):
        OptimizerStep(optimizer_fn(Net().parameters()), torch.device("cpu"), mode="gpu")
    model = Net()
    with pytest.raises(ValueError, match="optimizer_step must be one of"):
        compile_offload.fit(model, optimizer_fn, batch(0), memory_budget=BUDGET, loss_fn=loss_fn,
                            optimizer_step="gpu", inner_compiler="eager")
    assert not dist.is_initialized()
    assert not hasattr(model.blocks[0], "_get_fsdp_state")  # refused before anything was prepared


def test_fit_streams_the_host_state_through_the_device_like_an_eager_loop():
    """fit(optimizer_step="device") with the state on the host (FSDP2's CPUOffloadPolicy):
    the host shards step streamed, and the parameters after 4 steps are an eager loop's."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    tokens = 128  # activations that need more than the host placement's budget, less than the whole state's
    result = compile_offload.fit(model, optimizer_fn, batch(0, tokens=tokens), memory_budget=4 * BUDGET,
                                 loss_fn=loss_fn, optimizer_step="device", inner_compiler="eager")
    try:
        assert result.plan.cpu_offload and result.plan.optimizer_step == DEVICE
        assert result.plan.optimizer_step_chunk_bytes >= result.optimizer_step.chunk_bytes > 0
        assert "streamed through the device" in str(result.plan)
        streamed = []
        real = result.optimizer_step._step_chunks
        result.optimizer_step._step_chunks = lambda group, chunks, stepped: streamed.append(len(chunks)) or real(group, chunks, stepped)
        assert_trains_like_an_eager_loop(result, reference, 4, tokens=tokens)
        assert result.optimizer_step.chosen == DEVICE, result.optimizer_step.why
        assert len(streamed) == 3 and all(n > 1 for n in streamed), streamed  # steps 2-4, in several groups
    finally:
        result.close()
        torch._dynamo.reset()


class _WithoutBiases(nn.Module):
    """Only matrices: none fits one streamed group at the smallest host placement."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64, bias=False), nn.GELU(),
                                                  nn.Linear(64, 32, bias=False)) for _ in range(3))
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _assert_like(model, optimizer, reference, reference_optimizer):
    for (label, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=label)
        for key, value in reference_optimizer.state[q].items():
            torch.testing.assert_close(optimizer.state[p][key], value, msg=f"{label} {key}")


def test_a_group_out_of_memory_in_its_step_steps_on_the_host_with_its_counters_stepped_once(monkeypatch):
    """review33d O1: out of device memory inside a group's step (the foreach kernels allocate
    temporaries), after the step counters the host shares with it were incremented, the step
    raised with earlier groups stepped and this group's counters one step ahead. The group and
    those after it now step on the host, its counters put back first: one whole step."""
    model, optimizer, stepper, reference, reference_optimizer = _two_steps_each(DEVICE)
    calls = []
    real = optim.step_without_hooks

    def step_then_fail(inner):
        calls.append(1)
        if len(calls) == 3:
            for state in inner.state.values():  # as torch's foreach Adam: the counters first
                state["step"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        real(inner)

    monkeypatch.setattr(optim, "step_without_hooks", step_then_fail)
    with pytest.warns(UserWarning, match=r"ran out of device memory stepping a group .* stepped on the host this step$"):
        _train(model, stepper.step, 1)
    _train(reference, reference_optimizer.step, 1)
    assert len(calls) == 3 and len(list(model.parameters())) > 3 and stepper.chosen == DEVICE
    _assert_like(model, optimizer, reference, reference_optimizer)


def test_a_measured_streamed_step_out_of_memory_stays_on_the_host_from_then_on(monkeypatch):
    """review33d O1: where "auto" had measured the streamed step faster, a shortage of device
    memory recurred every step (a warning and an emptied allocator cache each time). The step
    now stays on the host after the first, and the plan's line says why."""
    model, optimizer, stepper, reference, reference_optimizer = _two_steps_each(AUTO)
    staged = []

    def stage(self, params, group):
        staged.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(OptimizerStep, "_stage", stage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, stepper.step, 3)
    _train(reference, reference_optimizer.step, 3)
    said = [str(w.message) for w in caught if "ran out of device memory" in str(w.message)]
    assert len(said) == 1 and said[0].endswith("the optimizer steps on the host from now on"), said
    assert len(staged) == 1 and stepper.chosen == HOST
    assert stepper.describe() == "optimizer step on the host (the streamed step ran out of device memory)"
    _assert_like(model, optimizer, reference, reference_optimizer)


def test_a_streamed_step_that_falls_back_to_the_host_says_so_in_the_plan():
    """optimizer_step="device" where no host parameter fits one group steps on the host; the
    plan kept saying "device" and "streamed through the device" (fuzz32a F02)."""
    import re

    sample = torch.randn(8, 32)
    with pytest.raises(ValueError) as error:
        compile_offload.fit(_WithoutBiases(), optimizer_fn, sample, memory_budget=1, loss_fn=loss_fn,
                            inner_compiler="eager")
    smallest = int(re.findall(r"\((\d+) bytes\)", str(error.value))[-1])
    result = compile_offload.fit(_WithoutBiases(), optimizer_fn, sample, memory_budget=smallest, loss_fn=loss_fn,
                                 inner_compiler="eager", optimizer_step="device")
    try:
        for _ in range(3):
            result.step(sample)
        assert result.optimizer_step.chosen == HOST
        assert result.plan.optimizer_step == HOST
        said = [note for note in result.plan.notes if note.startswith("optimizer step")]
        assert said == [result.optimizer_step.describe()] and "on the host" in said[0], said
    finally:
        result.close()
        torch._dynamo.reset()


def test_fit_on_the_cpu_keeps_the_step_on_the_host_and_says_why():
    result = compile_offload.fit(Net(), optimizer_fn, batch(0), memory_budget=BUDGET, loss_fn=loss_fn,
                                 inner_compiler="eager")
    try:
        assert result.plan.optimizer_step == HOST
        assert any("on the CPU the host is the device" in note for note in result.plan.notes), result.plan.notes
    finally:
        result.close()
        torch._dynamo.reset()


def test_a_forced_optimizer_step_with_no_host_state_says_it_changes_nothing():
    result = compile_offload.fit(Net(), optimizer_fn, batch(0), memory_budget="64MiB", loss_fn=loss_fn,
                                 optimizer_step="host", inner_compiler="eager")
    try:
        assert result.plan.parameters_on == "device" and result.optimizer_step is None
        assert result.plan.optimizer_step == DEVICE
        assert any("optimizer_step='host' changes nothing" in note for note in result.plan.notes), result.plan.notes
    finally:
        result.close()
        torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["adamw", "adamw-fused", "sgd-momentum"])
def test_on_cuda_the_streamed_step_of_host_parameters_equals_the_host_step(name):
    """Parameters on the host (pinned, as FSDP2 offloads them) and on the device, in one
    optimizer: the host ones stream through the GPU in groups on copy streams, the device ones
    step in place; parameters and state after 3 steps equal the same optimizer's steps on a
    copy, and the host tensors are complete when step() returns. Every host state tensor the
    groups copy is pinned (fused kernels' step counters too), so their copies are asynchronous."""
    torch.manual_seed(0)
    shapes = [(256, 512), (512,), (1024, 256), (256,)] * 3
    host = [nn.Parameter(torch.randn(s).pin_memory()) for s in shapes]
    device = [nn.Parameter(torch.randn(s, device="cuda")) for s in shapes[:2]]
    params = host + device
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    optimizer, reference_optimizer = OPTIMIZERS[name](params), OPTIMIZERS[name](reference)
    stepper = OptimizerStep(optimizer, torch.device("cuda"), mode=DEVICE, chunk_bytes=_chunk(optimizer, 2))
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        for p, q, g in zip(params, reference, grads):
            p.grad, q.grad = g.to(p.device), g.to(q.device)
        stepper.step()
        reference_optimizer.step()
    assert stepper.chosen == DEVICE
    for p, q in zip(params, reference):
        assert p.device == q.device
        torch.testing.assert_close(p, q)
        for key, value in reference_optimizer.state[q].items():
            torch.testing.assert_close(optimizer.state[p][key], value, msg=key)
    group = optimizer.param_groups[0]
    moved = [v for p in host for v in optimizer.state[p].values() if stepper._moves(v, group)]
    assert moved and all(v.is_pinned() for v in moved)
    assert any(v.dim() == 0 for v in moved) == (name == "adamw-fused")


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_sgd_with_its_state_on_the_host_trains_like_an_eager_loop(momentum):
    """torch's fused SGD has no rule for FSDP2's sharded parameters (its first step raised
    NotImplementedError for aten._fused_sgd_): its groups get foreach=True there. Without
    momentum SGD keeps no state: optimizer_step="device" streams every step after the first
    all the same (it used to take the host path at every step)."""
    def sgd(params):
        return torch.optim.SGD(params, lr=1e-2, momentum=momentum, weight_decay=1e-2)

    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    result = compile_offload.fit(model, sgd, batch(0), memory_budget=BUDGET, loss_fn=loss_fn,
                                 inner_compiler="eager", optimizer_step="device")
    streamed = []
    stream = result.optimizer_step._streamed
    result.optimizer_step._streamed = lambda: streamed.append(1) or stream()
    try:
        assert result.plan.cpu_offload
        assert [group["foreach"] for group in result.optimizer.param_groups] == [True]
        assert any("foreach=True" in note for note in result.plan.notes), result.plan.notes
        reference_optimizer = sgd(reference.parameters())
        for step in range(3):
            result.step(batch(step))
            loss_fn(reference(batch(step))).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        assert len(streamed) == 2  # every step after the first
        for (name, p), q in zip(result.model.named_parameters(), reference.parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            torch.testing.assert_close(full.detach(), q.detach(), rtol=1e-4, atol=1e-5, msg=name)
    finally:
        result.close()
        torch._dynamo.reset()


def test_the_host_step_uses_torchs_fused_kernels_where_the_implementation_was_left_to_torch():
    """AdamW(fused=None, foreach=None) with its state on the host: fit sets fused=True (torch's
    for-loop default is several times slower there), says so, and trains like an eager loop;
    an implementation the user chose is kept."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    result = compile_offload.fit(model, optimizer_fn, batch(0), memory_budget=BUDGET, loss_fn=loss_fn,
                                 inner_compiler="eager")
    try:
        assert result.plan.cpu_offload
        assert all(group["fused"] is True for group in result.optimizer.param_groups)
        assert any("fused=True" in note for note in result.plan.notes), result.plan.notes
        assert_trains_like_an_eager_loop(result, reference, 3)
    finally:
        result.close()
        torch._dynamo.reset()

    from compile_offload.training.optimizer_step import prefer_fused

    chosen = torch.optim.AdamW(Net().parameters(), foreach=False)
    assert prefer_fused(chosen) is None and chosen.param_groups[0]["fused"] is None
    assert prefer_fused(torch.optim.RMSprop(Net().parameters())) is None  # no fused kernel on the host


def test_the_step_on_the_device_uses_torchs_fused_kernels_where_the_implementation_was_left_to_torch():
    """All state on a CUDA device: torch's default there (foreach) held temporaries of the
    parameters' size (Adam's square roots of its second moments) beside the budget; the fused
    kernels step in place. SGD is left to torch there: its default holds no such temporaries,
    and fused SGD refuses sparse gradients (an Embedding(sparse=True) trained before)."""
    from compile_offload.training.optimizer_step import prefer_fused

    adamw = torch.optim.AdamW(Net().parameters())
    note = prefer_fused(adamw, on_host=False)
    assert all(group["fused"] is True for group in adamw.param_groups)
    assert "fused=True in 1 of 1" in note and "on the device in place" in note and "host" not in note

    class Sharded(torch.Tensor):  # stands for FSDP2's DTensor: what prefer_fused looks for
        def to_local(self):
            return self

    sgd = torch.optim.SGD([torch.zeros(2).as_subclass(Sharded).requires_grad_()], lr=0.1)
    assert prefer_fused(sgd, on_host=False) is None and sgd.param_groups[0]["foreach"] is None
    assert "foreach=True" in prefer_fused(sgd) and sgd.param_groups[0]["foreach"] is True
    plain_sgd = torch.optim.SGD(Net().parameters(), lr=0.1)
    assert prefer_fused(plain_sgd, on_host=False) is None and plain_sgd.param_groups[0]["fused"] is None
