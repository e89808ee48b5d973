"""Every private torch name the package uses, listed (issue 53): a torch upgrade shows what to check.

The package (``compile_offload/``, ``passes/``, ``benchmarks/``) is read as source; a name is
private when a part of its dotted path starts with ``_`` (``torch._inductor.config``,
``torch.cuda._sleep``), whether imported (``from torch._guards import TracingContext``) or
reached as an attribute of ``torch`` (``torch._dynamo.reset``). Members reached through an
imported private module (``inductor_config.triton``) are covered by the module's entry. Aten
ops (``torch.ops.aten._...``) are operators, not Python API, and are not listed.

A new private name fails ``test_the_inventory_lists_every_private_name`` until it is added
here; every listed name must resolve on the installed torch (``test_every_listed_name_resolves``),
so on a new torch the names that moved are the failures.
"""

from __future__ import annotations

import ast
import importlib
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
    "torch._C._profiler._EventType",
    # torch._dynamo
    "torch._dynamo",
    "torch._dynamo.backends.common.aot_autograd",
    "torch._dynamo.backends.registry._BACKENDS",
    "torch._dynamo.backends.registry._COMPILER_FNS",
    "torch._dynamo.backends.registry.register_backend",
    "torch._dynamo.config",
    "torch._dynamo.device_interface",
    "torch._dynamo.reset",
    "torch._dynamo.source.GlobalStateSource",
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
