"""passes.offload on real partitioned graphs: eligibility, structure, bitwise parity."""

import re

import pytest
import torch
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx.experimental.proxy_tensor import make_fx

from compile_offload.runtime import ops
from compile_offload.runtime.ops import OFFLOAD_OPS
from compile_offload.passes.offload import (
    ROLE_OFFLOAD,
    ROLE_RELOAD,
    ROLE_WAIT_OFFLOAD,
    ROLE_WAIT_RELOAD,
    eligible_for_offload,
    eligible_saved_tensors,
    insert_offloads,
    is_non_overlapping,
    saved_tensor_eligibility,
)


def model(x, w):
    """Saves int64 (sort indices), bool, a non-dense view, a view aliasing a user output."""
    a = torch.mm(x, w)
    b = a.relu()
    idx = b.argsort(dim=1)
    g = torch.gather(b, 1, idx)
    c = g[:, ::2]
    d = torch.mm(c, c.t())
    m = x > 0
    return d.tanh().sum() + torch.where(m, x, 0).sum(), b[1:3]


def inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randn(6, 10, generator=gen, dtype=torch.float64)


class Partitioned:
    """The forward and backward GraphModules torch's min-cut partitioner makes for ``fn``."""

    def __init__(self, fn, example_inputs, decompositions=None):
        captured = {}

        def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
            captured.update(fw=fw, bw=bw, num_fwd_outputs=num_fwd_outputs)
            return fw, bw

        compiled = aot_function(
            fn, fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm,
            partition_fn=partition, decompositions=decompositions,
        )
        compiled(*[t.detach().requires_grad_() for t in example_inputs])
        self.fw, self.bw, self.num_fwd_outputs = captured["fw"], captured["bw"], captured["num_fwd_outputs"]
        outputs = list(self.fw.graph.find_nodes(op="output")[0].args[0])
        # Positions of the forward outputs feeding each backward placeholder, by name
        # (fixed before any rewrite: the pass keeps positions, not names).
        self.saved_position = {v.name: i for i, v in enumerate(outputs) if i >= self.num_fwd_outputs}

    def run(self, example_inputs, fw=None, bw=None):
        """Forward then backward, eagerly; returns (user outputs, gradients)."""
        fw, bw = fw or self.fw, bw or self.bw
        fw_out = fw(*example_inputs)
        gen = torch.Generator().manual_seed(1)
        args = []
        for placeholder in bw.graph.find_nodes(op="placeholder"):
            if placeholder.name.startswith("tangents"):
                val = placeholder.meta["val"]
                args.append(torch.randn(val.shape, generator=gen, dtype=val.dtype))
            else:
                args.append(fw_out[self.saved_position[placeholder.name]])
        grads = bw(*args)
        return list(fw_out[: self.num_fwd_outputs]), list(grads)


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _nodes(gm, role):
    return [n for n in gm.graph.nodes if n.meta.get("offload", {}).get("role") == role]


@pytest.fixture(autouse=True)
def _no_leftover_transfers():
    ops.drain_pending_transfers()
    yield
    assert ops.drain_pending_transfers() == 0


@pytest.fixture
def offloaded():
    """(reference partition, partition with every eligible saved tensor offloaded, names)."""
    reference, rewritten = Partitioned(model, inputs()), Partitioned(model, inputs())
    names = eligible_saved_tensors(rewritten.fw, rewritten.num_fwd_outputs)
    insert_offloads(rewritten.fw, rewritten.bw, names, OFFLOAD_OPS, num_fwd_outputs=rewritten.num_fwd_outputs)
    return reference, rewritten, names


# --- eligibility ---------------------------------------------------------------------------


