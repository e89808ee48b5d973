"""``python -m compile_offload model-check``: the machinery (torch's plans read back, the
eager plans, the output format), never the figures it prints."""

from __future__ import annotations

import json
import re

import pytest
import torch

from compile_offload.__main__ import main
from compile_offload.tools.model_check import (
    CheckpointedDecoder,
    autograd_saved,
    capture_joint,
    checkpoint_inputs,
    decoder_on_meta,
    load_anchors,
)
from compile_offload.passes import compat
from compile_offload.passes.analyze import analyze_joint

from .passes.joint_capture import capture

TINY = {"layers": 2, "d": 32, "heads": 2, "ff": 128, "seq": 16, "batch": 2, "dtype": "float32"}


def mlp(x, w1, w2):
    return torch.tanh(torch.relu(x @ w1) @ w2).sum()


@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_budget_saved_values_are_what_torchs_partitioner_saves_under_that_budget(budget):
    def hook(joint, joint_inputs):
        saved = {n.name for n in compat.budget_saved_values(joint, budget)}
        with torch._functorch.config.patch(activation_memory_budget=budget):
            _, bw = compat.default_partition(joint, joint_inputs)
        read = {n.name for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")}
        return saved, read

    inputs = (torch.randn(16, 32, requires_grad=True), torch.randn(32, 64, requires_grad=True),
              torch.randn(64, 32, requires_grad=True))
    (saved, read), _ = capture(mlp, *inputs, hook=hook)
    assert saved == read


def test_budget_saved_values_rejects_a_budget_outside_0_1():
    def hook(joint, _):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            compat.budget_saved_values(joint, 1.5)
        return True

    captured, _ = capture(mlp, torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True),
                          torch.randn(8, 8, requires_grad=True), hook=hook)
    assert captured


def test_checkpointed_plan_keeps_only_each_blocks_input():
    model, x = decoder_on_meta(TINY)
    a = analyze_joint(capture_joint(CheckpointedDecoder(model), x, decompose=False))
    kept = checkpoint_inputs(a)
    # Block 0 reads the model input (steady, not counted); block 1 reads block 0's output.
    assert len(kept) == 1
    (block_output,) = kept
    assert block_output.target is torch.ops.aten.add.Tensor and block_output.meta.get("ac_graph_id") is not None


def test_autograd_plan_keeps_every_forward_tensor_the_backward_reads():
    model, x = decoder_on_meta(TINY)
    a = analyze_joint(capture_joint(model, x, decompose=False))
    kept = autograd_saved(a)
    assert kept and all(a.is_forward(t) for t in kept)
    read = {arg for n in a.bw_nodes for arg in a.inputs[n]}
    assert kept <= read


