"""``python -m compile_offload bench``: our backend against torch's alternatives.

The measuring code lives in the repository's ``benchmarks/`` folder (workloads,
strategies, runner), installed as ``compile_offload.benchmarks``: ``bench`` works from a
wheel as from a checkout.

``--smoke`` runs a tiny model on the CPU in a few minutes at most: the eager strategies,
``torch.compile`` default, one ``activation_memory_budget`` and ours at two budgets, ours
with ``inner_compiler="eager"`` (the partitioned graphs run as Python: it skips two
Inductor compiles of ~20 s each per budget on a small CPU, and the plan is the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path

SMOKE_STRATEGIES = (
    "eager,eager_ckpt,eager_save_on_cpu,eager_ckpt_save_on_cpu,compile,torch_budget:0.5,torch_sac_offload,ours"
)
SMOKE_BUDGETS = "0.5,256KiB"
DEFAULT_STRATEGIES = (
    "eager,eager_ckpt,eager_save_on_cpu,eager_ckpt_save_on_cpu,compile,torch_budget,torch_sac_offload,ours"
)


def _benchmarks():
    """The measuring code, installed with the package as ``compile_offload.benchmarks``."""
    return importlib.import_module("compile_offload.benchmarks.runner")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options; size options left unset take the workload's defaults."""
    workload = parser.add_argument_group("workload")
    workload.add_argument("--model", default="gpt", choices=("gpt", "deep", "resnet", "unet", "hf_gpt2"),
                          help="hf_gpt2: a tiny-to-GPT-2-sized Hugging Face model, random weights (needs transformers)")
    workload.add_argument("--layers", type=int, help="blocks (transformers), blocks per stage scale (resnet) or levels (unet)")
    workload.add_argument("--width", type=int, help="model width (transformers) or base channels (conv nets)")
    workload.add_argument("--heads", type=int)
    workload.add_argument("--seq", type=int, help="sequence length (transformers) or image side (conv nets)")
    workload.add_argument("--batch", type=int)
    workload.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    workload.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: bfloat16 on GPU, float32 on CPU")
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--strategies", help=f"comma-separated (default: {DEFAULT_STRATEGIES})")
    sweep.add_argument("--budgets", help="our budgets: fractions and sizes, e.g. 0.25,0.5,0.75,2GiB (default: 0.25,0.5,0.75)")
    sweep.add_argument("--torch-budgets", help="torch activation_memory_budget sweep (default: 0.5,0.0)")
    sweep.add_argument("--inner-compiler", choices=("inductor", "eager"), help="ours: default inductor (eager with --smoke)")
    sweep.add_argument("--device-profile", help="ours: cost-model profile (h100, h200, a100, rtx4090, cpu)")
    sweep.add_argument("--steps", type=int, help="timed steps (default 8; 2 with --smoke)")
    sweep.add_argument("--warmup", type=int, help="steps after the first call before timing (default 2; 1 with --smoke)")
    sweep.add_argument("--time-limit", type=float, help="start no new strategy after this many seconds")
    sweep.add_argument("--in-turn", action="store_true",
                       help="the sweep and --equal-memory: keep every strategy's model, and once all have run "
                            "time them again, one step of each in turn for --steps rounds (a drift of the machine "
                            "then reaches all alike); the tables give these times")
    sweep.add_argument("--no-cpu-peak", action="store_true", help="on CPU, skip the profiled step that measures peak memory")
    sweep.add_argument("--no-predict", action="store_true", help="ours: do not call compile_offload.tools.explain")
    run = parser.add_argument_group("run")
    run.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, few strategies: a few minutes at most")
    run.add_argument("--find-max-batch", action="store_true",
                     help="instead of the sweep: the largest batch that fits each byte budget in --budgets")
    run.add_argument("--attribute", action="store_true",
                     help="profile one step of torch.compile and of ours at the first of --budgets (default 0.5), "
                          "and split ours' extra step time by kind of kernel (recompute, copies, slower kernels)")
    run.add_argument("--equal-memory", action="store_true",
                     help="instead of the sweep: the baselines in --strategies (default: compile, torch_budget:0.5, "
                          "torch_sac_offload, eager_ckpt), then ours at each one's measured peak and at --budgets "
                          "(default: 0.25), with and without measured plan choice; one table of ratios to torch.compile")
    run.add_argument("--fit", action="store_true",
                     help="instead of the sweep: the whole training step (optimizer included) of FSDP2's CPU offload "
                          "with per-block checkpointing, then compile_offload.fit at its device peak (CUDA) and at "
                          "--budgets (sizes); one table of step times against that baseline")
    run.add_argument("--out", default="bench_out", help="folder for the results (default: bench_out)")
    run.add_argument("--tag", help="file name prefix of the results (default: the model name)")


