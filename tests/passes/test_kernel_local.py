"""``passes.inductor.kernel_local``: the values Inductor realizes and then keeps inside one kernel,
and fused kernels run as one. Checked on hand-built orders and, for the buffers, at the CPU
allocator against what Inductor's generated code allocates."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import torch._inductor.lowering  # noqa: F401
from torch._inductor.decomposition import select_decomp_table

from compile_offload.passes.analyze import fusable_nodes, inlined_values
from compile_offload.passes.inductor.kernel_local import fused_kernel_order, kernel_groups

from .test_memory import simulated_and_compiled_peaks

ROWS, COLS = 20, 50  # float32 values of 4000 bytes


def _tanh_read_twice(x, y):
    """tanh is realized on CPU (a heavy op read twice); both readers are pointwise over as
    many elements, so Inductor computes the three in one kernel and drops tanh's buffer."""
    shared = torch.tanh(x + y)
    return shared * 3, shared * 2


def _tanh_read_by_a_row_sum(x, y):
    """One reader is a reduction over rows: one fused kernel, two loop nests, and tanh is
    stored between them."""
    shared = torch.tanh(x + y)
    return (shared * 3).sum(dim=1), shared * 2


def _tanh_read_around_a_matmul(x, y):
    """The second reader waits for a matmul of the first: no kernel can hold both, so tanh
    is a buffer between them."""
    shared = torch.tanh(x + x)
    product = (shared * 3) @ y  # y: (COLS, COLS)
    return shared * product, product


def _traced(fn, *inputs) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake", decomposition_table=select_decomp_table())(*inputs)


def _groups(gm: fx.GraphModule):
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    inlined = inlined_values(gm.graph.nodes, fusable_nodes(gm.graph.nodes, lambda node: True))
    return kernel_groups(gm.graph.nodes, inlined, position, lambda node: node.op == "placeholder")


def _tanh(gm: fx.GraphModule) -> fx.Node:
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.tanh.default]
    return node


def _inputs_of(fn) -> list[torch.Tensor]:
    second = (COLS, COLS) if fn is _tanh_read_around_a_matmul else (ROWS, COLS)
    return [torch.randn(ROWS, COLS), torch.randn(*second)]


@pytest.mark.parametrize("fn, local", [(_tanh_read_twice, True), (_tanh_read_by_a_row_sum, False),
                                       (_tanh_read_around_a_matmul, False)])
def test_which_values_lose_their_buffer(fn, local):
    inputs = _inputs_of(fn)
    gm = _traced(fn, *inputs)
    assert (_tanh(gm) in _groups(gm).local) == local


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("fn", [_tanh_read_twice, _tanh_read_by_a_row_sum, _tanh_read_around_a_matmul])
def test_the_simulated_peak_is_what_inductor_allocates(fn):
    """The simulation of the traced graph (kernel-local values included) equals the peak of
    the compiled function at the CPU allocator: tanh's 4000 bytes are counted exactly where
    the generated code allocates them."""
    predicted, measured = simulated_and_compiled_peaks(fn, _inputs_of(fn))
    assert measured == predicted


def _chain(names_and_inputs: list[tuple[str, list[str]]]) -> dict[str, fx.Node]:
    """A graph of ``operator.add`` nodes, in the order given, each reading the named inputs."""
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {"input": graph.placeholder("input")}
    for name, inputs in names_and_inputs:
        args = [nodes[i] for i in inputs] + [nodes["input"]] * (2 - len(inputs))
        nodes[name] = graph.call_function(operator.add, tuple(args[:2]))
        nodes[name].name = name
    graph.output(nodes[names_and_inputs[-1][0]])
    return nodes


def _inputs(node: fx.Node):
    return node.all_input_nodes


def test_a_kernel_runs_where_its_first_member_is_with_what_the_rest_waits_for_moved_up():
    # a (kernel member) ... b (what c waits for: a matmul) ... c (kernel member) ... d
    nodes = _chain([("a", []), ("other", []), ("b", ["other"]), ("c", ["a", "b"]), ("d", ["c"])])
    order = [nodes[n] for n in ("a", "other", "b", "c", "d")]
    fused = fused_kernel_order(order, [frozenset({nodes["a"], nodes["c"]})], _inputs)
    assert [n.name for n in fused] == ["other", "b", "a", "c", "d"]


