"""Every code block in ``README.md`` and ``docs/*.md`` is run or checked, so the docs cannot rot.

Conventions for writing docs (a failing test here names the file and the line of the block):

- Every fenced block names its language: ```` ```python ````, ```` ```bash ```` or
  ```` ```text ```` (output, diagrams, file contents: not checked). An unlabelled fence fails.
- ```` ```python ```` blocks are executed, one test per block (id ``file:line``). The blocks of
  one file run **in order, in one namespace**, like cells of a notebook: a block may use names
  an earlier block of the same file defined (running one block alone runs the blocks before
  it first). They run on the CPU, so keep them to tiny models or the ``meta`` device
  (``explain`` plans without running; ``device_profile="h100"`` plans for a GPU on a CPU),
  and to seconds each. Each file's blocks run in a temporary folder of its own (files they
  write land there), with the repository on ``sys.path`` (``from benchmarks.workloads
  import Decoder`` works). ``compile_offload.config`` and the ``compile_offload`` logger's
  level are restored after every block: set a knob in the block that needs it. Without a
  GPU the blocks run with ``inner_compiler="eager"`` (the partitioned graphs as Python:
  Inductor's CPU code generation takes minutes on a small machine; other tests cover it).
  A block that needs a CUDA GPU or an optional package starts with a line such as
  ``# needs: cuda`` or ``# needs: transformers, accelerate`` and is skipped without them
  (the blocks after it must not depend on it). A ```` ```text ```` block right after a python
  block, where the prose between them says the block ``prints here``, is its output: each of
  its lines must be printed by the block.
- ```` ```bash ```` blocks are checked line by line (``\\`` continues a line, ``#`` starts a
  comment; ``VAR=value`` prefixes must be knobs' ``COMPILE_OFFLOAD_*`` variables or torch's
  ``TORCH_LOGS``/``TORCH_TRACE``):

  - ``python -m compile_offload explain FILE.py:FACTORY ...`` runs (planning only, cheap),
    with ``--out`` redirected to a temporary folder;
  - any other ``python -m MODULE ...``, ``python SCRIPT.py ...`` and ``torchrun ...
    SCRIPT.py ...`` must parse: the module or script exists and its ``argparse`` parser
    accepts the arguments (nothing after the parse runs);
  - ``pip install`` may only name extras ``pyproject.toml`` declares; a line running
    ``pytest`` must be exactly the test command ``.ci/run`` runs, and the README shows it;
  - a ``*.sh`` script must exist, be executable and pass ``bash -n``;
  - any other command fails the test: make it checkable or show it as ```` ```text ````.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import re
import runpy
import shlex
import subprocess
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import compile_offload

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(.*)$")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    blocks, current, lines = [], None, []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        match = FENCE.match(text)
        if current is None:
            if match:
                current, indent, lines = Block(path, number, match.group(2).strip(), ""), match.group(1), []
        elif match and not match.group(2).strip():
            current.code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines) + "\n"
            blocks.append(current)
            current = None
        else:
            lines.append(text)
    assert current is None, f"{path.relative_to(REPO)}:{current.line}: code block never closed"
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in blocks_of(path)]
PYTHON = [b for b in ALL_BLOCKS if b.language == "python"]
BASH = [b for b in ALL_BLOCKS if b.language == "bash"]


def test_every_block_names_its_language():
    unknown = [f"{b.id} ({b.language or 'no language'})" for b in ALL_BLOCKS if b.language not in ("python", "bash", "text")]
    assert not unknown, "label these fences python, bash or text: " + ", ".join(unknown)


# --- python blocks --------------------------------------------------------------------------


class FileSession:
    """The namespace and folder one doc file's python blocks share, and how far they ran."""

    def __init__(self, path: Path, folder: Path) -> None:
        # A real module, so classes the blocks define have an importable home (Dynamo
        # looks a class's module up when it traces a method of it).
        module = types.ModuleType(f"_docs_{path.stem}")
        sys.modules[module.__name__] = module
        self.namespace: dict = module.__dict__
        self.folder = folder
        self.ran = 0  # blocks of this file executed so far, in order


_sessions: dict[Path, FileSession] = {}


@contextlib.contextmanager
def isolated(folder: Path):
    """Run in ``folder`` with the repository importable; restore the config, the logger
    level and the working directory afterwards."""
    config = compile_offload.config.get_config_copy()
    logger = logging.getLogger("compile_offload")
    level = logger.level
    cwd = os.getcwd()
    sys.path.insert(0, str(REPO))
    os.chdir(folder)
    if not torch.cuda.is_available():
        compile_offload.config.inner_compiler = "eager"  # Inductor's CPU code generation: minutes here
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.path.remove(str(REPO))
        logger.setLevel(level)
        for name, value in config.items():
            if getattr(compile_offload.config, name) != value:
                setattr(compile_offload.config, name, value)


