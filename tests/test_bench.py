"""The benchmark suite: workloads, strategies, the runner's outputs, the max-batch search
and the ``bench`` command line. No timing assertions: only that things run and the
outputs are well formed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # benchmarks/ is a folder of the checkout, not an installed package
    sys.path.insert(0, str(REPO))

import compile_offload  # noqa: E402
from compile_offload.benchmarks import runner, strategies, workloads  # noqa: E402
from compile_offload.tools.max_batch import largest_fitting, max_batch  # noqa: E402
from compile_offload.passes.plan import Plan  # noqa: E402


# --- workloads ------------------------------------------------------------------------------


def _needs_packages(name: str) -> None:
    if name in workloads.HF_WORKLOADS:
        pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(workloads.FACTORIES))
def test_workload_trains_one_step(name):
    _needs_packages(name)
    model, inputs, loss_fn = workloads.build(name, workloads.SMOKE_SIZES[name], "cpu", torch.float32)
    loss = loss_fn(model(*inputs))
    loss.backward()
    assert loss.dim() == 0
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", sorted(workloads.FACTORIES))
def test_checkpointed_blocks_give_the_same_gradients(name):
    _needs_packages(name)
    size = workloads.SMOKE_SIZES[name]
    model, inputs, loss_fn = workloads.build(name, size, "cpu", torch.float64)
    wrapped, _, _ = workloads.build(name, size, "cpu", torch.float64)
    count = strategies.wrap_blocks(wrapped)
    assert count == sum(isinstance(m, model.checkpoint_block_types) for m in model.modules())
    loss_fn(model(*inputs)).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    for tensor in inputs:
        tensor.grad = None
    loss_fn(wrapped(*inputs)).backward()
    for want, got in zip(expected, (p.grad for p in wrapped.parameters()), strict=True):
        torch.testing.assert_close(got, want)


def test_unet_rejects_an_image_side_its_depth_cannot_halve():
    with pytest.raises(ValueError, match="divisible"):
        workloads.build("unet", workloads.SMOKE_SIZES["unet"].replace(seq=30), "cpu", torch.float32)


# --- strategies -----------------------------------------------------------------------------


def test_budget_tokens_are_fractions_or_sizes():
    assert strategies.parse_budget_list("0.25, 0.5,2GiB,none,1000") == [0.25, 0.5, "2GiB", None, "1000"]
    with pytest.raises(ValueError):
        strategies.parse_budget("1.5")
    with pytest.raises(ValueError):
        strategies.parse_budget("2 parsecs")


def test_expand_sweeps_budgets_and_rejects_unknown_names():
    names = [s.name for s in strategies.expand(["eager", "torch_budget", "ours", "ours:1GiB"], [0.5, "2GiB"], [0.0])]
    assert names == ["eager", "torch_budget:0", "ours:0.5", "ours:2GiB", "ours:1GiB"]
    with pytest.raises(ValueError, match="unknown strategy"):
        strategies.expand(["fastest"], [], [])
    with pytest.raises(ValueError, match="takes no budget"):
        strategies.expand(["eager:0.5"], [], [])


def test_sac_offload_is_unavailable_without_cuda():
    reason = strategies.Strategy("torch_sac_offload").unavailable_reason(torch.device("cpu"))
    assert reason is not None and "CUDA" in reason


def test_hf_ckpt_offload_runs_on_hugging_face_models_only():
    hf = strategies.Strategy("hf_ckpt_offload")
    assert "Hugging Face models only" in hf.unavailable_reason(torch.device("cpu"), "gpt")
    if importlib.util.find_spec("transformers") is None:
        assert "needs Hugging Face transformers" in hf.unavailable_reason(torch.device("cpu"), "hf_gpt2")
    else:
        assert hf.unavailable_reason(torch.device("cpu"), "hf_gpt2") is None


def test_hf_ckpt_offload_checkpoints_offloads_and_gives_the_same_gradients(monkeypatch):
    pytest.importorskip("transformers")
    import transformers.modeling_utils

    entered = []
    real_save_on_cpu = torch.autograd.graph.save_on_cpu

    def counting_save_on_cpu(*args, **kwargs):
        entered.append(kwargs)
        return real_save_on_cpu(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", counting_save_on_cpu)
    monkeypatch.setattr(transformers.modeling_utils, "save_on_cpu", counting_save_on_cpu, raising=False)
    size = workloads.SMOKE_SIZES["hf_gpt2"]
    model, inputs, loss_fn = workloads.build("hf_gpt2", size, "cpu", torch.float64)
    offloaded, _, _ = workloads.build("hf_gpt2", size, "cpu", torch.float64)
    strategy = strategies.Strategy("hf_ckpt_offload")
    run = strategy.prepare(offloaded)
    assert strategy.detail
    calls = []
    # A pre-hook: the recompute stops early (torch.utils.checkpoint) before the MLP returns.
    offloaded.hf_model.transformer.h[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    loss_fn(model(*inputs)).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    loss_fn(run(*inputs)).backward()
    for want, got in zip(expected, (p.grad for p in offloaded.parameters()), strict=True):
        torch.testing.assert_close(got, want)
    assert len(calls) == 2, "the block ran again in the backward: it was checkpointed"
    assert len(entered) == size.layers, "each block's checkpoint ran under save_on_cpu"


# --- runner pieces --------------------------------------------------------------------------


def test_pareto_front_keeps_only_undominated_points():
    points = [(3.0, 1.0), (1.0, 5.0), (2.0, 2.0), (2.5, 3.0), (1.0, 6.0)]
    assert runner.pareto_front(points) == [(1.0, 5.0), (2.0, 2.0), (3.0, 1.0)]


def test_ratios_are_against_compile_default():
    rows = [
        {"strategy": "compile", "status": "ok", "ms_median": 10.0, "peak_bytes": 400},
        {"strategy": "eager", "status": "ok", "ms_median": 15.0, "peak_bytes": 100},
        {"strategy": "ours:0.5", "status": "error", "error": "boom"},
    ]
    runner.add_ratios(rows)
    assert rows[1]["ms_vs_compile"] == 1.5 and rows[1]["peak_vs_compile"] == 0.25
    assert "ms_vs_compile" not in rows[2]


def test_the_table_says_where_a_row_measured_over_its_budget():
    """fuzz33b F06: a row over its budget (within_budget false in the jsonl) read "ok"."""
    rows = [{"strategy": "ours:256KiB", "status": "ok", "peak_bytes": 600 * 1024, "budget_bytes": 256 * 1024},
            {"strategy": "ours:1MiB", "status": "ok", "peak_bytes": 600 * 1024, "budget_bytes": 2**20},
            {"strategy": "compile", "status": "ok", "peak_bytes": 900 * 1024},
            {"strategy": "ours:0", "status": "ok", "peak_bytes": 600 * 1024, "budget_bytes": 0}]  # review33d B1
    for row in rows:
        runner._add_prediction_checks(row)
    table = runner.markdown_table(rows).splitlines()
    assert table[2].endswith("| ok, over budget (2.344x) |") and table[3].endswith("| ok |"), table
    assert table[4].endswith("| ok |") and table[5].endswith("| ok, over budget |")


def _plan(peak: int, seconds: float, budget: int | None) -> Plan:
    return Plan(feasible=budget is None or peak <= budget, budget_bytes=budget, predicted_peak_bytes=peak,
                predicted_step_seconds=seconds, baseline_peak_bytes=2 * peak, baseline_step_seconds=seconds,
                min_peak_bytes=peak // 2, device_profile="cpu")


def test_prediction_sums_the_plans_of_several_graphs(monkeypatch):
    monkeypatch.setattr(compile_offload, "explain_all", lambda model, *inputs, memory_budget=None: [
        _plan(100, 0.001, 1000), _plan(300, 0.002, 1000)], raising=False)
    predicted = runner.predict(strategies.Strategy("ours", "1000"), torch.nn.Linear(2, 2), (torch.ones(2),))
    assert predicted["predicted_peak_bytes"] == 400
    assert predicted["predicted_step_ms"] == pytest.approx(3.0)
    assert predicted["plan_graphs"] == 2 and predicted["plan_feasible"]


# --- max batch ------------------------------------------------------------------------------


@pytest.mark.parametrize("low,high", [(1, 1), (1, 100), (3, 64), (5, 5)])
def test_largest_fitting_finds_the_threshold(low, high):
    for threshold in range(0, 70):
        calls = []

        def fits(batch):
            calls.append(batch)
            return batch <= threshold

        expected = None if threshold < low else min(threshold, high)
        assert largest_fitting(fits, low, high) == expected
        assert all(low <= b <= high for b in calls)


def _linear_factory(width=8):
    def factory(batch, device):
        model = torch.nn.Linear(width, width).to(device)
        return model, (torch.randn(batch, width, device=device),)

    return factory


def _explain_peak_per_sample(per_sample: int, seen_devices: list):
    def explain(model, x, memory_budget=None, **options):
        seen_devices.append(x.device.type)
        return _plan(per_sample * x.shape[0], 1e-3 * x.shape[0], memory_budget)

    return explain


def test_max_batch_plans_on_meta_and_finds_the_largest_fitting_batch(monkeypatch):
    devices = []
    monkeypatch.setattr(compile_offload, "explain_all", _explain_peak_per_sample(1000, devices), raising=False)
    found = max_batch(_linear_factory(), "37000", high=4096, device="cpu", measure=False)
    assert found.batch == 37
    assert found.predicted_peak_bytes == 37000
    assert found.planned_on == "meta" and set(devices) == {"meta"}
    assert any(not p.fits for p in found.probes)


@pytest.mark.slow
def test_max_batch_plans_the_loss_the_factory_returns():
    """fuzz30b F2: the loss was left out of the planned step: a loss projecting onto a large
    vocabulary (its logits the step's largest tensors) gave the batch found without it."""
    def factory(batch, device, vocabulary=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64)).to(device)
        inputs = (torch.randn(batch, 64, device=device),)
        if vocabulary is None:
            return model, inputs
        head = torch.randn(64, vocabulary, device=device)
        return model, inputs, lambda out: (out @ head).logsumexp(-1).mean()

    plain = max_batch(factory, "2MiB", high=256, device="cpu", measure=False)
    with_loss = max_batch(lambda batch, device: factory(batch, device, 4096), "2MiB", high=256, device="cpu",
                          measure=False)
    assert plain.batch is not None and with_loss.batch is not None
    assert with_loss.batch * 4096 * 4 <= 2 * 2**20 < plain.batch * 4096 * 4, (plain.batch, with_loss.batch)