def test_a_kernel_whose_member_waits_on_another_through_an_outside_node_is_left_alone():
    # c waits for b, which reads a: one kernel cannot hold a and c
    nodes = _chain([("a", []), ("b", ["a"]), ("c", ["a", "b"])])
    order = [nodes[n] for n in ("a", "b", "c")]
    assert fused_kernel_order(order, [frozenset({nodes["a"], nodes["c"]})], _inputs) == order


def test_no_kernels_keep_the_order_itself():
    nodes = _chain([("a", []), ("b", ["a"])])
    order = [nodes["a"], nodes["b"]]
    assert fused_kernel_order(order, [], _inputs) is order


def test_a_node_listed_in_two_kernels_runs_once_with_the_first():
    # x is inlined into a member of each kernel: each node must still run exactly once
    nodes = _chain([("x", []), ("a", ["x"]), ("b", ["x"]), ("c", ["a"]), ("d", ["b"])])
    order = [nodes[n] for n in ("x", "a", "b", "c", "d")]
    kernels = [frozenset({nodes["x"], nodes["a"], nodes["c"]}), frozenset({nodes["x"], nodes["b"], nodes["d"]})]
    fused = fused_kernel_order(order, kernels, _inputs)
    assert sorted(n.name for n in fused) == sorted(n.name for n in order)
    assert [n.name for n in fused] == ["x", "a", "c", "b", "d"]


def test_the_kernel_a_cycle_runs_back_into_is_the_one_run_apart():
    # r1 and r2 (a recomputed forward value and a backward node) cannot be one kernel: r2
    # waits for y, which waits for s2, which waits (through x) for r1. s1 and s2 can: run
    # together, with z, which s2 waits for, moved up before them.
    nodes = _chain([("r1", []), ("x", ["r1"]), ("s1", ["x"]), ("z", []), ("s2", ["s1", "z"]), ("y", ["s2"]),
                    ("r2", ["r1", "y"])])
    order = [nodes[n] for n in ("r1", "x", "s1", "z", "s2", "y", "r2")]
    kernels = [frozenset({nodes["r1"], nodes["r2"]}), frozenset({nodes["s1"], nodes["s2"]})]
    assert [n.name for n in fused_kernel_order(order, kernels, _inputs)] == ["r1", "x", "z", "s1", "s2", "y", "r2"]


def test_the_kernel_a_cycle_runs_apart_is_remembered_for_the_next_order():
    nodes = _chain([("r1", []), ("x", ["r1"]), ("s1", ["x"]), ("z", []), ("s2", ["s1", "z"]), ("y", ["s2"]),
                    ("r2", ["r1", "y"])])
    order = [nodes[n] for n in ("r1", "x", "s1", "z", "s2", "y", "r2")]
    kernels = [frozenset({nodes["r1"], nodes["r2"]}), frozenset({nodes["s1"], nodes["s2"]})]
    cycles: dict = {}
    first = fused_kernel_order(order, kernels, _inputs, cycles)
    assert [kernel for kernel, _ in cycles.values()] == [(nodes["r1"], nodes["r2"])]
    assert fused_kernel_order(order, kernels, _inputs, cycles) == first == fused_kernel_order(order, kernels, _inputs)


def test_a_kernel_a_cycle_only_passes_through_stays_one():
    # Walking from a (first in the order), the cycle a -> p -> m3 ... m103 -> q -> a passes
    # through the kernel {a, a2} in at a2 and out at a2 (sound: a2 reads a inside it), and
    # through {m3, m103} out at m103 and back in at m3, which m103 does not lead to inside
    # the kernel: that one joins a forward value with a node waiting on it through others
    # (the GPT-2's layer norm recomputed and its gradient) and runs apart. The sound kernel
    # runs as one, what it waits for moved up.
    nodes = _chain([("a", []), ("m3", []), ("p", ["m3"]), ("a2", ["p", "a"]), ("q", ["a2"]), ("m103", ["q"])])
    order = [nodes[n] for n in ("a", "m3", "p", "a2", "q", "m103")]
    kernels = [frozenset({nodes["a"], nodes["a2"]}), frozenset({nodes["m3"], nodes["m103"]})]
    assert [n.name for n in fused_kernel_order(order, kernels, _inputs)] == ["m3", "p", "a", "a2", "q", "m103"]


