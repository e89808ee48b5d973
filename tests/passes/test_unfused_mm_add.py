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
    # the matmul reads a value whose last reader it is; a buffer is allocated before its add
    product = aten.mm.default(aten.mul.Tensor(a, 2.0), b)
    later = aten.mul.Tensor(c, d)
    second = aten.mm.default(aten.mul.Tensor(a, 3.0), b)
    spacer = aten.mul.Tensor(d, 2.0)
    return aten.add.Tensor(product, later), aten.add.Tensor(c, second), spacer


def _next_sum(a, b, c, d):
    # each add right after its matmul, whose inputs are read later anyway: folding holds nothing
    first = aten.add.Tensor(aten.mm.default(a, b), c)
    second = aten.add.Tensor(d, aten.mm.default(a, b))
    return first, second, aten.mul.Tensor(a, 2.0), aten.mul.Tensor(b, 2.0)


def _inputs():
    torch.manual_seed(0)
    return torch.randn(16, 8), torch.randn(8, 4), torch.randn(16, 4), torch.randn(16, 4)


def test_an_add_whose_fold_would_hold_the_matmuls_input_becomes_a_sum_inductor_does_not_fold_with_the_same_bits():
    gm = make_fx(_late_sum)(*_inputs())
    expected = gm(*_inputs())
    assert _targets(gm).count(aten.add.Tensor) == 2
    unfused_mm_add(gm)
    assert aten.add.Tensor not in _targets(gm) and _targets(gm).count(aten.sub.Tensor) == 2
    assert aten.addmm.default not in _targets(gm)
    assert all(torch.equal(x, y) for x, y in zip(expected, gm(*_inputs())))


def test_an_add_whose_fold_holds_nothing_is_folded_here_as_inductor_would():
    gm = make_fx(_next_sum)(*_inputs())
    expected = gm(*_inputs())
    unfused_mm_add(gm)
    targets = _targets(gm)
    assert targets.count(aten.addmm.default) == 2 and aten.mm.default not in targets and aten.add.Tensor not in targets
    for got, want in zip(gm(*_inputs()), expected):
        torch.testing.assert_close(got, want)


def test_an_add_whose_fold_holds_less_than_the_matmuls_output_is_folded():
    """The fold keeps the matmul's input past its last reader, but spares its output, four
    times larger, until the add: it holds less, and is made."""
    def wide(a, b, c, d):
        product = aten.mm.default(aten.mul.Tensor(a, 2.0), b)  # [16, 8] read last here, [16, 32] out
        spacer = aten.mul.Tensor(d, 2.0)  # allocated before the add
        return aten.add.Tensor(product, c), spacer

    inputs = (torch.randn(16, 8), torch.randn(8, 32), torch.randn(16, 32), torch.randn(16, 32))
    gm = make_fx(wide)(*inputs)
    expected = gm(*inputs)
    unfused_mm_add(gm)
    assert _targets(gm).count(aten.addmm.default) == 1 and aten.sub.Tensor not in _targets(gm)
    for got, want in zip(gm(*inputs), expected):
        torch.testing.assert_close(got, want)


def test_a_chain_of_written_sums_is_ended_by_a_fold():
    """A weight's gradient summed over many uses: after one add written as a sum, the next
    is folded even where that holds an input, so that the sums are not one pointwise chain
    Inductor would inline into one kernel reading every matmul's output."""
    def chain(a, b, c):
        total, spacers = c, []
        for scale in (2.0, 3.0, 4.0):
            product = aten.mm.default(aten.mul.Tensor(a, scale), b)  # its input's last reader
            spacers.append(aten.mul.Tensor(c, scale))  # allocated before the add
            total = aten.add.Tensor(total, product)
        return total, *spacers

    gm = make_fx(chain)(*_inputs()[:3])
    expected = gm(*_inputs()[:3])
    unfused_mm_add(gm)
    targets = _targets(gm)
    assert targets.count(aten.sub.Tensor) == 2 and targets.count(aten.addmm.default) == 1
    subs = [n for n in gm.graph.nodes if n.target is aten.sub.Tensor]
    assert not any(arg in subs for sub in subs for arg in sub.args)  # no sum of a sum
    for got, want in zip(gm(*_inputs()[:3]), expected):
        torch.testing.assert_close(got, want)