def test_max_batch_falls_back_to_the_device_when_meta_fails(monkeypatch):
    devices = []
    monkeypatch.setattr(compile_offload, "explain_all", _explain_peak_per_sample(1000, devices), raising=False)
    linear = _linear_factory()

    def factory(batch, device):
        if device == "meta":
            raise NotImplementedError("no meta kernel")
        return linear(batch, device)

    found = max_batch(factory, "5KB", device="cpu", measure=False)
    assert found.batch == 5 and found.planned_on == "cpu"


def test_max_batch_reports_none_when_even_low_does_not_fit(monkeypatch):
    monkeypatch.setattr(compile_offload, "explain_all", _explain_peak_per_sample(1000, []), raising=False)
    found = max_batch(_linear_factory(), 999, device="cpu", measure=False)
    assert found.batch is None and found.predicted_peak_bytes is None
    assert found.notes == ["no batch fits: batch 1 (low) is planned to peak at 1000 B, above the budget of "
                           "999 B; raise the budget or lower low"]


def test_max_batch_without_high_says_where_it_stopped(monkeypatch):
    from compile_offload.tools import max_batch as module

    monkeypatch.setattr(compile_offload, "explain_all", _explain_peak_per_sample(1, []), raising=False)
    monkeypatch.setattr(module, "DEFAULT_HIGH", 64)
    found = max_batch(_linear_factory(), "1MiB", device="cpu", measure=False)
    assert found.batch == 64 and found.notes == ["the search stopped at batch 64, where high=None stops it; pass "
                                                 "high= to search beyond"]
    assert max_batch(_linear_factory(), "1MiB", high=64, device="cpu", measure=False).notes == []


