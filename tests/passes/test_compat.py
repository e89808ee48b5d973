"""Each wrapper in ``passes/compat.py`` on the installed torch, on real joint graphs.

The joint graphs are captured the way the backend sees them: Dynamo -> AOTAutograd with a
partition hook (``joint_capture.capture``). A hook runs the wrapper under
test on the prepared joint graph and records what it returned; the assertions run after
compilation. Private torch APIs that ``compile_offload/pipeline/backend.py`` and
``compile_offload/runtime/ops.py`` use (through ``compile_offload/torch_api/``) are checked at the end.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._functorch import partitioners as _p
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from compile_offload.passes import compat

from .joint_capture import capture

aten = torch.ops.aten


def tanh_mlp(x, w1, w2):
    return torch.tanh(torch.tanh(x @ w1) @ w2).sum()


def mlp_inputs():
    # Distinct shapes, so a wrong primal order fails loudly.
    x = torch.randn(8, 16)
    w1 = torch.randn(16, 12, requires_grad=True)
    w2 = torch.randn(12, 4, requires_grad=True)
    return x, w1, w2


def eager_grads(fn, inputs):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs)
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad])
    return out.detach(), grads


def run_partition(fw: fx.GraphModule, bw: fx.GraphModule, primals, tangents):
    """Run a forward/backward pair by hand: the backward's placeholders are wired by name
    to the forward's outputs (tangents in order), as AOTAutograd wires them by position."""
    from torch.fx.graph import _BoxedCodeGen

    def call(gm, args):  # compat.boxed_python switches a module the pipeline ran to boxed
        return gm(list(args)) if isinstance(gm.graph._codegen, _BoxedCodeGen) else gm(*args)

    fw_out = call(fw, primals)
    fw_out = list(fw_out) if isinstance(fw_out, (tuple, list)) else [fw_out]
    (fw_out_node,) = [n for n in fw.graph.nodes if n.op == "output"]
    names = [getattr(a, "name", None) for a in fw_out_node.args[0]]
    by_name = dict(zip(names, fw_out))
    tangents = iter(tangents)
    bw_args = []
    for p in (n for n in bw.graph.nodes if n.op == "placeholder"):
        bw_args.append(next(tangents) if p.name.startswith("tangents") else by_name[p.name])
    return fw_out, call(bw, bw_args)


def placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


# --- JointGraph / prepare_joint / has_backward ----------------------------------------------


def test_prepare_joint_returns_a_classified_joint_graph():
    def hook(joint, joint_inputs):
        info = joint.node_info
        return dict(
            is_joint=isinstance(joint, compat.JointGraph),
            num_fwd_outputs=joint.num_fwd_outputs,
            inputs=[n.name for n in info.inputs],
            primals=[n.name for n in placeholders(joint.gm) if n.name.startswith("primals")],
            tangents_bw=[info.is_required_bw(n) for n in placeholders(joint.gm) if n.name.startswith("tangents")],
            static=(joint.static_lifetime_input_indices, joint.static_lifetime_input_nodes),
            rng=joint.has_recomputable_rng_ops,
            n_joint_inputs=[len(x) for x in joint_inputs],
            tanh_fw=[info.is_required_fw(n) for n in joint.gm.graph.nodes if n.target is aten.tanh.default],
            has_backward=compat.has_backward(joint),
        )

    got, _ = capture(tanh_mlp, *mlp_inputs(), hook=hook)
    assert got["is_joint"]
    assert got["num_fwd_outputs"] == 1  # the loss
    assert got["inputs"] == got["primals"] and len(got["primals"]) == 3
    assert got["tangents_bw"] == [True]
    assert got["n_joint_inputs"] == [3, 1]  # (primals, tangents)
    indices, nodes = got["static"]
    assert isinstance(indices, list) and len(nodes) == len(indices)
    assert got["rng"] is False
    assert got["tanh_fw"] == [True, True]
    assert got["has_backward"] is True


def test_prepare_joint_flags_random_ops_in_checkpointed_regions():
    def fn(x, w):
        return checkpoint(lambda a: F.dropout(torch.tanh(a @ w), 0.5, training=True), x, use_reentrant=False).sum()

    got, _ = capture(fn, torch.randn(4, 8), torch.randn(8, 8, requires_grad=True),
                     hook=lambda joint, _: joint.has_recomputable_rng_ops)
    assert got is True


def test_has_backward_is_false_without_backward_nodes():
    def hook(joint, _):
        real = compat.has_backward(joint)
        info = joint.node_info
        saved = info.required_bw_nodes
        info.required_bw_nodes = type(saved)()
        try:
            return real, compat.has_backward(joint)
        finally:
            info.required_bw_nodes = saved

    (real, emptied), _ = capture(tanh_mlp, *mlp_inputs(), hook=hook)
    assert (real, emptied) == (True, False)


