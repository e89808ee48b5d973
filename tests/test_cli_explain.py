"""python -m compile_offload explain MODULE:FACTORY (compile_offload.tools.cli_explain)."""

import json
import re
import subprocess
import sys
import textwrap

import pytest

from compile_offload.__main__ import main

META_FACTORY = textwrap.dedent("""
    import torch
    def make():
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
            x = torch.randn(128, 64)
        return model, (x,)
    def not_a_pair():
        return 1
    def not_callable():
        return 3, (torch.randn(2, 4),)
    def needs_a_width(width):
        return make()
    def three_values():
        return (*make(), None)
    a_number = 5
    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)
        def forward(self, x, *, mask):
            return self.linear(x).relu() * mask
    class MaskedPositional(Masked):
        def forward(self, x, mask):
            return super().forward(x, mask=mask)
    def keyword_inputs():
        with torch.device("meta"):
            return Masked(), {"x": torch.randn(128, 64), "mask": torch.ones(64)}
    def positional_inputs():
        with torch.device("meta"):
            return MaskedPositional(), (torch.randn(128, 64), torch.ones(64))
""")


@pytest.fixture
def factory_folder(tmp_path):
    (tmp_path / "my_models.py").write_text(META_FACTORY)
    return tmp_path


def test_the_command_line_writes_the_dump_for_a_module_of_the_current_folder(factory_folder):
    pytest.importorskip("matplotlib")  # the optional plot extra draws the figures this test reads
    # A real process, run from the user's folder with the module named as a module (not a
    # path): what the docs tell users to type.
    out = factory_folder / "dump"
    command = [sys.executable, "-m", "compile_offload", "explain", "my_models:make", "--budget", "200KiB",
               "--profile", "h100", "--out", str(out)]
    result = subprocess.run(command, cwd=factory_folder, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "predicted peak" in result.stdout and "decision" in result.stdout
    (folder,) = list(out.iterdir())
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["device_profile"] == "h100" and plan["budget_bytes"] == 200 * 1024
    assert {"joint.py", "forward.py", "backward.py", "report.md", "timeline.png"} <= {p.name for p in folder.iterdir()}
    assert all(d["name"] in result.stdout for d in plan["decisions"])


@pytest.mark.parametrize("arguments, message", [
    (["nocolon"], "expected MODULE:FACTORY"),
    (["no_such_module_anywhere:make"], "cannot import 'no_such_module_anywhere'"),
    (["{folder}/missing.py:make"], "no such file"),
    (["{folder}/my_models.py:absent"], "has no function 'absent'"),
    (["{folder}/my_models.py:a_number"], r"my_models.py:a_number is a value of type int, not a function returning \(model, inputs\)"),
    (["{folder}/my_models.py:not_a_pair"], r"must return \(model, example_inputs\), .*a dict of keyword inputs.*; "
                                           "it returned a value of type int"),
    (["{folder}/my_models.py:three_values"], r"must return \(model, example_inputs\), .*; it returned 3 values"),
    (["{folder}/my_models.py:make", "--budget", "lots"], "memory_budget='lots' is not a size"),
    (["{folder}/my_models.py:make", "--profile", "b200"], "device_profile='b200' is unknown"),
    (["{folder}/my_models.py:not_callable"], "model of type int, which cannot be called"),
    (["{folder}/my_models.py:needs_a_width"], "needs_a_width must be callable without arguments .*'width'"),
    (["{folder}/my_models.py:make", "--budget", "-1"], "memory_budget='-1' is negative"),
    (["{folder}/my_models.py:make", "--budget", "200GiB", "--profile", "h100"],
     r"--budget: .*is more than the 80.00 GiB of memory of the 'h100' device profile's GPU"),
    (["{folder}/my_models.py:make", "--out", "{folder}/my_models.py"], "--out: .*dump_dir=.*it is a file, not a folder"),
    (["{folder}/my_models.py:make", "--out", "/proc/no_such/dump"], "--out: .*dump_dir=.*cannot write into it"),
])
def test_mistakes_exit_with_a_message_not_a_traceback(factory_folder, arguments, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", *(a.format(folder=factory_folder) for a in arguments)])
    assert str(exit_info.value).startswith("explain: ")
    assert re.search(message, str(exit_info.value))


def test_a_factory_may_return_the_models_keyword_inputs_as_a_dict(factory_folder, capsys):
    printed = {}
    for factory in ("keyword_inputs", "positional_inputs"):
        assert main(["explain", f"{factory_folder}/my_models.py:{factory}", "--budget", "0", "--profile", "h100"]) == 0
        printed[factory] = capsys.readouterr().out
    assert "predicted peak" in printed["keyword_inputs"]
    # the plan of the same model called with the same tensors as positional inputs
    assert printed["keyword_inputs"] == printed["positional_inputs"]


def test_a_strict_budget_below_the_minimum_exits_with_one_line(factory_folder):
    import compile_offload

    with compile_offload.config.patch(strict_budget=True), pytest.raises(SystemExit) as exit_info:
        main(["explain", f"{factory_folder}/my_models.py:make", "--budget", "1", "--profile", "h100"])
    assert re.fullmatch(r"explain: compile_offload: graph_0: memory budget 1 B is below the minimum .*; "
                        r"strict_budget=True", str(exit_info.value))


def test_a_factory_file_named_like_a_standard_module_leaves_that_module_alone(tmp_path, capsys):
    import random

    (tmp_path / "random.py").write_text(META_FACTORY)
    assert main(["explain", f"{tmp_path}/random.py:make", "--budget", "0.5", "--profile", "h100"]) == 0
    assert sys.modules["random"] is random and "predicted peak" in capsys.readouterr().out


def test_a_failing_import_inside_the_module_keeps_its_traceback(tmp_path):
    (tmp_path / "broken_models.py").write_text("import no_such_dependency_xyz\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
            main(["explain", "broken_models:make"])
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_refused_not_taken_for_no_dump(factory_folder, out):
    # fuzz24b: --out "" printed the plan, exit 0, and wrote nothing, where dump_dir="" is an error
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", f"{factory_folder}/my_models.py:make", "--out", out])
    assert re.fullmatch(r"explain: --out '\s*': an empty path; .*leave --out out for no dump", str(exit_info.value))


@pytest.mark.parametrize("budget", ["", "  "])
def test_an_empty_budget_is_refused_naming_the_flag_not_the_environment(factory_folder, budget):
    # it said to leave COMPILE_OFFLOAD_MEMORY_BUDGET unset, which the user of the flag never set
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", f"{factory_folder}/my_models.py:make", "--budget", budget])
    message = str(exit_info.value)
    assert re.fullmatch(r"explain: --budget '\s*': an empty budget; leave --budget out .*", message)
    assert "COMPILE_OFFLOAD_MEMORY_BUDGET" not in message


def test_a_factory_file_with_a_syntax_error_is_one_line_naming_where(tmp_path):
    # fuzz24b finding 20: 'def make(:' printed a 20-line traceback through our code
    (tmp_path / "syntax_models.py").write_text("import torch\ndef make(:\n    pass\n")
    for target in (f"{tmp_path}/syntax_models.py:make", "syntax_models:make"):
        sys.path.insert(0, str(tmp_path))
        try:
            with pytest.raises(SystemExit) as exit_info:
                main(["explain", target])
        finally:
            sys.path.remove(str(tmp_path))
        message = str(exit_info.value)
        assert message.startswith("explain: cannot import ") and "\n" not in message
        assert re.search(r"\(SyntaxError: .*syntax_models\.py, line 2\)\); fix the file$", message), message


def test_an_exception_the_factory_raises_keeps_its_traceback(tmp_path):
    (tmp_path / "raising_models.py").write_text("def make():\n    raise RuntimeError('boom in the factory')\n")
    with pytest.raises(RuntimeError, match="boom in the factory"):
        main(["explain", f"{tmp_path}/raising_models.py:make"])


def test_a_dump_that_could_not_be_written_is_not_reported_written(factory_folder, capsys):
    # fuzz24b finding 3: with out/graph_0 a file the dump failed (warned), yet the command
    # printed "dump written to out" and exited 0.
    out = factory_folder / "dump"
    out.mkdir()
    (out / "graph_0").write_text("not a folder")
    with pytest.warns(UserWarning, match="could not write the dump"), pytest.raises(SystemExit) as exit_info:
        main(["explain", f"{factory_folder}/my_models.py:make", "--budget", "0.5", "--profile", "h100",
              "--out", str(out)])
    assert re.fullmatch(rf"explain: --out {re.escape(str(out))}: the dump of graph_0 was not written "
                        r"\(.+\); what is printed above is not in it: fix the folder "
                        "and run again", str(exit_info.value))
    printed = capsys.readouterr().out
    assert "predicted peak" in printed and "dump written" not in printed
    assert (out / "graph_0").read_text() == "not a folder"
    # The folder fixed, the same command writes the dump and says so.
    (out / "graph_0").unlink()
    assert main(["explain", f"{factory_folder}/my_models.py:make", "--budget", "0.5", "--profile", "h100",
                 "--out", str(out)]) == 0
    assert f"dump written to {out}" in capsys.readouterr().out and (out / "graph_0" / "plan.json").is_file()
