"""Plan.save / Plan.load and config.plan_cache_dir (compile_offload.pipeline.plan_cache)."""

import json
import os
import warnings

import pytest
import torch

import compile_offload
from compile_offload.pipeline import plan_cache
from compile_offload.pipeline.device_profile import resolve_profile
from compile_offload.passes.plan import Plan

from .models import MLP, ReadsMutatedBuffer, TransformerBlock, mlp_inputs, sequence_inputs
from .partition_results import partition_once


def test_plan_round_trips_through_json(tmp_path):
    model = MLP()
    plan = compile_offload.explain(model, *mlp_inputs(), memory_budget=0.5, device_profile="cpu")
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


def test_the_same_plan_made_twice_is_equal_and_count_refuses_a_typo():
    first, second = (compile_offload.explain(MLP(), *mlp_inputs(), memory_budget=0.5, device_profile="cpu")
                     for _ in range(2))
    assert first == second  # how long each took to solve is not part of the plan
    assert first.count("recompute") + first.count("keep") + first.count("offload") == len(first.decisions)
    for method in (first.count, first.bytes_of):
        with pytest.raises(ValueError, match=r"Plan\.\w+\('Recompute'\): accepted: 'keep', 'recompute', 'offload'"):
            method("Recompute")


@pytest.mark.parametrize("content", ["{not json", '{"schema": "other"}', '{"schema": "compile_offload.plan/1", "x": 1}',
                                     b"\xff\xfe\x00binary"])
def test_loading_a_corrupt_file_is_an_error(tmp_path, content):
    path = tmp_path / "plan.json"
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(ValueError, match="plan"):  # a file that is not text named its codec, not the file (fuzz30b)
        Plan.load(path)
    if isinstance(content, bytes):
        with pytest.raises(ValueError, match=rf"cannot read a plan from {path}"):
            Plan.load(path)


@pytest.mark.parametrize("field, value", [
    ("saved", 5), ("saved", [["addmm"]]), ("offloaded", ["addmm"]), ("offloaded", {"addmm": "near"}),
    ("predicted_peak_bytes", "1 GiB"), ("feasible", 1), ("budget_bytes", 0.5),
    # fuzz30b F12: read as 'budget -5 B' and 'step nan ms'
    ("budget_bytes", -5), ("predicted_step_seconds", float("nan")), ("baseline_step_seconds", float("inf")),
])
def test_loading_a_field_of_the_wrong_type_is_an_error(tmp_path, field, value):
    plan = compile_offload.explain(MLP(), *mlp_inputs(), memory_budget=0.5, device_profile="cpu")
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data[field] = value
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"Plan.{field} has the wrong type"):
        Plan.load(tmp_path / "plan.json")


@pytest.mark.parametrize("field", ["decisions", "min_peak_bytes"])
def test_a_plan_without_its_decisions_or_a_field_without_a_default_is_an_error(tmp_path, field):
    """A plan file without its decisions loaded as a plan that kept, recomputed and offloaded
    nothing, its summary all zeros."""
    plan = compile_offload.explain(MLP(), *mlp_inputs(), memory_budget=0.5, device_profile="cpu")
    data = plan.to_json()
    del data[field]
    with pytest.raises(ValueError, match=f"not a compile_offload plan: .*{field}"):
        Plan.from_dict(data)


def test_an_unknown_decision_kind_is_an_error(tmp_path):
    plan = compile_offload.explain(MLP(), *mlp_inputs(), memory_budget=0.5, device_profile="cpu")
    data = plan.to_dict()
    data["decisions"][0]["decision"] = "discard"
    with pytest.raises(ValueError, match="Decision.decision"):
        Plan.from_dict(data)


# --------------------------------------------------------------------------- through the backend


def _train_once(cache_dir, calls):
    torch._dynamo.reset()
    model = MLP()
    backend = compile_offload.offload_remat(inner_compiler="eager", memory_budget=0.5, plan_cache_dir=str(cache_dir))
    torch.compile(model, backend=backend)(*mlp_inputs()).sum().backward()
    return calls[-1]


def _train_once_at(budget, cache_dir, strict=False):
    torch._dynamo.reset()
    backend = compile_offload.offload_remat(inner_compiler="eager", memory_budget=budget, strict_budget=strict,
                                            plan_cache_dir=str(cache_dir))
    torch.compile(MLP(), backend=backend)(*mlp_inputs()).sum().backward()


