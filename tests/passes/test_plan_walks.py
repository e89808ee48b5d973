"""The per-saved-set walks the solver repeats for every candidate plan equal their
definitions.

``passes.memory`` answers "which forward nodes run", "which are recomputed" and "in what
order does the backward run" from tables the analysis builds once (forward-side inputs,
the backward's readers of each forward node). Here each fast walk is compared with a
direct transcription of its definition on the graph itself (``node.all_input_nodes``,
``passes.schedule.just_in_time_order``, then Inductor's kernels run as one:
``passes.inductor.kernel_local.fused_kernel_order``), for random saved sets of a transformer's joint
graph: subsets of the nodes torch's min-cut saves, and of every forward node.
"""

import random

import pytest

from compile_offload.passes.inductor.kernel_local import fused_kernel_order
from compile_offload.passes.memory import backward_order, forward_nodes_needed, plan_nodes, recomputed_nodes
from compile_offload.passes.schedule import just_in_time_order

from .joint_capture import encoder_stack


def transformer():
    return encoder_stack(layers=2, width=32, heads=4, ff=64, batch=2, seq=16)


def recomputed_by_definition(a, saved):
    """Forward nodes some backward node reads, directly or through other such nodes,
    stopping at saved tensors and steady-state inputs."""
    recomputed = set()
    stack = [arg for n in a.bw_nodes for arg in n.all_input_nodes if a.is_forward(arg)]
    while stack:
        node = stack.pop()
        if node in saved or node in recomputed or node in a.steady:
            continue
        recomputed.add(node)
        stack.extend(arg for arg in node.all_input_nodes if a.is_forward(arg))
    return recomputed


def forward_needed_by_definition(a, saved):
    """Forward nodes the user outputs and the saved tensors depend on, in joint order."""
    needed = set()
    stack = [*a.fw_outputs, *saved]
    while stack:
        node = stack.pop()
        if node in needed or not a.is_forward(node):
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    return [n for n in a.fw_nodes if n in needed]


def saved_sets(a, base, count=40):
    """Random saved sets: the unconstrained one, none, subsets of it and of all forward nodes."""
    rng = random.Random(0)
    forward = [n for n in a.fw_nodes if n not in a.steady]
    yield set(base)
    yield set()
    for _ in range(count):
        pool = base if rng.random() < 0.5 else forward
        yield {n for n in pool if rng.random() < rng.choice((0.1, 0.5, 0.9))}


def test_the_walks_equal_their_definitions():
    a, base = transformer()
    checked = 0
    for saved in saved_sets(a, base):
        recomputed = recomputed_nodes(a, saved)
        assert recomputed == recomputed_by_definition(a, saved)
        assert forward_nodes_needed(a, saved) == forward_needed_by_definition(a, saved)
        order = backward_order(a, recomputed)
        just_in_time = just_in_time_order(a.bw_nodes, recomputed)
        assert order == fused_kernel_order(just_in_time, a.kernels, lambda n: n.all_input_nodes, split=a.triton_kernels,
                                           parts=None if a.fusion_pulls else a.kernel_parts, inlined=a.kernel_inlined)
        assert set(order) == set(just_in_time) and len(order) == len(just_in_time)
        nodes = plan_nodes(a, saved)
        assert (nodes.recomputed, nodes.backward) == (recomputed, order)
        checked += bool(recomputed)
    assert checked > 10  # most saved sets recompute something, so the order is exercised


@pytest.mark.parametrize("table", ["fw_inputs", "bw_readers"])
def test_the_analysis_tables_match_the_graph(table):
    a, _ = transformer()
    if table == "fw_inputs":
        for node, inputs in a.fw_inputs.items():
            assert inputs == tuple(arg for arg in node.all_input_nodes if a.is_forward(arg))
    else:
        readers = {}
        for index, node in enumerate(a.bw_nodes):
            for arg in node.all_input_nodes:
                if a.is_forward(arg):
                    readers.setdefault(arg, set()).add(index)
        assert {node: set(indices) for node, indices in a.bw_readers.items()} == readers
        assert all(list(indices) == sorted(set(indices)) for indices in a.bw_readers.values())


def test_offloadable_per_step_equals_its_definition():
    from compile_offload.passes.offload import eligible_for_offload
    from compile_offload.passes.solve.joint import Offloadable, offloadable

    a, base = transformer()
    eligible = lambda node: eligible_for_offload(node)[0]  # noqa: E731
    fast = Offloadable(a, eligible)
    rng = random.Random(1)
    found = 0
    for saved in saved_sets(a, base):
        offloaded = {n for n in saved if rng.random() < 0.2}
        expected = offloadable(a, saved, offloaded, eligible)
        assert fast(saved, offloaded) == expected
        found += len(expected)
    assert found > 0


def test_node_durations_are_the_cost_functions_values_looked_up():
    from compile_offload.passes.node_durations import node_durations

    a, _ = transformer()
    calls = []

    def seconds(node):
        calls.append(node)
        return a.position[node] * 1e-6

    looked_up = node_durations(seconds)
    nodes = list(a.position)
    assert [looked_up(n) for n in nodes] == [seconds(n) for n in nodes]
    calls.clear()
    assert [looked_up(n) for n in nodes] == [a.position[n] * 1e-6 for n in nodes]
    assert calls == []  # every value came from the table
    assert node_durations(looked_up) is looked_up


def test_schedules_timed_through_the_duration_table_equal_the_cost_functions():
    # ``transfer.timed`` reads a node_durations table's schedule terms (0.0 for nodes that
    # are not calls) instead of calling the cost function per node: the same floats.
    from compile_offload.passes.node_durations import node_durations
    from compile_offload.passes.transfer import timed

    a, base = transformer()
    rng = random.Random(2)
    times = {n: rng.random() * 1e-3 for n in a.position}
    seconds = times.__getitem__
    looked_up = node_durations(seconds)
    for saved in saved_sets(a, base, count=10):
        nodes = plan_nodes(a, saved)
        for order in (nodes.forward, nodes.backward):
            assert timed(order, looked_up) == timed(order, seconds)


def test_plan_program_with_the_saved_sets_first_uses_equals_the_backward_walk():
    # The solver hands plan_program each saved set's first backward uses (kept for the
    # copies' prices); the program must be the one walking the backward finds.
    from compile_offload.passes.memory import StepBuilder, plan_program
    from compile_offload.passes.transfer import first_backward_uses, plan_schedules

    a, base = transformer()
    rng = random.Random(3)
    builder = StepBuilder(a, True)
    compared = 0
    for saved in saved_sets(a, base):
        nodes = plan_nodes(a, saved)
        forward, backward = plan_schedules(nodes, lambda n: 1e-6)
        first_uses = first_backward_uses(a, backward, forward.index)
        owners = [n for n in saved if a.roots.get(n, n) is n and n in forward.index]
        offloaded = {n for n in owners if rng.random() < 0.5}
        distance = {n: rng.randrange(0, 4) for n in offloaded}
        computed = builder(saved, nodes)
        assert builder(saved, nodes) is computed  # the same saved set again: the steps kept
        walked = plan_program(a, saved, offloaded, fusion=True, reload_distance=distance, computed=computed)
        read_off = plan_program(a, saved, offloaded, fusion=True, reload_distance=distance, computed=computed,
                                first_uses=first_uses, first_uses_of=forward.index)
        assert [(s.label, s.allocates, s.reads, s.kind) for s in read_off.steps] == \
               [(s.label, s.allocates, s.reads, s.kind) for s in walked.steps]
        compared += any(s.kind == "reload" for s in walked.steps)
    assert compared > 5
