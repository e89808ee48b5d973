"""A view of an unrealized pointwise value, read by a matmul and something else, is copied
into a buffer of its own (``GraphLowering.run_node`` requires the matmul input's stride
order, and a view of an inlined value has no storage): the value stays inlined, so its
other consumers compute it again and keep what it reads alive (``analyze.copy_decisions``).
Checked here on the analysis of the backend's joint graphs; at the CPU allocator by the
budget contract (``tests/test_budget_contract.py``: the MLP-mixer at 0.6, predicted 5.1%
low without this rule)."""

import warnings

import pytest
import torch
from torch import nn

import compile_offload
from compile_offload.benchmarks import budget_contract
from compile_offload.passes import analyze
from compile_offload.passes.memory import StepBuilder, plan_nodes, plan_program, simulate

from ..graphs_program import graphs_program

from ..partition_results import partitions

BATCH, WIDTH = 1024, 256  # one activation: 1 MiB of float32


def _analysis(fn, *inputs):
    """The backend's analysis of ``fn``'s joint graph under Inductor (after its joint-graph
    passes, with its fusion), and the saved nodes of the backend's plan."""
    torch._dynamo.reset()
    with partitions() as found, warnings.catch_warnings(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        warnings.simplefilter("ignore")
        compiled = torch.compile(fn, backend=compile_offload.offload_remat(device_profile="cpu",
                                                                           inner_compiler="inductor"))
        compiled(*inputs).backward()
    (partition,) = found
    a = partition.result.analysis
    assert a.fusion
    saved = {n for n in a.joint.gm.graph.nodes if n.name in set(partition.plan.saved)}
    return a, saved


def _mixer():
    model, inputs, loss_of = budget_contract.build("mlp_mixer")
    return _analysis(lambda *args: loss_of(model(*args)), *inputs)


def _copies(a, saved):
    """The views Inductor copies under the plan that saves ``saved``, and what it inlines."""
    builder = StepBuilder(a, fusion=True)
    builder(saved, plan_nodes(a, saved))
    return builder.copies, builder.fused


@pytest.mark.inductor
@pytest.mark.slow
def test_the_mixers_loss_gradient_is_copied_for_the_matmuls_and_inlined_in_the_residual():
    a, saved = _mixer()
    copies, fused = _copies(a, saved)
    assert copies
    backward = set(a.bw_nodes)
    for view in copies:
        assert a.copy_candidates[view] is view.args[0] and view.args[0] in fused and view.args[0] in backward
        assert len(view.users) > 1 and any(u.target is torch.ops.aten.mm.default for u in view.users)
        assert a.copy_bytes[view] == analyze.allocation_bytes(analyze.tensor_value(view))
    # The loss gradient (it loads the saved output and the one-element incoming gradient)
    # is among them: its other consumer, a pointwise add, computes it again, so in the
    # simulated program that add reads what the copy reads, the copy allocates, and
    # nothing allocates the gradient itself.
    program = plan_program(a, saved, fusion=True)
    steps = {step.label: step for step in program.steps}
    recomputed_in = {view: [u for u in view.args[0].users if u is not view and analyze.is_pointwise(u)]
                     for view in copies}
    view = next(v for v, users in recomputed_in.items() if users)
    copy = steps[view.name]
    assert copy.allocates == [(view, a.copy_bytes[view])] and copy.reads
    assert not steps[view.args[0].name].allocates
    assert set(copy.reads) <= set(steps[recomputed_in[view][0].name].reads)


class Residual(nn.Module):
    """``x + linear(x)``: the loss gradient feeds the linear's matmuls through a view, and the
    residual's add."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.linear(x)


@pytest.mark.inductor
@pytest.mark.slow
def test_a_value_loading_two_tensors_is_realized_not_copied():
    # The plan recomputes the residual sum (``x`` plus the saved linear output) inside the
    # loss gradient, whose body then loads two tensors: the view's ``realize_hint``
    # realizes the gradient itself, and the view reads its buffer (measured: the generated
    # backward's first kernel writes the gradient, and the residual's add reads it).
    torch.manual_seed(0)
    model, x = Residual(), torch.randn(4, BATCH // 4, WIDTH, requires_grad=True)
    a, saved = _analysis(lambda inp: model(inp).pow(2).mean(), x)
    assert a.copy_candidates  # the pattern is there: a view read by the matmuls and the bias's sum
    copies, fused = _copies(a, saved)
    assert not copies
    assert all(value not in fused for value in a.copy_candidates.values())
    # Had the plan saved the sum, the gradient would load it alone, and be copied.
    total = next(n for n in a.joint.gm.graph.nodes if n.op == "call_function"
                 and n.target is torch.ops.aten.add.Tensor and n in set(a.fw_nodes))
    copies_if_saved, _ = _copies(a, set(saved) | {total})
    assert copies_if_saved == frozenset(a.copy_candidates)


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("budget_fraction", [None, 0.6])
def test_the_partitioned_graphs_program_makes_the_same_copies(budget_fraction):
    # ``graphs_program`` decides the copies on the backward graph the partitioner built, the
    # planner on the joint graph and a saved set: the same program, the same peak.
    model, inputs, loss_of = budget_contract.build("mlp_mixer")
    torch._dynamo.reset()
    with partitions() as found, warnings.catch_warnings(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        warnings.simplefilter("ignore")
        step = torch.compile(lambda *args: loss_of(model(*args)), backend=compile_offload.offload_remat(
            memory_budget=budget_fraction, device_profile="cpu", inner_compiler="inductor"))
        step(*inputs).backward()
    partition = found[0]
    a = partition.result.analysis
    saved = {n for n in a.joint.gm.graph.nodes if n.name in set(partition.plan.saved)}
    copies, _ = _copies(a, saved)
    assert copies
    planned = plan_program(a, saved, fusion=True)
    built = graphs_program(partition.fw, partition.bw, partition.num_fwd_outputs, fusion=True)
    assert simulate(built).peak_bytes == simulate(planned).peak_bytes
    backward = {step.label: step for step in built.steps[built.backward_start:]}
    for view in copies:  # each copy allocates the view's bytes in the backward graph too
        assert [nbytes for _, nbytes in backward[view.name].allocates] == [a.copy_bytes[view]]
        assert not backward[view.args[0].name].allocates
