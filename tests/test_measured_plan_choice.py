"""``config.measured_plan_choice``: candidate plans that fit the budget in Inductor's code run
the first training steps in turn, and the fastest whose measured peak fits runs from then on.

The choice itself (``plan_trials.choose``), the ranks' agreement on it and the schedule are
checked on stand-in compiled graphs; one Inductor model checks the whole path: every trial
step's gradients equal eager's, the choice becomes the graph's plan, and the plan cache
gives it to the next compile without trials. (Ranks choosing alike on real process groups:
tests/test_distributed.py.)
"""

from __future__ import annotations

import copy
import json
import logging
import warnings

import pytest
import torch
from torch import nn

from compile_offload.passes.plan import Plan
from compile_offload.reporting import logs
from compile_offload.runtime.plan_trials import PlanTrials, Trial, agree_across_ranks, choose

from .models import CompiledFunction


def _plan() -> Plan:
    return Plan(feasible=True, budget_bytes=1000, predicted_peak_bytes=900, predicted_step_seconds=0.0,
                baseline_peak_bytes=1000, baseline_step_seconds=0.0, min_peak_bytes=500)


def _trial(name: str, seconds: list[float], peak: int | None) -> Trial:
    return Trial(name, compiled=None, plan=_plan(), seconds=list(seconds), peak_bytes=peak)


def test_the_fastest_candidate_whose_measured_peak_fits_is_chosen():
    trials = [_trial("planner", [3.0, 3.1, 2.9], 900), _trial("faster, over", [1.0, 1.0, 1.0], 1200),
              _trial("faster, fits", [2.0, 2.5, 2.1], 1005)]  # 1005: within the 1% the allocator may add
    assert choose(trials, 1000).name == "faster, fits"


def test_a_rival_faster_only_within_the_noise_leaves_the_planners_plan():
    planner = _trial("planner", [10.0, 10.4, 10.2], 900)
    assert choose([planner, _trial("rival", [9.9, 10.0, 9.8], 900)], 1000) is planner  # its steps overlap
    assert choose([planner, _trial("rival", [8.0, 8.1, 10.1], 900)], 1000) is planner  # faster median, one slow step
    assert choose([planner, _trial("rival", [9.0, 9.1, 9.05], 900)], 1000).name == "rival"  # every step faster
    steady = _trial("planner", [10.0, 10.0, 10.0], 900)
    assert choose([steady, _trial("rival", [9.95, 9.95], 900)], 1000) is steady  # under the 1% floor
    assert choose([steady, _trial("rival", [9.8, 9.8], 900)], 1000).name == "rival"


def test_where_the_planners_plan_measures_over_the_budget_the_fastest_fitting_rival_runs():
    trials = [_trial("planner", [1.0], 1100), _trial("slow", [3.0], 900), _trial("slower", [4.0], 800)]
    assert choose(trials, 1000).name == "slow"


def test_a_candidate_over_the_budget_is_never_chosen_while_one_fits():
    trials = [_trial("planner", [3.0], 990), _trial("fast, over", [0.1], 1011)]
    assert choose(trials, 1000).name == "planner"


def test_where_no_candidate_fits_the_lowest_measured_peak_runs():
    trials = [_trial("a", [1.0], 1500), _trial("b", [5.0], 1100), _trial("c", [0.5], None)]
    assert choose(trials, 1000).name == "b"


def test_equal_times_keep_the_planners_plan():
    trials = [_trial("planner", [2.0, 2.0], 800), _trial("other", [2.0, 2.0], 700)]
    assert choose(trials, 1000).name == "planner"


def test_ranks_agree_on_the_slowest_time_and_the_highest_peak():
    # Rank 0 finds "a" slow and "b" fast, rank 1 the reverse: alone they would choose differently.
    ranks = [[([4.0, 4.0], 800), ([1.0, 1.0], 900)], [([1.0, 1.0], 850), ([3.0, 3.0], 950)]]
    for mine in ranks:
        trials = [_trial("a", mine[0][0], mine[0][1]), _trial("b", mine[1][0], mine[1][1])]
        agree_across_ranks(trials, gather=lambda _: ranks)
        assert [t.seconds for t in trials] == [[4.0, 4.0], [3.0, 3.0]]
        assert [t.peak_bytes for t in trials] == [850, 950]
        assert choose(trials, 1000).name == "b"


def _stand_in(delay: float, calls: list[str], name: str):
    def compiled(x):
        calls.append(name)
        return CompiledFunction.apply(x, delay)

    return compiled