def run_python(block: Block, session: FileSession) -> None:
    with isolated(session.folder):
        exec(compile(block.code, block.id, "exec"), session.namespace)  # noqa: S102


def missing_needs(block: Block) -> list[str]:
    """What the block's ``# needs: ...`` first line names that this machine lacks."""
    first = block.code.splitlines()[0] if block.code.strip() else ""
    if not first.startswith("# needs:"):
        return []
    missing = []
    for need in (word.strip() for word in first.removeprefix("# needs:").split(",")):
        if need == "cuda":
            if not torch.cuda.is_available():
                missing.append("a CUDA GPU")
        elif importlib.util.find_spec(need) is None:
            missing.append(need)
    return missing


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs(block: Block, tmp_path_factory):
    missing = missing_needs(block)
    if missing:
        pytest.skip(f"the block needs {', '.join(missing)}")
    same_file = [b for b in PYTHON if b.path == block.path and not missing_needs(b)]
    index = same_file.index(block)
    session = _sessions.get(block.path)
    if session is None or session.ran > index:  # a fresh namespace when a block runs again
        session = _sessions[block.path] = FileSession(block.path, tmp_path_factory.mktemp(block.path.stem))
    for earlier in same_file[session.ran:index]:  # the blocks this one may depend on
        try:
            run_python(earlier, session)
        except Exception as error:
            pytest.fail(f"an earlier block of the same file, {earlier.id}, failed: {error!r}")
        session.ran += 1
    printed = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
        warnings.simplefilter("ignore")  # the docs show warnings on purpose (a GPU profile on a CPU, ...)
        run_python(block, session)
    session.ran = index + 1
    shown = shown_output(block)
    if shown is not None:  # what the page says the block prints, it prints
        missing = [line for line in shown.code.splitlines() if line.strip() and line not in printed.getvalue()]
        assert not missing, f"{shown.id}: the page shows lines {block.id} does not print: {missing}"


def shown_output(block: Block) -> Block | None:
    """The ```` ```text ```` block a page shows as ``block``'s output: the next block of the
    file, where the prose between them says it ``prints here``."""
    later = [b for b in ALL_BLOCKS if b.path == block.path and b.line > block.line]
    if not later or later[0].language != "text":
        return None
    lines = block.path.read_text().splitlines()[block.line:later[0].line - 1]
    return later[0] if "prints here" in " ".join(lines) else None


# --- bash blocks ----------------------------------------------------------------------------


def lines_of(code: str) -> list[list[str]]:
    """Each line of a block as words: comments dropped, backslash continuations joined."""
    found, pending = [], ""
    for line in code.splitlines():
        line = pending + line
        pending = ""
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        words = shlex.split(line, comments=True)
        if words:
            found.append(words)
    return found


def commands(code: str) -> list[list[str]]:
    """The block's commands as word lists, ``a && b`` split into ``a`` and ``b``."""
    found = []
    for words in lines_of(code):
        command = []
        for word in words:
            if word == "&&":
                found.append(command)
                command = []
            else:
                command.append(word)
        found.append(command)
    return found


KNOB_VARIABLES = {f"COMPILE_OFFLOAD_{name.upper()}" for name in compile_offload.config.get_config_copy()}
OTHER_VARIABLES = {"TORCH_LOGS", "TORCH_TRACE", "CUDA_VISIBLE_DEVICES", "PYTHONPATH"}


class Parsed(Exception):
    """Raised in place of running a program once its arguments parsed."""


@contextlib.contextmanager
def stop_after_parsing():
    import argparse

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        result = original(self, args, namespace)
        raise Parsed(result)

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def check_parses(target: list[str], *, module: bool, where: str) -> None:
    """``python -m MODULE ARGS`` (``module``) or ``python SCRIPT ARGS``: the module or script
    exists and its argparse parser accepts ARGS; nothing after the parse runs."""
    name, args = target[0], target[1:]
    if not module:
        assert (REPO / name).is_file(), f"{where}: no such script {name}"
    argv, path = sys.argv, list(sys.path)
    sys.argv = [name, *args]
    sys.path.insert(0, str(REPO))
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with stop_after_parsing(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the package's __main__ imported before
            if module:
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(REPO / name), run_name="__main__")
    except Parsed as parsed:
        if module and args[:1] == ["bench"]:
            check_bench_flags(parsed.args[0], target, where)
        return
    except SystemExit as error:
        pytest.fail(f"{where}: {shlex.join(target)} does not parse (exit {error.code}): {stderr.getvalue().strip()}")
    finally:
        sys.argv, sys.path[:] = argv, path
    pytest.fail(f"{where}: {shlex.join(target)} never parsed its arguments with argparse")


