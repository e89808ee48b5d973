"""The transfer model on constructed graphs and profiles whose answer is worked out by hand."""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from compile_offload.passes.cost import DeviceProfile, node_seconds, transfer_seconds
from compile_offload.passes.memory import backward_order, forward_nodes_needed, plan_program, recomputed_nodes, simulate
from compile_offload.passes.transfer import LinkEstimate, backward_schedule, forward_schedule, plan_transfers

from .joint_capture import Tower, capture_analysis


def profile(link: float, shared_h2d_bytes: int = 0) -> DeviceProfile:
    """Slow compute, a link of ``link`` bytes/s each way, no launch overhead (so the
    arithmetic below is exact); ``shared_h2d_bytes`` copied by another user as the backward
    starts."""
    return DeviceProfile(f"test-{link:g}", {"float32": 1e9}, memory_bandwidth=1e10, d2h_bandwidth=link,
                         h2d_bandwidth=link, launch_overhead_seconds=0.0, shared_h2d_bytes=shared_h2d_bytes)


@functools.cache
def tower():
    torch.manual_seed(0)
    analysis, base = capture_analysis(Tower(), torch.randn(1024, 64))
    return analysis, set(base)


def activations(analysis, saved):
    """The saved activations (three tanh outputs, the last matmul's output), in forward order."""
    return sorted((n for n in saved if n.op == "call_function"), key=analysis.position.__getitem__)


def seconds_for(device):
    return lambda node: node_seconds(node, device)


def forward_times(analysis, saved, seconds):
    """(end time of each forward node, forward total), summed by hand."""
    ends, now = {}, 0.0
    for node in forward_nodes_needed(analysis, saved):
        now += seconds(node) if node.op == "call_function" else 0.0
        ends[node] = now
    return ends, now


def backward_starts(analysis, saved, seconds):
    """(nodes, start time of each) of the backward, summed by hand."""
    nodes = backward_order(analysis, recomputed_nodes(analysis, saved))
    starts, now = [], 0.0
    for node in nodes:
        starts.append(now)
        now += seconds(node) if node.op == "call_function" else 0.0
    return nodes, starts


def first_use(analysis, nodes, tensor):
    return next(i for i, n in enumerate(nodes) if tensor in n.all_input_nodes)


def test_a_copy_compute_covers_is_hidden():
    analysis, saved = tower()
    first = activations(analysis, saved)[0]
    device = profile(1e12)
    plan = plan_transfers(analysis, saved, {first}, seconds_for(device), device)
    assert plan.exposed_seconds == 0.0
    assert plan.reload_distance[first] >= 1, "the reload is issued ahead of the first use"


def test_one_copy_longer_than_the_step_is_exposed():
    analysis, saved = tower()
    first = activations(analysis, saved)[0]
    device = profile(1e3)  # a 256 KiB tensor takes minutes: nothing covers it
    seconds = seconds_for(device)
    plan = plan_transfers(analysis, saved, {first}, seconds, device)
    ends, total = forward_times(analysis, saved, seconds)
    copy = transfer_seconds(analysis.bytes_of[first], device, "d2h")
    assert plan.forward_exposed_seconds == pytest.approx(ends[first] + copy - total)
    nodes, starts = backward_starts(analysis, saved, seconds)
    use = first_use(analysis, nodes, first)
    # Issued at the backward's start, it still waits for the part not covered.
    assert plan.backward_exposed_seconds == pytest.approx(copy - starts[use])
    assert plan.reload_before[first] is nodes[0]


