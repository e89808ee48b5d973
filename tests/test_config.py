"""``compile_offload.config``: patching, environment variables, torch.compile options,
and validation of every knob (``compile_offload.settings.resolve``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import compile_offload
from compile_offload import config, settings

# --------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    ("value", "expected_bytes"),
    [
        ("512MiB", 512 * 2**20),
        ("6GB", 6 * 10**9),
        ("6GiB", 6 * 2**30),
        ("1.5 GiB", 3 * 2**29),
        ("2gib", 2 * 2**30),  # units are case-insensitive
        ("100 KB", 100 * 10**3),
        ("1000", 1000),  # a bare number is bytes
        ("64B", 64),
        (4096, 4096),
        (0, 0),
    ],
)
def test_byte_budgets_parse_to_bytes(value, expected_bytes):
    resolved = settings.resolve({"memory_budget": value})
    assert resolved.budget_bytes == expected_bytes
    assert resolved.budget_fraction is None


def test_a_numpy_integer_is_a_byte_budget():
    np = pytest.importorskip("numpy")  # a size computed with NumPy (installed with the plot extra)
    assert settings.resolve({"memory_budget": np.int64(4096)}).budget_bytes == 4096


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.999, "0.25"])
def test_float_budgets_are_fractions(fraction):
    resolved = settings.resolve({"memory_budget": fraction})
    assert resolved.budget_fraction == float(fraction)
    assert resolved.budget_bytes is None


@pytest.mark.parametrize("fraction", [1.0, "1.0", 1])
def test_a_fraction_of_one_is_no_limit(fraction):
    """fuzz35a: 1.0 resolved to the planner's predicted unconstrained peak, under which
    Inductor's real unconstrained code did not fit: the backend re-planned, recomputed, and
    warned over a budget the user meant as 'all torch.compile saves'. As torch's knob at 1.0,
    it is no limit. (An int 1 is one byte.)"""
    resolved = settings.resolve({"memory_budget": fraction})
    if isinstance(fraction, int):
        assert resolved.budget_bytes == 1 and resolved.has_budget
    else:
        assert resolved.budget_fraction is None and resolved.budget_bytes is None and not resolved.has_budget


@pytest.mark.parametrize("value", [None, "none"])  # "" is an error (tests/test_budget_kept.py)
def test_no_budget(value):
    resolved = settings.resolve({"memory_budget": value})
    assert resolved.budget_bytes is None and resolved.budget_fraction is None


# --------------------------------------------------------------------------- bad values

NAN = float("nan")
# (knob, bad value, exception type). Every one must be rejected with a message naming the
# knob, the value and what is accepted.
BAD_VALUES = [
    ("memory_budget", -1, ValueError),
    ("memory_budget", -0.5, ValueError),
    ("memory_budget", NAN, ValueError),
    ("memory_budget", 1.5, ValueError),
    ("memory_budget", 4096.0, ValueError),  # a float is a fraction, never bytes
    ("memory_budget", "6 parsecs", ValueError),
    ("memory_budget", "6XB", ValueError),
    ("memory_budget", "-1GiB", ValueError),
    ("memory_budget", "lots", ValueError),
    ("memory_budget", True, TypeError),
    ("memory_budget", [1], TypeError),
    ("solver", "simplex", ValueError),
    ("solver", 3, TypeError),
    ("inner_compiler", "aot_eager", ValueError),
    ("device_profile", "tpu", ValueError),
    ("offload", "yes", TypeError),
    ("offload", 1, TypeError),
    ("prefetch", None, TypeError),
    ("strict_budget", "no", TypeError),
    ("debug_force_offload", 0, TypeError),
    ("verify_budget", "yes", TypeError),
    ("dump_dir", 5, TypeError),
    ("exact_max_candidates", 0, ValueError),
    ("exact_max_candidates", True, ValueError),
    ("measured_plan_choice", "on", TypeError),
    ("measured_plan_steps", 0, ValueError),
    ("measured_plan_steps", 2.5, ValueError),
    ("pinned_pool_limit", -1, ValueError),
    ("pinned_pool_limit", "1 GiB of RAM", ValueError),
    ("pinned_pool_limit", "1.5", ValueError),  # not a whole number of bytes (was 1 byte)
    ("pinned_pool_limit", "-2MiB", ValueError),
    ("plan_time_limit", -1, ValueError),
    ("plan_time_limit", NAN, ValueError),
    ("plan_time_limit", "soon", ValueError),
    ("plan_time_limit", True, TypeError),
    ("plan_time_limit", [5], TypeError),
    ("plan_time_limit", "", ValueError),  # was no limit, silently
    ("shared_h2d_bytes", None, TypeError),  # was 0, silently
]


def bad_value_id(case) -> str:
    knob, value, _ = case
    return f"{knob}={value!r}"


def assert_names_knob_and_value(message: str, knob: str, value) -> None:
    assert f"compile_offload.config.{knob}" in message, message
    assert repr(value) in message, message
    assert "accepted" in message.lower(), message


@pytest.mark.parametrize("case", BAD_VALUES, ids=bad_value_id)
def test_resolve_rejects_bad_value(case):
    knob, value, error = case
    with pytest.raises(error) as info:
        settings.resolve({knob: value})
    assert_names_knob_and_value(str(info.value), knob, value)


@pytest.mark.parametrize("case", BAD_VALUES, ids=bad_value_id)
def test_config_patch_with_bad_value_is_rejected_by_resolve(case):
    knob, value, error = case
    with config.patch(**{knob: value}), pytest.raises(error) as info:
        settings.resolve()
    assert_names_knob_and_value(str(info.value), knob, value)


def compile_and_run(backend, **compile_kwargs):
    model = torch.nn.Linear(4, 2)
    return torch.compile(model, backend=backend, **compile_kwargs)(torch.randn(3, 4))


@pytest.mark.parametrize("case", BAD_VALUES, ids=bad_value_id)
def test_first_compile_rejects_bad_option(case):
    """Dynamo wraps backend errors in BackendCompilerFailed; our message must survive."""
    knob, value, error = case
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compile_and_run("offload_remat", options={"inner_compiler": "eager", knob: value})
    assert isinstance(info.value.inner_exception, error)
    assert_names_knob_and_value(str(info.value), knob, value)


@pytest.mark.parametrize("case", [c for c in BAD_VALUES if c[0] in ("memory_budget", "solver")], ids=bad_value_id)
def test_first_compile_rejects_bad_config_value(case):
    knob, value, error = case
    with config.patch(**{knob: value}), pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compile_and_run("offload_remat", options={"inner_compiler": "eager"})
    assert isinstance(info.value.inner_exception, error)
    assert_names_knob_and_value(str(info.value), knob, value)


def test_unknown_option_name_is_rejected():
    with pytest.raises(ValueError, match="unknown option.*memory_budgte"):
        settings.resolve({"memory_budgte": "1GiB"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="memory_budgte"):
        compile_and_run("offload_remat", options={"memory_budgte": "1GiB"})
    with pytest.raises(ValueError, match="memory_budgte"):
        compile_offload.offload_remat(memory_budgte="1GiB")


@pytest.mark.parametrize("name,value,declared", [("triton.cudagraphs", "false", "bool"), ("max_autotune", "yes", "bool"),
                                                 ("max_fusion_size", 4.5, "int")])
def test_an_inductor_option_of_the_wrong_type_is_rejected_as_torch_rejects_it(name, value, declared):
    """Only the names were checked: "false" for triton.cudagraphs read as true (the CUDA-graph
    warning quoted it as True) and crashed inside Inductor; torch's own backend refuses it."""
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compile_and_run("offload_remat", options={"inner_compiler": "eager", name: value})
    assert isinstance(info.value.inner_exception, ValueError)
    assert f"Inductor's {name} takes a {declared}, not a {type(value).__name__}" in str(info.value)
    with pytest.raises(RuntimeError, match=f"Unexpected type of attr {name}"):  # as torch's backend does
        compile_and_run("inductor", options={name: value})