def check_bench_flags(args, target: list[str], where: str) -> None:
    """bench refuses, before any work, a flag its mode does not read (review35c H1: a page
    gave ``--attribute ... --no-predict``, which argparse accepts and bench refuses). A
    command for a GPU is checked as on a machine with one."""
    from unittest import mock

    from compile_offload.tools import bench

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), mock.patch("torch.cuda.is_available", return_value=True):
            bench.check_arguments(args)
    except SystemExit as error:
        pytest.fail(f"{where}: {shlex.join(target)} is refused (exit {error.code}): {stderr.getvalue().strip()}")


def declared_extras() -> set[str]:
    text = (REPO / "pyproject.toml").read_text()
    try:
        import tomllib  # Python >= 3.11
    except ImportError:
        section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
        return set(re.findall(r"^(\w[\w-]*)\s*=", section, flags=re.M))
    return set(tomllib.loads(text)["project"]["optional-dependencies"])


def check_pip(words: list[str], where: str) -> None:
    declared = declared_extras()
    for word in words[2:]:
        match = re.fullmatch(r"\.\[([\w,]+)\]", word.strip("'\""))
        if match:
            unknown = set(match.group(1).split(",")) - declared
            assert not unknown, f"{where}: pip install names extras pyproject.toml does not declare: {unknown}"


def ci_test_command() -> list[str]:
    """The line of ``.ci/run`` that runs the tests, as words."""
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    return shlex.split(next(line for line in lines if "python -m pytest" in line and not line.lstrip().startswith("#")))


def check_command(words: list[str], where: str, tmp_path: Path) -> None:
    words = list(words)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        variable = words.pop(0).split("=", 1)[0]
        assert variable in KNOB_VARIABLES | OTHER_VARIABLES, f"{where}: unknown environment variable {variable}"
    assert words, f"{where}: an assignment without a command"
    program, command = words[0], shlex.join(words)
    if program == "pip":
        return check_pip(words, where)
    if program == "python" and words[1:3] == ["-m", "pip"]:
        return check_pip(words[2:], where)
    if program == "python" and words[1:3] == ["-m", "pytest"]:
        return
    if program == "python" and words[1:4] == ["-m", "compile_offload", "explain"] and ".py:" in "".join(words[4:5]):
        return run_explain(words[3:], where, tmp_path)
    if program == "python" and words[1:2] == ["-m"]:
        return check_parses(words[2:], module=True, where=where)
    if program == "python":
        return check_parses(words[1:], module=False, where=where)
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(words[1:])
        return check_parses([parsed.training_script, *parsed.training_script_args], module=False, where=where)
    if program.endswith(".sh"):
        script = REPO / program
        assert script.is_file() and os.access(script, os.X_OK), f"{where}: {program} is missing or not executable"
        subprocess.run(["bash", "-n", str(script)], check=True)
        return
    pytest.fail(f"{where}: no check for {command!r}: make it checkable (tests/test_docs.py) or show it as text")


def run_explain(argv: list[str], where: str, tmp_path: Path) -> None:
    """``python -m compile_offload explain FILE.py:FACTORY ...``: plan for real (nothing runs
    on the device), the dump in a temporary folder."""
    from compile_offload.__main__ import main

    argv = list(argv)
    if "--out" in argv:
        argv[argv.index("--out") + 1] = str(tmp_path / "out")
    stdout = io.StringIO()
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(stdout), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert main(argv) == 0, f"{where}: {shlex.join(argv)} failed"
    finally:
        os.chdir(cwd)
    assert "predicted peak" in stdout.getvalue(), f"{where}: {shlex.join(argv)} printed no plan"


@pytest.mark.parametrize("block", BASH, ids=[b.id for b in BASH])
def test_bash_block_checks(block: Block, tmp_path):
    for line in lines_of(block.code):
        if "pytest" in line:
            assert line == ci_test_command(), \
                f"{block.id}: the test command is not the one .ci/run runs ({shlex.join(ci_test_command())})"
    for command in commands(block.code):
        check_command(command, block.id, tmp_path)