def test_trials_run_each_candidate_in_turn_then_only_the_chosen_one():
    calls: list[str] = []
    chosen: list[Trial] = []
    trials = [Trial("slow", _stand_in(0.02, calls, "slow"), _plan()),
              Trial("fast", _stand_in(0.0, calls, "fast"), _plan())]
    runner = PlanTrials(trials, budget_bytes=1 << 30, device=torch.device("cpu"), graph_name="g", steps=2,
                        on_chosen=lambda c, measured: chosen.append(c))
    x = torch.ones(8, requires_grad=True)
    steps = len(runner.schedule)
    assert steps == 2 * (1 + 1 + 2)  # per candidate: a warm-up, a peak step (CPU), two timed steps
    for _ in range(steps):
        x.grad = None
        runner(x).sum().backward()
        assert torch.equal(x.grad, torch.full((8,), 2.0))  # every trial step is a real step
    assert calls == ["slow", "fast"] * 4
    assert len(chosen) == 1 and chosen[0] is choose(trials, 1 << 30)  # as its measured steps say
    assert [len(t.seconds) for t in trials] == [2, 2] and all(t.peak_bytes is not None for t in trials)
    for _ in range(3):
        runner(x).sum().backward()
    assert calls[-3:] == [chosen[0].name] * 3 and len(chosen) == 1


def test_a_call_on_fake_tensors_is_not_a_step():
    """DDPOptimizer runs each compiled bucket graph on fake tensors while it compiles the
    next: such a call took the profile step's events to ``on_profiled``, whose collectives
    and compiles then ran inside a compile (on one rank alone, where only it compiled). It
    runs the planner's plan and leaves the trials as they were."""
    from compile_offload.torch_api.fake_tensors import FakeTensorMode

    calls: list[str] = []
    profiled: list = []
    trials = [Trial("a", _stand_in(0.0, calls, "a"), _plan()), Trial("b", _stand_in(0.0, calls, "b"), _plan())]
    runner = PlanTrials(trials, 1 << 30, torch.device("cpu"), "g", steps=1, on_chosen=lambda c, measured: None,
                        on_profiled=lambda events: profiled.append(events))
    x = torch.ones(4, requires_grad=True)
    for _ in range(3):  # two warm-ups, then the planner's plan profiled
        runner(x).sum().backward()
    with FakeTensorMode() as mode:
        fake = runner(mode.from_tensor(x))
    assert fake.shape == (4,) and profiled == [] and runner.position == 3 and calls == ["a", "b", "a", "a"]
    runner(x).sum().backward()
    assert profiled == [[]] and runner.position == 4 and calls[-1] == "a"


def test_other_code_called_in_a_step_the_trials_graph_ran_in_leaves_that_step_measured():
    """Another graph of the frame (a later layer of a model compiled per layer) runs through
    ``run_other`` in the same step as the trials' own graph: it dropped that graph's measured
    step and took the place unmeasured, so no step was ever measured. It just runs now."""
    calls: list[str] = []
    trials = [Trial("a", _stand_in(0.0, calls, "a"), _plan())]
    runner = PlanTrials(trials, 1 << 30, torch.device("cpu"), "g", steps=1, on_chosen=lambda c, measured: None)
    layer = _stand_in(0.0, calls, "layer 1")
    x = torch.ones(4, requires_grad=True)
    while runner.chosen is None:
        before = runner.position
        (runner(x) + runner.run_other(layer, (x,))).sum().backward()
        assert runner.position == before + 1
    assert len(trials[0].seconds) == 1 and trials[0].peak_bytes is not None
    assert calls == ["a", "layer 1"] * 3


def test_with_no_step_timed_on_every_rank_the_planners_plan_runs_unadopted(monkeypatch):
    """Another rank ran every timed place unmeasured (its code compiled again): the agreed
    times were empty for every candidate, and the choice fell to the lowest measured peak, a
    slower plan, which was adopted and stored as measured."""
    from compile_offload.runtime import plan_trials

    def two_ranks(obj):
        figures = isinstance(obj, list) and obj and isinstance(obj[0], tuple)
        return [obj, [([], None) for _ in obj]] if figures else [obj, obj]

    monkeypatch.setattr(plan_trials, "_process_group_gather", lambda: two_ranks)
    chosen: list[Trial] = []
    calls: list[str] = []
    trials = [Trial("fast", _stand_in(0.0, calls, "fast"), _plan()), Trial("slow", _stand_in(0.01, calls, "slow"), _plan())]
    runner = PlanTrials(trials, 1 << 30, torch.device("cpu"), "g", steps=1, on_chosen=lambda c, m: chosen.append(c))
    x = torch.ones(4, requires_grad=True)
    for _ in range(len(runner.schedule)):
        runner(x).sum().backward()
    assert runner.chosen is trials[0] and not chosen