def test_unknown_option_name_offers_the_nearest_known_name():
    with pytest.raises(ValueError, match=r"'memory_budgte': did you mean 'memory_budget'\?"):
        settings.resolve({"memory_budgte": "1GiB"})
    with pytest.raises(ValueError) as info:  # nothing near: no guess
        settings.resolve({"zzz": 1})
    assert "did you mean" not in str(info.value)


def test_offload_remat_validates_at_once():
    """A bad option fails when the backend is made, before anything is compiled."""
    with pytest.raises(ValueError) as info:
        compile_offload.offload_remat(memory_budget=-1)
    assert_names_knob_and_value(str(info.value), "memory_budget", -1)


def test_unsupported_compile_mode_is_rejected():
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"mode='fastest'\) is not an Inductor mode"):
        compile_and_run("offload_remat", mode="fastest")  # torch.compile refuses mode and options together


# --------------------------------------------------------------------------- config.patch


def test_patch_as_context_manager():
    before = settings.resolve()
    with config.patch(memory_budget="512MiB", solver="exact"):
        inside = settings.resolve()
    assert (inside.budget_bytes, inside.solver) == (512 * 2**20, "exact")
    assert settings.resolve() == before


def test_patch_as_decorator():
    @config.patch(offload=False, memory_budget=0.5)
    def resolve_patched():
        return settings.resolve()

    before = settings.resolve()
    patched = resolve_patched()
    assert patched.offload is False and patched.budget_fraction == 0.5
    assert settings.resolve() == before