def test_a_cached_plan_over_its_budget_warns_and_strict_raises_like_a_solved_one(tmp_path, plans):
    with pytest.warns(UserWarning, match="below the minimum"):
        _train_once_at("1KiB", tmp_path)
    assert not plans[-1].feasible and not any("plan cache" in note for note in plans[-1].notes)
    with pytest.warns(UserWarning, match="below the minimum"):
        _train_once_at("1KiB", tmp_path)
    assert len(plans) == 2 and plans[-1].predicted_peak_bytes == plans[0].predicted_peak_bytes
    assert any("plan cache" in note for note in plans[-1].notes), plans[-1].notes
    with pytest.raises(Exception, match="strict_budget=True"):
        _train_once_at("1KiB", tmp_path, strict=True)


@pytest.fixture
def plans(captured_plans):
    return captured_plans


def test_a_restart_reuses_the_saved_plan(tmp_path, plans):
    first = _train_once(tmp_path, plans)
    assert len(list(tmp_path.glob("*.json"))) == 1
    second = _train_once(tmp_path, plans)
    assert "reused from the plan cache" in second.notes
    assert second.saved == first.saved and second.decisions == first.decisions


def test_a_corrupt_entry_is_ignored_with_a_warning(tmp_path, plans):
    _train_once(tmp_path, plans)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text("{garbage")
    with pytest.warns(UserWarning, match="corrupt plan cache entry"):
        plan = _train_once(tmp_path, plans)
    assert "reused from the plan cache" not in plan.notes
    Plan.load(entry)  # planned again and rewritten


@pytest.mark.parametrize("field, value", [("saved", 5), ("saved", [["addmm"]]), ("offloaded", ["addmm"])])
def test_an_entry_with_mistyped_fields_is_planned_again_not_fallen_back(tmp_path, plans, field, value):
    # The graph must be planned again (the budget applies), not handed to torch's
    # partitioner because rebuilding from the entry crashed.
    _train_once(tmp_path, plans)
    (entry,) = tmp_path.glob("*.json")
    data = json.loads(entry.read_text())
    data[field] = value
    entry.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="corrupt plan cache entry") as caught:
        plan = _train_once(tmp_path, plans)
    assert not any("falling back" in str(w.message) for w in caught)
    assert plan.decisions and not any("fallback" in note for note in plan.notes)
    assert isinstance(Plan.load(entry).saved, list)  # rewritten


def test_a_stale_entry_is_ignored_with_a_warning(tmp_path, plans):
    _train_once(tmp_path, plans)
    (entry,) = tmp_path.glob("*.json")
    stale = Plan.load(entry)
    stale.saved = ["no_such_tensor"]
    stale.save(entry)
    with pytest.warns(UserWarning, match="stale plan cache entry"):
        plan = _train_once(tmp_path, plans)
    assert "reused from the plan cache" not in plan.notes


def test_a_cache_folder_that_cannot_be_written_is_a_warning(tmp_path, plans):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    # Found when the knob is read, before any planning (compile_offload.settings).
    with pytest.warns(UserWarning, match=r"plan_cache_dir=.*is a file, not a folder.*plans will not be cached"):
        plan = _train_once(blocker, plans)
    assert plan.decisions  # planned and used all the same


# --------------------------------------------------------------------------- lookup's checks


def _store_and_lookup(monkeypatch, tmp_path, model, inputs, edit=None):
    """Plan ``model``, store the plan, optionally edit the stored plan, look it up with the
    graph's analysis. Returns ``(looked up plan, analysis)``."""
    result, _, settings = partition_once(model, inputs, memory_budget=0.5, plan_cache_dir=str(tmp_path))
    joint_gm, analysis = result.analysis.joint.gm, result.analysis
    profile = resolve_profile(settings.device_profile, torch.device("cpu")).to_dict()
    plan = Plan.from_dict(result.plan.to_dict())
    if edit is not None:
        edit(plan, analysis)
    plan_cache.store(joint_gm, settings, profile, plan)
    return plan_cache.lookup(joint_gm, settings, profile, analysis=analysis), plan