def test_a_candidate_from_the_profile_step_joins_the_trials_after_its_warm_up():
    calls: list[str] = []
    chosen: list[Trial] = []
    profiled: list = []
    late = Trial("late", _stand_in(0.0, calls, "late"), _plan())

    def on_profiled(events):
        profiled.append(events)
        return late

    trials = [Trial("a", _stand_in(0.0, calls, "a"), _plan()), Trial("b", _stand_in(0.0, calls, "b"), _plan())]
    runner = PlanTrials(trials, 1 << 30, torch.device("cpu"), "g", steps=1,
                        on_chosen=lambda c, measured: chosen.append((c, list(measured))), on_profiled=on_profiled)
    x = torch.ones(4, requires_grad=True)
    for _ in range(3):  # two warm-ups, then the planner's plan profiled
        runner(x).sum().backward()
    assert calls == ["a", "b", "a"] and profiled == []
    while not chosen:
        x.grad = None
        runner(x).sum().backward()
        assert torch.equal(x.grad, torch.full((4,), 2.0))
    assert len(profiled) == 1 and profiled[0] == []  # a stand-in has no compiled graph's call
    # The late candidate's warm-up, then a peak and a timed step for each of the three.
    assert calls[3:] == ["late", "a", "b", "late", "a", "b", "late"]
    assert [len(t.seconds) for t in chosen[0][1]] == [1, 1, 1]


def test_with_no_rival_and_no_candidate_from_the_profile_the_planners_plan_runs_unmeasured():
    """... and is adopted as the choice (one candidate), so that the plan cache stores it and
    the next run tries nothing (it compiled and profiled everything again)."""
    calls: list[str] = []
    chosen: list = []
    runner = PlanTrials([Trial("a", _stand_in(0.0, calls, "a"), _plan())], 1 << 30, torch.device("cpu"), "g",
                        steps=2, on_chosen=lambda *args: chosen.append(args), on_profiled=lambda events: None)
    x = torch.ones(4, requires_grad=True)
    for _ in range(4):
        runner(x).sum().backward()
    assert calls == ["a"] * 4 and runner.chosen is runner.trials[0]
    assert chosen == [(runner.trials[0], runner.trials)]


def test_steps_without_a_backward_or_grad_are_not_counted():
    calls: list[str] = []
    trials = [Trial("a", _stand_in(0.0, calls, "a"), _plan()), Trial("b", _stand_in(0.0, calls, "b"), _plan())]
    runner = PlanTrials(trials, 1 << 30, torch.device("cpu"), "g", steps=1, on_chosen=lambda *_: None)
    x = torch.ones(4, requires_grad=True)
    with torch.no_grad():
        runner(x)
    runner(x)  # an evaluation with grad on: its backward never runs
    assert runner.position == 0 and calls == ["a", "a"]
    runner(x).sum().backward()
    assert runner.position == 1


def test_a_step_overtaken_by_the_next_forward_is_not_counted_when_its_backward_runs():
    calls: list[str] = []
    trials = [Trial("a", _stand_in(0.0, calls, "a"), _plan()), Trial("b", _stand_in(0.0, calls, "b"), _plan())]
    runner = PlanTrials(trials, 1 << 30, torch.device("cpu"), "g", steps=1, on_chosen=lambda *_: None)
    x = torch.ones(4, requires_grad=True)
    first = runner(x)
    second = runner(x)  # two micro-batches, one backward
    (first.sum() + second.sum()).backward()
    assert runner.position == 1 and calls == ["a", "a"]  # only the second step counted


def test_a_user_profiler_step_runs_the_planners_plan_unmeasured():
    calls: list[str] = []
    trials = [Trial("a", _stand_in(0.0, calls, "a"), _plan()), Trial("b", _stand_in(0.0, calls, "b"), _plan())]
    runner = PlanTrials(trials, 1 << 30, torch.device("cpu"), "g", steps=1, on_chosen=lambda *_: None)
    x = torch.ones(4, requires_grad=True)
    with torch.profiler.profile() as prof:
        runner(x).sum().backward()
    assert runner.position == 0 and calls == ["a"]
    assert prof.key_averages() is not None  # the user's profiler kept its session