def test_patch_entered_inside_a_traced_function_fails_naming_what_to_do():
    """fuzz31b F0: entered inside a function torch.compile traces, the patch failed with
    Dynamo's 'super(type, obj): obj must be an instance or subtype of type', which says
    nothing of it; had Dynamo broken the graph there, the body would have run eagerly,
    without the budget. The decorator form compiles under the patch."""
    from compile_offload.reporting.logs import latest_plans

    model, x = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)), torch.randn(4, 8)

    def inside(x):
        with config.patch(memory_budget="1KiB"):
            y = model(x)
        return y.sum()

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"compile_offload.config.patch inside a function torch.compile traces: "
                                        r"enter it around the call"):
        torch.compile(inside, backend="offload_remat")(x)

    @config.patch(memory_budget="1KiB", inner_compiler="eager")
    def decorated(x):
        return model(x).sum()

    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="below the minimum"):
        torch.compile(decorated, backend="offload_remat")(x).backward()
    assert latest_plans()[-1].budget_bytes == 1024


def test_options_override_config():
    with config.patch(memory_budget="1GiB", solver="exact"):
        resolved = settings.resolve({"memory_budget": "2GiB"})
    assert resolved.budget_bytes == 2 * 2**30
    assert resolved.solver == "exact"  # not overridden: the config's value


# --------------------------------------------------------------------------- options reach the planner


def test_compile_options_reach_the_planner(captured_plans):
    compile_and_run("offload_remat", options={"inner_compiler": "eager", "memory_budget": "3KiB"})
    assert [plan.budget_bytes for plan in captured_plans] == [3 * 2**10]


def test_offload_remat_options_reach_the_planner(captured_plans):
    compile_and_run(compile_offload.offload_remat(inner_compiler="eager", memory_budget="5KiB", solver="exact"))
    assert [(plan.budget_bytes, plan.solver) for plan in captured_plans] == [(5 * 2**10, "exact")]


def test_config_reaches_the_planner(captured_plans):
    with config.patch(memory_budget="7KiB", inner_compiler="eager"):
        compile_and_run("offload_remat")
    assert [plan.budget_bytes for plan in captured_plans] == [7 * 2**10]


# --------------------------------------------------------------------------- environment variables

_RESOLVE_IN_FRESH_PROCESS = """
import dataclasses, json
import compile_offload.settings as settings
try:
    result = dataclasses.asdict(settings.resolve({overrides}))
except Exception as error:
    result = {{"error": type(error).__name__, "message": str(error)}}
print(json.dumps(result))
"""


