"""The scripts in ``examples/`` run as users run them: in a subprocess, on the CPU, with
their tiny default sizes, each under a timeout. Each prints the plan of its compiled graphs
(the ``compile_offload`` INFO line, prefixed ``plan:``) and checks its losses or gradients
against a run without our backend (``--check``).

``examples/train_ddp.py`` runs here as one process (a 1-rank gloo group, no ``torchrun``);
``tests/test_distributed.py`` runs it under ``torchrun`` on 2 ranks.
"""

from __future__ import annotations

import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180


def run_example(script: str, *args: str, env: dict | None = None) -> str:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("COMPILE_OFFLOAD_")}
    environment |= {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"} | (env or {})
    # The code in this checkout, whether or not it is the installed copy.
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(REPO / "examples" / script), *args], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{script} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def plan_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("plan: ")]


def test_train_gpt_trains_prints_the_plan_and_matches_eager(tmp_path):
    dump = tmp_path / "dump"
    # The cpu profile never offloads (host memory is the CPU's own memory), so the offload
    # runtime runs here through the environment variable that forces every eligible copy.
    out = run_example("train_gpt.py", "--steps", "2", "--budget", "0.5", "--profile", "cpu", "--dump-dir", str(dump),
                      "--offload", "on", "--check", env={"COMPILE_OFFLOAD_DEBUG_FORCE_OFFLOAD": "1"})
    (line,) = plan_lines(out)
    assert "predicted peak" in line and "keep" in line and "budget none" not in line
    assert "offload 0 " not in line, line
    assert "offload_remat step 1: loss" in out and "largest loss difference against eager" in out
    (folder,) = dump.iterdir()
    assert {"plan.json", "report.md", "forward.py", "backward.py"} <= {p.name for p in folder.iterdir()}


def test_train_gpt_takes_a_budget_in_bytes():
    out = run_example("train_gpt.py", "--steps", "1", "--budget", "2MiB")
    assert "budget 2.00 MiB" in plan_lines(out)[0]


@pytest.mark.parametrize("args, message", [(["--budget", "5x"], "train_gpt: compile_offload.config.memory_budget='5x' "
                                                                  "is not a size"),
                                           (["--steps", "0"], "train_gpt: --steps 0: train at least one step")])
def test_train_gpt_refuses_a_bad_argument_in_one_line(args, message):
    """fuzz33b F12: a bad budget ended in a traceback; --steps 0 exited 0 having trained nothing."""
    main = runpy.run_path(str(REPO / "examples" / "train_gpt.py"))["main"]
    logger = logging.getLogger("compile_offload")
    before = (list(logger.handlers), logger.level)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert str(exit_info.value).startswith(message) and "\n" not in str(exit_info.value)
    assert (list(logger.handlers), logger.level) == before  # refused before it set up its plan lines


def test_train_gpt_takes_what_it_is_not_given_from_the_environment():
    out = run_example("train_gpt.py", "--steps", "1", env={"COMPILE_OFFLOAD_MEMORY_BUDGET": "none",
                                                           "COMPILE_OFFLOAD_DEVICE_PROFILE": "cpu"})
    (line,) = plan_lines(out)
    assert "budget none" in line, line
    assert "budget none, offload on" in out


def test_train_hf_trainer_takes_the_budget_from_the_environment_and_matches_trainer():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = run_example("train_hf_trainer.py", "--check", env={"COMPILE_OFFLOAD_MEMORY_BUDGET": "0.5"})
    lines = plan_lines(out)
    assert lines and all("budget none" not in line for line in lines)
    assert "memory_budget '0.5'" in out
    assert "offload_remat step 3: loss" in out and "largest loss difference against Trainer without compile" in out


@pytest.mark.skipif(not (REPO / "examples" / "train_ddp.py").exists(), reason="examples/train_ddp.py not written yet")
def test_train_ddp_runs_as_one_process_without_torchrun():
    out = run_example("train_ddp.py", "--steps", "2", "--blocks", "2", "--width", "64", "--tokens", "64",
                      "--inner-compiler", "eager", "--check")
    assert plan_lines(out) and "gradients match eager DDP" in out
