"""``python -m compile_offload explain MODULE:FACTORY``: print a plan and write its dump.

``FACTORY`` is a function of ``MODULE`` (an importable module name, or a path to a ``.py``
file) that takes no arguments and returns ``(model, example_inputs)``; the model and
inputs may live on the ``meta`` device. Nothing runs: the model is traced and planned.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="MODULE:FACTORY",
                        help="e.g. my_models:make_gpt or path/to/models.py:make_gpt; the factory returns (model, inputs)")
    parser.add_argument("--budget", default=None, help="bytes ('4GiB', '512MB') or a fraction ('0.5'); default: no limit")
    parser.add_argument("--profile", default=None, help="device profile: h100, a100, rtx4090, cpu (default: this machine)")
    parser.add_argument("--out", default=None, help="folder for the dump (graphs, plan.json, report.md, timeline.png)")
    parser.add_argument("--no-offload", action="store_true", help="keep or recompute only")


def parse_budget(text: str | None):
    """None, a fraction ("0.5"), or a size for compile_offload.config ("4GiB", "1000")."""
    from .demo import parse_budget as parse

    return None if text is None else parse(text)


def load_factory(target: str):
    module_name, sep, factory_name = target.rpartition(":")
    if not sep or not module_name or not factory_name:
        raise SystemExit(f"explain: expected MODULE:FACTORY, got {target!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise SystemExit(f"explain: no such file {path}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise SystemExit(f"explain: {module_name} has no function {factory_name!r}")
    return factory


def run_explain(args: argparse.Namespace) -> int:
    import compile_offload

    made = load_factory(args.target)()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise SystemExit("explain: the factory must return (model, example_inputs)")
    model, inputs = made
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    options = {"dump_dir": args.out} if args.out else {}
    if args.no_offload:
        options["offload"] = False
    for plan in compile_offload.explain_all(model, *inputs, memory_budget=parse_budget(args.budget),
                                            device_profile=args.profile, **options):
        print(plan)
        print()
    if args.out:
        print(f"dump written to {args.out}")
    return 0
