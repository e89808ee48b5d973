"""The package's import structure: imports run one way.

Every ``.py`` file of the installed package (``compile_offload/``, and the repository's
``passes/`` and ``benchmarks/`` folders, installed as ``compile_offload.passes`` and
``compile_offload.benchmarks``) is read as source; every import statement counts, also
those inside functions and under ``TYPE_CHECKING`` (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# installed name -> folder in the repository (pyproject.toml's package-dir)
PACKAGES = {
    "compile_offload": REPO / "compile_offload",
    "compile_offload.passes": REPO / "passes",
    "compile_offload.benchmarks": REPO / "benchmarks",
}


def package_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` (at ``path``) imports, relative imports resolved."""
    is_package = path.stem == "__init__"
    package_parts = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import sub` imports the submodule when there is one
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        else:
            continue
        for target in targets:
            # the longest known module the name starts with
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules, or None. Package ``__init__`` modules are
    left out: importing a submodule always runs its package's ``__init__``, which is not a
    dependency of the submodule on its siblings."""
    graph = {name: {t for t in targets if t not in PACKAGES} for name, targets in graph.items() if name not in PACKAGES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_scan_sees_every_kind_of_import():
    known = {"compile_offload.a", "compile_offload.b", "compile_offload.c", "compile_offload.passes",
             "compile_offload.passes.x", "compile_offload"}
    source = textwrap.dedent("""
        from typing import TYPE_CHECKING
        from . import b
        if TYPE_CHECKING:
            from .c import Thing
        def f():
            from .passes.x import y
    """)
    path = Path(__file__).parent / "_layering_probe.py"
    path.write_text(source)
    try:
        found = imports_of("compile_offload.a", path, known)
    finally:
        path.unlink()
    assert found == {"compile_offload.b", "compile_offload.c", "compile_offload.passes.x"}


def test_the_cycle_finder_finds_a_circle():
    graph = {"compile_offload.a": {"compile_offload.b"}, "compile_offload.b": {"compile_offload.a"},
             "compile_offload.c": set()}
    assert find_cycle(graph) == ["compile_offload.a", "compile_offload.b", "compile_offload.a"]
    assert find_cycle({"compile_offload.a": {"compile_offload.b"}, "compile_offload.b": set()}) is None


def test_no_import_circle_inside_the_package():
    assert find_cycle(import_graph()) is None


@pytest.mark.parametrize("name", sorted(n for n in package_modules() if n.startswith("compile_offload.passes")))
def test_passes_imports_nothing_of_the_package_outside_passes(name):
    outside = {t for t in import_graph()[name] if not t.startswith("compile_offload.passes")}
    assert outside == set(), f"{name} imports {sorted(outside)}"


def test_only_compile_offload_is_installed_at_the_top_level():
    """pyproject maps passes/ and benchmarks/ beneath compile_offload: a folder of the
    user's named ``passes`` must not shadow ours."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(name.split(".")[0] == "compile_offload" for name in config["packages"])
    assert {name: REPO / folder for name, folder in config["package-dir"].items()} == PACKAGES


def test_import_works_beside_a_passes_package_of_the_users(tmp_path):
    (tmp_path / "passes").mkdir()
    (tmp_path / "passes" / "__init__.py").write_text("")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    code = "import compile_offload, compile_offload.passes.solve.recompute, compile_offload.benchmarks.runner; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_no_folder_holds_more_than_sixteen_modules():
    """The folders show the architecture (docs/design.md, "The code's map"): a folder that
    grows past 16 modules is split by role, as compile_offload/ and passes/ were."""
    folders: dict[Path, list[str]] = {}
    for path in package_modules().values():
        if path.stem != "__init__":
            folders.setdefault(path.parent, []).append(path.stem)
    crowded = {str(folder.relative_to(REPO)): len(names) for folder, names in folders.items() if len(names) > 16}
    assert crowded == {}


def test_the_runtime_package_ships_no_test_only_module():
    """Code only tests use lives under tests/ (the branch-and-bound optimum), code only the
    studies use under compile_offload/tools (calibration, the exhaustive optimum)."""
    modules = package_modules()
    assert "compile_offload.passes.solve_bound" not in modules
    assert not [name for name in modules if name.startswith("compile_offload.passes.")
                and name.rsplit(".", 1)[-1] in ("calibrate", "solve_exhaustive")]
    assert "def graphs_program" not in (REPO / "passes" / "memory.py").read_text()  # tests/graphs_program.py


def _notes_read_back(source: str) -> list[int]:
    """Lines where a loop or comprehension over some ``.notes`` tests the notes' text
    (``startswith``, ``in``...): a free-text note parsed back instead of a typed field."""
    found = []
    for node in ast.walk(ast.parse(source)):
        loops = ([g for g in node.generators] if isinstance(node, (ast.GeneratorExp, ast.ListComp, ast.SetComp))
                 else [node] if isinstance(node, ast.For) else [])
        if not any(isinstance(loop.iter, ast.Attribute) and loop.iter.attr == "notes" for loop in loops):
            continue
        for inner in ast.walk(node):
            tests_text = (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                          and inner.func.attr in ("startswith", "endswith", "removeprefix", "split", "rsplit"))
            if tests_text or (isinstance(inner, ast.Compare) and any(isinstance(op, (ast.In, ast.Eq)) for op in inner.ops)):
                found.append(node.lineno)
                break
    return found


def test_the_notes_check_finds_a_parsed_note():
    assert _notes_read_back("x = next(n for n in plan.notes if n.startswith('fallback: '))") == [1]
    assert _notes_read_back("text = '; '.join(plan.notes)") == []


def test_no_note_is_parsed_back():
    """What the budget loop did, and why a graph fell back, travel as typed ``Plan`` fields
    (``budget_outcome``, ``replans``, ``unconstrained``, ``fallback``); ``notes`` are for
    people, written and shown, never read back by the package."""
    parsed = {str(path.relative_to(REPO)): lines for path in package_modules().values()
              if (lines := _notes_read_back(path.read_text()))}
    assert parsed == {}