def test_a_cycle_met_inside_the_walk_goes_back_to_where_its_kernel_was_first_pushed():
    # Walking from s0 (kernel {s0, s1}): u runs first (s1 waits for it), then v, which waits
    # for the kernel {k1, k2}; k2 waits for w, which reads k1: a cycle through w, so that
    # kernel runs apart, and the walk resumes from v's wait as a new walk from s0 would (u
    # stays where it ran); each node runs once.
    nodes = _chain([("s0", []), ("u", []), ("k1", []), ("w", ["k1"]), ("k2", ["w"]), ("v", ["k2"]),
                    ("s1", ["u", "v"])])
    order = [nodes[n] for n in ("s0", "u", "k1", "w", "k2", "v", "s1")]
    kernels = [frozenset({nodes["s0"], nodes["s1"]}), frozenset({nodes["k1"], nodes["k2"]})]
    cycles: dict = {}
    fused = fused_kernel_order(order, kernels, _inputs, cycles)
    assert [n.name for n in fused] == ["u", "k1", "w", "k2", "v", "s0", "s1"]
    assert [kernel for kernel, _ in cycles.values()] == [(nodes["k1"], nodes["k2"])]


def _zeros_shared_by_a_kernel_and_a_matmul_input(x, y, w):
    zeros = torch.zeros(ROWS, COLS)  # inlined wherever it is read
    shared = torch.tanh(x + y)  # realized (read twice on CPU), one kernel with both readers
    kernel_outputs = torch.where(shared > 0, zeros, shared) * 2, shared * 3
    return kernel_outputs[0] + kernel_outputs[1], torch.where(y > 0, zeros, y) @ w


def test_an_inlined_value_read_outside_a_kernel_is_not_listed_with_it():
    """Listed with the kernel, the matmul's input would wait for the whole kernel: each
    reader computes the zeros itself."""
    gm = _traced(_zeros_shared_by_a_kernel_and_a_matmul_input, torch.randn(ROWS, COLS), torch.randn(ROWS, COLS),
                 torch.randn(COLS, COLS))
    (zeros,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.full.default]
    kernels = _groups(gm).kernels
    assert any(_tanh(gm) in k for k in kernels)
    assert not any(zeros in k for k in kernels)


def _layer_norm_rows(x, y):
    """A layer norm over rows: ``var_mean`` returns two tensors (one Welford reduction in
    Inductor), which the normalization reads through ``getitem``."""
    shifted = x + y
    var, mean = torch.var_mean(shifted, dim=1, keepdim=True, correction=0)
    return (shifted - mean) * torch.rsqrt(var + 1e-5), shifted * 2


def test_a_reduction_of_two_results_joins_the_kernel_that_reads_them():
    gm = _traced(_layer_norm_rows, torch.randn(ROWS, COLS), torch.randn(ROWS, COLS))
    (var_mean,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.var_mean.correction]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    normalized = output.args[0][0]
    assert any(var_mean in k and normalized in k for k in _groups(gm).kernels)


def _inlined_value_also_read_by_a_matmuls_input(x, w):
    """``shifted`` is inlined: ``scaled`` (a matmul's input, so a buffer) computes it again
    from ``x``. The kernel of ``first`` and ``second`` waits for the matmul, and the matmul
    for ``scaled`` only: the two can be one kernel."""
    shifted = x + 1
    first = shifted * 3
    product = (shifted * 5) @ w
    second = first * product + shifted
    return first, second