def resolve_with_env(env: dict[str, str], overrides: str = "None") -> dict:
    """``settings.resolve(overrides)`` in a fresh interpreter whose environment has ``env``
    (the config module reads its environment variables once, at import)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_OFFLOAD_")}
    completed = subprocess.run(
        [sys.executable, "-c", _RESOLVE_IN_FRESH_PROCESS.format(overrides=overrides)],
        env={**clean, **env}, capture_output=True, text=True, timeout=120, check=True,
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"COMPILE_OFFLOAD_MEMORY_BUDGET": "2GiB"}, {"budget_bytes": 2 * 2**30, "budget_fraction": None}),
        ({"COMPILE_OFFLOAD_MEMORY_BUDGET": "0.5"}, {"budget_bytes": None, "budget_fraction": 0.5}),
        # torch's config module turns "0" and "1" into bools; they must still mean bytes.
        ({"COMPILE_OFFLOAD_MEMORY_BUDGET": "0"}, {"budget_bytes": 0, "budget_fraction": None}),
        ({"COMPILE_OFFLOAD_OFFLOAD": "0", "COMPILE_OFFLOAD_SOLVER": "exact"}, {"offload": False, "solver": "exact"}),
        ({"COMPILE_OFFLOAD_INNER_COMPILER": "eager", "COMPILE_OFFLOAD_EXACT_MAX_CANDIDATES": "7"},
         {"inner_compiler": "eager", "exact_max_candidates": 7}),
        ({"COMPILE_OFFLOAD_PLAN_TIME_LIMIT": "2.5"}, {"plan_time_limit": 2.5}),
        ({}, {"verify_budget": False}),
        ({"COMPILE_OFFLOAD_VERIFY_BUDGET": "1"}, {"verify_budget": True}),
        ({"COMPILE_OFFLOAD_MEASURED_PLAN_CHOICE": "1", "COMPILE_OFFLOAD_MEASURED_PLAN_STEPS": "5"},
         {"measured_plan_choice": True, "measured_plan_steps": 5}),
        # "1" too, which torch's config module reads as True
        ({"COMPILE_OFFLOAD_MEASURED_PLAN_STEPS": "1", "COMPILE_OFFLOAD_EXACT_MAX_CANDIDATES": "1"},
         {"measured_plan_steps": 1, "exact_max_candidates": 1}),
        ({"COMPILE_OFFLOAD_SHARED_H2D_BYTES": "0", "COMPILE_OFFLOAD_PINNED_POOL_LIMIT": "1",
          "COMPILE_OFFLOAD_PLAN_TIME_LIMIT": "1"},
         {"shared_h2d_bytes": 0, "pinned_pool_limit": 1, "plan_time_limit": 1.0}),
        ({"COMPILE_OFFLOAD_SHARED_H2D_BYTES": "1", "COMPILE_OFFLOAD_PINNED_POOL_LIMIT": "0",
          "COMPILE_OFFLOAD_PLAN_TIME_LIMIT": "0"},
         {"shared_h2d_bytes": 1, "pinned_pool_limit": 0, "plan_time_limit": 0.0}),
        # "none" is None for every knob whose default is None (a dump folder named "none" was
        # made; device_profile and pinned_pool_limit refused it)
        ({"COMPILE_OFFLOAD_DUMP_DIR": "none", "COMPILE_OFFLOAD_DEVICE_PROFILE": "None",
          "COMPILE_OFFLOAD_PINNED_POOL_LIMIT": "NONE", "COMPILE_OFFLOAD_PLAN_CACHE_DIR": " none "},
         {"dump_dir": None, "device_profile": None, "pinned_pool_limit": None, "plan_cache_dir": None}),
    ],
    ids=lambda v: ",".join(f"{k}={val}" for k, val in v.items()) if isinstance(v, dict) else None,
)
def test_environment_variables(env, expected):
    resolved = resolve_with_env(env)
    assert {k: resolved.get(k, resolved) for k in expected} == expected


_READ_BACK_IN_FRESH_PROCESS = """
import dataclasses, json
import compile_offload
import compile_offload.settings as settings
knobs = ["memory_budget", "pinned_pool_limit", "shared_h2d_bytes", "plan_time_limit", "offload"]
read = {knob: getattr(compile_offload.config, knob) for knob in knobs}
before = dataclasses.asdict(settings.resolve())
for knob, value in read.items():
    setattr(compile_offload.config, knob, value)  # the value read, assigned back in code