def test_under_a_process_group_a_step_under_the_users_profiler_keeps_its_place_in_the_schedule(monkeypatch):
    """One rank profiled by its user (steps 1-3) must reach the collectives that agree on the
    figures at the same step as the others: its profiled steps pass their place in the
    schedule unmeasured (skipped, that rank fell three steps behind, and the two ranks'
    all_gather_object and DDP's all-reduces crossed: a deadlock). The profile step it missed
    hands None to ``on_profiled``, which agrees on None with the ranks."""
    from compile_offload.runtime import plan_trials

    gathered: list = []
    monkeypatch.setattr(plan_trials, "_process_group_gather",
                        lambda: lambda obj: gathered.append(obj) or [obj, obj])  # two ranks, alike
    calls: list[str] = []
    chosen: list[Trial] = []
    profiled: list = []
    trials = [Trial("a", _stand_in(0.0, calls, "a"), _plan()), Trial("b", _stand_in(0.0, calls, "b"), _plan())]
    runner = PlanTrials(trials, 1 << 30, torch.device("cpu"), "g", steps=1,
                        on_chosen=lambda c, measured: chosen.append(c), on_profiled=lambda c: profiled.append(c))
    x = torch.ones(4, requires_grad=True)
    steps = len(runner.schedule)  # 2 warm-ups, the profile, 2 peaks, 2 timed
    for step in range(steps):
        if 1 <= step <= 3:  # the warm-up of b, the profile and a's peak step, under the user's profiler
            with torch.profiler.profile():
                runner(x).sum().backward()
        else:
            runner(x).sum().backward()
        assert runner.position == min(step + 1, steps) or chosen
    assert profiled == [None]  # the profile step was missed: on_profiled hears of it, with nothing
    assert len(chosen) == 1 and gathered  # the choice was made after as many steps as the other ranks'
    assert calls[1:4] == ["a", "a", "a"]  # the profiled steps ran the planner's plan
    assert trials[0].peak_bytes is None and trials[1].peak_bytes is not None


def test_a_candidate_joins_only_where_every_rank_has_it():
    from compile_offload.runtime.plan_trials import agree_all

    assert agree_all(True, gather=lambda flag: [flag, True]) and not agree_all(True, gather=lambda flag: [flag, False])
    assert agree_all(True) and not agree_all(False)  # one process: its own


def test_ranks_keep_the_rivals_every_rank_kept_in_their_order():
    from compile_offload.runtime.plan_trials import agree_on_names

    mine = ["the planner's plan", "planned under 2 MiB", "planned under 1 MiB", "offload off"]
    other = ["the planner's plan", "planned under 1 MiB", "offload off"]
    assert agree_on_names(mine, gather=lambda names: [names, other]) == other
    assert agree_on_names(mine) == mine  # one process: its own


def _trials_began(text: str) -> bool:
    """Whether the log says a graph's trials begin (several candidates, or the planner's plan
    alone with its profile step)."""
    return ("candidate plans compiled" in text
            or "no other plan fits the budget in Inductor's code (" in text and "profiles the planner's plan" in text)


def _trained_under_measured_choice(model, x, steps: int, caplog) -> str:
    """The compile_offload log of ``steps`` training steps of ``model`` compiled at budget
    0.5 with measured plan choice (gradients checked against eager)."""
    import compile_offload

    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        compiled = torch.compile(model, backend=compile_offload.offload_remat(
            memory_budget=0.5, measured_plan_choice=True, measured_plan_steps=1))
        _train(compiled, eager, x, steps=steps)
    return caplog.text


@pytest.mark.inductor
@pytest.mark.slow
def test_under_a_process_group_a_rival_another_rank_dropped_is_not_run(monkeypatch, caplog):
    """The rivals were kept or dropped by each rank's own scheduled peak: a rank keeping one
    more ran more trial steps than the others, and their collectives crossed. Here the other
    rank kept none: only the planner's plan (and its profile step) runs."""
    from compile_offload.pipeline import plan_choice
    from compile_offload.runtime import plan_trials

    def two_ranks(obj):
        if isinstance(obj, list) and all(isinstance(name, str) for name in obj):
            return [obj, ["the planner's plan", plan_choice.PROFILE_STEP]]  # the other rank dropped every rival
        return [obj, obj]

    monkeypatch.setattr(plan_trials, "_process_group_gather", lambda: two_ranks)
    torch.manual_seed(0)
    said = _trained_under_measured_choice(_Residual(), torch.randn(1024, 64), 1, caplog)
    assert "dropped, not kept on every rank" in said and "no other plan fits the budget in Inductor's code" in said, said


@pytest.mark.inductor
@pytest.mark.slow
def test_under_a_process_group_trials_run_only_where_every_rank_would_run_them(monkeypatch, caplog):
    """Whether a graph tries candidates was each rank's own answer: a plan served from one
    rank's plan cache with its measured choice tries nothing there, and the other ranks'
    trials waited at their first agreement for it. Here the other rank would not try them."""
    from compile_offload.runtime import plan_trials

    monkeypatch.setattr(plan_trials, "_process_group_gather",
                        lambda: lambda obj: [obj, False] if isinstance(obj, bool) else [obj, obj])
    torch.manual_seed(0)
    said = _trained_under_measured_choice(_Residual(d=32, n=2), torch.randn(512, 32), 2, caplog)
    assert "on another rank its plan tries no candidates" in said, said
    assert not _trials_began(said)


