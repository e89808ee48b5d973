"""Costs measured on the device (``runtime/kernel_costs.py``): a profiled step's kernel events
paired with the kernels Inductor scheduled, their times given to the FX nodes they compute.

The pairing and the split are checked on hand-built records and events; the profile of a
real compiled step on the CPU (its C++ kernels named with ``cpp.enable_kernel_profile``) and
the whole path through measured plan choice are in tests/test_measured_plan_choice.py.
"""

from __future__ import annotations

import pytest
import torch

from compile_offload.inductor.kernels import GraphKernels, Kernel
from compile_offload.runtime.kernel_costs import (
    Event,
    MeasuredCosts,
    ProfileMismatch,
    call_events,
    kernel_seconds,
    measured_costs,
    node_seconds,
)
from compile_offload.runtime.plan_trials import agree_on_costs


def _graph(*kernels: Kernel, backward: bool = False) -> GraphKernels:
    return GraphKernels(backward, list(kernels), [], [], [])


def _fused(name: str, *origins: str) -> Kernel:
    return Kernel(name, origins=list(origins))


def _extern(name: str, op: str, *origins: str) -> Kernel:
    return Kernel(name, origins=list(origins), launch="extern", extern_op=op)


MODEL = {"add": 1.0, "mul": 3.0, "mm": 10.0, "relu": 2.0, "sum": 1.0}


def _model(name: str) -> float | None:
    return MODEL.get(name)


def test_kernels_take_their_events_in_order_past_the_wrappers_own_ops():
    graph = _graph(_fused("op0", "add", "mul"), Kernel("nop", launch=""), _extern("op1", "mm", "mm", "mul"),
                   _fused("op2", "relu"), _extern("op3", "offload", "offload"))
    events = [Event("graph_0_cpp_fused_add_mul_0", 4e-3), Event("aten::empty_strided", 1e-5),
              Event("aten::mm", 9e-3), Event("aten::zero_", 1e-5), Event("triton_poi_fused_relu_1", 2e-3),
              Event("compile_offload::offload", 1e-3)]
    pairs = kernel_seconds(graph, events)
    assert [(k.name, s) for k, s in pairs] == [("op0", 4e-3), ("op1", 9e-3), ("op2", 2e-3), ("op3", 1e-3)]


def test_a_kernel_without_its_event_or_an_event_without_its_kernel_is_a_mismatch():
    with pytest.raises(ProfileMismatch, match="no event for kernel op1"):
        kernel_seconds(_graph(_fused("op0", "add"), _extern("op1", "mm", "mm")), [Event("cpp_fused_add_0", 1e-3)])
    with pytest.raises(ProfileMismatch, match="where kernel op1"):  # a generated kernel where an extern was due
        kernel_seconds(_graph(_fused("op0", "add"), _extern("op1", "mm", "mm")),
                       [Event("cpp_fused_add_0", 1e-3), Event("cpp_fused_relu_1", 1e-3), Event("aten::mm", 1e-3)])
    with pytest.raises(ProfileMismatch, match="not scheduled in the record"):
        kernel_seconds(_graph(_fused("op0", "add")), [Event("cpp_fused_add_0", 1e-3), Event("cpp_fused_relu_1", 1e-3)])


def test_a_kernels_time_is_split_over_its_nodes_by_the_model_and_an_externs_goes_to_its_op():
    pairs = [(_fused("op0", "add", "mul", "not_in_graph"), 8e-3), (_extern("op1", "mm", "mm", "mul"), 5e-3)]
    found = node_seconds(pairs, _model)
    assert found == pytest.approx({"add": 2e-3, "mul": 6e-3, "mm": 5e-3})