def test_saved_tensor_eligibility_on_a_partitioned_graph():
    part = Partitioned(model, inputs())
    verdicts = saved_tensor_eligibility(part.fw, part.num_fwd_outputs)
    nodes = {n.name: n for n in part.fw.graph.nodes}
    eligible = [nodes[name].meta["val"] for name, (ok, _) in verdicts.items() if ok]
    reasons = {reason for ok, reason in verdicts.values() if not ok}
    assert {torch.int64, torch.bool, torch.float64} <= {val.dtype for val in eligible}
    assert any(not val.is_contiguous() for val in eligible)  # the strided slice's transpose
    assert "view or alias of a graph input" in reasons  # the transposed inputs mm saves
    assert any("user output" in r for r in reasons)  # relu, which the output b[1:3] aliases
    assert eligible_saved_tensors(part.fw, part.num_fwd_outputs) == [n for n, (ok, _) in verdicts.items() if ok]


def _fake_graph(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def test_graph_inputs_and_their_views_are_not_eligible():
    gm = _fake_graph(lambda x: (x.t() * 2, x[1:].sin()), torch.randn(4, 4))
    by_name = {n.name: n for n in gm.graph.nodes}
    assert eligible_for_offload(by_name["x_1"]) == (False, "graph input")
    view = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.t.default)
    assert eligible_for_offload(view) == (False, "view or alias of a graph input")
    sin = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.sin.default)
    assert eligible_for_offload(sin) == (True, "eligible")


def test_symints_zero_bytes_and_overlapping_layouts_are_not_eligible():
    def f(x):
        return x.sum(0).expand(5, 4) * 1, x[:0] * 2, x.size(0) * 2

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3, 4))
    verdicts = {n.name: eligible_for_offload(n) for n in gm.graph.nodes if n.op == "call_function"}
    sym = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.sym_size.int)
    assert verdicts[sym.name] == (False, "not a tensor")
    expand = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.expand.default)
    assert verdicts[expand.name][0] is False and "overlapping" in verdicts[expand.name][1]
    gm = _fake_graph(lambda x: x[:0] * 2, torch.randn(3, 4))
    mul = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor)
    assert eligible_for_offload(mul) == (False, "zero bytes")


def test_nodes_without_metadata_are_not_eligible():
    gm = torch.fx.symbolic_trace(lambda x: x.sin())
    node = next(n for n in gm.graph.nodes if n.op == "call_method")
    assert eligible_for_offload(node) == (False, "no tensor metadata (meta['val'])")


@pytest.mark.parametrize(
    "size, stride, expected",
    [((4, 3), (3, 1), True), ((4, 3), (6, 2), True), ((3, 4), (1, 6), True), ((4, 3), (0, 1), False),
     ((4, 3), (2, 1), False), ((1, 5), (0, 1), True), ((2, 2, 2), (4, 1, 2), True), ((2, 2, 2), (2, 1, 2), False)],
)
def test_is_non_overlapping(size, stride, expected):
    assert is_non_overlapping(size, stride) is expected


# --- the rewrite ---------------------------------------------------------------------------


def test_offloaded_graphs_are_bitwise_equal_to_the_originals(offloaded):
    reference, rewritten, names = offloaded
    assert len(names) >= 4
    expected_out, expected_grads = reference.run(inputs())
    for _ in range(3):  # the same graphs run repeatedly: nothing may go stale between steps
        out, grads = rewritten.run(inputs())
        for a, b in zip(out + grads, expected_out + expected_grads):
            assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(_bits(a), _bits(b))
        assert ops.pending_transfer_count() == 0


def test_each_offload_has_one_wait_that_the_forward_returns(offloaded):
    _, part, names = offloaded
    offloads = _nodes(part.fw, ROLE_OFFLOAD)
    assert sorted(n.meta["offload"]["tensor"] for n in offloads) == sorted(names)
    outputs = list(part.fw.graph.find_nodes(op="output")[0].args[0])
    order = {n: i for i, n in enumerate(part.fw.graph.nodes)}
    for offload in offloads:
        source = offload.args[0]
        assert order[offload] == order[source] + 1  # right after the producer
        (wait,) = offload.users
        assert wait.target is OFFLOAD_OPS.wait_offload and wait.args == (offload, source)
        assert outputs[part.saved_position[source.name]] is wait
        assert source not in outputs[part.num_fwd_outputs:]
        other_uses = [u for u in source.users if u not in (offload, wait)]
        assert all(order[u] < order[wait] for u in other_uses)  # no later than the source's last use
        assert all(order[u] > order[wait] for u in wait.users if u.op != "output") or not other_uses