def _resolve_size(args, workloads):
    defaults = (workloads.SMOKE_SIZES if args.smoke else workloads.DEFAULT_SIZES)[args.model]
    given = {name: getattr(args, name) for name in ("layers", "width", "heads", "seq", "batch") if getattr(args, name) is not None}
    return defaults.replace(**given)


def _resolve_device(args):
    import torch

    if args.device:
        return torch.device(args.device)
    if args.smoke:
        return torch.device("cpu")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_dtype(args, device, workloads):
    import torch

    return getattr(torch, args.dtype) if args.dtype else workloads.default_dtype(device)


def _pick(value, smoke_value, default):
    return value if value is not None else (smoke_value if smoke_value is not None else default)


def _fail(message: str):
    """A bad flag: the message on stderr and exit status 2, as argparse does, before any work."""
    print(f"bench: {message}", file=sys.stderr)
    raise SystemExit(2)


def _parse_flag(flag: str, parse, text: str):
    try:
        return parse(text)
    except (TypeError, ValueError) as error:
        _fail(f"{flag} {text}: {error}")


# The flags a run of its own does not read (it would run as without them, and say nothing).
_IGNORED_BY_MODE = {
    "--find-max-batch": ("strategies", "torch_budgets", "inner_compiler", "steps", "warmup", "time_limit",
                         "no_cpu_peak", "no_predict"),
    "--fit": ("device_profile", "torch_budgets", "time_limit", "no_cpu_peak", "no_predict"),
    "--equal-memory": ("torch_budgets",),
    "--attribute": ("torch_budgets", "time_limit", "no_cpu_peak", "no_predict"),
}


def check_arguments(args: argparse.Namespace) -> None:
    """Reject bad flag values (``SystemExit`` 2 naming the flag) before anything is built:
    empty tensors would time nothing and report "ok", zero steps have no statistics."""
    for flag in ("layers", "width", "heads", "seq", "batch", "steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            _fail(f"--{flag} {value}: must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        _fail(f"--warmup {args.warmup}: must be at least 0")
    for flag in ("strategies", "budgets", "torch_budgets"):  # an empty list ran nothing and wrote an empty table
        value = getattr(args, flag)
        if value is not None and not value.replace(",", "").strip():
            _fail(f"--{flag.replace('_', '-')} {value!r}: names nothing; leave the flag out for its default")
    modes = [flag for flag, on in (("--attribute", args.attribute), ("--equal-memory", args.equal_memory),
                                   ("--find-max-batch", args.find_max_batch), ("--fit", args.fit)) if on]
    if len(modes) > 1:
        _fail(f"{' and '.join(modes)}: each is a run of its own; pick one")
    ignored = [f"--{name.replace('_', '-')}" for name in _IGNORED_BY_MODE.get(modes[0] if modes else "", ())
               if getattr(args, name) is not None and getattr(args, name) is not False]  # 0 is a value given
    if ignored:
        _fail(f"{modes[0]} does not use {', '.join(ignored)}: drop {'it' if len(ignored) == 1 else 'them'}")
    if args.in_turn and (args.fit or args.attribute or args.find_max_batch):
        _fail(f"--in-turn with {modes[0]}: it times the sweep's or --equal-memory's strategies in turn")
    if args.fit:
        _check_fit_arguments(args)
    if args.time_limit is not None and not args.time_limit > 0:
        _fail(f"--time-limit {args.time_limit}: must be a positive number of seconds")
    if args.device:
        import torch

        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError):
            _fail(f"--device {args.device}: not a device torch knows; accepted: cpu, cuda, cuda:N")
        if device.type not in ("cpu", "cuda"):
            _fail(f"--device {args.device}: accepted: cpu, cuda, cuda:N")
        if device.type == "cuda" and not torch.cuda.is_available():
            _fail(f"--device {args.device}: no CUDA device is available here")
    if args.device_profile is not None:
        from ..settings import PROFILE_NAMES

        if args.device_profile.strip().lower() not in PROFILE_NAMES:
            _fail(f"--device-profile {args.device_profile}: accepted: {', '.join(PROFILE_NAMES)}")
    from ..benchmarks import strategies as strategies_mod

    if args.budgets is not None:
        _parse_flag("--budgets", strategies_mod.parse_budget_list, args.budgets)
    if args.torch_budgets is not None:
        _parse_flag("--torch-budgets", lambda text: [strategies_mod.parse_torch_budget(t) for t in text.split(",")],
                    args.torch_budgets)
    if args.strategies is not None:  # names and their budgets (ours:2GiB)
        _parse_flag("--strategies", lambda text: strategies_mod.expand(text.split(","), [], []), args.strategies)
    _check_size(args)
    if args.find_max_batch:
        budgets = _pick(args.budgets, SMOKE_BUDGETS if args.smoke else None, "0.25,0.5,0.75")
        if not any(isinstance(b, str) for b in strategies_mod.parse_budget_list(budgets)):
            _fail(f"--find-max-batch --budgets {budgets}: needs byte budgets (e.g. --budgets 4GiB); a fraction "
                  "or none scales with the batch, so it bounds no batch size")
    if args.tag is not None and any(sep and sep in args.tag for sep in ("/", os.sep, os.altsep)):
        _fail(f"--tag {args.tag}: a file name prefix, not a path; accepted: a name without a path separator "
              "(the results go into --out)")
    # Last: folder_problem creates the folder, which a rejected run should not leave behind.
    from ..settings import folder_problem

    problem = folder_problem(args.out)
    if problem is not None:
        _fail(f"--out {args.out}: {problem}")