try:
    same = dataclasses.asdict(settings.resolve()) == before
except Exception as error:
    same = f"{type(error).__name__}: {error}"
print(json.dumps({"read": read, "same": same}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("raw", ["0", "1"])
def test_an_environment_0_or_1_reads_back_as_what_it_means(raw):
    """torch's config module reads "0"/"1" as bools: config.memory_budget read False (True),
    which assigned back was "a bool is not a budget". A knob that is not a flag reads the
    variable's string, as for any other value; a flag reads the bool."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_OFFLOAD_")}
    variables = {f"COMPILE_OFFLOAD_{knob.upper()}": raw for knob in
                 ("memory_budget", "pinned_pool_limit", "shared_h2d_bytes", "plan_time_limit")}
    completed = subprocess.run([sys.executable, "-c", _READ_BACK_IN_FRESH_PROCESS],
                               env={**clean, **variables, "COMPILE_OFFLOAD_OFFLOAD": raw},
                               capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["read"] == {**{knob.removeprefix("COMPILE_OFFLOAD_").lower(): raw for knob in variables},
                              "offload": raw == "1"}
    assert result["same"] is True, result


@pytest.mark.slow
def test_an_environment_flag_word_reads_back_as_its_bool():
    """fuzz33b F01: COMPILE_OFFLOAD_OFFLOAD=no read back as the string "no", true to
    ``if compile_offload.config.offload:`` (the backend read it right); every word the
    reference lists for flags reads back as its bool, and another stays a string the
    settings refuse."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_OFFLOAD_")}
    words = {"offload": ("no", False), "strict_budget": ("On", True), "debug_force_offload": (" yes ", True),
             "verify_budget": ("FALSE", False), "prefetch": ("off", False), "suppress_errors": ("true", True)}
    script = ("import json, compile_offload\n"
              f"print(json.dumps({{knob: getattr(compile_offload.config, knob) for knob in {sorted(words)!r}}}))")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                               env={**clean, **{f"COMPILE_OFFLOAD_{k.upper()}": raw for k, (raw, _) in words.items()}})
    assert json.loads(completed.stdout.strip().splitlines()[-1]) == {k: value for k, (_, value) in words.items()}
    assert resolve_with_env({"COMPILE_OFFLOAD_OFFLOAD": "maybe"})["error"] == "ValueError"


def test_dir_of_the_config_lists_its_knobs():
    """fuzz33b F13: dir(compile_offload.config), what tab completion reads, listed none of them."""
    assert set(config.get_config_copy()) <= set(dir(config))
    assert "patch" in dir(config)


@pytest.mark.parametrize("knob", ["measured_plan_steps", "exact_max_candidates"])
def test_a_bool_is_no_count_in_code(knob):
    with pytest.raises(ValueError, match="accepted: a positive int"):
        settings.resolve({knob: True})


@pytest.mark.slow
def test_environment_variable_with_bad_value_is_rejected():
    resolved = resolve_with_env({"COMPILE_OFFLOAD_SOLVER": "simplex"})
    assert resolved.get("error") == "ValueError", resolved
    assert_names_knob_and_value(resolved["message"], "solver", "simplex")


@pytest.mark.slow
@pytest.mark.parametrize(("variable", "raw"), [("COMPILE_OFFLOAD_EXACT_MAX_CANDIDATES", "many"),
                                              ("COMPILE_OFFLOAD_MEMORY_BUDGET", "lots"),
                                              ("COMPILE_OFFLOAD_PLAN_TIME_LIMIT", "soon"),
                                              ("COMPILE_OFFLOAD_BUDGET_SCOPE", "frame")])