@pytest.mark.inductor
@pytest.mark.slow
def test_under_a_process_group_a_frames_recompile_runs_no_trials(monkeypatch, caplog):
    """A recompile may happen on one rank alone (an uneven last batch fails a guard there):
    its trials' collectives waited for ranks that never joined, and that rank hung. Under a
    process group only a frame's first compile tries candidates; alone, a recompile does too."""
    import compile_offload
    from compile_offload.pipeline import plan_choice

    def run(ranks: int, evaluate_first: bool = False) -> list[str]:
        monkeypatch.setattr(plan_choice, "process_group_ranks", lambda: ranks)
        torch.manual_seed(0)
        model = _Residual(d=32, n=2)
        eager = copy.deepcopy(model)
        torch._dynamo.reset()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="compile_offload"):
            compiled = torch.compile(model, backend=compile_offload.offload_remat(
                memory_budget=0.5, measured_plan_choice=True, measured_plan_steps=1), dynamic=False)
            if evaluate_first:  # one rank's evaluation before training: a compile that tries nothing
                with torch.no_grad():
                    compiled(torch.randn(512, 32))
            _train(compiled, eager, torch.randn(512, 32), steps=1)
            _train(compiled, eager, torch.randn(384, 32), steps=1)  # the frame compiled again
        return [r.getMessage() for r in caplog.records if "measured plan choice" in r.getMessage()]

    alone = run(1)
    assert [m for m in alone if "graph_0_1" in m and _trials_began(m)], alone
    among = run(2)
    assert [m for m in among if "graph_0_0" in m and _trials_began(m)], among
    (off,) = [m for m in among if "graph_0_1" in m]
    assert "Dynamo compiled this frame again" in off
    # An evaluation under no_grad first (on one rank, say): the training compile is the frame's
    # second, and still the first to try candidates, as on the ranks that did not evaluate.
    evaluated = run(2, evaluate_first=True)
    assert [m for m in evaluated if "graph_0_1" in m and _trials_began(m)], evaluated
    (off,) = [m for m in evaluated if "graph_0_2" in m]
    assert "Dynamo compiled this frame again" in off


@pytest.mark.inductor
@pytest.mark.slow
def test_under_a_process_group_a_recompile_while_the_trials_run_keeps_their_schedule(monkeypatch):
    """One rank alone got a smaller batch while the trials ran: Dynamo compiled the frame again
    there, its steps ran the new code, and the trials' schedule stood still on that rank, which
    reached the collectives that agree on the figures steps after the other ranks: they waited
    until the process group's timeout. The new code's steps take the trials' places, unmeasured."""
    import compile_offload
    from compile_offload.pipeline import plan_choice
    from compile_offload.runtime import plan_trials

    monkeypatch.setattr(plan_choice, "process_group_ranks", lambda: 2)
    monkeypatch.setattr(plan_trials, "_process_group_gather", lambda: lambda obj: [obj, obj])
    torch.manual_seed(0)
    model = _Residual(d=32, n=2)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=compile_offload.offload_remat(
        memory_budget=0.5, measured_plan_choice=True, measured_plan_steps=1), dynamic=False)
    _train(compiled, eager, torch.randn(512, 32), steps=1)
    (running,) = plan_choice._running.values()
    assert running.position == 1 and running.chosen is None
    sizes = [384, 384, 512]  # compiled again at 384, as on this rank alone; then each size in turn
    for step in range(len(running.schedule) + 2):
        if running.chosen is not None:
            break
        before = running.position
        _train(compiled, eager, torch.randn(sizes[step % 3], 32), steps=1)
        # a step takes the schedule's next place (or, the profile step's place passed, ends
        # the trials where no candidate joins)
        assert running.position == before + 1 or running.chosen is not None, (step, before, running.schedule)
    assert running.chosen is not None and step > 1
    _train(compiled, eager, torch.randn(384, 32), steps=1)  # once chosen, the new code just runs