def test_the_readme_shows_the_ci_test_command():
    readme = [line for b in BASH if b.path.name == "README.md" for line in lines_of(b.code)]
    assert ci_test_command() in readme


@pytest.mark.parametrize("command", [
    "python -m compile_offload demo --no-such-flag",
    "python -m compile_offload demo --inner-compiler tvm",
    "python -m compile_offload bench --attribute --model gpt --budgets 0.5 --no-predict",
    "python examples/no_such_example.py",
    "python examples/train_gpt.py --budgte 0.5",
    "torchrun --nproc-per-node 2 examples/train_ddp.py --no-such-flag",
    "COMPILE_OFFLOAD_MEMORY_BUGDET=1GiB python examples/train_gpt.py",
    'pip install -e ".[test,no_such_extra]"',
    "curl https://example.com",
])
def test_the_bash_checks_catch_mistakes(command, tmp_path):
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check_command(shlex.split(command), "test", tmp_path)


# --- what the user pages say ------------------------------------------------------------------
#
# The user pages (the README and docs/*.md but the two below) describe the product as it is:
# every knob in the reference, every warning in troubleshooting, links that resolve, and no
# lab notebook (dates, commit hashes, machine loans, issue numbers, "not landed" stories).
# design.md and benchmarks.md describe how it works and what was measured, and are exempt.

EXEMPT_FROM_USER_RULES = {"docs/design.md", "docs/benchmarks.md"}
USER_PAGES = [path for path in DOC_FILES if str(path.relative_to(REPO)) not in EXEMPT_FROM_USER_RULES]

# Words from how the project was developed that a user page must not use: replace them with
# plain words, or define them in the glossary (docs/index.md) and drop them from this list.
DENIED = {
    r"\blease[sd]?\b": "a loan of a GPU machine: say what was measured, on which GPU",
    r"\bissue\s*#?\d+": "an issue number: say what the behaviour is",
    r"\bcontract suite\b|\bbudget contract\b|\bthe contract\b": "an internal test suite: say what is checked",
    r"\bmodel famil(?:y|ies)\b|\bfamilies\b": "internal grouping of test models: name the models",
    r"\bbudget loop\b": "say 're-planning' (defined in the glossary)",
    r"\bnot landed\b|\btried and reverted\b|\bfixed since\b|\bfixed the same day\b": "a development story",
    r"\b\d-core (?:VM|machine)\b|\bthis project's \d-core\b": "a development machine",
}
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"`(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}`")