def test_max_batch_refuses_to_judge_a_graph_torch_partitioned(monkeypatch):
    """A fallback plan's peaks read 0: taken as fitting, every batch up to high "fit"."""
    seen: list = []

    def explain(model, x, memory_budget=None, **options):
        seen.append(x.device.type)
        return [Plan.unplanned(feasible=False, budget_bytes=memory_budget, device_profile="cpu", solver="greedy",
                               graph_name="graph_0", why="torch.cond", fallback="a higher-order op (cond)")]

    monkeypatch.setattr(compile_offload, "explain_all", explain, raising=False)
    with pytest.raises(ValueError, match=r"max_batch: at batch 1 graph_0 is not planned \(torch's partition runs: "
                                         r"a higher-order op \(cond\)\), so its memory cannot be predicted"):
        max_batch(_linear_factory(), "4KiB", high=4096, device="cpu", measure=False)
    assert seen == ["meta"]  # not planned again on the device


def test_max_batch_measures_the_compiled_step_at_the_batch_it_found(monkeypatch):
    """``measure=True`` trains the found batch through the backend: a step time and the
    allocator's peak on any device, no error. The step's output (batch x width floats) is
    alive during the step, so the peak is at least that."""
    monkeypatch.setattr(compile_offload, "explain_all", _explain_peak_per_sample(1000, []), raising=False)
    with compile_offload.config.patch(inner_compiler="eager"):
        found = max_batch(_linear_factory(), "5KB", device="cpu", measure=True, steps=2, warmup=1)
    assert found.measure_error is None, found.measure_error
    assert found.batch == 5 and found.measured_step_seconds > 0
    assert found.measured_peak_bytes >= 5 * 8 * 4


def _one_argument_factory(batch):
    return _linear_factory()(batch, "cpu")