@pytest.mark.inductor
@pytest.mark.slow
def test_under_ddp_a_recompile_while_the_trials_run_keeps_every_bucket_graphs_schedule(monkeypatch, tmp_path):
    """The same under DDPOptimizer, whose compile makes a graph per bucket: each new bucket
    graph takes the places of the trials of the bucket graph it replaces. (The trials were
    forgotten at each bucket graph's compile but the last, and only that bucket's stayed in
    step.) One rank here, counted as two."""
    import torch.distributed as dist

    import compile_offload
    from compile_offload.pipeline import plan_choice
    from compile_offload.runtime import plan_trials

    monkeypatch.setattr(plan_choice, "process_group_ranks", lambda: 2)
    monkeypatch.setattr(plan_trials, "_process_group_gather", lambda: lambda obj: [obj, obj])
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = _Residual(d=32, n=3)
        eager = copy.deepcopy(model)
        block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        monkeypatch.setattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", block)  # a bucket graph per block
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=block / 2**20)
        torch._dynamo.reset()
        compiled = torch.compile(ddp, backend=compile_offload.offload_remat(
            memory_budget=0.5, measured_plan_choice=True, measured_plan_steps=1), dynamic=False)
        _train(compiled, eager, torch.randn(512, 32), steps=1)
        running = [trials for trials in plan_choice._running.values() if "bucket" in trials.graph_name]
        assert len(running) == 3 and [r.position for r in running] == [1, 1, 1], [r.graph_name for r in running]
        sizes = [384, 384, 512]  # compiled again at 384, as on this rank alone; then each size in turn
        for step in range(max(len(r.schedule) for r in running) + 2):
            if all(r.chosen is not None for r in running):
                break
            before = [r.position for r in running]
            _train(compiled, eager, torch.randn(sizes[step % 3], 32), steps=1)
            for trials, position in zip(running, before):
                assert trials.position == position + 1 or trials.chosen is not None, (step, trials.graph_name)
        assert all(r.chosen is not None for r in running) and step > 1
    finally:
        dist.destroy_process_group()