def test_a_bad_environment_value_is_named_by_its_variable(variable, raw):
    """The user set the variable, not the knob in code: the error leads with it."""
    resolved = resolve_with_env({variable: raw})
    assert resolved.get("error") == "ValueError", resolved
    assert resolved["message"].startswith(f"{variable}={raw!r} (the environment): "), resolved["message"]


@pytest.mark.slow
def test_a_bad_value_in_code_is_named_by_its_knob_whatever_the_environment():
    knob = "exact_max_candidates"
    resolved = resolve_with_env({"COMPILE_OFFLOAD_EXACT_MAX_CANDIDATES": "7"}, overrides=f'{{"{knob}": -1}}')
    assert resolved["message"].startswith(f"compile_offload.config.{knob}=-1"), resolved


@pytest.mark.slow
def test_explicit_bool_budget_is_rejected_whatever_the_environment():
    """The environment's "1" arrives as True (torch's config module); an explicit
    ``memory_budget=True`` from the caller is still not a budget."""
    resolved = resolve_with_env({"COMPILE_OFFLOAD_MEMORY_BUDGET": "1"}, overrides='{"memory_budget": True}')
    assert resolved.get("error") == "TypeError", resolved



@pytest.mark.parametrize(("value", "seconds"), [(None, None), (0, 0.0), (30, 30.0), (2.5, 2.5), ("12", 12.0),
                                                ("None", None)])
def test_plan_time_limit_parses_to_seconds(value, seconds):
    assert settings.resolve({"plan_time_limit": value}).plan_time_limit == seconds


def test_a_time_limit_past_a_floats_range_is_a_value_error_not_an_overflow():
    with pytest.raises(ValueError, match=r"plan_time_limit=1000.* is too large"):
        settings.resolve({"plan_time_limit": 10**400})
    from compile_offload import config_guard

    assert config_guard._understood("plan_time_limit", 10**400)[0] == "as written"  # the guard does not raise


def test_numpy_floats_of_every_width_are_fractions_and_seconds():
    np = pytest.importorskip("numpy")
    for kind in (np.float16, np.float32, np.float64):
        assert settings.resolve({"memory_budget": kind(0.5)}).budget_fraction == 0.5
        assert settings.resolve({"plan_time_limit": kind(2.5)}).plan_time_limit == 2.5


def test_device_profile_names_are_case_insensitive():
    assert settings.resolve({"device_profile": " H100 "}).device_profile == "h100"
    assert settings.resolve({"device_profile": "H200"}).device_profile == "h200"


def test_an_unknown_device_profile_is_named_as_written():
    with pytest.raises(ValueError, match=r"device_profile='V100' is unknown; accepted: h100, h200"):
        settings.resolve({"device_profile": "V100"})


# --------------------------------------------------------------------------- torch's budget knob


@pytest.fixture
def fresh_torch_budget_notices(monkeypatch):
    """Each test sees the once-only notices about torch's activation_memory_budget anew."""
    monkeypatch.setattr(settings, "_TORCH_BUDGET_ANNOUNCED", set())


def _decisions(plan):
    return [(d.name, d.decision) for d in plan.decisions]


def test_torch_activation_memory_budget_alone_gives_the_same_plan_as_ours(fresh_torch_budget_notices, caplog):
    from compile_offload.benchmarks.workloads import Decoder

    model = Decoder(2, 64, 2)
    x = torch.randn(2, 64, 64, requires_grad=True)
    ours = compile_offload.explain(model, x, memory_budget=0.3, device_profile="h100")
    unconstrained = compile_offload.explain(model, x, device_profile="h100")
    with torch._functorch.config.patch(activation_memory_budget=0.3), caplog.at_level("INFO", "compile_offload"):
        theirs = compile_offload.explain(model, x, device_profile="h100")
    assert _decisions(ours) != _decisions(unconstrained), "0.3 must change the plan for the test to mean anything"
    assert (theirs.budget_bytes, theirs.saved, theirs.offloaded) == (ours.budget_bytes, ours.saved, ours.offloaded)
    assert _decisions(theirs) == _decisions(ours)
    notices = [r for r in caplog.records if "activation_memory_budget=0.3" in r.getMessage()]
    assert len(notices) == 1, "said once, though explain resolves the settings more than once"


