"""``passes.saved_storages``: the forward never hands the backward two saved tensors that
share one intermediate storage (AOTAutograd would donate it twice, and Inductor's backward
may overwrite it while the other alias is still read: issue 49's wrong gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compile_offload.passes.analyze import UnsupportedGraph, analyze_joint
from compile_offload.passes.rewrite import build_graphs
from compile_offload.passes.saved_storages import saved_storages

from .joint_capture import capture, capture_analysis


def _by_name(analysis):
    return {node.name: node for node in analysis.position}  # the analysed graph's nodes


def _linear_then_views(x, w, b):
    h = torch.addmm(b, x, w)      # the base buffer
    v = h.view(2, 4, 8)           # a view of it, read by the backward of gelu
    s = h.t()                     # another view, read by the backward of sin
    return (F.gelu(v).sum() + torch.sin(s).sum() + (h * h).sum(),)


def _inputs():
    return (torch.randn(8, 16, dtype=torch.float64, requires_grad=True),
            torch.randn(16, 8, dtype=torch.float64, requires_grad=True),
            torch.randn(8, dtype=torch.float64, requires_grad=True))


def test_a_saved_view_of_a_saved_buffer_is_recomputed_from_it():
    analysis, _ = capture_analysis(_linear_then_views, *_inputs())
    nodes = _by_name(analysis)
    base = next(n for n in nodes.values() if n.target is torch.ops.aten.addmm.default)
    views = {n for n in nodes.values() if analysis.roots.get(n) is base and n is not base and analysis.is_forward(n)}
    assert views, "the graph has views of the addmm"
    assert saved_storages(analysis, {base, *views}) == {base}


def test_a_saved_view_of_an_offloaded_buffer_is_recomputed_from_its_reloaded_copy():
    """review34c F2: a plan offloading a buffer and saving a view of it kept the view, so
    the forward returned it and its storage stayed on the device beside the reloaded copy
    (the memory model counted the buffer kept and no reload: 256 KiB under)."""
    analysis, _ = capture_analysis(_linear_then_views, *_inputs())
    nodes = _by_name(analysis)
    base = next(n for n in nodes.values() if n.target is torch.ops.aten.addmm.default)
    views = [n for n in nodes.values() if analysis.roots.get(n) is base and n is not base and analysis.is_forward(n)]
    assert views, "the graph has views of the addmm"
    for view in views:
        assert saved_storages(analysis, {base, view}, offloaded={base}) == {base}, view


def test_sibling_views_are_replaced_by_their_storage():
    analysis, _ = capture_analysis(_linear_then_views, *_inputs())
    nodes = _by_name(analysis)
    base = next(n for n in nodes.values() if n.target is torch.ops.aten.addmm.default)
    views = [n for n in nodes.values() if analysis.roots.get(n) is base and n is not base
             and analysis.alias_parent.get(n) is base]
    assert len(views) >= 2
    assert saved_storages(analysis, set(views)) == {base}
    assert saved_storages(analysis, {views[0]}) == {views[0]}, "a single view is saved as it is"


def test_the_forward_returns_one_tensor_per_storage():
    """The partitioned forward's saved outputs share no storage, whatever the plan asked."""

    def build(joint, _):
        analysis = analyze_joint(joint)
        base = next(n for n in analysis.position if n.target is torch.ops.aten.addmm.default)
        asked = {n for n in analysis.position if analysis.roots.get(n) is base and analysis.is_forward(n)}
        assert len(asked) >= 3, asked
        fw_gm, _ = build_graphs(analysis, asked)
        output = next(n for n in fw_gm.graph.nodes if n.op == "output")
        return base.name, [n.name for n in output.args[0][1:] if isinstance(n, torch.fx.Node) and n.op != "placeholder"]

    (base, saved), _ = capture(_linear_then_views, *_inputs(), hook=build)
    assert saved == [base]


def test_aliases_that_cannot_be_recomputed_from_one_tensor_are_not_planned():
    analysis, _ = capture_analysis(_linear_then_views, *_inputs())
    nodes = _by_name(analysis)
    base = next(n for n in nodes.values() if n.target is torch.ops.aten.addmm.default)
    views = [n for n in nodes.values() if analysis.alias_parent.get(n) is base]
    for view in views:  # as if each view's path to the buffer were banned from recompute
        analysis.ban[view] = "test"
    with pytest.raises(UnsupportedGraph, match="share the storage of"):
        saved_storages(analysis, set(views))