def _check_size(args: argparse.Namespace) -> None:
    """The transformers split their width among their heads (``workloads.DecoderBlock``,
    GPT-2's config): a width the heads do not divide is refused before anything is built."""
    if args.model not in ("gpt", "deep", "hf_gpt2"):
        return  # the conv nets have no heads
    from ..benchmarks import workloads

    size = _resolve_size(args, workloads)
    if size.width % size.heads == 0:
        return
    if args.heads is not None:
        width = f"--width {size.width}" if args.width is not None else f"the default --width {size.width}"
        _fail(f"--heads {size.heads}: {width} is not divisible by it; accepted: heads that divide the width")
    _fail(f"--width {size.width}: not divisible by the default --heads {size.heads}; accepted: a multiple of --heads")


def _check_fit_arguments(args: argparse.Namespace) -> None:
    from ..benchmarks import strategies as strategies_mod

    if args.strategies:
        _fail("--fit compares compile_offload.fit with FSDP2's CPU offload and per-block checkpointing; "
              "drop --strategies")
    if args.model not in ("gpt", "deep"):
        _fail(f"--fit --model {args.model}: fit shards a model's blocks (an nn.ModuleList); use gpt or deep")
    budgets = _parse_flag("--budgets", strategies_mod.parse_budget_list, args.budgets or "")
    if any(b is None or isinstance(b, float) for b in budgets):
        _fail(f"--fit --budgets {args.budgets}: fit takes a byte budget for the whole step (sizes such as 8GiB), "
              "not a fraction")
    import torch

    on_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if not budgets and not on_cuda:
        _fail("--fit on the CPU: give --budgets (sizes); fit runs at the baseline's device peak only on CUDA")


