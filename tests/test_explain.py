"""compile_offload.tools.explain: plans without running, on meta models and named GPU profiles."""

import warnings

import pytest
import torch
import torch.nn as nn

import compile_offload
from compile_offload.benchmarks.workloads import Decoder
from compile_offload import BudgetError
from compile_offload.passes.plan import format_bytes


def meta_gpt(layers=4, width=256, heads=4, seq=1024, batch=8):
    """Large enough that activations, not parameter gradients, dominate the peak."""
    with torch.device("meta"):
        model = Decoder(layers, width, heads).to(torch.bfloat16)
        x = torch.randn(batch, seq, width, dtype=torch.bfloat16, requires_grad=True)
    return model, x


def test_predicted_peak_falls_with_the_budget_on_a_meta_gpt_for_h100():
    model, x = meta_gpt()
    plans = [compile_offload.explain(model, x, memory_budget=b, device_profile="h100", offload=False)
             for b in (None, 0.75, 0.5, 0.25, 0.0)]
    peaks = [p.predicted_peak_bytes for p in plans]
    assert all(later <= earlier for earlier, later in zip(peaks, peaks[1:])), peaks
    assert peaks[-1] < 0.6 * peaks[0], "the minimum-memory plan saves a large part of the activations"
    times = [p.predicted_step_seconds for p in plans]
    assert times[-1] > times[0], "recomputation costs predicted time"
    assert all(p.device_profile == "h100" for p in plans)
    assert all(p.baseline_peak_bytes == plans[0].predicted_peak_bytes for p in plans)
    # Parameters stayed on the meta device: nothing was materialised or run.
    assert all(p.device.type == "meta" for p in model.parameters())


def test_plan_fields_and_table():
    model, x = meta_gpt()
    plan = compile_offload.explain(model, x, memory_budget=0.6, device_profile="a100")
    assert 0.6 * plan.baseline_peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    assert plan.feasible and plan.predicted_peak_bytes <= plan.budget_bytes
    kinds = {d.decision for d in plan.decisions}
    assert "recompute" in kinds and "keep" in kinds
    for decision in plan.decisions:
        assert decision.bytes >= 0 and decision.reason and decision.dtype
    text = str(plan)
    assert "recompute" in text and plan.decisions[0].name in text


@pytest.mark.parametrize("explain", [compile_offload.explain, compile_offload.explain_all])
def test_a_model_that_cannot_be_called_is_a_type_error_naming_the_argument(explain):
    with pytest.raises(TypeError, match=r"^compile_offload.tools.explain: model_or_fn is a NoneType, which cannot be "
                                        r"called; pass the model"):
        explain(None, torch.randn(2, 4))


@pytest.mark.parametrize("explain", [compile_offload.explain, compile_offload.explain_all])
def test_an_input_passed_by_name_is_said_to_be_positional(explain):
    """fuzz30b F12: explain(model, input=x) was 'unknown option(s) ['input']' and the knobs."""
    with pytest.raises(TypeError, match=r"explain: input=\.\.\.: the example inputs are positional \(explain\(model, "
                                        r"x, y\)\); keyword inputs: explain\(lambda x: model\(x=x\), x\)"):
        explain(nn.Linear(4, 4), input=torch.randn(2, 4))


def test_explain_notes_the_options_a_plan_alone_cannot_honour():
    """fuzz30b F7: a plan whose offloads pass pinned_pool_limit (training with it raises), and
    verify_budget / measured_plan_choice (they act on training steps), said nothing."""
    model, x = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256)).to("meta"), torch.randn(
        64, 256, device="meta")
    offloading = compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100",
                                         pinned_pool_limit="1KiB", debug_force_offload=True)
    assert offloading.bytes_of("offload") > 1024
    assert any(note.startswith("above pinned_pool_limit 1.00 KiB") for note in offloading.notes), offloading.notes
    measured = compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100", verify_budget=True)
    assert "verify_budget and measured_plan_choice act on training steps: explain runs none" in measured.notes