def test_under_a_process_group_trials_all_run_under_the_users_profiler_keep_the_planners_plan(monkeypatch):
    from compile_offload.runtime import plan_trials

    monkeypatch.setattr(plan_trials, "_process_group_gather", lambda: lambda obj: [obj, obj])
    chosen: list[Trial] = []
    calls: list[str] = []
    trials = [Trial("a", _stand_in(0.0, calls, "a"), _plan()), Trial("b", _stand_in(0.0, calls, "b"), _plan())]
    runner = PlanTrials(trials, 1 << 30, torch.device("cpu"), "g", steps=1, on_chosen=lambda c, m: chosen.append(c))
    x = torch.ones(4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught, torch.profiler.profile():
        warnings.simplefilter("always")
        for _ in range(len(runner.schedule)):
            runner(x).sum().backward()
    assert runner.chosen is trials[0] and not chosen  # nothing measured: nothing adopted as measured
    assert not [w for w in caught if "measured plan choice" in str(w.message)]
    assert set(calls) == {"a"}


class _Residual(nn.Module):
    """Residual MLP blocks on a long batch: activations far above the weights, so plans between
    the unconstrained and the minimum-memory one differ."""

    def __init__(self, d: int = 64, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _train(compiled, eager, x, steps):
    for _ in range(steps):
        for p in (*compiled.parameters(), *eager.parameters()):
            p.grad = None
        compiled(x).pow(2).mean().backward()
        eager(x).pow(2).mean().backward()
        for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.inductor
@pytest.mark.slow
def test_measured_choice_trains_like_eager_and_the_plan_cache_keeps_the_choice(tmp_path, caplog):
    import compile_offload

    torch.manual_seed(0)
    model = _Residual()
    eager = copy.deepcopy(model)
    x = torch.randn(1024, 64)
    options = {"memory_budget": 0.5, "measured_plan_choice": True, "measured_plan_steps": 1,
               "plan_cache_dir": str(tmp_path)}
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        compiled = torch.compile(model, backend=compile_offload.offload_remat(**options))
        _train(compiled, eager, x, steps=1)
    said = caplog.text
    assert "candidate plans compiled" in said and "profiles the planner's plan" in said, said
    compiled_first = int(said.split("measured plan choice: ")[1].split(" candidate")[0])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        for _ in range(4 * (compiled_first + 1) + 1):  # the rest of the trials: warm-ups, profile, peaks, timed
            _train(compiled, eager, x, steps=1)
            if "<- runs" in caplog.text:
                break
    said = caplog.text
    assert "<- runs" in said, said
    # torch's own plan at equal memory was among them: its first fraction's code peaked over the
    # budget, and the next one down joined (passes/solve/torch_plan.py, plan_choice.torch_rival)
    assert "torch's plan, budget" in said, said
    # The profiled step priced the graph's nodes from its kernels, and the plan made from them
    # was a candidate unless it repeated one already measured.
    assert "nodes priced from their kernels' times" in said, said
    candidates = compiled_first + ("the plan from measured costs" not in said)
    assert candidates >= 2
    (table,) = (tmp_path / "measured_costs").iterdir()
    assert json.loads(table.read_text())["device"] == "cpu"
    (plan,) = [p for p in logs.latest_plans() if p.graph_name.startswith("graph")][-1:]
    assert plan.measured_candidates == candidates
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= plan.budget_bytes * 1.01
    assert plan.measured_step_seconds is not None and plan.measured_step_seconds > 0
    assert plan.measured_choice == "the planner's plan" or plan.measured_choice in said, (plan.measured_choice, said)

    # A new compile of the same graph: the plan cache gives the choice, and no trials run.
    torch._dynamo.reset()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        again = torch.compile(model, backend=compile_offload.offload_remat(**options))
        _train(again, eager, x, steps=2)
    assert not _trials_began(caplog.text) and "from the plan cache" in caplog.text
    (cached,) = [p for p in logs.latest_plans() if p.graph_name == plan.graph_name]
    assert cached.measured_candidates == candidates
    assert cached.saved == plan.saved and cached.offloaded == plan.offloaded
    assert cached.measured_choice == plan.measured_choice

    # Another budget for the same graph on the same device: planned from the measured costs at once.
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="compile_offload"):
        other = torch.compile(model, backend=compile_offload.offload_remat(**{**options, "memory_budget": 0.6}))
        _train(other, eager, x, steps=1)
    (replanned,) = [p for p in logs.latest_plans() if p.graph_name == plan.graph_name]
    assert replanned.cost_source == "measured" and "priced from measured kernel times" in replanned.summary()


@pytest.mark.inductor
@pytest.mark.slow
def test_a_profile_that_does_not_line_up_leaves_the_model_with_one_warning(monkeypatch):
    """No compiled-graph call in the profile (a profiler that names nothing): one warning, and
    the candidates planned from the cost model are measured and chosen from as before."""
    import compile_offload
    from compile_offload.runtime import kernel_costs

    monkeypatch.setattr(kernel_costs, "call_events", lambda events, cuda: [])
    torch.manual_seed(0)
    model = _Residual()
    eager = copy.deepcopy(model)
    x = torch.randn(1024, 64)
    torch._dynamo.reset()
    options = {"memory_budget": 0.5, "measured_plan_choice": True, "measured_plan_steps": 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend=compile_offload.offload_remat(**options))
        _train(compiled, eager, x, steps=16)
    said = [str(w.message) for w in caught if "could not price the graph" in str(w.message)]
    assert len(said) == 1 and "0 compiled-graph calls profiled" in said[0], said
    (plan,) = [p for p in logs.latest_plans() if p.graph_name.startswith("graph")][-1:]
    assert plan.cost_source == "model" and plan.measured_candidates >= 1


@pytest.mark.inductor
@pytest.mark.slow
def test_the_graphs_latest_plan_is_the_one_it_runs_while_candidates_are_compiled_and_dropped(monkeypatch):
    """Each candidate compiled reported itself as the graph's latest plan (and dump): after
    the trials' compiles, and after the plan from measured costs was made and dropped, the
    latest plan (explain, verify_budget, dump_dir) was a candidate that does not run."""
    import compile_offload
    from compile_offload.pipeline import plan_choice

    torch.manual_seed(0)
    model = _Residual()
    eager = copy.deepcopy(model)
    x = torch.randn(1024, 64)
    options = {"memory_budget": 0.5, "measured_plan_steps": 1}
    torch._dynamo.reset()
    reference = compile_offload.explain(copy.deepcopy(model), x, **options)
    dropped: list = []
    real = plan_choice._measured_cost_candidate

    def dropping(loop, trials):
        on_profiled = real(loop, trials)
        # the plan from measured costs is made (and reports itself), then dropped
        return None if on_profiled is None else (lambda calls: dropped.append(on_profiled(calls)) and None)

    monkeypatch.setattr(plan_choice, "_measured_cost_candidate", dropping)
    compiled = torch.compile(model, backend=compile_offload.offload_remat(measured_plan_choice=True, **options))

    def latest():
        (plan,) = [p for p in logs.latest_plans() if p.graph_name.startswith("graph")][-1:]
        return plan

    _train(compiled, eager, x, steps=1)  # compiles the planner's plan and its rivals
    assert (latest().saved, latest().offloaded) == (reference.saved, reference.offloaded)
    assert latest().measured_choice is None
    _train(compiled, eager, x, steps=16)
    assert dropped, "the profile step never made the plan from measured costs"
    plan = latest()
    if plan.measured_choice is None or plan.measured_choice == "the planner's plan":
        assert (plan.saved, plan.offloaded) == (reference.saved, reference.offloaded)
        assert plan.cost_source == "model"


@pytest.mark.inductor
@pytest.mark.parametrize("options, why", [
    ({}, "without a memory budget"),
    ({"memory_budget": 0.5, "inner_compiler": "eager"}, "with inner_compiler='eager'"),
])
def test_where_it_cannot_act_nothing_is_tried_and_a_warning_says_so_once(caplog, monkeypatch, options, why):
    import compile_offload
    from compile_offload.pipeline import plan_choice

    monkeypatch.setattr(plan_choice, "_warned_off", set())
    torch.manual_seed(0)
    model = _Residual(d=16, n=1)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="compile_offload"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend=compile_offload.offload_remat(measured_plan_choice=True, **options))
        _train(compiled, eager, torch.randn(32, 16), steps=2)
        torch._dynamo.reset()
        _train(torch.compile(model, backend=compile_offload.offload_remat(measured_plan_choice=True, **options)),
               eager, torch.randn(32, 16), steps=1)
    assert "measured plan choice" not in caplog.text
    said = [str(w.message) for w in caught if "measured_plan_choice is off" in str(w.message)]
    assert len(said) == 1 and f"measured_plan_choice is off {why}" in said[0], said