def run_bench(args: argparse.Namespace) -> int:
    """Run the sweep (or the max-batch search); 0 when every strategy ran or was
    unavailable here, 1 when some failed (their errors are in the results)."""
    check_arguments(args)
    runner = _benchmarks()
    from ..benchmarks import strategies as strategies_mod
    from ..benchmarks import workloads

    smoke = args.smoke
    device = _resolve_device(args)
    dtype = _resolve_dtype(args, device, workloads)
    size = _resolve_size(args, workloads)
    budgets = _parse_flag("--budgets", strategies_mod.parse_budget_list,
                          _pick(args.budgets, SMOKE_BUDGETS if smoke else None, "0.25,0.5,0.75"))
    if args.find_max_batch:
        return _run_max_batch(args, runner, workloads, size, device, dtype, budgets)
    if args.equal_memory:
        return _run_equal_memory(args, runner, workloads, size, device, dtype)
    if args.fit:
        return _run_fit(args, runner, size, device, dtype)
    if args.attribute:
        return _run_attribution(args, runner, size, device, dtype, budgets)
    torch_budgets = _parse_flag("--torch-budgets", lambda text: [strategies_mod.parse_torch_budget(t) for t in text.split(",")],
                                _pick(args.torch_budgets, None, "0.5,0.0"))
    inner_compiler = _pick(args.inner_compiler, "eager" if smoke else None, "inductor")
    strategies = strategies_mod.expand(
        _pick(args.strategies, SMOKE_STRATEGIES if smoke else None, DEFAULT_STRATEGIES).split(","),
        budgets,
        torch_budgets,
        inner_compiler=inner_compiler,
        device_profile=args.device_profile,
    )
    suite = _suite(args, runner, size, device, dtype, smoke, {"smoke": smoke, "inner_compiler (ours)": inner_compiler})
    rows = runner.run_suite(suite, strategies)
    print(suite.markdown_path.read_text())
    written = [path for path in (suite.jsonl_path, suite.markdown_path, suite.plot_path) if path.exists()]
    print(f"results: {', '.join(map(str, written))}", file=sys.stderr)
    return 1 if any(row.get("status") == "error" for row in rows) else 0


def _suite(args, runner, size, device, dtype, smoke: bool, extra_meta: dict):
    return runner.Suite(
        workload=args.model,
        size=size,
        device=device,
        dtype=dtype,
        steps=_pick(args.steps, 2 if smoke else None, 8),
        warmup=_pick(args.warmup, 1 if smoke else None, 2),
        out_dir=Path(args.out),
        tag=args.tag or args.model,
        cpu_peak=not args.no_cpu_peak,
        predict=not args.no_predict,
        time_limit_s=args.time_limit,
        in_turn=args.in_turn,
        extra_meta=extra_meta,
    )


def _run_equal_memory(args, runner, workloads, size, device, dtype) -> int:
    """``--equal-memory``: ours at each baseline's measured peak (``benchmarks/equal_memory.py``)."""
    from ..benchmarks import equal_memory
    from ..benchmarks import strategies as strategies_mod

    if args.no_cpu_peak and device.type == "cpu":
        _fail("--equal-memory needs the measured peaks: drop --no-cpu-peak")
    names = _pick(args.strategies, None, ",".join(equal_memory.BASELINES)).split(",")
    if any(name.strip().startswith("ours") for name in names):
        _fail("--equal-memory: --strategies names the baselines; ours runs at each one's measured peak")
    baselines = strategies_mod.expand(names, [], [0.5])
    extra = _parse_flag("--budgets", strategies_mod.parse_budget_list, _pick(args.budgets, None, "0.25"))
    inner_compiler = _pick(args.inner_compiler, None, "inductor")
    template = strategies_mod.Strategy("ours", None, inner_compiler, args.device_profile)
    suite = _suite(args, runner, size, device, dtype, args.smoke, {"equal_memory": True})
    rows, table = equal_memory.run_equal_memory(suite, baselines, extra, template)
    print(table)
    print(f"results: {suite.out_dir / (suite.tag + '_equal_memory.md')}", file=sys.stderr)
    return 1 if any(row.get("status") == "error" for row in rows) else 0


def _run_fit(args, runner, size, device, dtype) -> int:
    """``--fit``: the whole step under one device budget, fit against FSDP2's CPU offload with
    per-block checkpointing (``benchmarks/fit_step.py``)."""
    from ..benchmarks import fit_step
    from ..benchmarks import strategies as strategies_mod

    budgets = _parse_flag("--budgets", strategies_mod.parse_budget_list, args.budgets or "")
    inner_compiler = _pick(args.inner_compiler, "eager" if args.smoke else None, "inductor")
    suite = _suite(args, runner, size, device, dtype, args.smoke, {"fit": True})
    from ..settings import parse_bytes

    rows, table = fit_step.run_fit_bench(suite, [parse_bytes(b, "memory_budget") for b in budgets], inner_compiler,
                                         progress=lambda line: print(line, file=sys.stderr))
    print(table)
    print(f"results: {suite.out_dir / (suite.tag + '_fit.md')}", file=sys.stderr)
    return 1 if any(row.get("status") == "error" for row in rows) else 0


