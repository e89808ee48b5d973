"""``python -m compile_offload explain MODULE:FACTORY``: print a plan and write its dump.

``FACTORY`` is a function of ``MODULE`` (an importable module name, or a path to a ``.py``
file) that takes no arguments and returns ``(model, example_inputs)``, the inputs a tuple of
positional inputs, a dict of keyword inputs or one tensor; the model and inputs may live on
the ``meta`` device. Nothing runs: the model is traced and planned.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="MODULE:FACTORY",
                        help="e.g. my_models:make_gpt or path/to/models.py:make_gpt; the factory returns (model, inputs)")
    parser.add_argument("--budget", default=None, help="bytes ('4GiB', '512MB') or a fraction ('0.5'); default: "
                        "COMPILE_OFFLOAD_MEMORY_BUDGET, else no limit")
    parser.add_argument("--profile", default=None, help="device profile: h100, h200, a100, rtx4090, cpu (default: "
                        "COMPILE_OFFLOAD_DEVICE_PROFILE, else this machine)")
    parser.add_argument("--out", default=None, help="folder for the dump (graphs, plan.json, report.md, timeline.png)")
    parser.add_argument("--no-offload", action="store_true", help="keep or recompute only")


def load_factory(target: str):
    """The function ``MODULE:FACTORY`` names; ``SystemExit`` with the reason when there is none."""
    module_name, sep, factory_name = target.rpartition(":")
    if not sep or not module_name or not factory_name:
        raise SystemExit(f"explain: expected MODULE:FACTORY, got {target!r}")
    if module_name.endswith(".py"):
        module = _load_file(Path(module_name))
    else:
        module = _import(module_name)
    if not hasattr(module, factory_name):
        raise SystemExit(f"explain: {module_name} has no function {factory_name!r}")
    factory = getattr(module, factory_name)
    if not callable(factory):
        raise SystemExit(f"explain: {module_name}:{factory_name} is a value of type {type(factory).__name__}, not a "
                         "function returning (model, inputs)")
    try:
        inspect.signature(factory).bind()
    except TypeError as error:
        raise SystemExit(f"explain: {factory_name} must be callable without arguments ({error}); wrap it in a "
                         "function that passes them") from None
    except ValueError:  # no signature to read (a builtin): call it and see
        pass
    return factory


def _load_file(path: Path):
    if not path.is_file():
        raise SystemExit(f"explain: no such file {path}")
    # A name of its own: under its stem a file named random.py or copy.py would replace the
    # standard module of that name for everything imported after it (torch included).
    name = f"_compile_offload_explain_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        del sys.modules[name]
        raise SystemExit(_cannot_parse(str(path), error)) from None
    return module


def _cannot_parse(module_name: str, error: SyntaxError) -> str:
    """The one line for a module that is not valid Python: it cannot be imported, as a missing
    one cannot (an exception the module or the factory raises keeps its traceback)."""
    return f"explain: cannot import {module_name!r} ({type(error).__name__}: {error}); fix the file"


def _import(module_name: str):
    # Modules of the current folder, as ``python -m`` finds them; the ``compile-offload``
    # script would otherwise only see its own folder and site-packages.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except SyntaxError as error:
        raise SystemExit(_cannot_parse(module_name, error)) from None
    except ModuleNotFoundError as error:
        if error.name is None or not (module_name == error.name or module_name.startswith(error.name + ".")):
            raise  # the module exists but an import inside it failed: its traceback says where
        raise SystemExit(f"explain: cannot import {module_name!r} ({error}); give a module importable from "
                         "this folder or a path to a .py file") from None


def explain_options(args: argparse.Namespace) -> dict:
    """The options ``args`` give ``compile_offload.explain_all``, validated (``SystemExit``
    naming the bad value), so a typo fails before the model is built. Only the flags given
    are options: the others are ``compile_offload.config``'s (the environment's)."""
    from .. import settings as settings_mod

    options = {}
    if args.budget is not None:
        if not args.budget.strip():  # as for --out: an empty value must not silently mean no budget
            raise SystemExit(f"explain: --budget {args.budget!r}: an empty budget; leave --budget out (or give "
                             "'none') for no budget, else bytes ('4GiB') or a fraction ('0.5')")
        options["memory_budget"] = args.budget
    if args.profile is not None:
        options["device_profile"] = args.profile
    if args.out is not None:
        if not args.out.strip():  # dump_dir="" is an error in the API too: it would silently mean no dump
            raise SystemExit(f"explain: --out {args.out!r}: an empty path; name a folder for the dump ('.' for "
                             "this one), or leave --out out for no dump")
        options["dump_dir"] = args.out
    if args.no_offload:
        options["offload"] = False
    try:
        settings = settings_mod.resolve(options)
        # A byte budget above the profile's GPU memory could never bind (checked again
        # per graph while planning, where it would be a traceback).
        if settings.device_profile is not None:
            settings_mod.check_budget_fits_device(settings, "meta")
    except (TypeError, ValueError) as error:
        flags = [flag for knob, flag in (("memory_budget", "--budget"), ("device_profile", "--profile"),
                                         ("dump_dir", "--out")) if knob in options and f"config.{knob}" in str(error)]
        raise SystemExit(f"explain: {''.join(flag + ': ' for flag in flags[:1])}{error}") from None
    return options


def run_explain(args: argparse.Namespace) -> int:
    import compile_offload

    from .explain import positional_call

    options = explain_options(args)
    made = load_factory(args.target)()
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        what = (f"{len(made)} values" if isinstance(made, (tuple, list))
                else f"a value of type {type(made).__name__}")
        raise SystemExit(f"explain: the factory must return (model, example_inputs), with example_inputs a tuple of "
                         f"positional inputs, a dict of keyword inputs or one tensor; it returned {what}")
    model, inputs = made
    if not callable(model):
        raise SystemExit(f"explain: the factory returned a model of type {type(model).__name__}, which cannot be "
                         "called; return (model, example_inputs) with model an nn.Module or a function")
    model, inputs = positional_call(model, inputs)
    try:
        plans = compile_offload.explain_all(model, *inputs, **options)
    except ValueError as error:  # ours (a budget the device cannot hold, a strict budget): no traceback
        if not str(error).startswith("compile_offload"):
            raise
        raise SystemExit(f"explain: {error}") from None
    for plan in plans:
        print(plan)
        print()
    if args.out is not None:
        from ..reporting import logs

        # The dump folder as config.dump_dir holds it (a leading ~ expanded).
        dump_dir = os.path.expanduser(args.out)
        failed = [(plan.graph_name, why) for plan in plans
                  if (why := logs.dump_failure(dump_dir, plan.graph_name)) is not None]
        if failed:
            raise SystemExit(f"explain: --out {args.out}: the dump of {', '.join(name for name, _ in failed)} was "
                             f"not written ({failed[0][1]}); what is printed above is not in it: fix the folder "
                             "and run again")
        print(f"dump written to {args.out}")
    return 0
