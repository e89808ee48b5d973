"""Command line: ``python -m compile_offload {demo,explain,bench,model-check} ...``."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path


# verb -> (module, help); each module has add_<name>_arguments(parser) and run_<name>(args),
# imported only when the command line is built (the verbs' imports are heavy).
VERBS = {
    "demo": ("tools.demo", "plan and train a small GPT-style model, printing the plan and the loss"),
    "explain": ("tools.cli_explain", "print the plan for MODULE:FACTORY and write its dump"),
    "bench": ("tools.bench", "benchmark our backend against the alternatives, side by side"),
    "model-check": ("tools.model_check", "predicted against measured H100 anchors, and greedy against exact plans"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        # as the user ran it: the installed script, or the module
        prog="compile-offload" if Path(sys.argv[0]).name == "compile-offload" else "python -m compile_offload",
        description="Plan, explain and benchmark the offload_remat backend. Each verb's --help says more.")
    sub = parser.add_subparsers(dest="command", required=True)
    for verb, (module_name, help_text) in VERBS.items():
        module = importlib.import_module(f".{module_name}", __package__)
        name = verb.replace("-", "_")
        command = sub.add_parser(verb, help=help_text)
        getattr(module, f"add_{name}_arguments")(command)
        command.set_defaults(func=getattr(module, f"run_{name}"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