def test_each_direction_carries_one_copy_at_a_time():
    """Two offloads each hidden alone queue on the device->host link: together the second
    finishes ``copy`` after the first, past the forward's end."""
    analysis, saved = tower()
    first, second = activations(analysis, saved)[:2]
    compute = profile(1.0)
    ends, total = forward_times(analysis, saved, seconds_for(compute))
    copy_seconds = 0.6 * (total - ends[first])
    assert ends[second] + copy_seconds < total and ends[first] + 2 * copy_seconds > total
    assert ends[second] < ends[first] + copy_seconds, "the second copy queues behind the first"
    device = profile(analysis.bytes_of[first] / copy_seconds)
    seconds = seconds_for(device)
    alone = [plan_transfers(analysis, saved, {t}, seconds, device).forward_exposed_seconds for t in (first, second)]
    both = plan_transfers(analysis, saved, {first, second}, seconds, device)
    assert alone == [0.0, 0.0]
    assert both.forward_exposed_seconds == pytest.approx(ends[first] + 2 * copy_seconds - total)
    stalls = [c.stall for c in both.copies if c.direction == "d2h"]
    assert stalls == [0.0, pytest.approx(both.forward_exposed_seconds)], "only the second copy stalls"


def test_the_forward_waits_once_compute_has_covered_the_copy():
    analysis, saved = tower()
    first = activations(analysis, saved)[0]
    compute = profile(1.0)
    ends, total = forward_times(analysis, saved, seconds_for(compute))
    copy_seconds = 0.5 * (total - ends[first])
    device = profile(analysis.bytes_of[first] / copy_seconds)
    plan = plan_transfers(analysis, saved, {first}, seconds_for(device), device)
    order = list(ends)
    wait = order.index(plan.offload_wait_after[first])
    last_use = max(order.index(u) for u in first.users if u in ends)
    done = ends[first] + copy_seconds
    assert wait >= last_use
    assert ends[order[wait]] >= done, "the wait comes after the copy is done"
    assert wait == last_use or ends[order[wait - 1]] < done, "and no later than needed"
    assert plan.forward_exposed_seconds == 0.0


def test_reloads_are_issued_as_late_as_still_hides_them():
    analysis, saved = tower()
    tensor = activations(analysis, saved)[1]
    compute = profile(1.0)
    seconds = seconds_for(compute)
    nodes, starts = backward_starts(analysis, saved, seconds)
    use = first_use(analysis, nodes, tensor)
    copy_seconds = 0.5 * starts[use]  # half the backward's compute before the first use
    device = profile(analysis.bytes_of[tensor] / copy_seconds)
    plan = plan_transfers(analysis, saved, {tensor}, seconds_for(device), device)
    issue = nodes.index(plan.reload_before[tensor])
    assert plan.reload_distance[tensor] == use - issue
    assert starts[use] - starts[issue] >= copy_seconds, "hidden"
    assert starts[use] - starts[issue + 1] < copy_seconds, "issued one node later it would not be"
    assert plan.hidden_behind_seconds[tensor] == pytest.approx(starts[use] - starts[issue])
    assert plan.backward_exposed_seconds == 0.0


def test_a_link_shared_as_the_backward_starts_delays_the_reloads_behind_it():
    """A reload hidden alone (issued half the compute before its use) waits, where FSDP2's
    upload of the next module's parameters holds the link until its first use, its whole
    copy; the forward's copies are not touched (the other direction)."""
    analysis, saved = tower()
    tensor = activations(analysis, saved)[1]
    seconds = seconds_for(profile(1.0))
    nodes, starts = backward_starts(analysis, saved, seconds)
    use = first_use(analysis, nodes, tensor)
    copy_seconds = 0.5 * starts[use]
    link = analysis.bytes_of[tensor] / copy_seconds
    alone = plan_transfers(analysis, saved, {tensor}, seconds_for(profile(link)), profile(link))
    shared_bytes = int(link * starts[use])
    busy = shared_bytes / link  # starts[use], to the byte
    shared_device = profile(link, shared_h2d_bytes=shared_bytes)
    shared = plan_transfers(analysis, saved, {tensor}, seconds_for(shared_device), shared_device)
    assert alone.backward_exposed_seconds == 0.0
    assert shared.backward_exposed_seconds == pytest.approx(busy + copy_seconds - starts[use])
    assert shared.backward_exposed_seconds == pytest.approx(copy_seconds, rel=1e-4)
    assert shared.forward_exposed_seconds == alone.forward_exposed_seconds
    (reload,) = [c for c in shared.copies if c.direction == "h2d"]
    assert reload.begin == pytest.approx(busy), "it begins once the shared copy is done"
    estimate = LinkEstimate(analysis, forward_schedule(analysis, saved, seconds), backward_schedule(analysis, saved, seconds),
                            set(), shared_device)
    assert estimate.marginal(tensor)[1] == pytest.approx(busy + copy_seconds - starts[use])
    assert LinkEstimate(analysis, forward_schedule(analysis, saved, seconds), backward_schedule(analysis, saved, seconds),
                        set(), profile(link)).marginal(tensor)[1] == 0.0


