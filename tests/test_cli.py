"""python -m compile_offload {demo,explain}."""

import json
import textwrap

from compile_offload.__main__ import main


def test_explain_prints_the_plan_and_writes_the_dump(tmp_path, capsys):
    factory = tmp_path / "models.py"
    factory.write_text(textwrap.dedent("""
        import torch
        def make():
            with torch.device("meta"):
                model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
                x = torch.randn(128, 64)
            return model, (x,)
    """))
    out = tmp_path / "dump"
    assert main(["explain", f"{factory}:make", "--budget", "0.5", "--profile", "h100", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "predicted peak" in printed and "decision" in printed and str(out) in printed
    (folder,) = list(out.iterdir())
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["device_profile"] == "h100" and 0.5 * plan["baseline_peak_bytes"] <= plan["budget_bytes"] < plan["baseline_peak_bytes"]


def test_demo_trains_and_prints_the_loss(capsys):
    assert main(["demo", "--steps", "1", "--device", "cpu", "--budget", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "predicted peak" in printed and "step 0: loss" in printed