@pytest.mark.parametrize("factory, error, message", [
    (None, TypeError, r"max_batch\(factory=\.\.\.\): got a NoneType, which cannot be called; pass a function "
                      r"factory\(batch, device\)"),
    (_one_argument_factory, TypeError, r"'_one_argument_factory' cannot be called as factory\(batch, device\)"),
    (lambda batch, device: _linear_factory()(batch, device)[0], TypeError,
     r"factory\(1, 'meta'\) returned a value of type Linear; it must return \(model, inputs\) or "
     r"\(model, inputs, loss_fn\)"),
    (lambda batch, device: (*_linear_factory()(batch, device), None, None), TypeError, r"returned 4 values; it must"),
    (lambda batch, device: ("model", (torch.ones(batch),)), TypeError, "returned a model of type str, which cannot"),
    (_linear_factory(), ValueError, r"max_batch\(low=0, high=None\): the batches tried are whole numbers"),
])
def test_max_batch_names_a_factory_or_range_it_cannot_search_with(monkeypatch, factory, error, message):
    calls = []
    monkeypatch.setattr(compile_offload, "explain_all", lambda *args, **kwargs: calls.append(args), raising=False)
    low = 0 if error is ValueError else 1
    with pytest.raises(error, match=message):
        max_batch(factory, "1MiB", low=low, device="cpu", measure=False)
    assert calls == []  # refused before anything is planned, on meta or on the device


@pytest.mark.parametrize("arguments, message", [
    (dict(device="gpu"), r"max_batch\(device='gpu'\) is not a device .*; accepted: 'cuda', 'cuda:N', 'cpu'"),
    (dict(device="meta", measure=True), r"max_batch\(measure=True, device='meta'\): meta tensors hold no values"),
    (dict(steps=0, measure=True), r"max_batch\(steps=0, warmup=2\): the measure times steps >= 1 steps"),
])
def test_max_batch_names_a_device_or_measure_it_cannot_use(monkeypatch, arguments, message):
    monkeypatch.setattr(compile_offload, "explain_all", _explain_peak_per_sample(1000, []), raising=False)
    with pytest.raises(ValueError, match=message):
        max_batch(_linear_factory(), "5KB", **{"device": "cpu", **arguments})


def test_max_batch_takes_numpy_whole_numbers_and_checks_steps_only_where_it_measures(monkeypatch):
    np = pytest.importorskip("numpy")
    monkeypatch.setattr(compile_offload, "explain_all", _explain_peak_per_sample(1000, []), raising=False)
    found = max_batch(_linear_factory(), "5KB", low=np.int64(1), high=np.int64(8), device="cpu", steps=0,
                      measure=False)
    assert found.batch == 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_max_batch_for_cuda_on_a_machine_without_it_plans_on_meta_and_says_why_it_did_not_measure(monkeypatch):
    monkeypatch.setattr(compile_offload, "explain_all", _explain_peak_per_sample(1000, []), raising=False)
    found = max_batch(_linear_factory(), "5KB", device="cuda")
    assert found.batch == 5 and found.planned_on == "meta"
    assert found.measure_error is None and "not measured: this machine has no CUDA device" in " ".join(found.notes)

    def meta_fails(batch, device):
        if device == "meta":
            raise NotImplementedError("no meta kernel")
        return _linear_factory()(batch, device)

    with pytest.raises(ValueError, match=r"planning batch 1 on meta failed \(NotImplementedError: no meta kernel\), "
                                         r"and device='cuda' to plan on instead cannot be used: this machine has no"):
        max_batch(meta_fails, "5KB", device="cuda")


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, scale=None):
        return self.linear(x) * (1.0 if scale is None else scale)


def test_max_batch_takes_keyword_inputs_as_a_dict_and_one_tensor_as_the_input():
    def factory(batch, device, inputs="tuple"):
        with torch.device(device):
            model, x, scale = _Scaled(), torch.randn(batch, 8), torch.ones(8)
        return model, {"tuple": (x, scale), "dict": {"x": x, "scale": scale}, "tensor": x}[inputs]

    found = {kind: max_batch(lambda batch, device: factory(batch, device, kind), "1MiB", high=4, device="cpu",
                             measure=False) for kind in ("tuple", "dict", "tensor")}
    assert {kind: (f.batch, f.planned_on) for kind, f in found.items()} == {kind: (4, "meta") for kind in found}
    assert found["dict"].predicted_peak_bytes == found["tuple"].predicted_peak_bytes
    with compile_offload.config.patch(inner_compiler="eager"):
        measured = max_batch(lambda batch, device: factory(batch, device, "dict"), "1MiB", low=2, high=2,
                             device="cpu", measure=True, steps=1, warmup=0)
    assert measured.measure_error is None and measured.measured_peak_bytes > 0


# --- the command line -----------------------------------------------------------------------


