"""Backend discovery: ``torch.compile(model, backend="offload_remat")`` works in a fresh
interpreter through the ``torch_dynamo_backends`` entry point, with or without importing
``compile_offload`` first; and ``passes`` never imports ``compile_offload``."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import compile_offload

# Compiles a tiny model by name, trains one step and compares with eager. Prints JSON.
_COMPILE_BY_NAME = """
import json, sys
import torch
{import_first}
report = {{"imported_before_compile": "compile_offload" in sys.modules}}
report["listed"] = "offload_remat" in torch._dynamo.list_backends()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
x = torch.randn(3, 4)
expected = model(x)
expected.sum().backward()
expected_grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
compiled = torch.compile(model, backend="offload_remat", options={{"inner_compiler": "eager"}})
out = compiled(x)
out.sum().backward()
report["output_matches"] = torch.allclose(out, expected, rtol=1e-5, atol=1e-6)
report["grads_match"] = all(
    torch.allclose(p.grad, g, rtol=1e-5, atol=1e-6) for p, g in zip(model.parameters(), expected_grads))
report["imported_after_compile"] = "compile_offload" in sys.modules
print(json.dumps(report))
"""


def run_fresh_python(code: str, tmp_path: Path) -> dict:
    """Run ``code`` in a fresh interpreter outside the checkout (so only the installed
    package can be found) with no COMPILE_OFFLOAD_* settings; return its JSON line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_OFFLOAD_")}
    completed = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_entry_point_is_declared():
    entry_points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    ours = [ep for ep in entry_points if ep.name == "offload_remat"]
    assert len(ours) == 1
    assert ours[0].load() is compile_offload.offload_remat_backend


@pytest.mark.slow
def test_compile_by_name_without_importing_compile_offload(tmp_path):
    report = run_fresh_python(_COMPILE_BY_NAME.format(import_first=""), tmp_path)
    assert report == {
        "imported_before_compile": False,
        "listed": True,
        "output_matches": True,
        "grads_match": True,
        # Dynamo loaded our backend through the entry point, which imports the package
        # (and runs its registration) while Dynamo is registering the same name.
        "imported_after_compile": True,
    }


@pytest.mark.slow
def test_import_then_compile_by_name(tmp_path):
    """Importing the package registers the backend; Dynamo's entry-point discovery must
    not then fail with a duplicate registration."""
    report = run_fresh_python(_COMPILE_BY_NAME.format(import_first="import compile_offload"), tmp_path)
    assert report["imported_before_compile"] and report["listed"]
    assert report["output_matches"] and report["grads_match"]


def test_a_backend_with_options_pickles_as_a_compiled_module_holding_it_does():
    """fuzz31b F1: offload_remat(...) returned a closure: "Can't pickle local object
    'offload_remat.<locals>.backend'", so neither did a module compiled with it (a spawned
    worker, torch.save of the module), where one compiled with another backend does."""
    import pickle

    import torch

    backend = compile_offload.offload_remat(memory_budget="1KiB", inner_compiler="eager")
    again = pickle.loads(pickle.dumps(backend))
    assert again.options == backend.options and again.__name__ == "offload_remat"
    assert "memory_budget='1KiB'" in repr(backend)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    compiled = torch.compile(model, backend=backend)
    compiled(torch.randn(2, 4)).sum().backward()  # a step first: the pickle holds its compiled state
    restored = pickle.loads(pickle.dumps(compiled))
    x = torch.randn(2, 4)
    torch.testing.assert_close(restored(x), model(x))