def history_in(text: str) -> list[str]:
    """What in ``text`` reads as a development note: denied words, dates, commit hashes."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, why in DENIED.items():
            for match in re.finditer(pattern, line, flags=re.I):
                found.append(f"line {number}: {match.group(0)!r} ({why})")
        found += [f"line {number}: date {m.group(0)}" for m in DATE.finditer(line)]
        found += [f"line {number}: commit hash {m.group(0)}" for m in COMMIT.finditer(line)]
    return found


def test_the_user_pages_are_listed_and_the_exempt_pages_exist():
    names = {str(path.relative_to(REPO)) for path in USER_PAGES}
    assert {"README.md", "docs/index.md", "docs/reference.md", "docs/troubleshooting.md"} <= names
    for exempt in EXEMPT_FROM_USER_RULES:
        assert (REPO / exempt).is_file(), f"{exempt} is exempt from the user-page rules but does not exist"


@pytest.mark.parametrize("path", USER_PAGES, ids=[str(p.relative_to(REPO)) for p in USER_PAGES])
def test_user_pages_carry_no_development_history(path):
    found = history_in(path.read_text())
    assert not found, f"{path.relative_to(REPO)}: " + "; ".join(found)


@pytest.mark.parametrize("text", [
    "measured in the third lease",
    "see issue 16 for the target",
    "the contract suite keeps every budget",
    "on eight more families",
    "the budget loop re-plans",
    "measured 2026-11-27 on an H200",
    "fixed in `d1fe956`",
    "this was tried, not landed",
])
def test_the_history_check_catches_development_notes(text):
    assert history_in(text)


@pytest.mark.parametrize("text", ["a budget of 1000 bytes", "`1000000` bytes", "re-planning under 2 GiB",
                                  "`graph_0_0`", "released in 2026"])
def test_the_history_check_leaves_plain_text_alone(text):
    assert not history_in(text)


def glossary() -> dict[str, str]:
    """The glossary table of docs/index.md: word -> meaning."""
    text = (REPO / "docs" / "index.md").read_text()
    section = text.split("## Words used in these docs", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    return {word.strip(): meaning.strip() for word, meaning in rows[1:]}  # rows[0]: the header


def test_the_glossary_defines_the_terms_the_pages_use():
    words = glossary()
    for term in ("memory budget", "steady state", "predicted peak", "scheduled peak", "re-planning",
                 "unconstrained plan", "minimum-memory plan", "device profile", "bucket graph"):
        assert term in words and len(words[term]) > 20, f"docs/index.md's glossary does not define {term!r}"
    for term in words:  # a glossary word must not be one the history check forbids
        assert not history_in(term), f"the glossary defines {term!r}, which the user pages may not use"


def config_knobs() -> dict:
    return compile_offload.config.get_config_copy()


def test_every_config_knob_is_in_the_reference():
    reference = (REPO / "docs" / "reference.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in reference.splitlines()
            if line.startswith("| `") and line.count("|") >= 6}
    missing = [knob for knob in config_knobs() if knob not in rows]
    assert not missing, f"docs/reference.md's knob table lacks {missing}"
    for knob, default in config_knobs().items():
        cells = [cell.strip() for cell in rows[knob].split("|")[1:-1]]
        assert cells[1] == f"`COMPILE_OFFLOAD_{knob.upper()}`", f"{knob}: environment variable cell is {cells[1]!r}"
        import ast

        assert ast.literal_eval(cells[3].strip("`")) == default, \
            f"{knob}: the default is {default!r}, the reference says {cells[3]}"
    documented = [name for name in rows if re.fullmatch(r"[a-z_]+", name) and "COMPILE_OFFLOAD" in rows[name]]
    stale = sorted(set(documented) - set(config_knobs()))
    assert not stale, f"docs/reference.md documents knobs the config does not have: {stale}"


def test_every_plan_field_is_in_the_reference():
    import dataclasses

    reference = (REPO / "docs" / "reference.md").read_text()
    section = reference.split("## `Plan`", 1)[1].split("\n## ", 1)[0]
    missing = [f.name for f in dataclasses.fields(compile_offload.Plan) if f"`{f.name}`" not in section]
    assert not missing, f"docs/reference.md's Plan section lacks {missing}"


def test_every_cli_verb_is_in_the_reference():
    from compile_offload.__main__ import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    reference = (REPO / "docs" / "reference.md").read_text()
    missing = [verb for verb in verbs if f"python -m compile_offload {verb}" not in reference]
    assert not missing, f"docs/reference.md does not show the command line verbs {missing}"


def test_the_command_line_synopsis_brackets_exactly_the_optional_flags():
    """fuzz24b: the synopsis showed ``bench ... --out DIR`` as required, where it defaults to bench_out."""
    import re

    from compile_offload.__main__ import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    reference = (REPO / "docs" / "reference.md").read_text()
    synopsis = reference.split("## Command line", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    lines = re.split(r"\n(?=python -m compile_offload )", synopsis.strip())
    assert len(lines) == len(verbs)
    for line in lines:
        verb = line.split()[3]
        unbracketed = re.sub(r"\[[^\[\]]*\]", "", line)
        shown_required = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", unbracketed))
        flags = {option: action for action in verbs[verb]._actions for option in action.option_strings}
        shown = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", line))
        assert shown <= set(flags), f"{verb}: the synopsis shows flags {sorted(shown - set(flags))} it does not take"
        optional = sorted(flag for flag in shown_required if not flags[flag].required)
        assert not optional, f"{verb}: the synopsis shows {optional} as required; they are optional (bracket them)"


# --- every warning the backend emits is in troubleshooting.md ------------------------------------

WARNING_SOURCES = [*sorted((REPO / "compile_offload").rglob("*.py")), *sorted((REPO / "passes").rglob("*.py"))]


def _texts(node, function) -> list[str]:
    """The literal text of a message expression, split where values are formatted in; a name
    is followed to its assignments in the same function."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [piece.value for piece in node.values if isinstance(piece, ast.Constant)]
    if isinstance(node, ast.BinOp):
        return _texts(node.left, function) + _texts(node.right, function)
    if isinstance(node, ast.Name) and function is not None:
        found = []
        for statement in ast.walk(function):
            if isinstance(statement, ast.Assign) and any(getattr(t, "id", None) == node.id for t in statement.targets):
                found += _texts(statement.value, None)
            elif isinstance(statement, ast.AugAssign) and getattr(statement.target, "id", None) == node.id:
                found += _texts(statement.value, None)
        return found
    if isinstance(node, ast.IfExp):
        return _texts(node.body, function) + _texts(node.orelse, function)
    return []