def test_the_table_of_a_step_keeps_a_recomputed_nodes_forward_time_and_scales_the_rest():
    forward = _graph(_fused("op0", "add", "mul"), _extern("op1", "mm", "mm"))
    backward = _graph(_fused("op0", "mul", "relu"), backward=True)  # mul recomputed beside relu
    calls = [[Event("cpp_fused_0", 4e-3), Event("aten::mm", 10e-3)], [Event("cpp_fused_1", 5e-3)]]
    costs = measured_costs(forward, backward, calls, _model, "cpu")
    assert costs.seconds == pytest.approx({"add": 1e-3, "mul": 3e-3, "mm": 10e-3, "relu": 2e-3})
    assert costs.scale == pytest.approx(sum(costs.seconds.values()) / (1 + 3 + 10 + 2))
    with pytest.raises(ProfileMismatch, match="1 compiled-graph calls"):
        measured_costs(forward, backward, calls[:1], _model, "cpu")
    with pytest.raises(ProfileMismatch, match="of the kernels' time is in nodes of the graph"):
        measured_costs(forward, backward, calls, lambda name: None if name != "relu" else 1.0, "cpu")


def test_a_recomputed_nodes_share_of_the_backward_counts_as_time_in_the_graphs_nodes():
    """A backward whose kernels mostly recompute: the recomputed node is priced at its forward
    time, and its backward share still counts as lined up (it was refused at 19%)."""
    forward = _graph(_fused("op0", "mul"))
    backward = _graph(_fused("op0", "mul", "relu"), backward=True)
    calls = [[Event("cpp_fused_0", 1e-3)], [Event("cpp_fused_1", 9e-3)]]
    costs = measured_costs(forward, backward, calls, {"mul": 9.0, "relu": 1.0}.get, "cpu")
    assert costs.seconds == pytest.approx({"mul": 1e-3, "relu": 0.9e-3})


def test_the_plans_copies_give_the_host_links_bandwidth_each_way():
    from compile_offload.inductor.kernels import Buffer

    forward = GraphKernels(False, [Kernel("op0", [Buffer("buf0", 4_000_000, "A")], ["x"], origins=["mm"]),
                                   _extern("op1", "offload", "offload"), _extern("op2", "wait_offload")],
                           ["x"], [], [], input_bytes={"x": 1000})
    forward.kernels[1].reads = ["buf0"]
    backward = GraphKernels(True, [Kernel("op0", [Buffer("buf1", 4_000_000, "A")], ["host"], launch="extern",
                                          extern_op="reload", origins=["reload"])], ["host"], [], [])
    calls = [[Event("cpp_fused_0", 1e-3), Event("compile_offload::offload", 2e-3),
              Event("compile_offload::wait_offload", 1e-5)],
             [Event("compile_offload::reload", 1e-3)]]
    costs = measured_costs(forward, backward, calls, lambda name: 1.0 if name in ("mm", "offload", "reload") else None,
                           "cuda")
    assert costs.d2h_bandwidth == pytest.approx(4e6 / 2e-3) and costs.h2d_bandwidth == pytest.approx(4e6 / 1e-3)
    from compile_offload.passes.cost import BUILTIN_PROFILES

    priced = costs.priced_profile(BUILTIN_PROFILES["h100"])
    assert priced.d2h_bandwidth == costs.d2h_bandwidth and priced.name == "h100"
    assert MeasuredCosts.from_json(costs.to_json()) == costs
    without = MeasuredCosts("cpu", {"mm": 1.0})
    assert without.priced_profile(BUILTIN_PROFILES["h100"]) is BUILTIN_PROFILES["h100"]
    with pytest.raises(ValueError, match="bandwidth"):
        MeasuredCosts.from_json({**costs.to_json(), "d2h_bandwidth": -1})


def test_measured_costs_price_measured_nodes_and_scale_the_model_elsewhere_and_survive_json():
    costs = MeasuredCosts("cpu", {"mm": 0.5}, scale=2.0)

    class _Node:
        def __init__(self, name):
            self.name = name

    seconds = costs.price(lambda node: 0.25)
    assert seconds(_Node("mm")) == 0.5 and seconds(_Node("add")) == 0.5
    again = MeasuredCosts.from_json(costs.to_json())
    assert again == costs and again.digest() == costs.digest()
    assert MeasuredCosts("cpu", {"mm": 0.6}, 2.0).digest() != costs.digest()
    with pytest.raises(ValueError):
        MeasuredCosts.from_json({**costs.to_json(), "seconds": {"mm": "slow"}})
    with pytest.raises(ValueError):
        MeasuredCosts.from_json({"device": "cpu"})


