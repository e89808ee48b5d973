"""Placing the copies the planner chose: forward waits and backward reloads."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified
from torch._inductor.decomposition import select_decomp_table

from compile_offload.runtime.ops import OFFLOAD_OPS
from compile_offload.passes import compat
from compile_offload.passes.analyze import analyze_joint
from compile_offload.passes.cost import DeviceProfile, node_seconds
from compile_offload.passes.memory import simulate

from ..graphs_program import graphs_program
from compile_offload.passes.offload import ROLE_RELOAD, ROLE_WAIT_OFFLOAD, ROLE_WAIT_RELOAD, eligible_for_offload, insert_offloads
from compile_offload.passes.rewrite import build_graphs
from compile_offload.passes.schedule import emit_after_inputs, place_offload_waits, place_reloads
from compile_offload.passes.solve.recompute import without_banned_recompute
from compile_offload.passes.solve.joint import OffloadOptions, solve_joint

from .joint_capture import Tower


def device(link: float) -> DeviceProfile:
    return DeviceProfile(f"test-{link:g}", {"float32": 1e9}, memory_bandwidth=1e10, d2h_bandwidth=link,
                         h2d_bandwidth=link, launch_overhead_seconds=1e-6)


# Slow matmuls, a link that hides each copy behind about one matmul: reloads go a few
# nodes ahead of their use, waits a little after the last forward use.
LINK = 3e7


def offloading_backend(record: dict, fraction: float, prefetch: bool = True, place: bool = True, link=LINK):
    """Plan with ``solve_joint``, build the graphs, insert the chosen copies and place them
    where the transfer model said (the wiring ``compile_offload.pipeline.planning`` does)."""

    def partition(joint_gm, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **_):
        joint = compat.prepare_joint(joint_gm, num_fwd_outputs, static_lifetime_input_indices)
        analysis = analyze_joint(joint)
        base = without_banned_recompute(analysis, compat.min_cut_saved_values(joint))
        profile = device(link)
        options = OffloadOptions(profile, lambda node: eligible_for_offload(node)[0], prefetch)
        seconds = functools.partial(node_seconds, profile=profile)
        solution = solve_joint(analysis, base, seconds, None, fraction, options)
        chosen = solution.chosen
        fw, bw = build_graphs(analysis, set(chosen.saved))
        names = sorted(t.name for t in chosen.offloaded)
        fw, bw = insert_offloads(fw, bw, names, OFFLOAD_OPS, num_fwd_outputs=num_fwd_outputs, prefetch_distance=0)
        if place and chosen.transfers is not None:
            fw = place_offload_waits(fw, {t.name: n.name for t, n in chosen.transfers.offload_wait_after.items()})
            bw = place_reloads(bw, {t.name: n.name for t, n in chosen.transfers.reload_before.items()})
        record.update(solution=solution, fw=fw, bw=bw, num_fwd_outputs=num_fwd_outputs)
        return fw, bw

    def backend(gm, example_inputs):
        return aot_module_simplified(
            gm, example_inputs,
            fw_compiler=lambda g, _: compat.boxed_python(g),
            bw_compiler=lambda g, _: compat.boxed_python(g),
            partition_fn=partition,
            decompositions=select_decomp_table(),
        )

    return backend


def train_step(model, x, backend=None):
    """Loss and gradients of one step, compiled with ``backend`` (eager without)."""
    model.zero_grad()
    run = torch.compile(model, backend=backend, fullgraph=True) if backend else model
    loss = run(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@functools.cache
def planned(fraction=0.6, prefetch=True, place=True, link=LINK):
    torch.manual_seed(0)
    model, x = Tower(), torch.randn(1024, 64)
    record = {}
    torch._dynamo.reset()
    compiled = train_step(model, x, offloading_backend(record, fraction, prefetch, place, link))
    return model, x, compiled, record


def by_role(graph: fx.Graph, role: str) -> dict[str, fx.Node]:
    return {n.meta["offload"]["tensor"]: n for n in graph.nodes if n.meta.get("offload", {}).get("role") == role}


def test_planned_copies_train_like_eager():
    model, x, (loss, grads), record = planned()
    assert record["solution"].chosen.offloaded, "the plan offloads"
    assert by_role(record["bw"].graph, ROLE_RELOAD), "and the backward reloads"
    expected_loss, expected_grads = train_step(model, x)
    torch.testing.assert_close(loss, expected_loss)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected)


def test_each_forward_wait_follows_its_planned_node():
    _, _, _, record = planned()
    anchors = record["solution"].chosen.transfers.offload_wait_after
    waits = by_role(record["fw"].graph, ROLE_WAIT_OFFLOAD)
    for tensor, anchor in anchors.items():
        node = waits[tensor.name].prev
        while node.meta.get("offload", {}).get("role") == ROLE_WAIT_OFFLOAD:
            node = node.prev  # several waits may follow one node
        assert node.name == anchor.name


def test_each_reload_precedes_its_planned_node_in_link_order():
    _, _, _, record = planned()
    anchors = record["solution"].chosen.transfers.reload_before
    graph = record["bw"].graph
    reloads = by_role(graph, ROLE_RELOAD)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for tensor, anchor in anchors.items():
        node = reloads[tensor.name].next
        while node.meta.get("offload", {}).get("role") == ROLE_RELOAD:
            node = node.next  # several reloads may precede one node
        expected = anchor.name if anchor.op != "placeholder" else node.name
        assert node.name == expected
    issue_order = sorted(anchors, key=lambda t: order[reloads[t.name]])
    assert issue_order == list(anchors), "reloads are issued in the order the link serves them"


def test_the_placed_graphs_simulate_to_the_predicted_peak():
    _, _, _, record = planned()
    chosen = record["solution"].chosen
    built = simulate(graphs_program(record["fw"], record["bw"], record["num_fwd_outputs"]))
    assert built.peak_bytes == chosen.peak_bytes


def test_reloads_are_issued_ahead_and_waits_deferred_here():
    """This link makes the plan move both (so the tests above check a real placement)."""
    _, _, _, record = planned()
    fw, bw = record["fw"].graph, record["bw"].graph
    waits = by_role(bw, ROLE_WAIT_RELOAD)
    assert all(reload.next is not waits[name] for name, reload in by_role(bw, ROLE_RELOAD).items())
    order = {n: i for i, n in enumerate(fw.nodes)}
    deferred = [wait for wait in by_role(fw, ROLE_WAIT_OFFLOAD).values()
                if order[wait] - 1 > max(order[u] for u in wait.args[1].users if u is not wait)]
    assert deferred, "some forward wait comes later than the tensor's last forward use"


def test_without_prefetch_each_reload_is_issued_right_before_its_wait():
    # A fast link: offloading still pays when every reload is waited for in full.
    _, _, _, record = planned(prefetch=False, link=1e12)
    graph = record["bw"].graph
    reloads, waits = by_role(graph, ROLE_RELOAD), by_role(graph, ROLE_WAIT_RELOAD)
    assert reloads
    for tensor, reload in reloads.items():
        assert reload.next is waits[tensor]


def copy_graph(gm):
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return fx.GraphModule(gm, graph)


@pytest.fixture
def graphs():
    """Copies of the planned graphs, for moving nodes around."""
    _, _, _, record = planned()
    return copy_graph(record["fw"]), copy_graph(record["bw"])


def test_reloads_before_one_node_keep_the_order_given(graphs):
    _, bw = graphs
    names = sorted(by_role(bw.graph, ROLE_RELOAD))
    assert len(names) >= 2
    first, second = names[:2]
    anchor = min((by_role(bw.graph, ROLE_WAIT_RELOAD)[n] for n in (first, second)),
                 key=list(bw.graph.nodes).index)
    for order in ([first, second], [second, first]):
        place_reloads(bw, {name: anchor.name for name in order})
        reloads = by_role(bw.graph, ROLE_RELOAD)
        assert reloads[order[0]].next is reloads[order[1]] and reloads[order[1]].next is anchor


def test_reloads_never_move_past_their_wait_nor_among_placeholders(graphs):
    _, bw = graphs
    name = sorted(by_role(bw.graph, ROLE_RELOAD))[0]
    output = next(iter(bw.graph.find_nodes(op="output")))
    place_reloads(bw, {name: output.prev.name})
    assert by_role(bw.graph, ROLE_RELOAD)[name].next is by_role(bw.graph, ROLE_WAIT_RELOAD)[name]
    placeholder = next(iter(bw.graph.find_nodes(op="placeholder")))
    place_reloads(bw, {name: placeholder.name, "no_such_tensor": placeholder.name})
    reload = by_role(bw.graph, ROLE_RELOAD)[name]
    assert reload.prev.op == "placeholder" or reload.prev.meta.get("offload", {}).get("role") == ROLE_RELOAD


def test_forward_waits_never_move_earlier(graphs):
    fw, _ = graphs
    waits = by_role(fw.graph, ROLE_WAIT_OFFLOAD)
    before = [n.name for n in fw.graph.nodes]
    first_compute = next(n for n in fw.graph.nodes if n.op != "placeholder")
    place_offload_waits(fw, {name: first_compute.name for name in waits})
    assert [n.name for n in fw.graph.nodes] == before


def _emitted_recursively(node, deferred, emitted, inputs, order):
    """The definition: each deferred input not yet emitted first (in input order, each
    after its own), then the node."""
    if node in emitted:
        return
    for arg in inputs(node):
        if arg in deferred and arg not in emitted:
            _emitted_recursively(arg, deferred, emitted, inputs, order)
    emitted.add(node)
    order.append(node)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 14).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.integers(0, n - 1), max_size=4), min_size=n, max_size=n),  # inputs, filtered below to a DAG
    st.sets(st.integers(0, n - 1)), st.sets(st.integers(0, n - 1)), st.lists(st.integers(0, n - 1), min_size=1))))
def test_emit_after_inputs_is_the_depth_first_definition(drawn):
    graph, deferred, emitted, roots = drawn
    inputs = {node: tuple(arg for arg in args if arg < node) for node, args in enumerate(graph)}  # repeats kept
    fast, slow = (set(emitted), []), (set(emitted), [])
    for root in roots:  # several calls sharing ``emitted``, as the backward order makes them
        emit_after_inputs(root, deferred, fast[0], inputs.__getitem__, fast[1])
        _emitted_recursively(root, deferred, slow[0], inputs.__getitem__, slow[1])
    assert fast == slow