@pytest.mark.parametrize("decisions, scheduled, why", [
    (["keep", "keep"], 900, "recomputes and copies nothing beyond torch.compile's own"),
    (["keep", "recompute"], 1100, None),  # over its budget: the fastest candidate with the lowest peak may run
    (["keep", "recompute"], 900, None),
    (["offload"], 900, None),
])
def test_no_candidates_are_tried_where_none_could_win_by_the_choices_rule(decisions, scheduled, why):
    """A plan that recomputes and copies nothing is the fastest there is."""
    from compile_offload.passes.plan import Decision
    from compile_offload.pipeline import plan_choice

    plan = _plan()
    plan.scheduled_peak_bytes = scheduled
    plan.decisions = [Decision(f"t{i}", (4,), "float32", 16, kind, "") for i, kind in enumerate(decisions)]
    found = plan_choice._nothing_to_try(plan)
    assert found is None if why is None else why in found


def test_torchs_plan_is_no_rival_where_a_checkpoint_policy_asks_to_offload(monkeypatch):
    """torch's plan offloads nothing: run in place of the planner's, it would drop a tensor the
    user tagged *_CPU_OFFLOAD."""
    from types import SimpleNamespace as NS

    from compile_offload.pipeline import plan_choice

    asked = []
    monkeypatch.setattr(plan_choice, "fitting_fraction", lambda *args, **kwargs: asked.append(args) and None)

    def kept(tag: str):
        nodes = [NS(meta={}), NS(meta={"recompute": NS(name=tag)})]
        return NS(plan=NS(budget_bytes=1000, graph_name="g"), analysis=NS(joint=NS(gm=NS(graph=NS(nodes=nodes)))))

    assert plan_choice.torch_rival(None, kept("MUST_CPU_OFFLOAD")) is None and not asked
    assert plan_choice.torch_rival(None, kept("PREFER_CPU_OFFLOAD")) is None and not asked
    assert plan_choice.torch_rival(None, kept("MUST_SAVE")) is None and len(asked) == 1  # looked for, none fits


@pytest.mark.inductor
def test_a_dynamic_graph_says_once_that_measured_choice_is_off_for_it(monkeypatch):
    """review31c #10: measured_plan_choice was dropped for a graph with dynamic sizes (and
    under CUDA graphs, and for a frame compiled again among ranks) with an INFO line only."""
    import compile_offload
    from compile_offload.pipeline import plan_choice

    monkeypatch.setattr(plan_choice, "_warned_off", set())
    torch.manual_seed(0)
    model = _Residual(d=16, n=1)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend=compile_offload.offload_remat(memory_budget=0.5,
                                                                               measured_plan_choice=True), dynamic=True)
        for batch in (32, 48):
            _train(compiled, eager, torch.randn(batch, 16), steps=1)
    said = [str(w.message) for w in caught if "measured_plan_choice is off" in str(w.message)]
    assert len(said) == 1 and "dynamic sizes" in said[0], said


def test_below_every_plan_a_candidate_no_higher_than_the_plan_kept_is_measured():
    """fuzz31b F3: at a budget below every plan, the plan from measured costs (512.25 KiB in
    Inductor's code) was dropped as over the budget (400.25 KiB), and the plan kept ran at
    513.50 KiB: a lower plan was never measured."""
    from compile_offload.passes.plan import Plan
    from compile_offload.pipeline.plan_choice import admitted_peak

    def kept(budget, scheduled):
        plan = Plan(feasible=scheduled <= budget, budget_bytes=budget, predicted_peak_bytes=scheduled,
                    predicted_step_seconds=1.0, baseline_peak_bytes=2 * scheduled, baseline_step_seconds=1.0,
                    min_peak_bytes=scheduled)
        plan.scheduled_peak_bytes = scheduled
        return plan

    assert admitted_peak(kept(400, 513)) == 513
    assert admitted_peak(kept(1000, 800)) == 1000