def test_budget_below_minimum_warns_with_both_numbers_and_strict_raises():
    model, x = meta_gpt(layers=1)
    with pytest.warns(UserWarning, match=r"below the minimum this planner can reach \(.*\)"):
        plan = compile_offload.explain(model, x, memory_budget="1KiB", device_profile="h100")
    assert not plan.feasible and plan.predicted_peak_bytes == plan.min_peak_bytes
    # explain raises BudgetError itself, not Dynamo's BackendCompilerFailed wrapping it.
    with pytest.raises(BudgetError, match="strict_budget=True"):
        compile_offload.explain(model, x, memory_budget="1KiB", device_profile="h100", strict_budget=True)


def test_a_fraction_below_the_minimum_warns_and_strict_raises_but_zero_does_not():
    """0.0 asks for the minimum plan; any other fraction the planner cannot reach is a
    budget missed, like bytes."""
    model, x = meta_gpt(layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the minimum, asked for: no warning
        minimum = compile_offload.explain(model, x, memory_budget=0.0, device_profile="h100")
    unreachable = minimum.min_peak_bytes / minimum.baseline_peak_bytes / 2
    with pytest.warns(UserWarning, match="below the minimum this planner can reach"):
        plan = compile_offload.explain(model, x, memory_budget=unreachable, device_profile="h100")
    assert not plan.feasible and plan.predicted_peak_bytes == minimum.min_peak_bytes
    with pytest.raises(BudgetError, match="strict_budget=True"):
        compile_offload.explain_all(model, x, memory_budget=unreachable, device_profile="h100", strict_budget=True)


@pytest.mark.parametrize("zero", [0, 0.0])
def test_a_budget_of_zero_bytes_or_fraction_is_met_by_the_minimum_memory_plan(zero):
    """0 bytes and the fraction 0.0 both ask for the minimum-memory plan: the plan made is
    what was asked for, so it meets its budget, says so in its summary, and is not reported
    below the minimum (0 bytes used to warn and raise under strict_budget, and both had
    ``meets_budget()`` False while the summary left out "-- over budget")."""
    model, x = meta_gpt(layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = compile_offload.explain(model, x, memory_budget=zero, device_profile="h100")
        compile_offload.explain(model, x, memory_budget=zero, device_profile="h100", strict_budget=True)
    assert plan.budget_bytes == 0 and plan.meets_budget()
    assert "budget 0 (the minimum-memory plan)" in plan.summary() and "over budget" not in plan.summary()
    assert plan.predicted_peak_bytes == plan.min_peak_bytes < plan.baseline_peak_bytes


def test_explain_plans_a_model_built_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        x = torch.randn(32, 64, requires_grad=True)
    plan = compile_offload.explain(model, x, device_profile="h100")
    assert plan.feasible and plan.decisions
    assert {d.name: d.shape for d in plan.decisions}.get("addmm") == (32, 256)  # the first layer's output


@pytest.mark.parametrize("made", ["meta", "inference_mode"])
def test_a_size_named_with_hint_override_is_planned_on_meta_and_inference_inputs(made):
    """fuzz34a F1: explain copies a meta input to the CPU, and an inference tensor to a normal
    one, and the copies lost Dynamo's marks: a batch of 8 marked hint_override=64 was planned
    at 8 (a plan 7.7x smaller than at the size named), where a CPU input is planned at 64."""
    def planned(device, batch, hint=None):
        torch.manual_seed(0)
        with torch.device(device):
            model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        if device == "meta" or made == "meta":
            x = torch.randn(batch, 16, 32, device=device)
        else:
            with torch.inference_mode():
                x = torch.randn(batch, 16, 32)
        if hint is not None:
            torch._dynamo.mark_dynamic(x, 0, hint_override=hint)
        plan = compile_offload.explain(model, x, memory_budget="2MiB", device_profile="h100", inner_compiler="eager")
        return plan.baseline_peak_bytes, plan.decisions[0].shape

    device = "meta" if made == "meta" else "cpu"
    assert planned(device, 8, hint=64) == planned("cpu", 64) != planned("cpu", 8)


def test_a_per_segment_plan_lists_what_the_forward_saves(tmp_path):
    """fuzz34e F2/F6: a plan from per-segment checkpointing listed the model's output as a
    kept saved tensor (its last cut), which the forward does not save, and under dynamic
    shapes plan.saved listed size expressions. The plan's saved tensors are now the ones the
    forward returns after the model's output."""
    import re

    from tests.models import TransformerBlock

    torch.manual_seed(0)
    model = nn.Sequential(*[TransformerBlock(d_model=64, n_heads=4, d_ff=256, dropout=0.0) for _ in range(3)])
    x = torch.randn(4, 32, 64)
    torch._dynamo.mark_dynamic(x, 0)
    plan = compile_offload.explain(model, x, memory_budget=0.0, inner_compiler="eager", dump_dir=str(tmp_path))
    assert any(note.startswith("from per-segment checkpointing") for note in plan.notes), plan.notes
    (forward,) = tmp_path.rglob("forward.py")
    text = forward.read_text()
    returned = re.findall(r"\w+", text[text.rindex("return"):])[1:]
    saved_by_forward = [name for name in returned[1:] if not name.startswith(("primals", "sym_size", "mul"))]
    assert [name for name in plan.saved if not name.startswith("primals")] == saved_by_forward, (plan.saved, returned)


def test_explain_a_plain_function_on_cpu_tensors():
    w = torch.randn(32, 32, requires_grad=True)

    def step(x):
        return torch.tanh(x @ w).sum()

    plan = compile_offload.explain(step, torch.randn(8, 32), device_profile="cpu")
    assert plan.predicted_peak_bytes > 0 and plan.baseline_step_seconds > 0


def test_explain_without_gradients_says_so():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="require grad"):
        compile_offload.explain(model, torch.randn(2, 4), device_profile="cpu")


def test_repeated_explain_keeps_planning(recwarn):
    """Each call plans afresh: past Dynamo's recompile limit a shared cache would make it
    fall back to running the model eagerly."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    limit = torch._dynamo.config.recompile_limit
    plans = [compile_offload.explain(model, x, memory_budget=b, device_profile="cpu")
             for b in [0.9, 0.5, 0.1] * (limit // 3 + 2)]
    assert len(plans) > limit and all(p.decisions for p in plans)
    assert not [w for w in recwarn if "recompile_limit" in str(w.message)]


def test_explain_a_train_mode_dropout_model_plans_like_the_backend(captured_plans):
    """The compiled forward creates the dropout mask with ``aten.rand(..., device=cpu)``;
    explain ran the forward on meta tensors, so the mask met them and raised. The plan must
    be the one the backend makes when it compiles the same model for training."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 4)).train()
    x = torch.randn(4, 8)
    plan = compile_offload.explain(model, x, memory_budget=0.0, device_profile="cpu", offload=False)
    assert plan.decisions
    assert not [d for d in plan.decisions if d.decision == "recompute" and d.dtype == "bool"], \
        "the dropout mask comes from a random op and must never be recomputed"
    compiled = torch.compile(model, backend=compile_offload.offload_remat(
        memory_budget=0.0, device_profile="cpu", offload=False, inner_compiler="eager"))
    compiled(x).sum().backward()
    assert [(d.name, d.decision) for d in captured_plans[-1].decisions] == \
        [(d.name, d.decision) for d in plan.decisions]


def test_plan_time_limit_returns_the_best_plan_found_with_one_warning():
    model, x = meta_gpt(layers=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        limited = compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100", plan_time_limit=0)
    limit_warnings = [w for w in caught if "planning reached plan_time_limit" in str(w.message)]
    assert len(limit_warnings) == 1, [str(w.message) for w in caught]
    assert any("plan_time_limit" in note for note in limited.notes)
    complete = compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100")
    assert not any("plan_time_limit" in note for note in complete.notes)
    # Chosen among fewer plans: never better than the complete search.
    if limited.feasible:
        assert limited.predicted_peak_bytes <= limited.budget_bytes
        assert complete.feasible and limited.predicted_step_seconds >= complete.predicted_step_seconds
    else:
        assert limited.predicted_peak_bytes >= complete.min_peak_bytes


def test_a_search_stopped_by_plan_time_limit_does_not_claim_the_budget_is_below_the_minimum():
    """The complete search fits 0.5; stopped after one plan (0.1 ms cannot cover the graph's
    analysis), the plan's lowest peak used to be reported as the planner's minimum: 'minimum'
    in the summary, a 'below the minimum this planner can reach' warning and, under
    strict_budget, a BudgetError saying so; and the limit read 'plan_time_limit=0 s'."""
    model, x = meta_gpt(layers=2)
    complete = compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100")
    assert complete.feasible and not complete.time_limit_reached
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        limited = compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100", plan_time_limit=1e-4)
    said = [str(w.message) for w in caught if "compile_offload" in str(w.message)]
    assert not limited.feasible and limited.time_limit_reached
    assert not any("below the minimum" in text for text in said), said
    assert any("plan_time_limit=0.0001 s after 1 candidate plans" in text for text in said), said
    stopped = "plan_time_limit stopped the search before it found a plan within the memory budget"
    assert any(stopped in text for text in said), said
    assert f"lowest found {format_bytes(limited.min_peak_bytes)} before plan_time_limit" in limited.summary()
    assert "minimum" not in limited.summary()
    with pytest.raises(BudgetError, match="strict_budget=True") as info:
        compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100", plan_time_limit=1e-4,
                                strict_budget=True)
    assert stopped in str(info.value) and "below the minimum" not in str(info.value)


def test_the_summary_says_minimum_only_where_the_search_reached_it():
    """``min_peak_bytes`` is the lowest peak the search simulated: the summary called it the
    'minimum' whatever the budget, so with no budget it read 'minimum' = the unconstrained
    peak, and under a budget that fitted on the way a figure above the minimum-memory plan's."""
    model, x = meta_gpt(layers=2)
    summaries = {budget: compile_offload.explain(model, x, memory_budget=budget, device_profile="h100")
                 for budget in (None, 0.6, 0.0)}
    least = summaries[0.0]
    assert f"minimum {format_bytes(least.min_peak_bytes)}" in least.summary()
    assert "minimum" not in summaries[None].summary() and "lowest" not in summaries[None].summary()
    fitted = summaries[0.6]
    assert fitted.feasible and fitted.min_peak_bytes >= least.min_peak_bytes
    assert f"lowest simulated {format_bytes(fitted.min_peak_bytes)}" in fitted.summary()
    assert "minimum" not in fitted.summary()


def test_plan_solver_says_greedy_where_the_exact_solver_refused_the_graph():
    model, x = meta_gpt(layers=1)
    with pytest.warns(UserWarning, match="using the greedy solver"):
        fell_back = compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100", solver="exact",
                                            exact_max_candidates=1)
    greedy = compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100")
    assert fell_back.solver == "greedy" and fell_back.decisions == greedy.decisions


