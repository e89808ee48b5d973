"""``passes.inductor.smaller_matmuls_first``: a gradient's weight-gradient matmul runs before its
input-gradient matmul when its output is smaller, which never raises the live set at those
kernels and frees the saved input sooner. Checked on hand-traced graphs (order, values,
what must not move) and on the contract's MLP-mixer, whose unconstrained step it brought
to what Inductor's peak-memory reordering reaches (at the allocator:
``tests/test_budget_contract.py``)."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from compile_offload.passes.inductor.rules import INDUCTOR
from compile_offload.benchmarks import budget_contract
from compile_offload.tools.model_check import backend_analysis, capture_joint
from compile_offload.passes import compat
from compile_offload.passes.analyze import analyze_joint
from compile_offload.passes.memory import plan_program, simulate
from compile_offload.passes.inductor.smaller_matmuls_first import smaller_matmuls_first

aten = torch.ops.aten
ROWS, COLS, INNER = 512, 256, 64


def _linear_backward(x, w, tangents_1):
    # the backward of y = x @ w.T: the input gradient (ROWS x INNER) and the weight gradient
    # (COLS x INNER, smaller), in autograd's order
    grad = aten.mul.Tensor(tangents_1, 2.0)
    grad_input = aten.mm.default(grad, w)
    grad_weight = aten.mm.default(aten.permute.default(grad, [1, 0]), x)
    return grad_input, grad_weight


def _inputs():
    torch.manual_seed(0)
    return torch.randn(ROWS, INNER), torch.randn(COLS, INNER), torch.randn(ROWS, COLS)


def _order(gm):
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def test_the_smaller_matmul_and_the_view_it_reads_move_before_the_larger():
    gm = make_fx(_linear_backward)(*_inputs())
    expected = gm(*_inputs())
    assert _order(gm) == ["mul", "mm", "permute", "mm_1"]
    smaller_matmuls_first(gm)
    assert _order(gm) == ["mul", "permute", "mm_1", "mm"]
    assert all(torch.equal(a, b) for a, b in zip(expected, gm(*_inputs())))


def test_nothing_moves_when_the_first_matmul_is_already_the_smaller():
    def weight_gradient_first(x, w, tangents_1):
        grad = aten.mul.Tensor(tangents_1, 2.0)
        return aten.mm.default(aten.permute.default(grad, [1, 0]), x), aten.mm.default(grad, w)

    # the weight gradient (COLS x INNER) first, then the larger input gradient (ROWS x 4 INNER)
    gm = make_fx(weight_gradient_first)(torch.randn(ROWS, INNER), torch.randn(COLS, 4 * INNER), torch.randn(ROWS, COLS))
    before = _order(gm)
    smaller_matmuls_first(gm)
    assert _order(gm) == before


def test_a_matmul_reading_something_computed_after_the_larger_one_stays():
    def computed_between(x, w, tangents_1):
        grad = aten.mul.Tensor(tangents_1, 2.0)
        grad_input = aten.mm.default(grad, w)
        scaled = aten.mul.Tensor(x, 3.0)  # not a view: the weight gradient cannot pass it
        return grad_input, aten.mm.default(aten.permute.default(grad, [1, 0]), scaled)

    gm = make_fx(computed_between)(*_inputs())
    before = _order(gm)
    smaller_matmuls_first(gm)
    assert _order(gm) == before


def test_forward_matmuls_are_left_alone():
    def forward_only(x, w, y):
        return aten.mm.default(x, aten.permute.default(w, [1, 0])), aten.mm.default(aten.permute.default(x, [1, 0]), y)

    gm = make_fx(forward_only)(*_inputs())
    before = _order(gm)
    smaller_matmuls_first(gm)
    assert _order(gm) == before


def test_the_mixers_unconstrained_peak_is_lower_in_the_backends_order():
    model, inputs, loss_of = budget_contract.build("mlp_mixer")

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return loss_of(self.model(x))

    (x,) = inputs
    traced = analyze_joint(capture_joint(Step(), x), INDUCTOR)
    ordered = backend_analysis(Step(), x)

    def peak(a):
        return simulate(plan_program(a, set(compat.min_cut_saved_values(a.joint)), fusion=True)).peak_bytes

    assert peak(ordered) < peak(traced)
