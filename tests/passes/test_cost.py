"""The cost model: FLOPs, bytes and roofline times of constructed nodes, checked against
answers computed by hand (or by torch's flop counter running the real function)."""

from __future__ import annotations

import dataclasses
import json
import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

from compile_offload.passes import cost
from compile_offload.passes.cost import BUILTIN_PROFILES, DeviceProfile

H100 = BUILTIN_PROFILES["h100"]


def trace(fn, *args, mode="fake"):
    """An aten graph whose nodes carry meta["val"] fake tensors."""
    return make_fx(fn, tracing_mode=mode)(*args)


def nodes_with(gm, target):
    return [n for n in gm.graph.nodes if n.target == target]


def only(gm, target):
    (node,) = nodes_with(gm, target)
    return node


@pytest.fixture(autouse=True)
def fresh_flop_cache():
    cost.clear_flop_cache()
    yield
    cost.clear_flop_cache()


# ---------------------------------------------------------------------------- FLOPs

@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_mm_flops_are_2mnk(mode):
    m, k, n = 64, 32, 48
    gm = trace(torch.mm, torch.randn(m, k), torch.randn(k, n), mode=mode)
    assert cost.node_flops(only(gm, torch.ops.aten.mm.default)) == 2 * m * n * k


def test_non_compute_nodes_have_no_flops():
    gm = trace(lambda x: (x.t().relu() + 1, x.max(dim=0)), torch.randn(8, 4))
    for node in gm.graph.nodes:
        assert cost.node_flops(node) == 0, node.format_node()


def test_joint_graph_flops_match_torch_flop_counter_on_real_tensors():
    def step(w1, w2, x):
        loss = torch.tanh(x @ w1).matmul(w2).pow(2).sum()
        return torch.autograd.grad(loss, (w1, w2))

    args = (torch.randn(16, 32, requires_grad=True), torch.randn(32, 8, requires_grad=True), torch.randn(64, 16))
    with FlopCounterMode(display=False) as counter:
        step(*args)
    gm = trace(step, *args)
    assert sum(cost.node_flops(n) for n in gm.graph.nodes) == counter.get_total_flops() > 0