def emitted_warnings() -> list[tuple[str, str]]:
    """(where, the longest literal piece of its message) for every ``warnings.warn`` and
    every call of the pinned pool's ``_warn_once`` in the package."""
    import ast

    found = []
    for source in WARNING_SOURCES:
        tree = ast.parse(source.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in [None, *functions]:
            body = tree if function is None else function
            for call in ast.walk(body):
                if not isinstance(call, ast.Call):
                    continue
                owner = min((f for f in functions if f.lineno <= call.lineno <= f.end_lineno),
                            key=lambda f: f.end_lineno - f.lineno, default=None)
                if owner is not function:
                    continue  # seen from its innermost function only
                name = getattr(call.func, "attr", getattr(call.func, "id", None))
                if name == "warn" and getattr(call.func, "value", None) is not None \
                        and getattr(call.func.value, "id", None) == "warnings":
                    message = call.args[0] if call.args else None
                elif name == "_warn_once" and len(call.args) == 2:
                    message = call.args[1]
                else:
                    continue
                if isinstance(message, ast.Name) and function is not None \
                        and message.id in {a.arg for a in function.args.args}:
                    continue  # a helper that passes its caller's message on (_warn_once itself)
                pieces = [" ".join(p.split()) for p in _texts(message, function)]
                where = f"{source.relative_to(REPO)}:{call.lineno}"
                found.append((where, max(pieces, key=len, default="")))
    return found


# Warnings whose text is made elsewhere (an exception's message, a helper's return value): the
# phrase troubleshooting.md must hold for them.
MADE_ELSEWHERE = {  # a file's warnings whose text a function makes: the phrases the page must quote
    "compile_offload/pipeline/planning.py": ("the exact solver handles at most N candidate storages (exact_max_candidates)",
                                             "the planner could not handle this graph"),
    "compile_offload/pipeline/graph_reports.py": "the planner could not handle this graph",
    "compile_offload/tools/explain.py": "run eagerly outside the compiled graphs (torch._dynamo.config.allow_rnn is False)",
    "compile_offload/settings.py": "plans will not be cached",
}
QUOTED = 40  # characters of a warning's longest literal piece the page must quote exactly


def quoted_part(piece: str) -> str:
    """What of a message's literal piece the page must hold: the piece without the common
    ``compile_offload:`` prefix (the page says it is left out) and the punctuation around the
    values formatted in, its first ``QUOTED`` characters."""
    return piece.removeprefix("compile_offload: ").strip(" ;:()[],.'\"")[:QUOTED]


def test_every_warning_the_backend_emits_is_in_troubleshooting():
    page = " ".join((REPO / "docs" / "troubleshooting.md").read_text().split())
    warnings_found = emitted_warnings()
    assert len(warnings_found) >= 25, f"found only {len(warnings_found)} warnings: the scan is broken"
    missing = []
    for where, piece in warnings_found:
        quoted = quoted_part(piece)
        if len(quoted) < 25:
            phrase = MADE_ELSEWHERE.get(where.split(":")[0])
            assert phrase, f"{where}: a warning whose text is made elsewhere: add its phrase to MADE_ELSEWHERE"
            quoted = phrase
        for text in (quoted,) if isinstance(quoted, str) else quoted:
            if text not in page:
                missing.append(f"{where}: {text!r}")
    assert not missing, "docs/troubleshooting.md does not quote these warnings: " + "; ".join(missing)


def test_the_warning_scan_sees_a_known_warning():
    pieces = [piece for _, piece in emitted_warnings()]
    assert any("is below the minimum this planner can reach" in piece for piece in pieces)
    assert any("could not write the plan cache entry" in piece for piece in pieces)


# --- links -------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors_of(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    found = set()
    for line in path.read_text().splitlines():
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


@pytest.mark.parametrize("path", USER_PAGES, ids=[str(p.relative_to(REPO)) for p in USER_PAGES])
def test_links_of_user_pages_resolve(path):
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{path.relative_to(REPO)}: broken links: {', '.join(broken)}"


def test_the_readme_answers_the_first_questions():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 120, "the README grew past 120 lines: move detail into docs/"
    for needed in ("H200", "torch 2.11", "GPT-8", "benchmarks/device_check.sh", "git clone",
                   "activation_memory_budget", "checkpoint", "docs/budget.md"):
        assert needed in readme, f"the README does not say {needed!r}"