def test_reloads_precede_waits_that_precede_every_backward_use(offloaded):
    _, part, names = offloaded
    order = {n: i for i, n in enumerate(part.bw.graph.nodes)}
    placeholders = {n.name: n for n in part.bw.graph.find_nodes(op="placeholder")}
    for name in names:
        placeholder = placeholders[name]
        assert placeholder.meta["val"].device.type == "cpu"
        (reload,) = [u for u in placeholder.users if u.target is OFFLOAD_OPS.reload]
        (wait,) = reload.users
        assert wait.target is OFFLOAD_OPS.wait_reload and wait.args == (reload, placeholder)
        assert set(placeholder.users) == {reload, wait}  # every original use was rewired
        consumers = list(wait.users)
        assert consumers and order[reload] < order[wait] < min(order[c] for c in consumers)
        between = list(part.bw.graph.nodes)[order[wait] + 1 : min(order[c] for c in consumers)]
        assert all("offload" in n.meta for n in between)  # the wait sits right before the first use


def test_restored_layout_matches_the_original_saved_tensor(offloaded):
    reference, part, names = offloaded
    originals = {n.name: n.meta["val"] for n in reference.bw.graph.find_nodes(op="placeholder")}
    for wait in _nodes(part.bw, ROLE_WAIT_RELOAD):
        original = originals[wait.meta["offload"]["tensor"]]
        assert wait.meta["val"].shape == original.shape and wait.meta["val"].stride() == original.stride()
        assert wait.meta["val"].device == original.device and wait.meta["val"].dtype == original.dtype


@pytest.mark.parametrize("distance", [0, 1, 3])
def test_prefetch_distance_counts_backward_nodes(distance):
    part = Partitioned(model, inputs())
    original = [n.name for n in part.bw.graph.nodes if n.op not in ("placeholder", "output")]
    names = eligible_saved_tensors(part.fw, part.num_fwd_outputs)
    insert_offloads(part.fw, part.bw, names, OFFLOAD_OPS, num_fwd_outputs=part.num_fwd_outputs, prefetch_distance=distance)
    nodes = list(part.bw.graph.nodes)
    for reload in _nodes(part.bw, ROLE_RELOAD):
        (wait,) = reload.users
        first_use = min((nodes.index(u), u.name) for u in wait.users)[1]
        between = [n.name for n in nodes[nodes.index(reload) : nodes.index(wait)] if "offload" not in n.meta]
        assert len(between) == min(distance, original.index(first_use))


def test_dead_code_elimination_keeps_every_inserted_node(offloaded):
    _, part, _ = offloaded
    for gm in (part.fw, part.bw):
        before = [n.name for n in gm.graph.nodes]
        gm.graph.eliminate_dead_code()
        assert [n.name for n in gm.graph.nodes] == before
        gm.graph.lint()


def test_meta_records_roles_and_fake_values(offloaded):
    _, part, names = offloaded
    for gm, roles in ((part.fw, (ROLE_OFFLOAD, ROLE_WAIT_OFFLOAD)), (part.bw, (ROLE_RELOAD, ROLE_WAIT_RELOAD))):
        for role in roles:
            nodes = _nodes(gm, role)
            assert sorted(n.meta["offload"]["tensor"] for n in nodes) == sorted(names)
            assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in nodes)
    for node in _nodes(part.fw, ROLE_OFFLOAD):
        assert node.meta["val"].device.type == "cpu"


