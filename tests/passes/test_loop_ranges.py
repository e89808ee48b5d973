"""``passes.inductor.loop_ranges``: the loop ranges Inductor's C++ backend gives a node after merging
the dimensions every access walks contiguously, and which nodes can share a kernel there."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import torch._inductor.lowering  # noqa: F401  (registers prims.inductor_random)
from torch._inductor.decomposition import select_decomp_table

from compile_offload.passes.analyze import fusable_nodes, inlined_values
from compile_offload.passes.inductor.kernel_local import kernel_groups, is_random_draw
from compile_offload.passes.inductor.loop_ranges import cpu_graph, fits_cpu_kernel, loop_ranges

ROWS, COLS = 6, 10


def _traced(fn, *inputs) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake", decomposition_table=select_decomp_table())(*inputs)


def _ranges_of_output(fn, *shapes):
    """The loop ranges of the node ``fn`` returns, with nothing inlined into it."""
    gm = _traced(fn, *(torch.randn(*shape) for shape in shapes))
    (out,) = gm.graph.output_node().args[0]
    return loop_ranges(out, frozenset())


def _draw(shape):
    seeds = torch.ops.prims.inductor_seeds.default(1, torch.device("cpu"))
    seed = torch.ops.prims.inductor_lookup_seed.default(seeds, 0)
    return torch.ops.prims.inductor_random.default(list(shape), seed, "rand")


@pytest.mark.parametrize("fn, shapes, ranges", [
    # every access contiguous over the same shape: one range
    (lambda x, y: (x * y,), [(ROWS, COLS), (ROWS, COLS)], ((ROWS * COLS,), ())),
    # a row statistic is read at stride 0 along the columns: rows and columns stay apart
    (lambda x, s: (x * s,), [(ROWS, COLS), (ROWS, 1)], ((ROWS, COLS), ())),
    # a transposed read walks the rows contiguously: no merge either
    (lambda x, y: (x * y.t(),), [(ROWS, COLS), (COLS, ROWS)], ((ROWS, COLS), ())),
    # a random draw loads nothing and takes the linear index as its offset: one range
    (lambda x: (_draw(x.shape),), [(ROWS, COLS)], ((ROWS * COLS,), ())),
    # reductions: the kept ranges, then the reduced ones
    (lambda x: (x.sum(1, keepdim=True),), [(ROWS, COLS)], ((ROWS,), (COLS,))),
    (lambda x: (x.sum(0),), [(ROWS, COLS)], ((COLS,), (ROWS,))),
    (lambda x: (x.amax((1, 2)),), [(2, ROWS, COLS)], ((2,), (ROWS * COLS,))),
    (lambda x: (x.sum(),), [(ROWS, COLS)], ((), (ROWS * COLS,))),
    (lambda x: (x.amax(),), [(ROWS, COLS)], ((), (ROWS * COLS,))),  # an empty dim list: all of them
])
def test_loop_ranges_after_merging_contiguous_dimensions(fn, shapes, ranges):
    assert _ranges_of_output(fn, *shapes) == ranges


def test_a_reduction_of_two_results_has_the_loops_of_each():
    # var_mean: one Welford reduction writing two row statistics
    gm = _traced(lambda x: torch.var_mean(x, dim=1, keepdim=True, correction=0), torch.randn(ROWS, COLS))
    (var_mean,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.var_mean.correction]
    assert loop_ranges(var_mean, frozenset()) == ((ROWS,), (COLS,))


def test_an_inlined_embedding_reads_its_indices_by_row_and_its_weight_by_column():
    # Inductor inlines the lookup: the indices are loaded along (batch, seq), the weight's row
    # along the width; a row sum over it keeps (batch * seq) and reduces the width
    def lookup_row_sum(weight, indices, x):
        return ((torch.nn.functional.embedding(indices, weight) * x).sum(-1),)

    gm = _traced(lookup_row_sum, torch.randn(ROWS, COLS), torch.randint(0, ROWS, (2, 3)), torch.randn(2, 3, COLS))
    inlined = inlined_values(gm.graph.nodes, fusable_nodes(gm.graph.nodes, lambda node: True))
    (out,) = gm.graph.output_node().args[0]
    assert any(n.target is torch.ops.aten.embedding.default for n in inlined)
    assert loop_ranges(out, inlined) == ((2 * 3,), (COLS,))


def test_an_inlined_value_contributes_its_own_loads():
    # x * s is inlined into the tanh: its stride-0 read of s keeps the tanh's loop 2-D
    gm = _traced(lambda x, s: (torch.tanh(x * s),), torch.randn(ROWS, COLS), torch.randn(ROWS, 1))
    (tanh,) = gm.graph.output_node().args[0]
    (product,) = tanh.all_input_nodes
    assert loop_ranges(tanh, frozenset()) == ((ROWS * COLS,), ())  # product read as a buffer
    assert loop_ranges(tanh, frozenset({product})) == ((ROWS, COLS), ())


@pytest.mark.parametrize("members, fits", [
    ([((ROWS * COLS,), ()), ((ROWS * COLS,), ())], True),  # pointwise only: not this rule's
    ([((ROWS, COLS), ()), ((ROWS,), (COLS,))], True),  # ``COMPATIBLE_REDUCTION``
    ([((ROWS * COLS,), ()), ((ROWS,), (COLS,))], False),  # one range against (rows, columns)
    ([((ROWS,), (COLS,)), ((ROWS,), (COLS,))], True),  # ``SAME_VARS_REDUCE``
    ([((ROWS,), (COLS,)), ((COLS,), (ROWS,))], False),  # row and column reductions
    ([None, ((ROWS,), (COLS,)), ((ROWS, COLS), ())], True),  # unknown ranges fit anything
])
def test_what_one_cpu_kernel_can_hold(members, fits):
    assert fits_cpu_kernel(members) == fits


def test_only_a_graph_all_on_the_cpu_gets_cpu_kernels():
    def fn(x):
        return (x.sum(0),)

    assert cpu_graph(_traced(fn, torch.randn(ROWS, COLS)).graph.nodes)
    assert not cpu_graph(make_fx(fn, tracing_mode="fake")(torch.randn(ROWS, COLS, device="meta")).graph.nodes)


def _dropout_then_row_sum(x, y):
    """A random draw (one range) read by a row reduction and by the pointwise node after it,
    and by a pointwise node of its own: measured with ``TORCH_LOGS=fusion`` (torch 2.13),
    Inductor's C++ backend puts the reduction and both pointwise readers in one kernel and
    leaves the draw in a buffer of its own."""
    keep = _draw(x.shape) > 0.1
    scaled = keep * x * x.amax(1, keepdim=True)
    return scaled - scaled.sum(1, keepdim=True), keep * y


@pytest.mark.parametrize("cpu", [True, False])
def test_a_one_range_draw_shares_no_kernel_with_a_row_reduction_on_the_cpu(cpu):
    gm = _traced(_dropout_then_row_sum, torch.randn(ROWS, COLS), torch.randn(ROWS, COLS))
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    inlined = inlined_values(nodes, fusable_nodes(nodes, lambda node: True))
    groups = kernel_groups(nodes, inlined, position, lambda node: node.op == "placeholder", cpu=cpu)
    (draw,) = [n for n in nodes if is_random_draw(n)]
    with_reduction = [k for k in groups.kernels if any(torch.Tag.reduction in getattr(n.target, "tags", ()) for n in k)]
    assert with_reduction, "the row statistics and the row sum are one kernel"
    # Triton indexes by element counts: on a GPU the draw joins that kernel
    assert any(draw in k for k in with_reduction) == (not cpu)


def test_a_sparse_value_has_no_ranges_to_read():
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2),
                                     check_invariants=True)
    gm = make_fx(lambda x: (x * 2,))(sparse)
    (product,) = gm.graph.output_node().args[0]
    assert loop_ranges(product, frozenset()) is None  # unknown: fits any kernel
