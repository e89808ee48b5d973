"""The user's budget is never dropped silently (issue 21): a changed config recompiles,
an assignment reaches worker threads, a dynamic size over the budget warns, and a warm
cache tells the user what a cold compile told them."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import compile_offload
from compile_offload import config
from tests.models import MLP, mlp_inputs


def _train_step(compiled, x):
    compiled(x).sum().backward()


@pytest.fixture
def eager_inner():
    with config.patch(inner_compiler="eager", device_profile="cpu"):
        yield


def test_changed_budget_recompiles_a_new_instance(eager_inner, captured_plans):
    """The issue's case: compile with no budget, set 0.0, compile a new instance of the
    same class: the plan must be the 0.0 plan, not the cached no-budget one."""
    (x,) = mlp_inputs()
    _train_step(torch.compile(MLP(), backend="offload_remat"), x)
    config.memory_budget = 0.0
    try:
        _train_step(torch.compile(MLP(), backend="offload_remat"), x)
    finally:
        config.memory_budget = None
    assert len(captured_plans) == 2
    unconstrained, minimum = captured_plans
    assert unconstrained.budget_bytes is None
    assert minimum.budget_bytes is not None  # 0.0 resolved to the minimum plan's bytes
    assert minimum.predicted_peak_bytes <= unconstrained.predicted_peak_bytes


def test_changed_budget_recompiles_the_same_compiled_model(eager_inner, captured_plans):
    """config.patch around calls of one compiled model: each budget gets its own plan, and
    going back to a budget already planned reuses that graph (Dynamo's cache, no third plan)."""
    (x,) = mlp_inputs()
    compiled = torch.compile(MLP(), backend="offload_remat")
    _train_step(compiled, x)
    with config.patch(memory_budget=0.0):
        _train_step(compiled, x)
    _train_step(compiled, x)
    assert [plan.budget_bytes is None for plan in captured_plans] == [True, False]


def test_options_fix_their_knobs_against_config_changes(eager_inner, captured_plans):
    """A knob an offload_remat(...) option sets cannot change, so changing it in the
    config recompiles nothing."""
    (x,) = mlp_inputs()
    compiled = torch.compile(MLP(), backend=compile_offload.offload_remat(memory_budget=0.5))
    _train_step(compiled, x)
    with config.patch(memory_budget=0.0):
        _train_step(compiled, x)
    assert len(captured_plans) == 1


def test_without_a_guard_a_changed_budget_warns_once(eager_inner, captured_plans, monkeypatch):
    """On a torch with no guard for us, the running plan warns once that it was made for
    another budget."""
    from compile_offload import config_guard

    monkeypatch.setattr(config_guard, "install", lambda skip=(): False)
    (x,) = mlp_inputs()
    compiled = torch.compile(MLP(), backend="offload_remat")
    _train_step(compiled, x)
    with config.patch(memory_budget=0.0), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_step(compiled, x)
        _train_step(compiled, x)
    messages = [str(w.message) for w in caught if "running a plan made for other settings" in str(w.message)]
    assert len(messages) == 1 and "memory_budget=None (now 0.0)" in messages[0]
    assert len(captured_plans) == 1


def test_an_assignment_reaches_a_worker_thread(eager_inner, captured_plans):
    """config.memory_budget set in the main thread is the budget of a compile in a worker
    thread (torch >= 2.12 keeps config overrides per thread)."""
    (x,) = mlp_inputs()
    errors = []

    def train():
        try:
            _train_step(torch.compile(MLP(), backend="offload_remat"), x)
        except Exception as error:  # surfaced below: an assert in a thread fails nothing
            errors.append(error)

    config.memory_budget = "1MiB"
    try:
        worker = threading.Thread(target=train)
        worker.start()
        worker.join()
    finally:
        config.memory_budget = None
    assert not errors
    assert [plan.budget_bytes for plan in captured_plans] == [2**20]


def test_a_patch_stays_in_its_thread():
    """config.patch applies to the thread that entered it; after it the thread reads the
    process's value again, including one assigned while the patch was active."""
    seen = {}
    entered, assigned = threading.Event(), threading.Event()

    def patched():
        with config.patch(memory_budget="2MiB"):
            seen["inside"] = config.memory_budget
            entered.set()
            assigned.wait(10)
        seen["after"] = config.memory_budget

    config.memory_budget = "1MiB"
    try:
        worker = threading.Thread(target=patched)
        worker.start()
        entered.wait(10)
        seen["main during patch"] = config.memory_budget
        config.memory_budget = "3MiB"
        assigned.set()
        worker.join()
    finally:
        config.memory_budget = None
    assert seen == {"inside": "2MiB", "main during patch": "1MiB", "after": "3MiB"}
    assert compile_offload.settings.resolve().budget_bytes is None
