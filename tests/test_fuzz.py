"""Hypothesis fuzzing of the offload_remat backend on random small programs.

Programs come from ``tests.fuzz_programs.programs`` (pointwise ops, reductions, matmuls,
views, in-place ops, dropout, BatchNorm, several outputs, shared inputs; fp32 and fp64,
and bf16 where no tolerance against eager is needed).
Each is compiled with ``fullgraph=True`` through ``compile_offload.offload_remat`` with
``inner_compiler="eager"`` (the partitioned graphs run as Python: no code generation),
under a random budget, with offload and ``debug_force_offload`` on or off. Properties:

* ``test_training_step_matches_eager``: outputs, gradients of parameters and inputs, and
  buffers (BatchNorm running statistics) match eager within the dtype's tolerance; the
  planner handled the graph (no fallback); both partitioned graphs pass ``lint()``; no
  random op and no input mutation is in the backward; the simulated peak of the
  partitioned graphs is the plan's predicted peak (at most it, with forced offloads); a
  plan is feasible exactly when the budget reaches its minimum peak, and a feasible plan's
  predicted and simulated peaks are within the budget.
* ``test_offload_is_bitwise_neutral``: with the partition held fixed (same budget, offload
  off vs every eligible saved tensor offloaded), outputs, gradients and buffers are
  bitwise equal and no transfer is left pending.
* ``test_plan_is_monotone_in_budget``: planning one program under falling budgets never
  raises the predicted peak nor lowers the predicted step time, and a plan is feasible
  exactly when the budget reaches the minimum peak.

Profiles: by default every test runs a fixed number of examples from a fixed seed (over
500 in all, a few minutes on two cores); ``HYPOTHESIS_PROFILE=long`` runs many more from
a random seed, for nightly and GPU runs. ``COMPILE_OFFLOAD_FUZZ_DEVICE=cuda`` runs the
programs on the GPU (real transfer streams). Failures are kept in hypothesis' example
database (``.hypothesis/``) and replayed first on the next run; bugs found by the fuzzer
stay below as explicit ``@example``s and regular tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, event, example, given, note, seed, settings
from hypothesis import strategies as st

import compile_offload
from compile_offload.runtime import ops
from compile_offload.pipeline import partitioner as partitioner_module
from compile_offload.pipeline.planning import plan_partition
from compile_offload.passes.memory import simulate

from .graphs_program import graphs_program
from compile_offload.passes.plan import Plan

from .partition_results import Partition, partitions
from .fuzz_programs import InputSpec, Program, aliased_programs, program_from_source, programs

# --------------------------------------------------------------------------- profiles

settings.register_profile(
    "fuzz",
    deadline=None,  # compile times vary with the machine's load
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile("long", settings.get_profile("fuzz"))
LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
LONG_FACTOR = 20  # the long profile runs this many times the default examples
FIXED_SEED = 20261101


def fuzz_settings(examples: int) -> Callable:
    """Settings and seed for one fuzz test: ``examples`` from a fixed seed by default,
    ``LONG_FACTOR`` times as many from a random seed under the long profile. The profile
    is looked up rather than loaded, so other hypothesis tests keep their own settings."""
    profile = settings.get_profile("long" if LONG else "fuzz")
    configured = settings(profile, max_examples=examples * (LONG_FACTOR if LONG else 1))

    def apply(test: Callable) -> Callable:
        test = configured(test)
        return test if LONG else seed(FIXED_SEED)(test)

    return apply


DEVICE = torch.device(os.environ.get("COMPILE_OFFLOAD_FUZZ_DEVICE", "cpu"))
if DEVICE.type == "cuda":
    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# --------------------------------------------------------------------------- strategies

TINY_BUDGETS = (1, 64, 1024)  # bytes: below (or near) any reachable peak of these programs
# Half the draws ask for the minimum-memory plan (fraction 0 or a tiny byte count), where
# the planner recomputes and offloads the most.
budgets = st.one_of(
    st.none(),
    st.just(0.0),
    st.floats(0.0, 1.0),
    st.sampled_from(TINY_BUDGETS),
)


@dataclass(frozen=True)
class Options:
    """Backend options one example compiles with."""

    memory_budget: int | float | None
    offload: bool
    debug_force_offload: bool
    prefetch: bool
    solver: str

    def backend(self) -> Callable:
        # debug_force_offload needs offload (with offload=False it is refused)
        forced = self.debug_force_offload and self.offload
        return compile_offload.offload_remat(inner_compiler="eager", **{**self.__dict__, "debug_force_offload": forced})


options = st.builds(
    Options,
    memory_budget=budgets,
    offload=st.booleans(),
    debug_force_offload=st.booleans(),
    prefetch=st.booleans(),
    solver=st.sampled_from(("greedy", "exact")),
)

# --------------------------------------------------------------------------- running


ALL_DTYPES = (torch.float32, torch.float64, torch.bfloat16)

# Eager and compiled run the same float math up to operation order (decompositions), which
# moves results by a few ulps; a wrong gradient is off by far more.
# bfloat16 keeps 8 bits of mantissa (one ulp is 0.4-0.8%): a decomposition that rounds an
# intermediate differently moves a result by a few ulps of the tensor's scale.
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-9, atol=1e-11),
              torch.bfloat16: dict(rtol=4e-2, atol=4e-2)}


def make_inputs(program: Program, rng_seed: int) -> list[torch.Tensor]:
    """Fresh leaf inputs on ``DEVICE`` (strides preserved), requiring grad as specified."""
    return [
        x.to(DEVICE).requires_grad_(spec.requires_grad)
        for x, spec in zip(program.make_inputs(rng_seed), program.inputs)
    ]


def run_step(program: Program, module: torch.nn.Module, forward: Callable,
             rng_seed: int = 0) -> dict[str, torch.Tensor | None]:
    """One forward and backward of ``forward`` (``module`` or its compiled wrapper): every
    output, the gradient of every input and parameter, and every buffer, by name.

    The backward uses random cotangents (the same on every run), so every output element
    gets its own gradient. The RNG is seeded before the forward, so dropout draws the same
    masks on every run that consumes the RNG the same way."""
    inputs = make_inputs(program, rng_seed)
    torch.manual_seed(rng_seed)
    outputs = forward(*inputs)
    generator = torch.Generator().manual_seed(rng_seed + 1)
    differentiable = [o for o in outputs if o.requires_grad]
    cotangents = [torch.randn(o.shape, generator=generator, dtype=o.dtype).to(DEVICE) for o in differentiable]
    torch.autograd.backward(differentiable, cotangents)
    named: dict[str, torch.Tensor | None] = {f"output {i}": o.detach().clone() for i, o in enumerate(outputs)}
    named.update({f"grad of input {s.name}": x.grad for s, x in zip(program.inputs, inputs)})
    named.update({f"grad of {n}": p.grad for n, p in module.named_parameters()})
    named.update({f"buffer {n}": b.detach().clone() for n, b in module.named_buffers()})
    return named


@dataclass
class CompiledRun:
    tensors: dict[str, torch.Tensor | None]
    partitions: list[Partition]
    warnings: list[str]


def run_compiled(program: Program, backend: Callable, rng_seed: int = 0) -> CompiledRun:
    """One step of ``program`` compiled with ``backend`` (fullgraph, fresh Dynamo)."""
    torch._dynamo.reset()
    module = program.make_module(rng_seed).to(DEVICE)
    with warnings.catch_warnings(record=True) as caught, partitions() as captured, \
            torch._inductor.config.patch(fallback_random=True):
        warnings.simplefilter("always")
        compiled = torch.compile(module, backend=backend, fullgraph=True)
        tensors = run_step(program, module, compiled, rng_seed)
    return CompiledRun(tensors, list(captured), [str(w.message) for w in caught])


def run_eager(program: Program, rng_seed: int = 0) -> dict[str, torch.Tensor | None]:
    module = program.make_module(rng_seed).to(DEVICE)
    return run_step(program, module, module, rng_seed)


# --------------------------------------------------------------------------- checks


FALLBACK = "falling back to torch's default"


def assert_same_tensors(actual: dict, expected: dict,
                        compare: Callable[[str, torch.Tensor, torch.Tensor], None]) -> None:
    assert actual.keys() == expected.keys(), sorted(actual.keys() ^ expected.keys())
    for what, want in expected.items():
        got = actual[what]
        assert (got is None) == (want is None), f"{what}: {got} vs {want}"
        if want is not None:
            compare(what, got, want)


def assert_close_for_dtype(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the dtype's tolerance; the absolute part scales with the tensor's largest
    element, since a sum that cancels to near zero carries the rounding error of its
    terms (a wrong gradient is off by about the tensor's scale, far more)."""
    if not want.is_floating_point():  # integer buffers (BatchNorm's batch count): exact
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
        return
    tolerance = TOLERANCES[want.dtype]
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=tolerance["rtol"], atol=tolerance["atol"] * scale,
                               msg=lambda m: f"{what}: {m}")


