"""Every private torch name the package uses, listed (issue 53): a torch upgrade shows what to check.

The package (``compile_offload/``, ``passes/``, ``benchmarks/``) is read as source; a name is
private when a part of its dotted path starts with ``_`` (``torch._inductor.config``,
``torch.cuda._sleep``), whether imported (``from torch._guards import TracingContext``, also
inside a function) or reached as an attribute of ``torch`` (``torch._dynamo.reset``). Members
reached through an imported private module (``inductor_config.triton``, ``functorch.config.patch``
after ``from compile_offload.torch_api import functorch``) are covered by the module's entry.
Aten ops (``torch.ops.aten._...``) are operators, not Python API, and are not listed.

A new private name fails ``test_the_inventory_lists_every_private_name`` until it is added
here; every listed name must resolve on the installed torch (``test_every_listed_name_resolves``),
so on a new torch the names that moved are the failures.

The names are reached in two places only (``test_private_names_only_in_their_area_module``):
``compile_offload/torch_api/``, one module per torch area (``AREA_MODULES``), and
``passes/compat.py``, the passes' own door (they cannot import ``compile_offload``).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = [REPO / "compile_offload", REPO / "passes", REPO / "benchmarks"]

INVENTORY = {
    # torch._C
    "torch._C",
    "torch._C._AutoDispatchBelowAutograd",
    "torch._C._autograd",
    "torch._C._autograd._profiler_enabled",
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "torch._C._profiler._EventType",
    # torch._dynamo
    "torch._dynamo",
    "torch._dynamo.backends.common.aot_autograd",
    "torch._dynamo.backends.registry._BACKENDS",
    "torch._dynamo.backends.registry._COMPILER_FNS",
    "torch._dynamo.backends.registry.register_backend",
    "torch._dynamo.config",
    "torch._dynamo.convert_frame.compile_lock",
    "torch._dynamo.device_interface",
    "torch._dynamo.eval_frame._debug_get_cache_entry_list",
    "torch._dynamo.eval_frame.reset_code",
    "torch._dynamo.forbid_in_graph",
    "torch._dynamo.reset",
    "torch._dynamo.source.GlobalStateSource",
    "torch._dynamo.utils.counters",
    # torch._functorch
    "torch._functorch._aot_autograd.runtime_wrappers",
    "torch._functorch.aot_autograd.aot_module_simplified",
    "torch._functorch.config",
    "torch._functorch.partitioners",
    "torch._functorch.partitioners.default_partition",
    "torch._functorch.partitioners.min_cut_rematerialization_partition",
    # torch._guards
    "torch._guards.CompileContext",
    "torch._guards.Guard",
    "torch._guards.TracingContext",
    "torch._guards.detect_fake_mode",
    # torch._inductor
    "torch._inductor.codegen.triton",
    "torch._inductor.codegen.wrapper.AllocateLine",
    "torch._inductor.codegen.wrapper.ReuseLine",
    "torch._inductor.compile_fx",
    "torch._inductor.compile_fx._recursive_joint_graph_passes",
    "torch._inductor.compile_fx.compile_fx",
    "torch._inductor.compile_fx.compile_fx_inner",
    "torch._inductor.config",
    "torch._inductor.custom_graph_pass.CustomPartitionerFn",
    "torch._inductor.custom_graph_pass.CustomSchedulerPass",
    "torch._inductor.decomposition.select_decomp_table",
    "torch._inductor.dependencies",
    "torch._inductor.graph",
    "torch._inductor.ir",
    "torch._inductor.kernel.bmm",
    "torch._inductor.list_mode_options",
    "torch._inductor.lowering",
    "torch._inductor.memory",
    "torch._inductor.runtime.cache_dir_utils.cache_dir",
    "torch._inductor.runtime.hints",
    "torch._inductor.scheduler",
    "torch._inductor.virtualized.V",
    # torch._library
    "torch._library.fake_class_registry.FakeScriptObject",
    # torch._logging
    "torch._logging._internal.register_log",
    "torch._logging.trace_structured",
    # torch._ops
    "torch._ops",
    "torch._ops.HigherOrderOperator",
    "torch._ops.OpOverload",
    "torch._ops.OpOverloadPacket",
    # torch._prims_common
    "torch._prims_common",
    # torch._subclasses
    "torch._subclasses.fake_tensor",
    "torch._subclasses.fake_tensor.FakeTensor",
    "torch._subclasses.fake_tensor.DataDependentOutputException",
    "torch._subclasses.fake_tensor.DynamicOutputShapeException",
    "torch._subclasses.fake_tensor.FakeTensorMode",
    "torch._subclasses.fake_tensor.unset_fake_temporarily",
    # torch.cuda._pin_memory_utils
    "torch.cuda._pin_memory_utils",
    # torch.cuda._sleep
    "torch.cuda._sleep",
    # torch.cuda.memory
    "torch.cuda.memory._record_memory_history",
    "torch.cuda.memory._snapshot",
    # torch.fx._lazy_graph_module
    "torch.fx._lazy_graph_module._use_lazy_graph_module",
    # torch.fx.graph
    "torch.fx.graph._BoxedCodeGen",
    # torch.autograd: the engine's final-callback queue (FSDP2 uses it too)
    "torch.autograd.Variable._execution_engine",
    "torch.autograd.Variable._execution_engine.queue_callback",
    # torch._C: the backward under way on this thread, if any
    "torch._C._current_graph_task_id",
    # torch.optim.optimizer: the step pre-hooks registered for every optimizer
    "torch.optim.optimizer._global_optimizer_pre_hooks",
    # torch.optim.optimizer: the step post-hooks registered for every optimizer
    "torch.optim.optimizer._global_optimizer_post_hooks",
    # torch.utils._config_module
    "torch.utils._config_module.Config",
    "torch.utils._config_module.ContextDecorator",
    "torch.utils._config_module._UNSET_SENTINEL",
    "torch.utils._config_module.install_config_module",
    # torch.utils._python_dispatch
    "torch.utils._python_dispatch._disable_current_modes",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass",
    # torch.utils._pytree
    "torch.utils._pytree",
    "torch.utils._pytree.tree_flatten",
    "torch.utils._pytree.tree_leaves",
    "torch.utils._pytree.tree_map",
    # torch.utils._sympy
    "torch.utils._sympy.functions",
    # torch.utils._triton
    "torch.utils._triton",
}

# Torch area (a dotted prefix) -> the one module of compile_offload/torch_api/ that reaches its
# private names. A name belongs to the area of its longest prefix here.
AREA_MODULES = {
    "torch._dynamo": "dynamo",
    "torch._functorch": "functorch",
    "torch._inductor": "inductor",
    "torch._guards": "guards",
    "torch._subclasses": "fake_tensors",
    "torch._library": "fake_tensors",
    "torch._C._autograd": "profiler",
    "torch._C._profiler": "profiler",
    "torch.cuda.memory": "profiler",
    "torch._C": "cuda",
    "torch._C._current_graph_task_id": "utils",
    "torch._C._autograd._top_saved_tensors_default_hooks": "utils",
    "torch.cuda": "cuda",
    "torch.utils": "utils",
    "torch.fx": "utils",
    "torch._logging": "utils",
    "torch._ops": "utils",
    "torch.optim": "optim",
    "torch.autograd": "utils",
    "torch._prims_common": "utils",
}
TORCH_API = REPO / "compile_offload" / "torch_api"
COMPAT = REPO / "passes" / "compat.py"


def _is_private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and parts[1:2] != ["ops"] and any(
        p.startswith("_") and not p.startswith("__") for p in parts)


def private_names(source: str) -> set[str]:
    """The private torch names ``source`` imports or reaches as attributes of ``torch``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torch"):
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Attribute):
            parts, current = [], node
            while isinstance(current, ast.Attribute):
                parts.append(current.attr)
                current = current.value
            if isinstance(current, ast.Name) and current.id == "torch":
                found.add(".".join(["torch", *reversed(parts)]))
    return {name for name in found if _is_private(name)}