def test_a_value_inlined_upstream_of_a_kernel_does_not_make_a_cycle_of_its_other_readers():
    gm = _traced(_inlined_value_also_read_by_a_matmuls_input, torch.randn(ROWS, COLS), torch.randn(COLS, COLS))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    first, second = output.args[0]
    assert any(first in k and second in k for k in _groups(gm).kernels)


def test_on_triton_a_kernel_a_cycle_breaks_keeps_what_does_not_wait_on_it():
    # The kernel {n, x, g} (a recomputed norm n, the backward's normalized input x, its
    # gradient's reduction g): g waits for d, the gradient from above, which waits for n
    # through the layer above (m). C++ kernels (measured on the CPU contract): all three run
    # apart, x where the order has it. Triton's (read from Inductor's CUDA kernels): n and x
    # stay one kernel where n runs, so x is computed early and held until g; g runs apart.
    nodes = _chain([("n", []), ("m", ["n"]), ("d", ["m"]), ("x", ["n"]), ("g", ["x", "d"])])
    order = [nodes[name] for name in ("n", "m", "d", "x", "g")]
    kernels = [frozenset({nodes["n"], nodes["x"], nodes["g"]})]
    assert [n.name for n in fused_kernel_order(order, kernels, _inputs)] == ["n", "m", "d", "x", "g"]
    assert [n.name for n in fused_kernel_order(order, kernels, _inputs, split=True)] == ["n", "x", "m", "d", "g"]


def _nodes(count: int) -> list[fx.Node]:
    graph = fx.Graph()
    x = graph.placeholder("x")
    return [graph.call_function(torch.neg, (x,)) for _ in range(count)]


def test_a_kernel_split_around_a_cycle_only_shrinks():
    """``_run_apart`` under Triton's split keeps the members a cycle does not wait on as one
    kernel only where that kernel is smaller than the one each was in: a "rest" equal to its
    members' kernel (a cycle kept for a kernel split already, nothing of it waiting) changed
    nothing, and the walk met the same cycle for ever (an unrolled GRU planned for an H100
    hung in planning; ``tests/test_explain.py``)."""
    from compile_offload.passes.inductor.kernel_local import _run_apart

    a, b, c, d = _nodes(4)
    kernel = (a, b, c, d)
    kernel_of = {n: kernel for n in kernel}
    _run_apart(kernel_of, kernel, frozenset({d}), split=True)  # d waits on the cycle: the rest stays one kernel
    assert kernel_of == {a: (a, b, c), b: (a, b, c), c: (a, b, c)}
    # The same cycle met again, kept for the kernel as it was, nothing waiting: splitting would
    # give (a, b, c, d) or (a, b, c) back; it runs apart whole.
    _run_apart(kernel_of, kernel, frozenset(), split=True)
    assert kernel_of == {}
    kernel_of = {n: (a, b, c) for n in (a, b, c)}
    _run_apart(kernel_of, (a, b, c), frozenset(), split=True)
    assert kernel_of == {}
    # Without the split (the C++ backend's kernels) a cycle runs its kernel apart whole.
    kernel_of = {n: kernel for n in kernel}
    _run_apart(kernel_of, kernel, frozenset({d}), split=False)
    assert kernel_of == {}


def test_parts_joined_by_a_shared_read_stay_apart_where_joining_them_would_pull_one_ahead():
    # a and c only share a read of x (two parts of one kernel: horizontal fusion); c also
    # waits for b, which the order has after a. Inductor by default runs the kernel at a with
    # b moved up; under plan_order_fusion's rule it refuses the pair, and b stays in place.
    nodes = _chain([("x", []), ("a", ["x"]), ("other", []), ("b", ["other"]), ("c", ["x", "b"]), ("d", ["c"])])
    order = [nodes[n] for n in ("x", "a", "other", "b", "c", "d")]
    a, c = frozenset({nodes["a"]}), frozenset({nodes["c"]})
    kernel = a | c
    pulled = ["x", "other", "b", "a", "c", "d"]
    assert [n.name for n in fused_kernel_order(order, [kernel], _inputs)] == pulled
    assert [n.name for n in fused_kernel_order(order, [kernel], _inputs, parts={kernel: (a, c)})] == [
        n.name for n in order]
    # Without parts the kernel is one piece (a consumer with its producer): pulled as before.
    assert [n.name for n in fused_kernel_order(order, [kernel], _inputs, parts={})] == pulled