def test_ranks_plan_from_the_slowest_time_of_each_node_and_from_none_where_one_rank_has_none():
    ours = MeasuredCosts("cpu", {"a": 1.0, "b": 2.0}, 1.0)
    theirs = (({"a": 3.0, "b": 1.0}, 1.5))
    agreed = agree_on_costs(ours, gather=lambda mine: [mine, theirs])
    assert agreed.seconds == {"a": 3.0, "b": 2.0} and agreed.scale == 1.5
    assert agree_on_costs(ours, gather=lambda mine: [mine, None]) is None
    assert agree_on_costs(ours) is ours  # no process group


@pytest.mark.inductor
def test_a_compiled_cpu_step_shows_one_event_per_kernel_when_kernels_are_profiled():
    """The events ``call_events`` reads off a real compiled graph: Inductor's C++ kernels are
    named in the profiler under ``cpp.enable_kernel_profile``, its extern matmul as
    ``aten::mm``/``aten::addmm``, all inside the compiled graph's call."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)
    torch._dynamo.reset()
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True, "fx_graph_cache": False}):
        compiled = torch.compile(model)
        compiled(x)
        with torch.no_grad(), torch.profiler.profile() as prof:
            compiled(x)
    calls = call_events(prof.events(), cuda=False)
    assert len(calls) >= 1
    names = [event.name for event in calls[-1]]
    assert any(name.startswith("aten::") and "mm" in name for name in names), names
    assert any("cpp_fused" in name for name in names), names
    assert all(event.seconds >= 0 for event in calls[-1])


def test_the_plan_cache_keeps_one_table_per_graph_and_device_and_ignores_a_broken_one(tmp_path):
    from compile_offload import settings as settings_mod
    from compile_offload.pipeline import plan_cache

    settings = settings_mod.resolve({"plan_cache_dir": str(tmp_path), "measured_plan_choice": True,
                                     "memory_budget": 0.5})
    graph = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    other = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    costs = MeasuredCosts("cpu", {"linear": 1e-3}, 1.5)
    plan_cache.store_measured_costs(graph, settings, costs)
    assert plan_cache.load_measured_costs(graph, settings, "cpu") == costs
    assert plan_cache.load_measured_costs(graph, settings, "NVIDIA H200") is None  # another device
    assert plan_cache.load_measured_costs(other, settings, "cpu") is None  # another graph
    (path,) = (tmp_path / "measured_costs").iterdir()
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the measured-costs table .*planning from the cost model"):
        assert plan_cache.load_measured_costs(graph, settings, "cpu") is None


def test_an_extern_node_is_named_by_its_op_not_its_overload():
    """Inductor's CPU max-pool backward falls back to ``aten.scatter_reduce_.two``: its event
    is ``aten::scatter_reduce_``, so the kernel's op is ``scatter_reduce_`` (the overload name
    ``two`` paired with nothing, and measured costs failed on every conv net with pooling)."""
    from types import SimpleNamespace

    from compile_offload.inductor.kernels import extern_op_name

    fallback = SimpleNamespace(op_overload=torch.ops.aten.scatter_reduce_.two,
                               python_kernel_name="aten.scatter_reduce_.two")
    assert extern_op_name(fallback) == "scatter_reduce_"
    assert extern_op_name(SimpleNamespace(python_kernel_name="extern_kernels.mm")) == "mm"
    assert extern_op_name(SimpleNamespace(op_overload=None,
                                          python_kernel_name="torch.ops.aten.convolution_backward.default")) == \
        "convolution_backward"