def names_in_use() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            for name in private_names(path.read_text()):
                used.setdefault(name, []).append(str(path.relative_to(REPO)))
    return used


def test_the_scan_finds_imports_and_attributes():
    source = (
        "import torch\n"
        "from torch._guards import TracingContext\n"
        "from torch.fx import Graph\n"
        "def f():\n"
        "    torch._dynamo.reset()\n"
        "    return torch.ops.aten._foo.default, torch.cuda.synchronize\n"
    )
    assert private_names(source) == {"torch._guards.TracingContext", "torch._dynamo.reset", "torch._dynamo"}


def test_the_inventory_lists_every_private_name():
    used = names_in_use()
    unlisted = {name: files for name, files in used.items() if name not in INVENTORY}
    assert unlisted == {}, "private torch names not in the inventory (add them, and check them on a torch upgrade)"
    assert sorted(set(INVENTORY) - set(used)) == [], "listed names no longer used: drop them"


def _resolve(name: str) -> object:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(name)


@pytest.mark.parametrize("name", sorted(INVENTORY))
def test_every_listed_name_resolves(name):
    assert _resolve(name) is not None


def area_module(name: str) -> str | None:
    """The torch_api module of ``name``'s area (its longest prefix in ``AREA_MODULES``)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = AREA_MODULES.get(".".join(parts[:cut]))
        if module is not None:
            return module
    return None


def misplaced_names(path: Path, source: str) -> set[str]:
    """The private torch names ``source`` (the file at ``path``) must not reach: any, outside
    ``passes/compat.py`` and ``compile_offload/torch_api/``; in a torch_api module, those of
    another area."""
    names = private_names(source)
    if path == COMPAT:
        return set()
    if path.parent == TORCH_API:  # ``torch._C._autograd.x`` also reaches ``torch._C``: its area is the longest name's
        longest = {name for name in names if not any(other.startswith(name + ".") for other in names)}
        return {name for name in longest if area_module(name) != path.stem}
    return names


def test_every_listed_name_has_an_area_and_every_area_module_exists():
    assert sorted(name for name in INVENTORY if area_module(name) is None) == []
    modules = {path.stem for path in TORCH_API.glob("*.py")} - {"__init__"}
    assert modules == set(AREA_MODULES.values())


def test_the_door_check_finds_a_stray_name():
    pipeline = REPO / "compile_offload" / "pipeline" / "backend.py"
    assert misplaced_names(pipeline, "import torch._dynamo\n") == {"torch._dynamo"}
    assert misplaced_names(pipeline, "from ..torch_api import dynamo\ndynamo.reset()\n") == set()
    assert misplaced_names(TORCH_API / "dynamo.py", "from torch._dynamo import config\n") == set()
    assert misplaced_names(TORCH_API / "guards.py", "from torch._dynamo import config\n") == {"torch._dynamo.config"}
    assert misplaced_names(COMPAT, "import torch._dynamo\n") == set()
    assert misplaced_names(TORCH_API / "profiler.py", "torch._C._autograd._profiler_enabled()\n") == set()


def test_private_names_only_in_their_area_module():
    """Outside ``passes/compat.py`` and ``compile_offload/torch_api/``, no file of the package
    imports a private torch name or reaches one as an attribute of ``torch``; each torch_api
    module reaches only the names of its own area. Members of a private module got from a
    door (``inductor.config.triton.cudagraphs``) are fine."""
    misplaced = {}
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            names = misplaced_names(path, path.read_text())
            if names:
                misplaced[str(path.relative_to(REPO))] = sorted(names)
    assert misplaced == {}, "reach these through compile_offload/torch_api (passes/: compat.py)"


def test_importing_the_package_loads_no_heavy_inductor_module():
    """The torch_api modules import what torch has not loaded yet (``compile_fx`` and what it
    pulls in) only when a function of theirs is called."""
    heavy = ["torch._inductor.compile_fx", "torch._inductor.scheduler", "torch._inductor.lowering",
             "torch._inductor.ir", "torch._inductor.graph", "torch._inductor.codegen.wrapper",
             "torch._inductor.memory", "torch._inductor.decomposition", "torch._inductor.kernel.bmm",
             "torch._functorch.aot_autograd", "torch._dynamo.backends.common"]
    code = ("import sys, compile_offload, compile_offload.benchmarks.runner\n"
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
