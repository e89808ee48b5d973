"""Command line: ``python -m compile_offload {demo,explain,bench,model-check} ...``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m compile_offload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from .demo import add_demo_arguments, run_demo

    demo = sub.add_parser("demo", help="plan and train a small GPT-style model, printing the plan and the loss")
    add_demo_arguments(demo)
    demo.set_defaults(func=run_demo)

    from .cli_explain import add_explain_arguments, run_explain

    explain = sub.add_parser("explain", help="print the plan for MODULE:FACTORY and write its dump")
    add_explain_arguments(explain)
    explain.set_defaults(func=run_explain)

    from .bench import add_bench_arguments, run_bench

    bench = sub.add_parser("bench", help="benchmark our backend against the alternatives, side by side")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)

    from .model_check import add_model_check_arguments, run_model_check

    model_check = sub.add_parser("model-check", help="predicted against measured H100 anchors, and greedy against exact plans")
    add_model_check_arguments(model_check)
    model_check.set_defaults(func=run_model_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