def write_anchors(directory, rows):
    header = {"torch": "2.11.0+cu130", "device": "test GPU", "args": TINY}
    lines = [json.dumps(header), json.dumps({"d2h_pinned_GBps": 55.1, "h2d_pinned_GBps": 54.9})]
    lines += [json.dumps(row) for row in rows]
    (directory / "anchors_gpt8.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_cli_prints_one_json_object_per_anchor_row(tmp_path, capsys):
    rows = [{"mode": "compile", "ms_median": 10.0, "peak_above_steady_mb": 1.0},
            {"mode": "compile_budget_0.5", "ms_median": 11.0, "peak_above_steady_mb": 0.8},
            {"mode": "eager_ckpt", "ms_median": 13.0, "peak_above_steady_mb": 0.5},
            {"mode": "eager_offload", "ms_median": 50.0, "peak_above_steady_mb": 0.2}]
    write_anchors(tmp_path, rows)
    assert main(["model-check", "--json", "--anchors", str(tmp_path), "--shapes", "gpt8", "--skip-optimality",
                 "--pareto-shapes", ""]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    anchors = [r for r in records if r["kind"] == "anchor"]
    assert [r["strategy"] for r in anchors] == [r["mode"] for r in rows]
    keys = {"kind", "strategy", "shape", "role", "measured_peak_mb", "predicted_peak_mb", "measured_ratio", "predicted_ratio"}
    assert all(keys <= set(r) for r in anchors)
    assert [r["role"] for r in anchors] == ["fit", "validation", "validation", "validation"]
    by = {r["strategy"]: r for r in anchors}
    assert by["compile"]["measured_ratio"] == 1.0 and by["compile"]["predicted_ratio"] == 1.0
    assert by["compile_budget_0.5"]["measured_ratio"] == pytest.approx(1.1)
    assert by["eager_ckpt"]["predicted_peak_mb"] > 0
    assert by["eager_offload"]["predicted_peak_mb"] is None and by["eager_offload"]["predicted_ratio"] is None
    # Without --json: the same rows as a table.
    assert main(["model-check", "--anchors", str(tmp_path), "--shapes", "gpt8", "--skip-optimality",
                 "--pareto-shapes", ""]) == 0
    table = capsys.readouterr().out
    assert all(f"| gpt8 | {r['mode']} |" in table for r in rows)


@pytest.mark.parametrize("flag", ["--shapes", "--pareto-shapes"])
def test_cli_rejects_an_unknown_shape_with_one_line(flag):
    with pytest.raises(SystemExit) as exit_info:
        main(["model-check", "--skip-optimality", flag, "gpt8,foo"])
    assert re.fullmatch(r"model-check: .*unknown anchor shape 'foo'; known: gpt8, deep24", str(exit_info.value))


@pytest.mark.parametrize("arguments, message", [
    # fuzz24b finding 19: an empty table, exit 0
    (["--shapes", "", "--skip-optimality"],
     r"--shapes '': names no anchor shape \(and no optimality graph: an empty report\); accepted: one or more of "
     r"gpt8, deep24, comma-separated"),
    (["--shapes", ",", "--optimality-graphs", ""], r"--shapes ',': names no anchor shape .*"),
    (["--shapes", "", "--fit"], r"--shapes '': names no anchor shape \(--fit fits the anchors\); .*"),
    # fuzz24b finding 19: accepted, then every graph's row read "too many for max_plans=-1"
    (["--max-plans", "-1"], r"--max-plans -1: the most plans the exhaustive search may evaluate; accepted: a whole "
                            r"number >= 1"),
    (["--max-plans", "0"], r"--max-plans 0: .*"),
])
def test_cli_rejects_no_shapes_and_a_non_positive_max_plans_with_one_line(arguments, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["model-check", "--pareto-shapes", "", *arguments])
    assert re.fullmatch(f"model-check: {message}", str(exit_info.value))


def test_no_anchor_shape_prints_the_optimality_table_alone(capsys):
    """fuzz33b F08: docs/benchmarks.md makes the optimality table with --shapes "", which was
    refused (no anchor shape) though the table needs none."""
    assert main(["model-check", "--shapes", "", "--pareto-shapes", "", "--optimality-graphs", "tower4"]) == 0
    printed = capsys.readouterr().out
    assert "| tower4 | 42.00 |" in printed and "| shape | strategy |" not in printed and "measured on" not in printed


def test_load_anchors_names_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_anchors(tmp_path, ["gpt8"])
    with pytest.raises(ValueError, match="unknown anchor shape"):
        load_anchors(tmp_path, ["gpt9"])
    (tmp_path / "anchors_gpt8.jsonl").write_text(json.dumps({"mode": "eager"}) + "\n")
    with pytest.raises(ValueError, match="header"):
        load_anchors(tmp_path, ["gpt8"])


def test_shipped_anchors_load():
    shapes = load_anchors()
    assert {s.name for s in shapes} == {"gpt8", "deep24"}
    assert all("compile" in s.rows and s.args["layers"] > 0 for s in shapes)


@pytest.mark.slow
def test_the_builtin_h100_constants_are_what_the_fit_gives_on_the_shipped_anchors():
    """Reproducible calibration: refitting on the torch.compile rows of the shipped anchors
    gives the built-in constants. Fails when the cost model or the simulator changes what
    the compile plans predict: then refit (model-check --fit) and update passes/cost.py and
    docs/benchmarks.md."""
    from compile_offload.tools.model_check import fit_h100, torch_plans
    from compile_offload.passes.cost import H100_CALIBRATION

    fit = fit_h100([torch_plans(shape, fit_only=True) for shape in load_anchors()])
    assert {"compute": fit.compute_efficiency, "memory": fit.memory_efficiency,
            "launch": fit.launch_overhead_seconds} == H100_CALIBRATION


@pytest.mark.slow
def test_the_h200_profile_predicts_the_measured_h200_compile_steps():
    """The h200 profile's memory fraction is fitted to the torch.compile steps of the H200
    runs (docs/benchmarks.md): each anchor's compile step is predicted within 2% of the
    range measured there."""
    from compile_offload.passes.cost import BUILTIN_PROFILES, H200_MEASURED_COMPILE_MS
    from compile_offload.tools.model_check import anchor_predictions, torch_plans

    for shape in load_anchors():
        (compile_row,) = [p.record() for p in anchor_predictions(torch_plans(shape, fit_only=True),
                                                                  BUILTIN_PROFILES["h200"])
                          if p.record()["strategy"] == "compile"]
        low, high = H200_MEASURED_COMPILE_MS[shape.name]
        assert 0.98 * low <= compile_row["predicted_ms"] <= 1.02 * high, (shape.name, compile_row)


@pytest.mark.inductor
@pytest.mark.slow
def test_the_anchor_step_of_torchs_default_plan_is_predicted_at_the_cpu_allocator():
    """The anchors' step as ``bench_anchors.py`` runs it (output held through the eager loss
    and the backward, gradients zeroed in place, several steps measured), compiled by torch
    on the CPU: its peak is what model-check predicts for torch's default plan, the eager
    loss and the input's gradient from the step before included."""
    from compile_offload.benchmarks.torch_plans_cpu import measured_peak, predicted_peaks

    args = {"layers": 2, "d": 64, "heads": 2, "ff": 256, "seq": 128, "batch": 2, "dtype": "float32"}
    predicted = predicted_peaks(args, {"compile": None})["compile"]
    assert measured_peak(args, None, reorder=True) == pytest.approx(predicted, rel=0.005)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_eager_loss_measured_small_and_extended_is_its_peak_at_full_size(dtype):
    """The loss's peak is linear in its size: measured on two small outputs and extended,
    it is what the allocator shows for the whole output."""
    from compile_offload.tools.model_check import LOSS_PROBE_ELEMENTS, _loss_peak_measured, loss_peak_bytes

    args = {"batch": 2, "seq": 8, "d": LOSS_PROBE_ELEMENTS // 4, "dtype": dtype}  # 4x the probe's size
    assert loss_peak_bytes(args) == _loss_peak_measured(2 * 8 * LOSS_PROBE_ELEMENTS // 4, getattr(torch, dtype))