def assert_bitwise(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
    assert torch.equal(got, want), f"{what}: not bitwise equal; max abs difference {(got - want).abs().max().item()}"


def mutates_input(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.aten.copy_.default \
        and node.args[0].op == "placeholder"


def is_random(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def assert_one_saved_tensor_per_storage(p: Partition) -> None:
    """No two tensors the forward saves for the backward share an intermediate storage:
    AOTAutograd would donate each to the backward, which may overwrite one in place while
    the other is still read (issue 49). Views of inputs are not donated."""
    from compile_offload.passes.analyze import storage_roots

    roots = storage_roots(p.fw.graph)
    output = next(n for n in p.fw.graph.nodes if n.op == "output")
    saved = [n for n in output.args[0][p.num_fwd_outputs:]
             if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]
    by_root: dict[torch.fx.Node, list[str]] = {}
    for node in saved:
        root = roots.get(node, node)
        if root.op != "placeholder":
            by_root.setdefault(root, []).append(node.name)
    shared = {root.name: names for root, names in by_root.items() if len(names) > 1}
    assert not shared, f"saved tensors sharing one storage: {shared}\n{p.fw.code}"


def check_partition(p: Partition, forced_offload: bool) -> None:
    """Properties every partition must have, whatever the budget. ``forced_offload``: the
    graphs were built with ``debug_force_offload`` (offloads the plan does not describe)."""
    plan = p.plan
    if currently_in_test_context():  # shown with a failing example; regular tests have the messages
        note(plan.summary())
    assert not [n for n in plan.notes if n.startswith("fallback")], plan.notes
    p.fw.graph.lint()
    p.bw.graph.lint()
    assert_one_saved_tensor_per_storage(p)
    # The forward draws each random number once; a backward that drew again would
    # differentiate a different mask than the forward applied.
    assert not [n.name for n in p.bw.graph.nodes if is_random(n)], p.bw.code
    # Buffer updates happen once, in the forward (never re-applied by recompute).
    assert not [n.name for n in p.bw.graph.nodes if mutates_input(n)], p.bw.code
    if not plan.decisions:
        return  # the graph saves nothing: nothing was planned
    built = simulate(graphs_program(p.fw, p.bw, p.num_fwd_outputs)).peak_bytes
    if forced_offload:
        # Moving saved tensors to host memory never raises the device peak.
        assert built <= plan.predicted_peak_bytes, f"forced offloads peak at {built} bytes: {plan.summary()}"
    else:
        # What the solver simulated is what the partitioned graphs do.
        assert built == plan.predicted_peak_bytes, f"the built graphs peak at {built} bytes: {plan.summary()}"
    if plan.budget_bytes is None:
        return
    assert plan.feasible == (plan.budget_bytes >= plan.min_peak_bytes), plan.summary()
    if plan.feasible:
        assert plan.predicted_peak_bytes <= plan.budget_bytes, plan.summary()
        assert built <= plan.budget_bytes, f"the built graphs peak at {built} bytes: {plan.summary()}"


def describe_decisions(partitions: list[Partition]) -> str:
    """A label for hypothesis' statistics: which kinds of decision the plans made."""
    if not partitions:
        return "no partition"
    kinds = sorted({d.decision for p in partitions for d in p.plan.decisions})
    return f"decisions: {' '.join(kinds) or 'none'}"


# --------------------------------------------------------------------------- bugs found

# Found by test_training_step_matches_eager (minimised): the forward saves ``getitem`` (a
# view of ``sin``, for layer_norm's backward) while the backward recomputes ``sin`` itself
# (for tanh's backward). passes.memory.plan_program maps every backward read of a view of
# ``sin`` to the recomputed copy, so the saved storage is modelled as freed at the end of
# the forward: the plan predicts a lower peak than the partitioned graphs have, and calls
# budgets between the two feasible.
SAVED_VIEW_OF_RECOMPUTED_STORAGE = program_from_source(
    """
    def forward(self, x0):
        v0 = torch.sin(x0)
        v1 = torch.tanh(v0)
        v2 = torch.exp(v1)
        v3, v4 = v0.reshape(3, 2, 2).unbind(1)
        v5 = torch.sin(v4)
        v6 = F.layer_norm(v3, (2,), eps=0.1)
        return (v2, v5, v6)
    """,
    torch.float32,
    [InputSpec("x0", (3, 4), requires_grad=True, transposed=False)],
)
# The converse, which a fix must keep right: a view recomputed in the backward (``permute``
# of ``sin`` for the matmul's backward) of a storage the forward saves reads the saved one.
RECOMPUTED_VIEW_OF_SAVED_STORAGE = program_from_source(
    """
    def forward(self, x0):
        v0 = torch.sin(x0)
        v1 = v0 @ v0.t()
        return (v1,)
    """,
    torch.float32,
    [InputSpec("x0", (1, 2), requires_grad=True, transposed=False)],
)
REGRESSIONS = {
    "saved_view_of_recomputed_storage": SAVED_VIEW_OF_RECOMPUTED_STORAGE,
    "recomputed_view_of_saved_storage": RECOMPUTED_VIEW_OF_SAVED_STORAGE,
}


# --------------------------------------------------------------------------- properties


@fuzz_settings(examples=300)
@given(program=programs(dtypes=ALL_DTYPES), options=options)
@example(program=SAVED_VIEW_OF_RECOMPUTED_STORAGE, options=Options(None, False, False, True, "greedy"))
def test_training_step_matches_eager(program: Program, options: Options):
    expected = run_eager(program)
    run = run_compiled(program, options.backend())
    assert not [m for m in run.warnings if FALLBACK in m], run.warnings
    # fullgraph=True: one graph, partitioned once, unless it has nothing to differentiate
    # (outputs that are views of inputs need no compiled graph at all).
    assert len(run.partitions) <= 1
    for partition in run.partitions:
        check_partition(partition, forced_offload=options.offload and options.debug_force_offload)
    event(describe_decisions(run.partitions))
    assert_same_tensors(run.tensors, expected, assert_close_for_dtype)


@fuzz_settings(examples=100)
@given(program=programs(dtypes=ALL_DTYPES), budget=budgets, prefetch=st.booleans())
def test_offload_is_bitwise_neutral(program: Program, budget, prefetch: bool):
    """Offload only moves data: with the saved set held fixed, offloading every eligible
    saved tensor must give the same step as offloading none: bitwise on CPU, to rounding
    on a GPU."""
    # Deterministic Inductor: on a GPU, Triton reduction configs are otherwise picked by
    # timing (conftest.deterministic_inductor). Even so the two compiles fuse differently
    # and on a GPU may sum in different orders (the fixture says why): bitwise on CPU, where
    # the C++ kernels have summed alike in every run, to the dtype's rounding on a GPU.
    with torch._inductor.config.patch(deterministic=True):
        kept = run_compiled(program, Options(budget, False, False, prefetch, "greedy").backend())
        moved = run_compiled(program, Options(budget, True, True, prefetch, "greedy").backend())
    assert [p.plan.saved for p in moved.partitions] == [p.plan.saved for p in kept.partitions], \
        "the partition was not held fixed"
    offloaded = sum(p.plan.count("offload") for p in moved.partitions)
    event(f"offloaded tensors: {min(offloaded, 3)}{'+' if offloaded >= 3 else ''}")
    for partition in moved.partitions:
        check_partition(partition, forced_offload=True)
    assert_same_tensors(moved.tensors, kept.tensors,
                        assert_bitwise if DEVICE.type == "cpu" else assert_close_for_dtype)
    assert ops.pending_transfer_count() == 0, "a transfer was started and never waited for"


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose graph can be changed (planning runs DCE and CSE on it and
    annotates its nodes) without touching ``gm``; node names and metadata are kept."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


@contextlib.contextmanager
def planned_under_budgets(fractions: list[float]) -> Iterator[list[tuple[int | str | None, Plan]]]:
    """Inside the block, each joint graph the backend partitions is also planned (on a copy)
    under no budget and then under falling byte budgets: each of ``fractions`` of the
    unconstrained peak, and 1 byte. Yields the (budget, plan) pairs in that order, then
    ("backend", the plan the backend itself made). One trace serves every budget, so this
    is much cheaper than calling ``compile_offload.explain`` per budget."""
    plans: list[tuple[int | str | None, Plan]] = []
    plan_backend = partitioner_module.plan_partition

    def plan_each_budget(joint_gm, joint_inputs, settings, **kwargs):
        def plan(budget: int | None) -> Plan:
            copy_settings = dataclasses.replace(settings, budget_bytes=budget, budget_fraction=None)
            return plan_partition(copy_graph_module(joint_gm), joint_inputs, copy_settings, **kwargs).plan

        unconstrained = plan(None)
        plans.append((None, unconstrained))
        peak = unconstrained.baseline_peak_bytes
        for budget in sorted({int(f * peak) for f in fractions} | {1}, reverse=True):
            plans.append((budget, plan(budget)))
        result = plan_backend(joint_gm, joint_inputs, settings, **kwargs)
        plans.append(("backend", result.plan))
        return result

    with warnings.catch_warnings(), mock.patch.object(partitioner_module, "plan_partition", plan_each_budget):
        warnings.simplefilter("ignore")  # below-the-minimum warnings for the tiny budgets
        yield plans


@fuzz_settings(examples=100)
@given(program=programs(dtypes=ALL_DTYPES, min_ops=4), fractions=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4),
       offload=st.booleans(), solver=st.sampled_from(("greedy", "exact")))
def test_plan_is_monotone_in_budget(program: Program, fractions: list[float], offload: bool, solver: str):
    """Falling budgets (bytes from the unconstrained peak down to 1) never get a higher
    predicted peak, nor a faster plan; a plan is feasible exactly when the budget reaches
    the minimum-memory plan, and then its predicted peak is within the budget."""
    torch._dynamo.reset()
    module = program.make_module().to(DEVICE)
    backend = Options(None, offload, False, True, solver).backend()
    with planned_under_budgets(fractions) as plans:
        torch.compile(module, backend=backend, fullgraph=True)(*make_inputs(program, 0))
    if not plans:
        event("no partition")
        return
    (_, unconstrained), *constrained, (_, backend_plan) = plans
    # Planning a copy of the joint graph gives the plan the backend made from the original.
    assert (backend_plan.saved, backend_plan.offloaded, backend_plan.predicted_peak_bytes) == \
        (unconstrained.saved, unconstrained.offloaded, unconstrained.predicted_peak_bytes)
    if not unconstrained.decisions:
        event("saves nothing")
        return
    previous = unconstrained
    # min_peak_bytes is the lowest peak among the plans the search simulated: the true
    # minimum whenever the budget is below it (the search then reaches it), and no lower than
    # that minimum otherwise.
    minima = {plan.min_peak_bytes for _, plan in constrained if not plan.feasible}
    assert len(minima) <= 1, minima
    for budget, plan in constrained:
        note(f"budget {budget}: {plan.summary()}")
        assert plan.baseline_peak_bytes == unconstrained.baseline_peak_bytes
        assert plan.feasible == (budget >= plan.min_peak_bytes)
        assert not plan.feasible or plan.min_peak_bytes <= plan.predicted_peak_bytes <= budget
        assert all(plan.min_peak_bytes >= minimum for minimum in minima)
        assert plan.predicted_peak_bytes <= previous.predicted_peak_bytes
        assert plan.predicted_step_seconds >= previous.predicted_step_seconds * (1 - 1e-9)
        previous = plan
    event(f"distinct plans: {len({(tuple(p.saved), tuple(p.offloaded)) for _, p in plans})}")


@contextlib.contextmanager
def saving_views_too(draw) -> Iterator[None]:
    """Plans start from torch's min-cut saved set plus views of forward intermediates and the
    tensors they view, as ``draw`` picks them (with no budget the plan saves exactly that
    set): every saved set with aliases reaches the rewrite and Inductor, not only those a
    budget happens to make."""
    from compile_offload.passes import compat
    from compile_offload.passes.analyze import storage_roots

    original = compat.min_cut_saved_values

    def with_views(joint):
        saved = original(joint)
        roots = storage_roots(joint.gm.graph)
        views = [n for n in joint.gm.graph.nodes
                 if joint.node_info.is_required_fw(n) and roots.get(n, n) is not n
                 and roots[n].op == "call_function" and joint.node_info.is_required_fw(roots[n])
                 and isinstance(n.meta.get("val"), torch.Tensor)]
        if not views:
            return saved
        chosen = draw(st.lists(st.sampled_from(views), unique=True, min_size=1, max_size=4), label="saved views")
        return list(dict.fromkeys([*saved, *chosen, *(roots[n] for n in chosen)]))

    with mock.patch.object(compat, "min_cut_saved_values", with_views):
        yield


@pytest.mark.inductor
@pytest.mark.slow
@fuzz_settings(examples=12)
@given(program=aliased_programs(), budget=st.sampled_from((None, None, 0.5, 0.0)), data=st.data())
def test_saved_tensors_and_their_views_match_eager_under_inductor(program: Program, budget, data):
    """Programs whose backward needs tensors and views of them, planned from saved sets that
    hold views and the tensors they view, compiled by Inductor with donated buffers on
    (AOTAutograd hands the backward its saved tensors to overwrite in place): the step
    matches eager in fp64 (issue 49)."""
    expected = run_eager(program)
    with torch._functorch.config.patch(donated_buffer=True, enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False, inplace_buffers=True), saving_views_too(data.draw):
        run = run_compiled(program, compile_offload.offload_remat(memory_budget=budget))
    assert not [m for m in run.warnings if FALLBACK in m], run.warnings
    for partition in run.partitions:
        assert_one_saved_tensor_per_storage(partition)
    event(describe_decisions(run.partitions))
    assert_same_tensors(run.tensors, expected, assert_close_for_dtype)


# --------------------------------------------------------------------------- regressions


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_plan_predicts_the_peak_of_the_graphs_it_builds(name):
    """Unconstrained, and then with the budget set to the predicted peak (a plan that says
    it is feasible), the partitioned graphs' simulated peak is the plan's."""
    program = REGRESSIONS[name]
    run = run_compiled(program, Options(None, False, False, True, "greedy").backend())
    (partition,) = run.partitions
    check_partition(partition, forced_offload=False)
    budget = partition.plan.predicted_peak_bytes
    run = run_compiled(program, Options(budget, False, False, True, "greedy").backend())
    (partition,) = run.partitions
    assert partition.plan.feasible
    check_partition(partition, forced_offload=False)