def test_rejects_names_that_are_not_eligible_saved_tensors():
    part = Partitioned(model, inputs())
    verdicts = saved_tensor_eligibility(part.fw, part.num_fwd_outputs)
    ineligible = next(name for name, (ok, _) in verdicts.items() if not ok)
    with pytest.raises(ValueError, match="cannot be offloaded"):
        insert_offloads(part.fw, part.bw, [ineligible], OFFLOAD_OPS, num_fwd_outputs=part.num_fwd_outputs)
    with pytest.raises(ValueError, match="not a saved tensor"):
        insert_offloads(part.fw, part.bw, ["primals_1"], OFFLOAD_OPS, num_fwd_outputs=part.num_fwd_outputs)
    with pytest.raises(ValueError, match="prefetch_distance"):
        insert_offloads(part.fw, part.bw, [], OFFLOAD_OPS, num_fwd_outputs=part.num_fwd_outputs, prefetch_distance=-1)


def test_offloading_nothing_changes_nothing():
    part = Partitioned(model, inputs())
    fw_code, bw_code = part.fw.code, part.bw.code
    insert_offloads(part.fw, part.bw, [], OFFLOAD_OPS, num_fwd_outputs=part.num_fwd_outputs)
    assert part.fw.code == fw_code and part.bw.code == bw_code


# --- Inductor --------------------------------------------------------------------------------


def source_buffers_live_until_waits(code: str) -> list[str]:
    """Check Inductor's wrapper code: each offload's source buffer is neither deleted nor
    reused before the wait that keeps it alive. Returns the source buffers checked."""
    lines = code.splitlines()
    checked = []
    for i, line in enumerate(lines):
        # The source is a buffer or a view of one: offload.default(reinterpret_tensor(bufN, ...
        match = re.search(r"compile_offload\.offload\.default\((?:reinterpret_tensor\()?(\w+)", line)
        if not match:
            continue
        source = match.group(1)
        wait_pattern = rf"wait_offload\.default\(\w+, (?:reinterpret_tensor\()?{source}\b"
        wait = next(j for j in range(i, len(lines)) if re.search(wait_pattern, lines[j]))
        for between in lines[i:wait]:
            assert not re.search(rf"\bdel {source}\b", between), between
            assert not re.search(rf"= {source};", between), between  # "bufN = bufM; del bufM  # reuse"
        checked.append(source)
    return checked


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_compiles_and_runs_the_offloaded_graphs():
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    def mlp(x, w):
        h = torch.mm(x, w).relu()
        h2 = (h * h.sigmoid())[:, ::2]
        return torch.mm(h2, h2.t()).tanh().sum()

    example = inputs()
    reference = Partitioned(mlp, example, decompositions=select_decomp_table())
    part = Partitioned(mlp, example, decompositions=select_decomp_table())
    names = eligible_saved_tensors(part.fw, part.num_fwd_outputs)
    insert_offloads(part.fw, part.bw, names, OFFLOAD_OPS, num_fwd_outputs=part.num_fwd_outputs)

    def fake_inputs(gm):
        return [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]

    fw_compiled = compile_fx_inner(part.fw, fake_inputs(part.fw))
    bw_compiled = compile_fx_inner(part.bw, fake_inputs(part.bw), is_backward=True)
    # Compiled graphs take their arguments boxed (one list), unlike the GraphModules.
    out, grads = part.run(example, fw=lambda *a: fw_compiled(list(a)), bw=_Boxed(bw_compiled, part.bw))
    expected_out, expected_grads = reference.run(example)
    for a, b in zip(out + grads, expected_out + expected_grads):
        torch.testing.assert_close(a, b)
    assert ops.pending_transfer_count() == 0
    assert len(source_buffers_live_until_waits(fw_compiled.source_code)) == len(names)
    assert bw_compiled.source_code.count("compile_offload.wait_reload.default(") == len(names)


class _Boxed:
    """A compiled backward called like its GraphModule (``Partitioned.run`` reads ``.graph``)."""

    def __init__(self, compiled, gm):
        self.compiled, self.graph = compiled, gm.graph

    def __call__(self, *args):
        return self.compiled(list(args))