def test_parts_whose_later_one_waits_only_for_what_runs_by_then_stay_one_kernel():
    # c waits for b, which runs before a ends (b is inlined into nothing and placed before
    # a's last member e): joining them pulls nothing.
    nodes = _chain([("x", []), ("other", []), ("a", ["x"]), ("b", ["other"]), ("e", ["a"]),
                    ("c", ["x", "b"]), ("d", ["c"])])
    order = [nodes[n] for n in ("x", "other", "a", "b", "e", "c", "d")]
    first, second = frozenset({nodes["a"], nodes["e"]}), frozenset({nodes["c"]})
    kernel = first | second
    fused = fused_kernel_order(order, [kernel], _inputs, parts={kernel: (first, second)})
    assert [n.name for n in fused] == ["x", "other", "b", "a", "e", "c", "d"]  # one kernel at a, b moved up


def test_a_pull_through_an_inlined_value_or_an_earlier_kernel_is_seen_through():
    # c waits for v, an inlined value placed after a, which waits for b (after a too): a pull.
    # A node in a kernel that starts before a ends is no pull itself; what it waits for is.
    nodes = _chain([("x", []), ("a", ["x"]), ("other", []), ("b", ["other"]), ("v", ["b"]), ("c", ["x", "v"])])
    order = [nodes[n] for n in ("x", "a", "other", "b", "v", "c")]
    a, c = frozenset({nodes["a"]}), frozenset({nodes["c"]})
    kernel = a | c
    apart = fused_kernel_order(order, [kernel], _inputs, parts={kernel: (a, c)}, inlined=frozenset({nodes["v"]}))
    assert apart == order
    from compile_offload.passes.inductor.kernel_local import _pulls

    position = {n: i for i, n in enumerate(order)}
    c_part = (nodes["c"],)
    assert _pulls(c_part, position[nodes["a"]], position, _inputs, frozenset({nodes["v"]}), {})
    # v, b and what b waits for in kernels starting at x (before a ends): nothing to pull
    started = {nodes["v"]: 0, nodes["b"]: 0, nodes["other"]: 0}
    assert not _pulls(c_part, position[nodes["a"]], position, _inputs, frozenset(), started)


def test_kernel_groups_name_the_parts_a_shared_read_joins():
    # sin and cos of a matmul's output: two kernels' worth of work only joined by reading it.
    def two_readers(x, w):
        y = x @ w
        return y.sin() * 2, y.cos() * 3

    gm = _traced(two_readers, torch.randn(ROWS, COLS), torch.randn(COLS, COLS))
    groups = _groups(gm)
    joined = [k for k in groups.kernels if k in groups.parts]
    assert len(joined) == 1
    parts = groups.parts[joined[0]]
    assert len(parts) == 2 and frozenset().union(*parts) == joined[0]
    names = [{n.target for n in part} for part in parts]
    assert any(torch.ops.aten.sin.default in t for t in names) and any(torch.ops.aten.cos.default in t for t in names)


def test_a_kernel_runs_at_its_first_realized_member_not_at_an_inlined_value_before_it():
    # x is an inlined value of the kernel {x, a, b}, placed before m (a matmul a waits for).
    # The scheduler has no node for x: the kernel runs at a, after m. Counted as the
    # kernel's first member, x ran it early and moved m up.
    nodes = _chain([("x", []), ("m", []), ("a", ["x", "m"]), ("b", ["a"])])
    order = [nodes[n] for n in ("x", "m", "a", "b")]
    kernel = frozenset({nodes["x"], nodes["a"], nodes["b"]})
    assert [n.name for n in fused_kernel_order(order, [kernel], _inputs)] == ["m", "x", "a", "b"]
    assert fused_kernel_order(order, [kernel], _inputs, inlined=frozenset({nodes["x"]})) == order