def test_where_the_greedy_finds_a_better_plan_the_exact_solver_keeps_it():
    """The exact search tries subsets of the storages the greedy's recompute moves reach, not
    its per-segment checkpointing: on two residual blocks at budget 0.5 it kept a plan at
    1.03 MiB over the 800 KiB budget, which the greedy meets."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

        def forward(self, x):
            return torch.tanh(x + self.b(torch.nn.functional.gelu(self.a(x))) * 0.5)

    torch.manual_seed(0)
    model, x = nn.Sequential(Block(), Block()), torch.randn(8, 64, 64)
    greedy = compile_offload.explain(model, x, memory_budget=0.5)
    exact = compile_offload.explain(model, x, memory_budget=0.5, solver="exact")
    assert greedy.meets_budget() and exact.meets_budget(), (greedy.summary(), exact.summary())
    assert exact.predicted_step_seconds <= greedy.predicted_step_seconds * (1 + 1e-9)
    assert exact.min_peak_bytes <= greedy.min_peak_bytes
    if exact.solver == "greedy":
        assert any("the greedy solver's plan was better" in note for note in exact.notes), exact.notes


def _plan_facts(plan):
    """What a plan decides and predicts (not how long solving took, nor the graph's name,
    which differs between Dynamo's compile ids and explain's count)."""
    return {
        "decisions": [(d.name, d.decision, d.bytes) for d in plan.decisions],
        "saved": plan.saved, "offloaded": plan.offloaded, "feasible": plan.feasible,
        "budget": plan.budget_bytes, "predicted_peak": plan.predicted_peak_bytes,
        "predicted_seconds": plan.predicted_step_seconds, "baseline_peak": plan.baseline_peak_bytes,
        "min_peak": plan.min_peak_bytes, "timeline": plan.timeline_bytes,
        "planned_budget": plan.planned_budget_bytes, "scheduled_peak": plan.scheduled_peak_bytes,
    }


def _kept_plans(captured):
    """The plan the backend kept for each graph it planned (``captured``: every plan made,
    re-plans of the budget loop included), in order."""
    from compile_offload.reporting import logs

    latest = {plan.graph_name: plan for plan in logs.latest_plans()}
    names = list(dict.fromkeys(plan.graph_name for plan in captured))
    return [latest[name] for name in names]


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.5, 0.0])
@pytest.mark.parametrize("family", ["mlp", "transformer", "convbn"])
def test_explain_plans_exactly_what_the_inductor_backend_plans(family, budget, captured_plans):
    """explain goes through the backend's pipeline (Inductor's pre-grad and joint-graph
    passes, then our partitioner): the same decisions and predictions as a real compile."""
    from . import models

    make = {"mlp": (models.MLP, models.mlp_inputs), "transformer": (models.TransformerBlock, models.sequence_inputs),
            "convbn": (models.ConvBN, models.image_inputs)}[family]
    torch.manual_seed(0)
    model, inputs = make[0]().train(), make[1]()
    options = {"memory_budget": budget, "device_profile": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a budget below the minimum warns in both
        explained = compile_offload.explain_all(model, *inputs, **options)
        captured_plans.clear()
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(model, backend=compile_offload.offload_remat(inner_compiler="inductor", **options))
            compiled(*inputs).sum().backward()
    kept = _kept_plans(captured_plans)
    assert kept and len(kept) == len(explained)
    for compiled_plan, explained_plan in zip(kept, explained):
        assert _plan_facts(explained_plan) == _plan_facts(compiled_plan)


@pytest.mark.parametrize("options", [{}, {"memory_budget": 0.5}, {"debug_force_offload": True}])
def test_explain_with_the_eager_inner_compiler_plans_the_graph_the_eager_backend_runs(options, captured_plans):
    """fuzz34e F4: with inner_compiler="eager", explain planned the joint graph after Inductor's
    joint-graph passes (an attention block's q/k/v views instead of its softmax), which the
    eager backend never runs: other rows, peaks and decisions than the compiled step's."""
    from . import models

    torch.manual_seed(0)
    model, inputs = models.TransformerBlock().train(), models.sequence_inputs()
    options = {"inner_compiler": "eager", "device_profile": "cpu", **options}
    explained = compile_offload.explain(model, *inputs, **options)
    captured_plans.clear()
    torch._dynamo.reset()
    torch.compile(model, backend=compile_offload.offload_remat(**options))(*inputs).sum().backward()
    (compiled_plan,) = captured_plans
    assert _plan_facts(explained) == _plan_facts(compiled_plan)


@pytest.mark.inductor
@pytest.mark.slow
def test_explain_keeps_the_plan_the_backend_re_plans(captured_plans):
    """Where the first plan's scheduled peak exceeds the budget (forced: every first plan's
    scheduled peak is raised over it), the backend re-plans; explain on CPU tensors lowers
    the graph as the backend does and keeps the same re-planned plan."""
    from compile_offload.inductor import kernels as inductor_kernels
    from compile_offload.inductor import scheduled_peak

    from .test_budget_loop import _deep_mlp, _inflating

    if not inductor_kernels.available():
        pytest.skip("this torch has no post-fusion scheduler hook")
    options = {"memory_budget": 0.8, "device_profile": "cpu"}
    x = torch.randn(512, 256)

    def forced():
        return _inflating([64 * 1024])[0]  # the first plan's scheduled peak 64 KiB over the budget

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch.setattr(scheduled_peak, "note_scheduled_peak", forced())
        explained = compile_offload.explain(_deep_mlp(), x, **options)
        patch.setattr(scheduled_peak, "note_scheduled_peak", forced())
        captured_plans.clear()
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            model = _deep_mlp()
            compiled = torch.compile(model, backend=compile_offload.offload_remat(inner_compiler="inductor",
                                                                                 **options))
            compiled(x).sum().backward()
    (kept,) = _kept_plans(captured_plans)
    assert len(captured_plans) >= 2 and kept.planned_budget_bytes is not None
    assert explained.planned_budget_bytes is not None
    assert _plan_facts(explained) == _plan_facts(kept)


def test_a_function_over_meta_modules_is_planned_as_the_module_is():
    """A function (a lambda, a closure, a bound method, a partial; also through a list, tuple or
    dict) calling modules on meta: their parameters get CPU stand-ins as a module passed itself
    does (they met CPU inputs on meta weights: a device mismatch), and the plan is the module's
    own."""
    import functools

    from compile_offload.tools.explain import positional_call

    model, x = meta_gpt(layers=1, width=64, heads=2, seq=64, batch=2)

    def closing_over(model):
        return lambda t: model(t)

    def call(module, t):
        return module(t)

    class Holding:
        def __init__(self, module):
            self.module = module

        def __call__(self, t):
            return self.module(t)

    def in_list(model):
        held = [model]
        return lambda t: held[0](t)

    class HoldingBlocks:
        def __init__(self, module):
            self.blocks = {"blocks": (module,)}

        def __call__(self, t):
            return self.blocks["blocks"][0](t)

    expected = compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100").summary()
    for fn in (lambda t: model(t), closing_over(model), model.forward, functools.partial(call, model),
               functools.partial(model), Holding(model), in_list(model), HoldingBlocks(model),
               functools.partial(lambda held, t: held["m"](t), {"m": model})):
        torch._dynamo.reset()
        plan = compile_offload.explain(fn, x, memory_budget=0.5, device_profile="h100")
        assert plan.summary() == expected
    # keyword inputs (the command line's and max_batch's dict inputs) reach the function too
    fn, inputs = positional_call(lambda t: model(t), {"t": x})
    torch._dynamo.reset()
    assert compile_offload.explain(fn, *inputs, memory_budget=0.5, device_profile="h100").summary() == expected
    assert all(p.device.type == "meta" for p in model.parameters())


def test_containers_a_function_holds_are_read_without_running_their_own_methods():
    """Containers among a function's names are read through the built-in types' own methods:
    a subclass's ``values`` or ``__iter__`` (a lazy mapping importing what it maps, an iterator
    that never ends) does not run."""
    from compile_offload.tools.explain import _modules_named_by

    class Lazy(dict):
        def values(self):
            raise RuntimeError("imported everything")

    class Endless(list):
        def __iter__(self):
            while True:
                yield None

    layer = nn.Linear(2, 2)
    held = (Lazy(m=layer), Endless([layer, nn.ReLU()]), [object()] * 50_000)
    named = _modules_named_by(lambda t: held[1][0](held[0]["m"](t)))
    assert named is not None and [type(m) for m in named.named] == [nn.Linear, nn.ReLU]


def test_explain_on_meta_says_the_scheduled_peak_was_not_checked():
    model, x = meta_gpt(layers=1, width=64, heads=2, seq=64, batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        budgeted = compile_offload.explain(model, x, memory_budget=0.6, device_profile="h100")
        unbudgeted = compile_offload.explain(model, x, memory_budget=None, device_profile="h100")
    assert any(n.startswith("scheduled peak not checked") and "meta" in n for n in budgeted.notes)
    assert budgeted.scheduled_peak_bytes is None and budgeted.planned_budget_bytes is None
    assert not any(n.startswith("scheduled peak not checked") for n in unbudgeted.notes)


def test_a_gpu_profile_on_cpu_tensors_is_not_checked_against_cpu_code(monkeypatch):
    """Planning for a GPU on this machine's tensors: Inductor's CPU code says nothing about
    the GPU's, so explain does not lower it (nor run the generated forward), and says so."""
    import importlib

    explain_module = importlib.import_module("compile_offload.tools.explain")  # the module, not the function
    monkeypatch.setattr(explain_module, "compile_with_the_budget_loop",
                        lambda *args, **kwargs: pytest.fail("lowered CPU code for a GPU plan"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile_offload.explain(model, x, memory_budget=0.6, device_profile="h100")
    assert any(n.startswith("scheduled peak not checked") and "'h100' GPU profile" in n for n in plan.notes)
    assert plan.scheduled_peak_bytes is None


def test_a_gpu_profile_on_host_tensors_groups_kernels_as_the_gpu_would(monkeypatch):
    """The memory model's kernels are the GPU's (Triton's rules) when explain plans for a GPU
    profile on host tensors, and the graph's own device decides otherwise (the CPU profile
    here; a real compile, whose C++ kernels are what runs)."""
    import importlib

    planning = importlib.import_module("compile_offload.pipeline.planning")
    analyze_joint = planning.analyze_joint
    asked: list = []

    def recording(joint, rules, **kwargs):
        asked.append(rules.generator)
        return analyze_joint(joint, rules, **kwargs)

    monkeypatch.setattr(planning, "analyze_joint", recording)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for profile in ("h100", "cpu"):
            compile_offload.explain(model, x, memory_budget=0.6, device_profile=profile)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=compile_offload.offload_remat(
            memory_budget=0.6, device_profile="h100", inner_compiler="eager"))
        compiled(x).sum().backward()
    # None: Inductor's generator for the graph's device (the CPU explain's budget loop may
    # compile a second plan to compare, analysed alike)
    assert asked[0] == "triton" and asked[-1] == "python" and set(asked[1:-1]) == {None}


def test_solver_refined_refines_the_greedy_plan_and_says_so(tmp_path, request):
    """solver="refined" refines the greedy's plan (passes/solve/refine.py): the Plan carries the
    refined decisions, a note with the undo steps, and the plan cache stores it; a
    planning time limit that has passed skips refinement; the default greedy solver
    does not refine."""
    model, x = meta_gpt(layers=1, width=768, heads=12, seq=1024, batch=8)
    # Without in-place reuse into saved tensors: with it (Inductor's default, counted by the
    # simulator since 2026-11-25) this block's unconstrained prediction falls from 256.94 to
    # 208.94 MiB, within 4% of its minimum, and no fractional budget leaves the greedy
    # anything to refine. The CPU profile: under a GPU profile the memory model groups this
    # block's kernels as Triton does (explain on host tensors, since 2026-11-26), and there
    # the greedy leaves nothing to refine at any of these budgets.
    reuse_off = torch._inductor.config.patch(inplace_buffers=False)
    reuse_off.__enter__()
    request.addfinalizer(lambda: reuse_off.__exit__(None, None, None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a budget below the minimum warns
        plans = {b: compile_offload.explain(model, x, memory_budget=b, device_profile="cpu", offload=False,
                                            solver="refined")
                 for b in (0.8, 0.6, 0.4, 0.2)}
    refined = {b: p for b, p in plans.items() if any(n.startswith("refined: ") for n in p.notes)}
    assert refined, "no budget was refined: this model no longer tests refinement"
    budget, plan = next(iter(refined.items()))
    assert plan.feasible and plan.predicted_peak_bytes <= plan.budget_bytes
    assert "undo step" in next(n for n in plan.notes if n.startswith("refined: "))
    peaks = [plans[b].predicted_peak_bytes for b in sorted(plans)]
    assert peaks == sorted(peaks)  # still monotone in the budget

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        greedy = compile_offload.explain(model, x, memory_budget=budget, device_profile="cpu", offload=False)
    assert not any(n.startswith("refined: ") for n in greedy.notes)
    assert greedy.predicted_step_seconds > plan.predicted_step_seconds

    options = {"memory_budget": budget, "device_profile": "cpu", "offload": False, "plan_cache_dir": str(tmp_path),
               "solver": "refined"}
    first = compile_offload.explain(model, x, **options)
    reused = compile_offload.explain(model, x, **options)
    assert "reused from the plan cache" in reused.notes
    for cached in (first, reused):
        assert (cached.saved, cached.offloaded) == (plan.saved, plan.offloaded)
        assert cached.predicted_step_seconds == pytest.approx(plan.predicted_step_seconds)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the time limit warns
        limited = compile_offload.explain(model, x, memory_budget=budget, device_profile="cpu", offload=False,
                                          plan_time_limit=0, solver="refined")
    assert not any(n.startswith("refined: ") for n in limited.notes)


@pytest.mark.inductor
@pytest.mark.slow
def test_explain_that_runs_the_generated_forward_leaves_the_model_as_it_was():
    """With a budget on real CPU tensors explain runs the generated forward once (the
    backend's Inductor path): a BatchNorm's running statistics and the random state are
    left as they were."""
    from . import models

    torch.manual_seed(0)
    model, inputs = models.ConvBN().train(), models.image_inputs()
    before = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile_offload.explain(model, *inputs, memory_budget=0.5, device_profile="cpu")
    assert plan.decisions and not any(n.startswith("scheduled peak not checked") for n in plan.notes)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
    assert torch.equal(torch.random.get_rng_state(), rng)


class _RecurrentHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.gru(x)[0]).pow(2).mean()


def test_explain_says_where_recurrent_modules_run_eagerly_outside_the_budget():
    """Dynamo runs ``nn.GRU`` eagerly unless ``allow_rnn`` (here the whole forward that calls
    it): its activations are in no graph and no plan covers them, which the backend cannot
    see (docs/budget.md, "Graph breaks: one budget per graph"). explain sees the model and says why it found no
    graph to plan; traced (``allow_rnn = True``) the GRU is planned, and nothing is said."""
    model, x = _RecurrentHead(), torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match=r"no training graph was produced; gru \(GRU\) run eagerly outside"):
        compile_offload.explain_all(model, x, memory_budget=0.5, device_profile="h100")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=True), warnings.catch_warnings(record=True) as traced:
        warnings.simplefilter("always")
        plans = compile_offload.explain_all(model, x, memory_budget=0.5, device_profile="h100")
    assert plans and not [w for w in traced if "run eagerly" in str(w.message)]
    assert not any("allow_rnn" in note for plan in plans for note in plan.notes)


def test_a_busy_host_link_makes_the_plan_offload_less():
    """``shared_h2d_bytes``: with the link held at each backward's start by another user's
    copy (FSDP2's parameter uploads), a reload can no longer hide behind the backward's first
    kernels. With a gigabyte ahead of them the planner recomputes instead; the plan is no
    faster and no larger for it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                                      torch.nn.Linear(2048, 512)) for _ in range(4)])
    x = torch.randn(8192, 512)
    free, busy = (compile_offload.explain(model, x, memory_budget=0.4, device_profile="h100", shared_h2d_bytes=shared)
                  for shared in (0, "1GiB"))
    assert free.count("offload") > 0 and busy.count("offload") < free.count("offload")
    assert busy.predicted_step_seconds >= free.predicted_step_seconds
    assert busy.feasible and busy.predicted_peak_bytes <= busy.budget_bytes


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_explain_plans_a_training_step_from_an_eval_loop_too(grad_mode):
    """Called under no_grad or inference_mode (an eval loop), explain still plans the training
    step: it said the parameters must require grad, which they did."""
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(32, 16)
    expected = compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100")
    with grad_mode():
        plan = compile_offload.explain(model, x, memory_budget=0.5, device_profile="h100")
        assert not torch.is_grad_enabled()  # the caller's mode is left as it was
        made_here = torch.randn(32, 16)  # an inference tensor under inference_mode: not for autograd as it is
        on_this_machine = compile_offload.explain(model, made_here, memory_budget=0.5)  # compiled for real
    assert on_this_machine.decisions
    assert plan.decisions and [(d.name, d.decision) for d in plan.decisions] == \
        [(d.name, d.decision) for d in expected.decisions]


def test_a_meta_module_explain_cannot_find_is_named_not_a_device_mismatch():
    """Three levels deep the module stays on meta while the inputs are stood in for:
    Dynamo's 'found at least two devices, cpu and meta' told the user to move tensors they
    had all put on meta."""
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        x = torch.randn(8, 16)
    holder = {"a": {"b": {"c": mlp}}}

    def deep(t):
        return holder["a"]["b"]["c"](t).sum()

    with pytest.raises(ValueError, match=r"the function used a module or tensor on meta that explain could not find"):
        compile_offload.explain(deep, x, memory_budget=0.5)
    weight = torch.randn(16, 64, device="meta", requires_grad=True)  # a plain tensor, not a module
    with pytest.raises(ValueError, match=r"or pass a meta tensor as an input"):
        compile_offload.explain(lambda t: (t @ weight).relu().sum(), x, memory_budget=0.5)


def test_a_forced_offload_is_in_the_plans_offloaded_as_in_its_decisions():
    # fuzz25b: the decisions said offload while Plan.offloaded stayed empty
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 32))
    plan = compile_offload.explain(model, torch.randn(128, 32, requires_grad=True), memory_budget=0.5,
                                   inner_compiler="eager", device_profile="h100", debug_force_offload=True)
    offloaded = {d.name for d in plan.decisions if d.decision == "offload"}
    assert offloaded and set(plan.offloaded) == offloaded
    assert all(distance >= 0 for distance in plan.offloaded.values())
