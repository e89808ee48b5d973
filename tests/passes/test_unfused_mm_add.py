"""``passes.inductor.unfused_mm_add``: an ``add`` of a matmul that Inductor would fold into an
``addmm`` (computing the matmul where the add is) is written so that it does not, with the
same values to the bit; and the backend's compiled step then calls ``mm``, not ``addmm``."""

import pytest
import torch
import torch.nn as nn
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from compile_offload.passes.inductor.unfused_mm_add import unfused_mm_add

aten = torch.ops.aten


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _late_sum(a, b, c, d):
    # the matmul's one user is an add that also needs a value computed after it
    product = aten.mm.default(a, b)
    later = aten.mul.Tensor(c, d)
    return aten.add.Tensor(product, later), aten.add.Tensor(later, aten.mm.default(aten.mul.Tensor(a, 2.0), b))


def _inputs():
    torch.manual_seed(0)
    return torch.randn(16, 8), torch.randn(8, 4), torch.randn(16, 4), torch.randn(16, 4)


def test_each_add_of_a_matmul_becomes_a_sum_inductor_does_not_fold_with_the_same_bits():
    gm = make_fx(_late_sum)(*_inputs())
    expected = gm(*_inputs())
    assert _targets(gm).count(aten.add.Tensor) == 2
    unfused_mm_add(gm)
    assert aten.add.Tensor not in _targets(gm) and _targets(gm).count(aten.sub.Tensor) == 2
    assert all(torch.equal(x, y) for x, y in zip(expected, gm(*_inputs())))


def test_adds_inductor_would_not_fold_stay():
    def kept(a, b, c, d):
        product = aten.mm.default(a, b)
        summed = aten.add.Tensor(product, c)  # the mm has another user: no fold
        return aten.add.Tensor(aten.mul.Tensor(c, d), 1.0), summed, aten.mul.Tensor(product, 2.0)

    gm = make_fx(kept)(*_inputs())
    before = _targets(gm)
    unfused_mm_add(gm)
    assert _targets(gm) == before


class _Residual(nn.Module):
    """A bias-free linear added to its input: the add Inductor folds the matmul into."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        return x + self.proj(torch.tanh(x))


@pytest.mark.inductor
def test_the_backend_compiles_a_matmul_and_an_add_where_inductor_alone_fuses_them():
    torch.manual_seed(0)
    model, x = _Residual(), torch.randn(64, 32, requires_grad=True)

    def step(compiled):
        compiled(x).pow(2).sum().backward()

    torch._dynamo.reset()
    _, plain = run_and_get_code(step, torch.compile(model, backend="inductor"))
    assert any("addmm" in code for code in plain)  # what the pass exists for: Inductor folds it
    expected = [p.grad.clone() for p in (*model.parameters(), x)]
    model.zero_grad(), x.grad.zero_()
    torch._dynamo.reset()
    _, ours = run_and_get_code(step, torch.compile(model, backend="offload_remat"))
    assert not any("addmm" in code for code in ours) and any("extern_kernels.mm" in code for code in ours)
    for got, want in zip((*model.parameters(), x), expected):
        torch.testing.assert_close(got.grad, want)