def test_a_profile_round_trips_its_shared_link_and_rejects_a_negative_one():
    device = profile(1e9, shared_h2d_bytes=4096)
    assert DeviceProfile.from_dict(device.to_dict()) == device and device.to_dict()["shared_h2d_bytes"] == 4096
    assert "shared_h2d_bytes" not in profile(1e9).to_dict()  # stored profiles read as before
    with pytest.raises(ValueError, match="shared_h2d_bytes must be an int >= 0"):
        profile(1e9, shared_h2d_bytes=-1)


def test_without_prefetch_every_reload_waits_its_whole_copy():
    analysis, saved = tower()
    offloaded = set(activations(analysis, saved)[:3])
    device = profile(1e9)
    seconds = seconds_for(device)
    plan = plan_transfers(analysis, saved, offloaded, seconds, device, prefetch=False)
    nodes, _ = backward_starts(analysis, saved, seconds)
    for tensor in offloaded:
        assert plan.reload_distance[tensor] == 0
        assert plan.reload_before[tensor] is nodes[first_use(analysis, nodes, tensor)]
    copies = sum(transfer_seconds(analysis.bytes_of[t], device, "h2d") for t in offloaded)
    assert plan.backward_exposed_seconds == pytest.approx(copies)


def test_deferred_forward_wait_holds_the_device_copy():
    """``plan_program`` keeps an offloaded tensor on the device until the forward waits."""
    analysis, saved = tower()
    first = activations(analysis, saved)[0]
    last = forward_nodes_needed(analysis, saved)[-1]
    early = simulate(plan_program(analysis, saved, {first}))
    late = simulate(plan_program(analysis, saved, {first}, offload_wait_after={first: last}))
    index = late.labels.index(last.name)
    assert late.labels[index + 1] == f"wait_offload {first.name}"
    assert late.live_bytes[index] - early.live_bytes[early.labels.index(last.name)] == analysis.bytes_of[first]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(subset=st.lists(st.booleans(), min_size=4, max_size=4), extra=st.integers(0, 3),
       link_exponent=st.floats(3.0, 9.0), shared=st.sampled_from([0, 1 << 12, 1 << 18]))
def test_link_estimate_agrees_with_the_simulation(subset, extra, link_exponent, shared):
    """The solver's cheap estimate: forward exposure exact, its marginal the exact
    difference; backward exposure a lower bound, positive exactly when the simulation's is,
    with or without a link shared as the backward starts."""
    analysis, saved = tower()
    tensors = activations(analysis, saved)
    offloaded = {t for t, chosen in zip(tensors, subset) if chosen}
    device = profile(10**link_exponent, shared_h2d_bytes=shared)
    seconds = seconds_for(device)
    estimate = LinkEstimate(analysis, forward_schedule(analysis, saved, seconds),
                            backward_schedule(analysis, saved, seconds), offloaded, device)
    exact = plan_transfers(analysis, saved, offloaded, seconds, device)
    assert estimate.forward_exposed == pytest.approx(exact.forward_exposed_seconds, abs=1e-12)
    assert (estimate.backward_exposed > 1e-12) == (exact.backward_exposed_seconds > 1e-12)
    assert estimate.backward_exposed <= exact.backward_exposed_seconds + 1e-12
    added = tensors[extra]
    if added not in offloaded:
        more = plan_transfers(analysis, saved, offloaded | {added}, seconds, device)
        forward, _ = estimate.marginal(added)
        assert forward == pytest.approx(more.forward_exposed_seconds - exact.forward_exposed_seconds, abs=1e-12)