# --- min_cut_saved_values / extract_forward_backward / default_partition --------------------


def _ancestors(node):
    seen, todo = set(), [node]
    while todo:
        for n in todo.pop().all_input_nodes:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_min_cut_saved_values_are_forward_values_the_backward_needs():
    def hook(joint, joint_inputs):
        info = joint.node_info
        saved = compat.min_cut_saved_values(joint)
        tangents = {n for n in placeholders(joint.gm) if n.name.startswith("tangents")}
        return dict(
            saved=[n.name for n in saved],
            # computable in the forward: no tangent among its inputs
            forward=[not (tangents & (_ancestors(n) | {n})) for n in saved],
            # needed: each is (an ancestor of) something the backward computes
            needed=[any(n in _ancestors(b) for b in info.required_bw_nodes) for n in saved],
            first_tanh=next(n.name for n in joint.gm.graph.nodes if n.target is aten.tanh.default),
        )

    got, _ = capture(tanh_mlp, *mlp_inputs(), hook=hook)
    assert got["saved"], "a tanh MLP's backward needs saved activations"
    assert all(got["forward"]), got
    assert all(got["needed"]), got
    # tanh(x @ w1) feeds the second matmul's weight gradient: saved, not recomputed.
    assert got["first_tanh"] in got["saved"]


def test_min_cut_saved_values_match_torchs_own_partition():
    def hook(joint, joint_inputs):
        saved = {n.name for n in compat.min_cut_saved_values(joint)}
        _, bw = compat.default_partition(joint, joint_inputs)
        read = {n.name for n in placeholders(bw) if not n.name.startswith("tangents")}
        return saved, read

    (saved, read), _ = capture(tanh_mlp, *mlp_inputs(), hook=hook)
    assert saved == read


@pytest.mark.parametrize("what", ["min_cut", "primals_only"])
def test_extract_forward_backward_saves_exactly_the_given_values_and_matches_eager(what):
    inputs = mlp_inputs()

    def hook(joint, joint_inputs):
        if what == "min_cut":
            saved = compat.min_cut_saved_values(joint)
        else:  # save nothing but the inputs: the backward recomputes every activation
            saved = list(joint.node_info.inputs)
        fw, bw = compat.extract_forward_backward(joint, saved)
        return fw, bw, {n.name for n in saved}

    def partition(joint, joint_inputs, hooked):
        return hooked[0], hooked[1]

    (fw, bw, saved), out = capture(tanh_mlp, *inputs, hook=hook, partition=partition)
    read = {n.name for n in placeholders(bw) if not n.name.startswith("tangents")}
    assert read <= saved
    if what == "primals_only":
        assert sum(n.target is aten.tanh.default for n in bw.graph.nodes) == 2  # recomputed
    expected, expected_grads = eager_grads(tanh_mlp, inputs)
    # The compiled function ran on these graphs: output and gradients match eager.
    x, w1, w2 = inputs
    torch.testing.assert_close(out, expected)
    out.backward()
    torch.testing.assert_close(w1.grad, expected_grads[0])
    torch.testing.assert_close(w2.grad, expected_grads[1])
    # And by hand, the pair alone.
    fw_out, grads = run_partition(fw, bw, list(inputs), [torch.ones(())])
    torch.testing.assert_close(fw_out[0], expected)
    torch.testing.assert_close(grads[1], expected_grads[0])
    torch.testing.assert_close(grads[2], expected_grads[1])


def test_default_partition_gives_graph_modules_that_run_and_match_eager():
    inputs = mlp_inputs()
    got, _ = capture(tanh_mlp, *inputs, hook=lambda joint, ji: compat.default_partition(joint, ji))
    fw, bw = got
    assert isinstance(fw, fx.GraphModule) and isinstance(bw, fx.GraphModule)
    expected, expected_grads = eager_grads(tanh_mlp, inputs)
    fw_out, grads = run_partition(fw, bw, list(inputs), [torch.ones(())])
    torch.testing.assert_close(fw_out[0], expected)
    assert grads[0] is None  # x does not require grad
    torch.testing.assert_close(grads[1], expected_grads[0])
    torch.testing.assert_close(grads[2], expected_grads[1])


# --- node predicates ---------------------------------------------------------------------------


def test_is_sym_node_on_a_dynamic_shape_joint_graph():
    def hook(joint, _):
        return [(n.name, type(n.meta.get("val")).__name__, compat.is_sym_node(n)) for n in placeholders(joint.gm)]

    x, w1, w2 = mlp_inputs()
    got, _ = capture(tanh_mlp, x, w1, w2, hook=hook, dynamic=True)
    sym = [name for name, val, is_sym in got if is_sym]
    assert sym, got
    assert all(val == "SymInt" for name, val, is_sym in got if is_sym)
    assert all(not is_sym for name, val, is_sym in got if val == "FakeTensor")
    assert any(val == "FakeTensor" for _, val, _ in got)