def _run_bench(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", "from compile_offload.tools.bench import main; main()", "--out", str(out), *extra]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _check_outputs(out: Path, tag: str) -> list[dict]:
    lines = (out / f"{tag}.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert rows and all(isinstance(row.get("strategy"), str) for row in rows)
    assert all(row.get("status") in ("ok", "error", "unavailable", "skipped") for row in rows)
    table = (out / f"{tag}.md").read_text()
    assert all(row["strategy"] in table for row in rows)
    assert (out / f"{tag}_pareto.png").read_bytes().startswith(b"\x89PNG")
    return rows


def test_bench_eager_strategies_write_well_formed_output(tmp_path):
    pytest.importorskip("matplotlib")  # the optional plot extra draws the figures this test reads
    result = _run_bench(tmp_path, "--smoke", "--strategies", "eager,eager_ckpt,eager_save_on_cpu,torch_sac_offload")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _check_outputs(tmp_path, "gpt")
    assert [r["strategy"] for r in rows] == ["eager", "eager_ckpt", "eager_save_on_cpu", "torch_sac_offload"]
    assert rows[-1]["status"] == "unavailable"  # no CUDA here


def test_bench_find_max_batch_writes_a_row_per_byte_budget(tmp_path, monkeypatch, capsys):
    from compile_offload.tools.bench import main

    monkeypatch.setattr(compile_offload, "explain_all", _explain_peak_per_sample(1000, []), raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--smoke", "--find-max-batch", "--budgets", "0.5,7000,20KB", "--out", str(tmp_path)])
    assert exit_info.value.code == 0
    rows = [json.loads(line) for line in (tmp_path / "gpt_max_batch.jsonl").read_text().splitlines()]
    assert [(r["strategy"], r["batch"]) for r in rows] == [("max_batch:7000", 7), ("max_batch:20KB", 20)]
    assert (tmp_path / "gpt_max_batch.md").stat().st_size > 0
    assert "skipping budgets 0.5" in capsys.readouterr().err  # said, not silently dropped


def test_bench_compares_hugging_face_offload_with_ours_on_a_tiny_hf_model(tmp_path):
    pytest.importorskip("transformers")
    result = _run_bench(tmp_path, "--smoke", "--model", "hf_gpt2", "--strategies", "hf_ckpt_offload,ours:0.5")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _check_outputs(tmp_path, "hf_gpt2")
    assert [(r["strategy"], r["status"]) for r in rows] == [("hf_ckpt_offload", "ok"), ("ours:0.5", "ok")]
    assert rows[0]["detail"] and rows[1]["predicted_peak_bytes"] > 0


@pytest.mark.slow
@pytest.mark.inductor
def test_bench_fit_times_the_whole_step_against_fsdp2_cpu_offload_with_checkpointing(tmp_path):
    """``bench --fit`` on the CPU: the baseline (per-block checkpointing, FSDP2 CPUOffloadPolicy)
    and fit at each budget, optimizer steps included; a budget that holds the state on the
    device and one that sends it to the host. Times only: the CPU has no device peak."""
    result = _run_bench(tmp_path, "--smoke", "--fit", "--device", "cpu", "--budgets", "1MiB,64MiB")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gpt_fit.jsonl").read_text().splitlines()]
    assert [(r["strategy"], r["status"]) for r in rows] == [
        ("fsdp2_offload_ckpt", "ok"), (f"fit:{2**20}", "ok"), (f"fit:{64 * 2**20}", "ok")]
    assert [r.get("parameters_on") for r in rows[1:]] == ["host", "device"]
    assert [r.get("optimizer_step") for r in rows[1:]] == ["host", "device"]  # on the CPU: never streamed
    assert all(r["ms_median"] > 0 and r["device_peak_bytes"] is None for r in rows)
    assert rows[1]["ms_vs_baseline"] == round(rows[1]["ms_median"] / rows[0]["ms_median"], 4)
    table = (tmp_path / "gpt_fit.md").read_text()
    assert "FSDP2 CPU offload + per-block checkpointing" in table and "64.00 MiB (--budgets)" in table
    assert "| optimizer step |" in table
    assert "fit at 1.00 MiB" in result.stderr  # progress, one line per strategy


def test_bench_equal_memory_runs_ours_at_each_baselines_measured_peak(tmp_path):
    # With predictions: explain's Dynamo reset would make the kept models compile again while
    # timed in turn (the rows would then fall back to the times measured alone).
    result = _run_bench(tmp_path, "--smoke", "--equal-memory", "--strategies", "compile,eager_ckpt",
                        "--budgets", "0.25", "--in-turn")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gpt_equal_memory.jsonl").read_text().splitlines()]
    by_name = {r["strategy"]: r for r in rows}
    peaks = [by_name[name]["peak_bytes"] for name in ("compile", "eager_ckpt")]
    assert all(isinstance(peak, int) and peak > 0 for peak in peaks)
    # Without measured choice first, then with it (each slower: it compiles several plans), so a
    # time limit keeps the plain comparisons; in each half torch.compile's own peak comes last.
    points = [peaks[1], "0.25", peaks[0]]
    expected = [f"ours:{budget}{suffix}" for suffix in ("", "+measured") for budget in points]
    assert [r["strategy"] for r in rows[2:]] == expected
    assert all(r["status"] == "ok" and r["ms_vs_compile"] > 0 for r in rows)
    assert all(r["measured_candidates"] >= 0 for r in rows if r["strategy"].endswith("+measured"))
    # --in-turn: every strategy timed again, 2 smoke steps each, after all had run
    assert all(r["timed"] == "in turn" and len(r["ms_all"]) == 2 and "ms_median_alone" in r for r in rows)
    table = (tmp_path / "gpt_equal_memory.md").read_text()
    assert "one step of each in turn" in table
    assert table.count("\n| ") >= 3 and "| compile |" in table and "| eager_ckpt |" in table and "budget 0.25" in table
    # Which candidate measured choice kept, where it measured some: the planner's plan or a named rival.
    chose = [r for r in rows if r["strategy"].endswith("+measured") and r["measured_candidates"]]
    assert all(r["measured_choice"] for r in chose)
    for row in chose:
        assert all(name in table for name in row["measured_choice"]) and "Measured choice kept " in table


def test_attribution_splits_the_extra_time_by_kind_of_kernel_and_adds_up():
    from compile_offload.benchmarks.attribution import Kernels, attribute, stem

    assert stem("graph_3_cpp_fused_gelu_12") == "cpp_fused_gelu" and stem("triton_poi_fused_add_7") == "triton_poi_fused_add"
    assert stem("aten::mm") == "aten::mm"
    reference = Kernels("compile", 0.010, 0.012)
    for phase, name, seconds in [("forward", "aten::mm", 2e-3), ("forward", "cpp_fused_gelu_0", 1e-3),
                                 ("backward", "aten::mm", 2e-3), ("backward", "aten::mm", 2e-3),
                                 ("backward", "cpp_fused_gone_1", 1e-3)]:
        reference.add(phase, name, seconds)
    ours = Kernels("ours:0.5", 0.013, 0.016)
    for phase, name, seconds in [("forward", "aten::mm", 2e-3), ("forward", "cpp_fused_gelu_0", 1.5e-3),
                                 ("backward", "aten::mm", 2e-3), ("backward", "aten::mm", 2e-3),
                                 ("backward", "aten::mm", 2.5e-3), ("backward", "cpp_fused_gelu_3", 1e-3),
                                 ("backward", "compile_offload::offload", 0.5e-3)]:
        ours.add(phase, name, seconds)
    split = attribute(reference, ours)
    assert split["extra calls"] == pytest.approx(2e-3)  # a third backward matmul at compile's 2 ms a call
    assert split["same kernels, slower"] == pytest.approx(0.5e-3 + 0.5e-3)  # the gelu, and the third mm's extra
    assert split["new kernels"] == pytest.approx(1e-3)  # the gelu recomputed in the backward
    assert split["kernels gone"] == pytest.approx(-1e-3)
    assert split["copies and waits"] == pytest.approx(0.5e-3)
    assert sum(split.values()) == pytest.approx(ours.profiled_seconds - reference.profiled_seconds)


@pytest.mark.slow
@pytest.mark.inductor
def test_bench_attribute_profiles_compile_and_ours_and_writes_the_split(tmp_path):
    result = _run_bench(tmp_path, "--smoke", "--attribute", "--budgets", "0.25", "--steps", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "gpt_attribution.json").read_text())
    reference, ours = data["strategies"]
    assert (reference["strategy"], ours["strategy"]) == ("compile", "ours:0.25")
    assert reference["kernels"] and ours["kernels"]  # Inductor's kernels were seen in the profile
    assert {k["phase"] for k in ours["kernels"]} == {"forward", "backward"}
    assert sum(data["split_seconds"].values()) == pytest.approx(ours["profiled_seconds"] - reference["profiled_seconds"])
    table = (tmp_path / "gpt_attribution.md").read_text()
    assert all(category in table for category in data["split_seconds"]) and table in result.stdout


def test_equal_memory_refuses_ours_among_the_baselines(capsys, monkeypatch):
    from compile_offload.tools import bench

    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--smoke", "--equal-memory", "--strategies", "compile,ours:0.5"])
    assert exit_info.value.code == 2 and "ours runs at each one's measured peak" in capsys.readouterr().err


def test_measured_strategies_parse_and_warm_up_past_their_trials():
    from compile_offload.benchmarks.strategies import expand

    (plain, measured) = expand(["ours:0.5", "ours:0.5+measured"], [], [])
    assert (plain.name, measured.name) == ("ours:0.5", "ours:0.5+measured")
    assert plain.trial_steps == 0 and measured.trial_steps > 0
    assert measured.ours_options()["measured_plan_choice"] is True and "measured_plan_choice" not in plain.ours_options()
    with pytest.raises(ValueError, match="only ours takes"):
        expand(["compile+measured"], [], [])


@pytest.mark.slow
@pytest.mark.inductor
def test_bench_smoke_works_and_writes_well_formed_output(tmp_path):
    result = _run_bench(tmp_path, "--smoke")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _check_outputs(tmp_path, "gpt")
    assert {"compile", "torch_budget:0.5", "ours:0.5"} <= {r["strategy"] for r in rows}


def test_bench_without_matplotlib_writes_the_tables_and_says_why_there_is_no_plot(tmp_path):
    """matplotlib is the optional ``plot`` extra: a user without it gets the JSON lines and
    the markdown table, and one line saying why there is no picture (it crashed before)."""
    code = (
        "import sys, builtins\n"
        "real_import = builtins.__import__\n"
        "def no_matplotlib(name, *args, **kwargs):\n"
        "    if name.split('.')[0] == 'matplotlib':\n"
        "        raise ImportError('no matplotlib here')\n"
        "    return real_import(name, *args, **kwargs)\n"
        "builtins.__import__ = no_matplotlib\n"
        "from compile_offload.tools.bench import main\n"
        "main()\n"
    )
    command = [sys.executable, "-c", code, "--out", str(tmp_path), "--smoke", "--strategies", "eager"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "gpt.jsonl").read_text().strip() and "eager" in (tmp_path / "gpt.md").read_text()
    assert not (tmp_path / "gpt_pareto.png").exists()
    assert "needs matplotlib" in result.stderr


@pytest.mark.parametrize("arguments, message", [
    (["--batch", "0"], "--batch 0: must be at least 1"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--warmup", "-1"], "--warmup -1: must be at least 0"),
    (["--device", "tpu"], "--device tpu: not a device torch knows"),
    (["--device", "meta"], "--device meta: accepted: cpu, cuda"),
    (["--budgets", "1.5"], "--budgets 1.5: .*a fraction must lie in \\[0, 1\\]"),
    (["--budgets", "lots"], "--budgets lots: .*is not a size"),
    (["--torch-budgets", "2"], "--torch-budgets 2: .*must lie in \\[0, 1\\]"),
    (["--out", "/proc/no_such/out"], "--out /proc/no_such/out: cannot write into it"),
    (["--attribute", "--equal-memory"], "--attribute and --equal-memory: each is a run of its own"),
    (["--fit", "--equal-memory"], "--equal-memory and --fit: each is a run of its own"),
    (["--fit", "--budgets", "0.5"], "--fit --budgets 0.5: fit takes a byte budget"),
    (["--fit", "--model", "resnet", "--budgets", "1MiB"], "--fit --model resnet: fit shards a model's blocks"),
    (["--fit", "--device", "cpu"], "--fit on the CPU: give --budgets"),
    (["--fit", "--strategies", "compile", "--budgets", "1MiB"], "--fit compares compile_offload.fit"),
    (["--attribute", "--in-turn"], "--in-turn with --attribute: it times the sweep's"),
    # audit29a: on the CPU it asked for --budgets first, then refused the pair
    (["--fit", "--in-turn", "--device", "cpu"], "--in-turn with --fit: it times the sweep's"),
    (["--strategies", "foo"], "--strategies foo: unknown strategy 'foo'; known: "),
    (["--strategies", "eager,ours:abc"], "--strategies eager,ours:abc: .*memory_budget='abc' is not a size"),
    (["--strategies", "eager:0.5"], "--strategies eager:0.5: strategy 'eager' takes no budget"),
    # fuzz24b: a traceback from the model's constructor once the run had started
    (["--heads", "3", "--width", "64"], "--heads 3: --width 64 is not divisible by it; accepted: heads that divide"),
    (["--heads", "3"], "--heads 3: the default --width 64 is not divisible by it"),
    (["--width", "66"], "--width 66: not divisible by the default --heads 4; accepted: a multiple of --heads"),
    (["--model", "hf_gpt2", "--width", "33"], "--width 33: not divisible by the default --heads 2"),
    # fuzz24b: the results went to --out/../escape.*
    (["--tag", "../escape"], "--tag ../escape: a file name prefix, not a path"),
    (["--find-max-batch", "--budgets", "0.5"], "--find-max-batch --budgets 0.5: needs byte budgets"),
    # audit29a: accepted, then ignored without a word
    (["--find-max-batch", "--budgets", "1MiB", "--strategies", "compile", "--steps", "3"],
     "--find-max-batch does not use --strategies, --steps: drop them"),
    (["--fit", "--budgets", "1MiB", "--device-profile", "h100"], "--fit does not use --device-profile: drop it"),
    (["--find-max-batch", "--budgets", "1MiB", "--warmup", "0"], "--find-max-batch does not use --warmup: drop it"),
    (["--equal-memory", "--torch-budgets", "0.5"], "--equal-memory does not use --torch-budgets: drop it"),
    # fuzz30b F1: read by neither mode; F5: an empty list benchmarked nothing, exit 0
    (["--fit", "--budgets", "1MiB", "--time-limit", "5"], "--fit does not use --time-limit: drop it"),
    (["--attribute", "--no-predict", "--no-cpu-peak"], "--attribute does not use --no-cpu-peak, --no-predict: drop"),
    (["--strategies", ""], "--strategies '': names nothing"),
    (["--budgets", " , "], "--budgets ' , ': names nothing"),
])
def test_bad_bench_flags_exit_before_any_work_naming_the_flag(arguments, message, capsys, monkeypatch):
    """Issue 21: each bad flag is exit status 2 and one line naming it, not a traceback, an
    "ok" row on empty tensors or a StatisticsError in the table."""
    import re

    from compile_offload.tools import bench

    monkeypatch.setattr(bench, "_benchmarks", lambda: pytest.fail("work started before the flags were checked"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--smoke", *arguments])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("arguments", [["--heads", "3"], ["--tag", "a/b"], ["--find-max-batch", "--budgets", "0.5"],
                                       ["--steps", "0"]])
def test_a_rejected_bench_run_leaves_no_out_folder(arguments, tmp_path, capsys):
    # fuzz24b finding 19: 'bench --find-max-batch --budgets 0.5 --out b9' exited 2 and left b9/
    from compile_offload.tools import bench

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--smoke", *arguments, "--out", str(out)])
    assert exit_info.value.code == 2 and capsys.readouterr().err.startswith("bench: ")
    assert not out.exists()


def _ready(name: str, calls: list[str], fail_at: int | None = None) -> runner.Ready:
    def step() -> None:
        calls.append(name)
        if fail_at is not None and calls.count(name) == fail_at:
            raise RuntimeError("out of memory")

    row = {"strategy": name, "ms_median": 100.0, "ms_all": [100.0]}
    return runner.Ready(strategies.Strategy("eager"), step, row)


def test_timing_in_turn_steps_each_strategy_in_turn_and_keeps_the_figures_measured_alone():
    suite = runner.Suite(workload="gpt", size=workloads.SMOKE_SIZES["gpt"], device=torch.device("cpu"),
                         dtype=torch.float32, steps=3, in_turn=True)
    calls: list[str] = []
    ready = [_ready("a", calls), _ready("b", calls)]
    rows = [kept.row for kept in ready]
    runner.time_in_turn(ready, suite)
    assert calls == ["a", "b"] * 4  # one round untimed, then the 3 timed ones
    for row in rows:
        assert row["timed"] == "in turn" and len(row["ms_all"]) == 3
        assert row["ms_median_alone"] == 100.0 and row["ms_all_alone"] == [100.0]
        assert row["ms_min"] <= row["ms_median"] < 100.0
    assert ready == []  # the models are let go


def test_a_failed_step_in_turn_keeps_every_row_at_its_figures_measured_alone(capsys):
    suite = runner.Suite(workload="gpt", size=workloads.SMOKE_SIZES["gpt"], device=torch.device("cpu"),
                         dtype=torch.float32, steps=2, in_turn=True)
    calls: list[str] = []
    ready = [_ready("a", calls), _ready("b", calls, fail_at=2)]
    rows = [kept.row for kept in ready]
    runner.time_in_turn(ready, suite)
    for row in rows:
        assert row["ms_median"] == 100.0 and "ms_median_alone" not in row
        assert row["timed"].startswith("alone (eager failed: RuntimeError: out of memory")
    assert "the step times are those measured alone" in capsys.readouterr().err


def test_strategies_kept_side_by_side_compile_graphs_of_their_own():
    """Two default torch.compile calls on two instances of one module class share one graph
    in Dynamo's cache, whatever functorch config was patched around each first call; kept
    side by side (no reset between them), torch's budget would then time torch.compile's
    plan. With backends of their own each compiles its own."""
    from compile_offload.torch_api import dynamo

    model_inputs = workloads.build("gpt", workloads.SMOKE_SIZES["gpt"], torch.device("cpu"), torch.float32)[1]
    before = dynamo.compiled_graph_count()
    for strategy in (strategies.Strategy("compile"), strategies.Strategy("torch_budget", 0.5)):
        model = workloads.build("gpt", workloads.SMOKE_SIZES["gpt"], torch.device("cpu"), torch.float32)[0]
        fn = strategy.prepare(model, own_backend=True)
        with strategy.run_context():
            fn(*model_inputs)
    assert dynamo.compiled_graph_count() == before + 2


def test_a_suite_of_zero_steps_is_refused():
    from compile_offload.benchmarks import runner, workloads

    size = workloads.SMOKE_SIZES["gpt"]
    with pytest.raises(ValueError, match="steps=0 must be at least 1"):
        runner.Suite(workload="gpt", size=size, device=torch.device("cpu"), dtype=torch.float32, steps=0)
    with pytest.raises(ValueError, match="size.batch=0 must be at least 1"):
        runner.Suite(workload="gpt", size=size.replace(batch=0), device=torch.device("cpu"), dtype=torch.float32)