def test_cpu_attention_counts_two_matmuls_forward_and_five_backward():
    b, h, s, d = 2, 3, 16, 8
    q = torch.randn(b, h, s, d, requires_grad=True)

    def attention_step(q):
        out = F.scaled_dot_product_attention(q, q, q)
        return torch.autograd.grad(out.sum(), q)

    gm = trace(attention_step, q)
    forward = nodes_with(gm, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    backward = nodes_with(gm, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    if not forward or not backward:
        pytest.skip("this torch build does not trace SDPA to the CPU flash kernel")
    one_matmul = 2 * b * h * s * s * d  # QK^T or PV
    assert cost.node_flops(forward[0]) == 2 * one_matmul
    # backward: recompute QK^T, then dP, dV, dQ, dK (as the flash kernels do)
    assert cost.node_flops(backward[0]) == 5 * one_matmul


def test_flops_are_counted_once_per_distinct_shape():
    shapes = [(8, 16, 4), (32, 8, 8)]

    def many_matmuls(*tensors):
        outs = []
        for _ in range(20):
            for i in range(0, len(tensors), 2):
                outs.append(torch.mm(tensors[i], tensors[i + 1]) + 1)
        return outs

    tensors = [t for m, k, n in shapes for t in (torch.randn(m, k), torch.randn(k, n))]
    gm = trace(many_matmuls, *tensors)
    mms = nodes_with(gm, torch.ops.aten.mm.default)
    assert len(mms) == 40
    total = sum(cost.node_flops(n) for n in gm.graph.nodes)
    assert total == 20 * sum(2 * m * k * n for m, k, n in shapes)
    assert cost.flop_counter().entered == len(shapes)


def test_ops_without_a_flop_formula_are_never_run():
    gm = trace(lambda x: [x.sin() * i for i in range(50)], torch.randn(4, 4))
    assert sum(cost.node_flops(n) for n in gm.graph.nodes) == 0
    assert cost.flop_counter().entered == 0


def test_flops_are_counted_under_an_active_fake_mode():
    gm = trace(torch.mm, torch.randn(4, 6), torch.randn(6, 5))
    with FakeTensorMode():
        assert cost.node_flops(only(gm, torch.ops.aten.mm.default)) == 2 * 4 * 6 * 5


# ---------------------------------------------------------------------------- bytes

def test_pointwise_bytes_are_inputs_plus_output():
    gm = trace(torch.add, torch.randn(100, 10), torch.randn(100, 10))
    assert cost.node_bytes_accessed(only(gm, torch.ops.aten.add.Tensor)) == 3 * 1000 * 4


def test_an_input_used_twice_is_read_once():
    gm = trace(lambda x: x * x, torch.randn(100, dtype=torch.float16))
    assert cost.node_bytes_accessed(only(gm, torch.ops.aten.mul.Tensor)) == 2 * 100 * 2


def test_an_expanded_input_reads_its_storage_once():
    gm = trace(lambda x: x.expand(256, 128) * 2, torch.randn(1, 128))
    assert cost.node_bytes_accessed(only(gm, torch.ops.aten.mul.Tensor)) == 128 * 4 + 256 * 128 * 4


def test_symbolic_sizes_use_their_hints():
    gm = trace(lambda x: x.cos(), torch.randn(12, 7), mode="symbolic")
    assert cost.node_bytes_accessed(only(gm, torch.ops.aten.cos.default)) == 2 * 12 * 7 * 4


def test_in_place_op_reads_and_writes_its_input():
    gm = trace(lambda x: x.add_(1), torch.randn(50))
    node = only(gm, torch.ops.aten.add_.Tensor)
    assert cost.launches_kernel(node)
    assert cost.node_bytes_accessed(node) == 2 * 50 * 4


def test_views_getitem_placeholders_and_outputs_are_free():
    def fn(x):
        values, indices = x.max(dim=0)
        return x.t(), x.view(4, 2), x.expand(3, 2, 4)[0], values, indices

    gm = trace(fn, torch.randn(2, 4))
    free = [n for n in gm.graph.nodes if n.op in ("placeholder", "output") or n.target in (
        operator.getitem, torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten.expand.default,
        torch.ops.aten.select.int)]
    assert len(free) >= 7
    for node in free:
        assert not cost.launches_kernel(node), node.format_node()
        assert cost.node_bytes_accessed(node) == 0
        assert cost.node_seconds(node, H100) == 0.0


# ---------------------------------------------------------------------------- time

def _kernel_seconds(node, profile) -> float:
    """A node's time without its launch overhead."""
    return cost.node_seconds(node, profile) - profile.launch_overhead_seconds


def _with_rates(profile, *, flops_scale=1.0, bandwidth_scale=1.0):
    return dataclasses.replace(
        profile,
        flops_per_second={k: v * flops_scale for k, v in profile.flops_per_second.items()},
        memory_bandwidth=profile.memory_bandwidth * bandwidth_scale,
    )


def test_large_bf16_matmul_is_compute_bound_on_h100():
    """Relations, not the formula: a large matmul's time follows the matmul rate (twice the
    rate, half the time), not the memory bandwidth, and grows as n**3."""
    def mm(n):
        a = torch.empty(n, n, dtype=torch.bfloat16, device="meta")
        return only(trace(torch.mm, a, a), torch.ops.aten.mm.default)

    node = mm(4096)
    base = _kernel_seconds(node, H100)
    assert _kernel_seconds(node, _with_rates(H100, flops_scale=2.0)) == pytest.approx(base / 2)
    assert _kernel_seconds(node, _with_rates(H100, bandwidth_scale=2.0)) == pytest.approx(base)
    assert _kernel_seconds(mm(8192), H100) == pytest.approx(8 * base)


def test_float32_matmul_uses_the_float32_rate():
    n = 1024
    a = torch.empty(n, n, device="meta")
    node = only(trace(torch.mm, a, a), torch.ops.aten.mm.default)
    slower_fp32 = dataclasses.replace(
        H100, flops_per_second={**H100.flops_per_second, "float32": H100.flops_per_second["float32"] / 4})
    faster_bf16 = dataclasses.replace(
        H100, flops_per_second={**H100.flops_per_second, "bfloat16": H100.flops_per_second["bfloat16"] * 4})
    base = _kernel_seconds(node, H100)
    assert _kernel_seconds(node, slower_fp32) == pytest.approx(4 * base)
    assert _kernel_seconds(node, faster_bf16) == pytest.approx(base)


def test_pointwise_add_is_bandwidth_bound():
    """A pointwise add's time follows the memory bandwidth, not the matmul rate, and grows
    linearly with the elements it reads and writes."""
    def add(n):
        x = torch.empty(n, device="meta")
        return only(trace(torch.add, x, x.clone()), torch.ops.aten.add.Tensor)

    node = add(1 << 20)
    base = _kernel_seconds(node, H100)
    assert base > 0
    assert _kernel_seconds(node, _with_rates(H100, bandwidth_scale=2.0)) == pytest.approx(base / 2)
    assert _kernel_seconds(node, _with_rates(H100, flops_scale=0.5)) == pytest.approx(base)
    assert _kernel_seconds(add(1 << 21), H100) == pytest.approx(2 * base)


def test_launch_overhead_is_added_once_per_kernel():
    gm = trace(lambda x: x.sin().cos(), torch.randn(8))
    no_overhead = dataclasses.replace(H100, launch_overhead_seconds=0.0)
    slow_launch = dataclasses.replace(H100, launch_overhead_seconds=1e-3)
    kernels = [n for n in gm.graph.nodes if cost.launches_kernel(n)]
    assert len(kernels) == 2
    difference = cost.graph_seconds(gm, slow_launch) - cost.graph_seconds(gm, no_overhead)
    assert difference == pytest.approx(2 * 1e-3)


def test_graph_seconds_sums_nodes_of_a_module_a_graph_or_a_list():
    gm = trace(lambda a, b: (a @ b).relu(), torch.randn(32, 16), torch.randn(16, 8))
    total = sum(cost.node_seconds(n, H100) for n in gm.graph.nodes)
    assert total > 0
    assert cost.graph_seconds(gm, H100) == total
    assert cost.graph_seconds(gm.graph, H100) == total
    assert cost.graph_seconds(list(gm.graph.nodes), H100) == total


def test_transfer_seconds():
    """Linear in bytes, inverse in the direction's own bandwidth, nothing for nothing."""
    gigabyte = 10**9
    one = {d: cost.transfer_seconds(gigabyte, H100, d) - H100.launch_overhead_seconds for d in ("d2h", "h2d")}
    two = {d: cost.transfer_seconds(2 * gigabyte, H100, d) - H100.launch_overhead_seconds for d in ("d2h", "h2d")}
    assert two == pytest.approx({d: 2 * t for d, t in one.items()})
    slow_d2h = dataclasses.replace(H100, d2h_bandwidth=H100.d2h_bandwidth / 2)
    assert cost.transfer_seconds(gigabyte, slow_d2h, "d2h") - H100.launch_overhead_seconds == pytest.approx(2 * one["d2h"])
    assert cost.transfer_seconds(gigabyte, slow_d2h, "h2d") == cost.transfer_seconds(gigabyte, H100, "h2d")
    assert cost.transfer_seconds(0, H100, "d2h") == 0.0
    with pytest.raises(ValueError, match="d2h"):
        cost.transfer_seconds(gigabyte, H100, "sideways")


# ---------------------------------------------------------------------------- profiles

@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_profile_round_trips_through_json(name):
    profile = BUILTIN_PROFILES[name]
    assert DeviceProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_builtin_profiles_exist_and_gpus_favour_bf16():
    assert {"h100", "h200", "a100", "rtx4090", "cpu"} <= set(BUILTIN_PROFILES)
    for name in ("h100", "h200", "a100", "rtx4090"):
        profile = BUILTIN_PROFILES[name]
        assert profile.peak_flops(torch.bfloat16) > profile.peak_flops(torch.float32)
        assert profile.memory_bandwidth > profile.d2h_bandwidth


def test_h100_figures_are_achievable_fractions_of_the_datasheet():
    assert 0.6 * 989e12 <= H100.peak_flops("bfloat16") <= 0.85 * 989e12
    assert 0.7 * 3.35e12 <= H100.memory_bandwidth <= 3.35e12
    assert (H100.d2h_bandwidth, H100.h2d_bandwidth) == (55.1e9, 54.9e9)  # measured pinned copies on an H100 (docs/benchmarks.md)


def test_h200_is_the_h100_chip():
    h200 = BUILTIN_PROFILES["h200"]
    assert h200.peak_flops("bfloat16") == H100.peak_flops("bfloat16")
    assert h200.launch_overhead_seconds == H100.launch_overhead_seconds
    assert 0.5 * 4.8e12 <= h200.memory_bandwidth <= 4.8e12
    assert (h200.d2h_bandwidth, h200.h2d_bandwidth) == (H100.d2h_bandwidth, H100.h2d_bandwidth)


def test_unlisted_dtypes_fall_back_to_float32_rate():
    assert H100.peak_flops(torch.int8) == H100.peak_flops("float32")
    assert H100.peak_flops("torch.complex64") == H100.peak_flops(torch.float32)
    bf16_only = dataclasses.replace(H100, flops_per_second={"bfloat16": 5.0, "float16": 3.0})
    assert bf16_only.peak_flops(torch.float32) == 3.0


def test_profile_is_hashable_and_owns_its_rates():
    rates = {"float32": 1e12}
    profile = DeviceProfile("x", rates, 1e12, 1e10, 1e10, 1e-6)
    rates["float32"] = 1.0
    assert profile.peak_flops("float32") == 1e12
    assert hash(profile) == hash(DeviceProfile.from_dict(profile.to_dict()))


@pytest.mark.parametrize("breakage", [
    lambda d: d.pop("memory_bandwidth"),
    lambda d: d.update(memory_bandwidth=-1.0),
    lambda d: d.update(d2h_bandwidth=None),
    lambda d: d.update(flops_per_second={}),
    lambda d: d.update(flops_per_second={"float32": math.inf}),
    lambda d: d.update(launch_overhead_seconds=-1e-6),
    lambda d: d.update(extra=1),
])
def test_malformed_profile_dicts_are_rejected(breakage):
    data = H100.to_dict()
    breakage(data)
    with pytest.raises(ValueError):
        DeviceProfile.from_dict(data)