def test_must_save_on_selective_checkpoint_tags():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x, w):
        body = lambda a: torch.tanh(torch.tanh(a @ w) @ w)  # noqa: E731
        context = functools.partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(body, x, use_reentrant=False, context_fn=context).sum()

    def hook(joint, _):
        info = joint.node_info
        fw = [n for n in joint.gm.graph.nodes if info.is_required_fw(n) and n.op == "call_function"]
        return [(n.target, compat.must_save(n)) for n in fw]

    got, _ = capture(fn, torch.randn(4, 8), torch.randn(8, 8, requires_grad=True), hook=hook)
    assert [t for t, must in got if must] == [aten.mm.default, aten.mm.default], got
    assert any(t is aten.tanh.default and not must for t, must in got)


def test_must_save_reads_the_recompute_tag():
    node = fx.Graph().placeholder("x")
    assert not compat.must_save(node)
    node.meta["recompute"] = CheckpointPolicy.PREFER_SAVE
    assert not compat.must_save(node)
    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    assert compat.must_save(node)


def test_must_be_in_forward_on_an_input_mutation():
    def fn(x, w, buf):
        buf.add_(1)  # an input mutation: copied back in the forward
        return torch.tanh(x @ w).sum() + buf.sum()

    def hook(joint, _):
        return [(n.target, compat.must_be_in_forward(n)) for n in joint.gm.graph.nodes if n.op == "call_function"]

    got, _ = capture(fn, torch.randn(4, 8), torch.randn(8, 8, requires_grad=True), torch.zeros(3), hook=hook)
    forced = [t for t, must in got if must]
    assert forced and all(t._schema.is_mutable for t in forced), got
    assert any(t is aten.mm.default and not must for t, must in got)


def test_must_be_in_forward_reads_the_partitioner_tag():
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(aten.sin.default, (x,))
    assert not compat.must_be_in_forward(node)
    node.meta["partitioner_tag"] = "must_be_in_forward"
    assert compat.must_be_in_forward(node)
    mutation = graph.call_function(aten.add_.Tensor, (x, x))
    assert compat.must_be_in_forward(mutation)
    mutation.meta["partitioner_tag"] = "must_be_in_backward"
    assert not compat.must_be_in_forward(mutation)


def test_random_ops_contains_dropout_and_rand_like_and_matches_a_dropout_graph():
    ops = compat.random_ops()
    assert {aten.native_dropout, aten.rand_like, aten.randn_like} <= ops
    assert aten.mm not in ops and aten.tanh not in ops

    def hook(joint, _):
        return [n.target for n in joint.gm.graph.nodes if n.op == "call_function"]

    def fn(x, w):
        return F.dropout(x @ w, 0.5, training=True).sum()

    inputs = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    targets, _ = capture(fn, *inputs, hook=hook, decompose=False)
    assert aten.native_dropout.default in targets and aten.native_dropout in ops
    # Inductor's table decomposes dropout into aten.rand, which is not in random_ops: it is
    # recognised by its nondeterministic_seeded tag (passes/analyze.py checks both).
    targets, _ = capture(fn, *inputs, hook=hook)
    random = [t for t in targets if isinstance(t, torch._ops.OpOverload)
              and (t.overloadpacket in ops or torch.Tag.nondeterministic_seeded in t.tags)]
    assert random, targets


def _symbool_graph():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    s = shape_env.create_unbacked_symint()
    graph = fx.Graph()
    cond = graph.placeholder("cond")
    cond.meta["val"] = s > 2
    return graph, cond


@pytest.mark.parametrize("torch_has_it", [True, False])
def test_is_assert_only_symbool(monkeypatch, torch_has_it):
    if not torch_has_it:  # our fallback (torch 2.11 / 2.12 have no module-level function)
        monkeypatch.delattr(_p, "_is_assert_only_symbool", raising=False)
    graph, cond = _symbool_graph()
    assert isinstance(cond.meta["val"], torch.SymBool)
    assert not compat._is_assert_only_symbool(cond)  # no users at all
    assert_node = graph.call_function(aten._assert_scalar.default, (cond, "cond failed"))
    assert compat._is_assert_only_symbool(cond)
    graph.call_function(aten.scalar_tensor.default, (cond,))
    assert not compat._is_assert_only_symbool(cond)  # also read by something else
    assert not compat._is_assert_only_symbool(assert_node)