@pytest.mark.parametrize("model, inputs", [(MLP, mlp_inputs), (TransformerBlock, sequence_inputs),
                                           (ReadsMutatedBuffer, mlp_inputs)], ids=["mlp", "dropout", "mutation"])
def test_the_solvers_own_plans_pass_the_checks(tmp_path, monkeypatch, model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a check that rejects the entry warns
        warnings.filterwarnings("ignore", message=".*below the minimum")  # 0.5 is out of reach for some
        found, stored = _store_and_lookup(monkeypatch, tmp_path, model(), inputs())
    assert found == stored


def _offload_a_saved_activation(plan, analysis):
    activation = next(name for name in plan.saved if not name.startswith("primals"))
    plan.offloaded = {activation: 1}


def test_a_legal_offload_passes_the_checks(tmp_path, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a check that rejects the entry warns
        warnings.filterwarnings("ignore", message=".*below the minimum")  # 0.5 is out of reach for some
        found, stored = _store_and_lookup(monkeypatch, tmp_path, TransformerBlock(), sequence_inputs(),
                                          _offload_a_saved_activation)
    assert found == stored and found.offloaded


def _save_inputs_only(plan, analysis):
    plan.saved = [name for name in plan.saved if name.startswith("primals")]  # recompute everything else


def _save_a_backward_value(plan, analysis):
    plan.saved.append(next(n.name for n in analysis.bw_nodes if n.op == "placeholder"))  # a tangent


def _offload_unsaved(plan, analysis):
    plan.offloaded = {next(n.name for n in analysis.fw_nodes if n.op == "call_function" and n.name not in plan.saved): 1}


def _offload_an_input(plan, analysis):
    plan.offloaded = {next(name for name in plan.saved if name.startswith("primals")): 1}


def _negative_distance(plan, analysis):
    _offload_a_saved_activation(plan, analysis)
    plan.offloaded = {name: -1 for name in plan.offloaded}


@pytest.mark.parametrize("edit, problem", [
    (_save_inputs_only, "would recompute .*random op"),
    (_save_a_backward_value, "saves backward values"),
    (_offload_unsaved, "offloads tensors it does not save"),
    (_offload_an_input, "graph input"),
    (_negative_distance, "Plan.offloaded has the wrong type \\(or is negative"),  # read back: refused as corrupt
])
def test_an_entry_the_solver_would_not_write_is_rejected(tmp_path, monkeypatch, edit, problem):
    with pytest.warns(UserWarning, match=f"(stale|corrupt) plan cache entry.*{problem}"):
        found, _ = _store_and_lookup(monkeypatch, tmp_path, TransformerBlock(), sequence_inputs(), edit)
    assert found is None


def test_store_leaves_no_temporary_files(tmp_path, monkeypatch):
    _store_and_lookup(monkeypatch, tmp_path, MLP(), mlp_inputs())
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]


def test_an_entry_made_for_another_budget_is_ignored_with_a_warning(tmp_path, plans):
    """An entry whose ``budget_bytes`` is not the budget asked for (a file copied or edited
    by hand under this graph's key) answers another question: planned again."""
    _train_once_at("8KiB", tmp_path)
    (entry,) = tmp_path.glob("*.json")
    other = Plan.load(entry)
    assert other.budget_bytes == 8 * 1024
    other.budget_bytes = 4 * 1024
    other.save(entry)
    with pytest.warns(UserWarning, match="made for a budget of 4096 bytes, not 8192 bytes"):
        _train_once_at("8KiB", tmp_path)
    assert "reused from the plan cache" not in plans[-1].notes
    assert Plan.load(entry).budget_bytes == 8 * 1024  # rewritten


def test_torchs_compiler_config_keys_the_cache(tmp_path, plans):
    """torch's partitioner (the unconstrained plan) and the memory model read torch's
    functorch and Inductor config: a plan made under inplace_buffers=False was served under
    the default, its budget 5.61 MiB where 4.80 MiB was asked, and the code peaked over the
    budget without a warning (review32c F4). A plan is reused only under the config it was
    made under, read as the compile began, not as our own patches leave it."""
    _train_once(tmp_path, plans)
    with torch._inductor.config.patch(inplace_buffers=False):
        other = _train_once(tmp_path, plans)
        assert "reused from the plan cache" not in other.notes
        assert "reused from the plan cache" in _train_once(tmp_path, plans).notes
    with torch._functorch.config.patch(aggressive_recomputation=True):
        assert "reused from the plan cache" not in _train_once(tmp_path, plans).notes
    assert "reused from the plan cache" in _train_once(tmp_path, plans).notes
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_torch_compiles_inductor_options_key_the_cache(tmp_path, plans):
    """``torch.compile(options=...)`` patches Inductor's config for one compile, after the
    settings read it: a plan made under ``inplace_buffers=False`` (whose code peaks higher,
    review32c F4) was served where the options were not given, and the reverse."""
    def train(options):
        torch._dynamo.reset()
        backend = compile_offload.offload_remat(memory_budget=0.5, plan_cache_dir=str(tmp_path))
        torch.compile(MLP(), backend=backend, options=options)(*mlp_inputs()).sum().backward()
        return plans[-1]

    train(None)
    entries = len(list(tmp_path.glob("*.json")))
    assert "reused from the plan cache" not in train({"inplace_buffers": False}).notes
    assert len(list(tmp_path.glob("*.json"))) == 2 * entries  # the same plans, under keys of their own
    assert "reused from the plan cache" in train({"inplace_buffers": False}).notes
    assert "reused from the plan cache" in train(None).notes


def test_every_setting_keys_the_cache_or_is_named_as_deciding_no_plan():
    """A setting that changes the plan but not the key serves one compile's plan to another:
    the budget loop's other-start re-plan (``lowest_start``) was stored under the key of the
    plain budget, so a later compile at that budget got the other start's plan from the cache
    (a 4-block MLP: keep 4 / recompute 12 at 1.294x, where a cold compile makes keep 8 /
    recompute 7 at 1.170x). Each field of ``Settings`` is one or the other, and the decision
    knobs change the key."""
    import dataclasses

    from compile_offload.pipeline import plan_cache
    from compile_offload.settings import Settings, resolve

    fields = {field.name for field in dataclasses.fields(Settings)}
    assert fields == set(plan_cache._DECISION_KNOBS) | set(plan_cache._NOT_DECIDING)
    assert not set(plan_cache._DECISION_KNOBS) & set(plan_cache._NOT_DECIDING)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    settings = resolve({"memory_budget": 0})
    key = plan_cache.cache_key(gm, settings, {})
    assert plan_cache.cache_key(gm, dataclasses.replace(settings, lowest_start="segments"), {}) != key
    assert plan_cache.cache_key(gm, dataclasses.replace(settings, budget_bytes=1), {}) != key
    assert plan_cache.cache_key(gm, dataclasses.replace(settings, verify_budget=True), {}) == key


def test_a_plan_without_decisions_prints_its_summary_alone():
    """fuzz30b F12: a plan of torch's partition printed its 'not planned' line and an empty table."""
    import dataclasses

    plan = compile_offload.explain(MLP(), *mlp_inputs(), memory_budget=0.5, device_profile="cpu")
    assert "decision" in str(plan) and str(plan).startswith(plan.summary())
    bare = dataclasses.replace(plan, decisions=[])
    assert str(bare) == bare.summary()


def test_options_are_one_text_in_every_process_and_tell_values_apart():
    """review33d F1: a set of passes was keyed by its elements' reprs (addresses: two processes
    disagreed), two functions or two dtypes by their type alone (one key), and a dict with keys
    of mixed types raised in every compile with options."""
    import subprocess
    import sys

    script = ("from compile_offload.pipeline.fingerprint import options_text\n"
              "from torch._inductor.custom_graph_pass import CustomGraphPass\n"
              "class P(CustomGraphPass):\n"
              "    def __init__(self, k): self.k = k\n"
              "    def __call__(self, g): pass\n"
              "    def uuid(self): return f'P{self.k}'\n"
              "print(options_text({'x': {P(1), P(2), P(3)}, 'y': {1: 'a', 'b': 2, (1, 2): None}}))")
    texts = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120,
                            env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(texts) == 1 and "P1" in texts.pop()
    from compile_offload.pipeline.fingerprint import options_text

    def first(graph):
        pass

    def second(graph):
        pass

    assert options_text({"pass": first}) != options_text({"pass": second})
    assert options_text({"dtype": torch.float16}) != options_text({"dtype": torch.bfloat16})