def _run_attribution(args, runner, size, device, dtype, budgets) -> int:
    """``--attribute``: where ours at the first of ``--budgets`` spends its extra step time
    against ``torch.compile`` (``benchmarks/attribution.py``)."""
    from dataclasses import replace

    from ..benchmarks import attribution
    from ..benchmarks import strategies as strategies_mod

    if args.strategies:
        _fail("--attribute compares torch.compile with ours at the first of --budgets; drop --strategies")
    budget = strategies_mod.parse_budget_list(args.budgets or "0.5")[0]
    inner_compiler = _pick(args.inner_compiler, None, "inductor")
    if inner_compiler != "inductor":
        _fail("--attribute profiles Inductor's kernels: --inner-compiler inductor")
    (reference,) = strategies_mod.expand(["compile"], [], [])
    ours = replace(strategies_mod.Strategy("ours", None, inner_compiler, args.device_profile), budget=budget)
    suite = _suite(args, runner, size, device, dtype, args.smoke, {"attribution": True})
    _, table = attribution.run_attribution(suite, reference, ours)
    print(table)
    print(f"results: {suite.out_dir / (suite.tag + '_attribution.md')}", file=sys.stderr)
    return 0


def _run_max_batch(args, runner, workloads, size, device, dtype, budgets) -> int:
    from .max_batch import max_batch

    byte_budgets = [b for b in budgets if isinstance(b, str)]  # some: check_arguments made sure
    skipped = [b for b in budgets if not isinstance(b, str)]
    if skipped:  # a fraction or none scales with the batch, so it bounds no batch size
        print(f"bench --find-max-batch: skipping budgets {', '.join(map(str, skipped))} (only bytes bound the batch)",
              file=sys.stderr)

    def factory(batch: int, on_device: str):
        return workloads.build(args.model, size.replace(batch=batch), on_device, dtype)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.tag or args.model}_max_batch"
    rows = []
    for budget in byte_budgets:
        print(f"max batch under {budget} ...", file=sys.stderr, flush=True)
        try:
            found = max_batch(factory, budget, low=1, high=size.batch * 64, device_profile=args.device_profile, device=str(device))
            row = {"strategy": f"max_batch:{budget}", "status": "ok", **_max_batch_fields(found)}
        except Exception as error:
            row = {"strategy": f"max_batch:{budget}", "status": "error", "error": f"{type(error).__name__}: {str(error)[:500]}"}
        rows.append({**row, "workload": args.model, "size": dataclasses.asdict(size),
                     "device": str(device), "dtype": str(dtype).removeprefix("torch.")})
        print(json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)
    runner.write_jsonl(rows, out / f"{tag}.jsonl")
    (out / f"{tag}.md").write_text(_max_batch_table(rows))
    print(_max_batch_table(rows))
    return 1 if any(row["status"] == "error" for row in rows) else 0


def _max_batch_fields(found) -> dict:
    return {
        "batch": found.batch,
        "budget_bytes": found.budget_bytes,
        "predicted_peak_bytes": found.predicted_peak_bytes,
        "predicted_step_ms": None if found.predicted_step_seconds is None else found.predicted_step_seconds * 1e3,
        "measured_step_ms": None if found.measured_step_seconds is None else found.measured_step_seconds * 1e3,
        "measured_peak_bytes": found.measured_peak_bytes,
        "measure_error": found.measure_error,
        "planned_on": found.planned_on,
        "probes": [vars(p) for p in found.probes],
        "notes": found.notes,
    }


def _max_batch_table(rows: list[dict]) -> str:
    def mib(value):
        return "–" if value is None else f"{value / 2**20:.1f}"

    def ms(value):
        return "–" if value is None else f"{value:.2f}"

    lines = ["| budget | batch | predicted peak MiB | predicted ms | measured peak MiB | measured ms | status |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('error', '')}"
        lines.append(f"| {row['strategy'].split(':', 1)[1]} | {row.get('batch', '–')} | {mib(row.get('predicted_peak_bytes'))} | "
                     f"{ms(row.get('predicted_step_ms'))} | {mib(row.get('measured_peak_bytes'))} | "
                     f"{ms(row.get('measured_step_ms'))} | {status} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m compile_offload bench", description=__doc__.split("\n\n")[0])
    add_bench_arguments(parser)
    raise SystemExit(run_bench(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