@pytest.mark.parametrize("torch_has_it", [True, False])
def test_is_opaque_node(monkeypatch, torch_has_it):
    from torch._library.fake_class_registry import FakeScriptObject

    def is_opaque(node):
        with monkeypatch.context() as m:  # only around our call: torch's partitioner uses it
            if not torch_has_it:  # our fallback (torch 2.11 has no is_opaque_node)
                m.delattr(_p, "is_opaque_node", raising=False)
            return compat._is_opaque_node(node)

    def hook(joint, _):
        return [is_opaque(n) for n in joint.gm.graph.nodes]

    got, _ = capture(tanh_mlp, *mlp_inputs(), hook=hook)
    assert got and not any(got)  # tensors are not opaque
    node = fx.Graph().placeholder("obj")
    node.meta["val"] = FakeScriptObject(object(), "__torch__.torch.classes.test.Foo", None)
    assert is_opaque(node)


# --- size_hint / boxed_python ------------------------------------------------------------------


def test_size_hint_of_ints_and_symints():
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
    from torch._dynamo.source import ConstantSource

    assert compat.size_hint(7) == 7
    shape_env = ShapeEnv()
    sym = shape_env.create_symbol(13, ConstantSource("s"), dynamic_dim=DimDynamic.DYNAMIC)
    s = shape_env.create_symintnode(sym, hint=13)
    assert isinstance(s, torch.SymInt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch 2.11's hint_int warned FutureWarning on each call
        assert compat.size_hint(s) == 13
        assert compat.size_hint(s * 2 + 1) == 27
        # no hint and no bound: Inductor's fallback (torch._inductor.config.unbacked_symint_fallback)
        assert compat.size_hint(shape_env.create_unbacked_symint()) == compat.unbacked_size_fallback() == 8192
        bounded = shape_env.create_unbacked_symint()
        shape_env.constrain_symbol_range(bounded.node.expr, compiler_min=0, compiler_max=100)
        assert compat.size_hint(bounded * 3) == 300  # no hint: the largest value torch knows it can take


def test_boxed_python_runs_with_the_boxed_convention_and_frees_its_arguments():
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output((graph.call_function(torch.add, (a, b)), graph.call_function(torch.mul, (a, b))))
    run = compat.boxed_python(fx.GraphModule(torch.nn.Module(), graph))
    assert run._boxed_call is True
    x, y = torch.randn(3), torch.randn(3)
    args = [x, y]
    out = run(args)
    assert args == []  # cleared on entry, so each input can be freed at its last use
    torch.testing.assert_close(out[0], x + y)
    torch.testing.assert_close(out[1], x * y)


# --- private torch APIs used outside compat (backend.py, ops.py, through torch_api) --------------------


def test_backend_graph_name_reads_dynamos_compile_id():
    from compile_offload.pipeline import backend, ddp

    assert backend._graph_name() == "graph"  # outside Dynamo
    assert ddp.bucket_index() is None
    seen = []

    def record(gm, example_inputs):
        seen.append((backend._graph_name(), ddp.bucket_index(), ddp.bucket_graph_count()))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: x.sin() + 1, backend=record)(torch.randn(3))
    assert seen == [("graph_0_0", None, None)]


def test_inductor_config_has_the_partitioner_hook_the_backend_patches():
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomPartitionerFn
    import inspect

    from compile_offload.pipeline.partitioner import OffloadRematPartitioner

    assert hasattr(inductor_config, "custom_partitioner_fn")
    assert "config_patches" in inspect.signature(compile_fx).parameters
    assert issubclass(OffloadRematPartitioner, CustomPartitionerFn)
    assert hasattr(torch._functorch.config, "enable_autograd_cache")
    with inductor_config.patch(custom_partitioner_fn=None):
        pass


def test_ops_private_helpers():
    from compile_offload.runtime import ops

    assert ops._is_dense(torch.randn(4, 5))
    assert ops._is_dense(torch.randn(4, 5).t())  # a permutation of a contiguous layout
    assert not ops._is_dense(torch.randn(4, 5)[:, ::2])
    assert not ops._is_dense(torch.randn(4, 1).expand(4, 5))

    w = torch.randn(3, requires_grad=True)
    with ops._below_autograd():
        y = w * 2
    assert y.grad_fn is None and not y.requires_grad
    assert (w * 2).grad_fn is not None


def test_ops_custom_ops_carry_the_cudagraph_unsafe_tag_where_torch_has_it():
    from compile_offload.runtime import ops

    for name in ("offload", "reload"):
        op = getattr(torch.ops.compile_offload, name).default
        if hasattr(torch.Tag, "cudagraph_unsafe"):
            assert torch.Tag.cudagraph_unsafe in op.tags, (name, op.tags)
    assert ops._CUDAGRAPH_UNSAFE == ((torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ())