def test_adds_inductor_would_not_fold_stay():
    def kept(a, b, c, d):
        product = aten.mm.default(a, b)
        summed = aten.add.Tensor(product, c)  # the mm has another user: no fold
        return aten.add.Tensor(aten.mul.Tensor(c, d), 1.0), summed, aten.mul.Tensor(product, 2.0)

    def broadcast_product(a, b, c, d):
        # the matmul's [1, 4] output is what broadcasts to the sum's [16, 4]: no addmm can
        return aten.add.Tensor(aten.mm.default(a[:1], b), c), d

    def doubled(a, b, c, d):
        product = aten.mm.default(a, b)
        return aten.add.Tensor(product, product), c, d  # one user, the add, reading it twice

    for fn in (kept, broadcast_product, doubled):
        gm = make_fx(fn)(*_inputs())
        expected = gm(*_inputs())
        before = _targets(gm)
        unfused_mm_add(gm)
        assert _targets(gm) == before, fn.__name__
        assert all(torch.equal(x, y) for x, y in zip(expected, gm(*_inputs())))


class _TiedHead(nn.Module):
    """A language model's head tied to its token embedding: the head's weight gradient is
    added to the embedding's at the end of the backward, an add Inductor folds the matmul
    into, holding the logits' gradient and the hidden states through the whole backward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.mix = nn.Linear(32, 32, bias=False)

    def forward(self, tokens):
        return torch.tanh(self.mix(self.embed(tokens))) @ self.embed.weight.t()


@pytest.mark.inductor
def test_the_backend_compiles_a_matmul_and_an_add_where_inductor_alone_fuses_them():
    torch.manual_seed(0)
    model, tokens = _TiedHead(), torch.randint(0, 64, (256,))

    def step(compiled):
        compiled(tokens).pow(2).sum().backward()

    torch._dynamo.reset()
    _, plain = run_and_get_code(step, torch.compile(model, backend="inductor"))
    assert any("addmm" in code for code in plain)  # what the pass exists for: Inductor folds it
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    _, ours = run_and_get_code(step, torch.compile(model, backend="offload_remat"))
    assert not any("addmm" in code for code in ours) and any("extern_kernels.mm" in code for code in ours)
    for got, want in zip(model.parameters(), expected):
        torch.testing.assert_close(got.grad, want)


class _RecurrentCell(nn.Module):
    """One cell applied at every step: its weights' gradients are sums over the steps."""

    def __init__(self, width=128, steps=12):
        super().__init__()
        self.inp, self.hidden, self.steps = nn.Linear(width, width), nn.Linear(width, width), steps

    def forward(self, x):
        h = torch.zeros(x.shape[1], x.shape[2])
        for t in range(self.steps):
            h = torch.tanh(self.inp(x[t]) + self.hidden(h))
        return h.sum()


@pytest.mark.inductor
def test_a_gradient_summed_over_many_steps_peaks_as_under_torch_compile():
    """Without a budget the backend's step holds what ``torch.compile``'s does: the sums
    accumulating the cell's weight gradients are not one pointwise chain that keeps every
    step's matmul output alive (it did when every such add was written as a sum: 3.9x)."""
    from compile_offload import measure_peak

    x = torch.randn(12, 32, 128)

    def peak(backend):
        torch.manual_seed(0)
        model = _RecurrentCell()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        compiled(x).backward()
        with measure_peak("cpu") as measured:
            compiled(x).backward()
        return measured.peak_bytes, [p.grad for p in model.parameters()]

    plain, plain_grads = peak("inductor")
    ours, our_grads = peak("offload_remat")
    assert ours <= 1.02 * plain, (ours, plain)
    for got, want in zip(our_grads, plain_grads):
        torch.testing.assert_close(got, want)