def test_torch_budget_is_a_fraction_in_the_settings(fresh_torch_budget_notices):
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        resolved = settings.resolve()
    assert (resolved.budget_bytes, resolved.budget_fraction) == (None, 0.5)
    with torch._functorch.config.patch(activation_memory_budget=1.0):  # torch's default: no budget
        assert settings.resolve().budget_fraction is None


@pytest.mark.parametrize("value", [-0.5, float("nan"), True, "half"])
def test_an_unusable_torch_budget_warns_once_and_is_no_budget(fresh_torch_budget_notices, recwarn, value):
    with torch._functorch.config.patch(activation_memory_budget=value):
        for _ in range(2):
            assert settings.resolve().budget_fraction is None
    messages = [str(w.message) for w in recwarn if "activation_memory_budget" in str(w.message)]
    assert messages == [f"compile_offload: torch._functorch.config.activation_memory_budget={value!r} is not a "
                        "fraction in [0, 1]: ignored (no budget from it)"]


def test_a_torch_budget_of_one_or_more_is_no_budget_and_no_warning(fresh_torch_budget_notices, recwarn):
    with torch._functorch.config.patch(activation_memory_budget=1.5):  # torch saves every activation too
        assert settings.resolve().budget_fraction is None
    assert not [w for w in recwarn if "activation_memory_budget" in str(w.message)]


def test_our_budget_wins_with_one_warning_when_they_disagree(fresh_torch_budget_notices, recwarn):
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        for _ in range(3):
            resolved = settings.resolve({"memory_budget": 0.25})
        agreeing = settings.resolve({"memory_budget": 0.5})
        in_bytes = settings.resolve({"memory_budget": "1GiB"})
    assert resolved.budget_fraction == 0.25 and agreeing.budget_fraction == 0.5
    assert (in_bytes.budget_bytes, in_bytes.budget_fraction) == (2**30, None)
    messages = [str(w.message) for w in recwarn if "activation_memory_budget" in str(w.message)]
    assert len(messages) == 2, messages  # once for 0.25, none for the agreeing 0.5, once for 1GiB
    assert "memory_budget=0.25 (a fraction) is set and wins" in messages[0]
    assert "1.00 GiB" in messages[1]


def test_forced_offload_without_offload_is_refused_naming_both_knobs():
    with pytest.raises(ValueError, match=r"debug_force_offload=True needs offload=True"):
        settings.resolve({"debug_force_offload": True, "offload": False})
    with config.patch(offload=False), pytest.raises(ValueError, match="debug_force_offload"):
        settings.resolve({"debug_force_offload": True})


@pytest.mark.slow
def test_an_environment_variable_that_names_no_knob_is_warned_with_the_nearest_knob():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_OFFLOAD_")}
    completed = subprocess.run([sys.executable, "-c", "import compile_offload"],
                               env={**clean, "COMPILE_OFFLOAD_MEMORY_BUGDET": "1GiB", "COMPILE_OFFLOAD_SOLVER": "exact",
                                    "COMPILE_OFFLOAD_plan_cache_dir": "plans"},
                               capture_output=True, text=True, timeout=120, check=True)
    assert ("the environment variable COMPILE_OFFLOAD_MEMORY_BUGDET names no knob and is ignored; did you mean "
            "COMPILE_OFFLOAD_MEMORY_BUDGET?") in completed.stderr
    # the case of the name: the knob's variable, not the nearest as written (..._OFFLOAD, fuzz33b F10)
    assert ("COMPILE_OFFLOAD_plan_cache_dir names no knob and is ignored; did you mean "
            "COMPILE_OFFLOAD_PLAN_CACHE_DIR?") in completed.stderr
    assert "COMPILE_OFFLOAD_SOLVER" not in completed.stderr  # a knob's own variable is not warned
