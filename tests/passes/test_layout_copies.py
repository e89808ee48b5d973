"""Inductor copies a steady input a convolution reads into a channels-last buffer when the
forward starts, and the backward receives the copy (``analyze.layout_copies``): checked at
the CPU allocator against the compiled step, and the rule's reading of Inductor's config."""

import pytest
import torch

from compile_offload.passes.analyze import layout_copies

from .test_in_place import planned_and_measured

INPUT_BYTES = 32 * 3 * 64 * 64 * 4  # 1.5 MiB: the copy decides the peak


def _conv_loss(x, w):
    return torch.nn.functional.conv2d(x, w, padding=1).pow(2).mean()


@pytest.mark.inductor
@pytest.mark.slow
def test_the_channels_last_copy_of_a_convolution_input_is_predicted():
    """``x`` is saved for the weight's gradient: with layout optimization (Inductor's
    default, on for CPU graphs with mkldnn) the forward copies it to channels-last and the
    copy lives into the backward, where it is most of the peak. (With layout optimization
    off the CPU convolution backward allocates several times the input itself, which the
    simulator does not model: design.md.)"""
    torch.manual_seed(0)
    x = torch.randn(32, 3, 64, 64)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    predicted, measured = planned_and_measured(_conv_loss, x, w)
    assert measured > INPUT_BYTES  # the copy is alive at the peak
    assert abs(predicted - measured) < INPUT_BYTES // 16


def test_only_steady_inputs_in_another_layout_are_copied():
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(x, w, y):
        return torch.nn.functional.conv2d(x, w) + torch.nn.functional.conv2d(y, w)

    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    y = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    gm = make_fx(fn, tracing_mode="fake")(x, w, y)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with torch._inductor.config.patch(layout_optimization=True):
        copies = layout_copies(gm.graph.nodes, placeholders)
        assert {n.name: b for n, b in copies.items()} == {placeholders[0].name: x.numel() * 4,
                                                          placeholders[1].name: w.numel() * 4}
        assert layout_copies(gm.graph.nodes, []) == {}  # not steady: a computed value, not a copy
    with torch._inductor.config.patch(layout_optimization=False):
        assert layout_copies(gm.graph.nodes, placeholders) == {}
