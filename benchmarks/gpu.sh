#!/usr/bin/env bash
# The full GPU suite, in under 10 minutes, writing at most 8 files into OUTDIR:
#   gpt.{jsonl,md}, gpt_pareto.png          GPT 8 x d2048, seq 2048, batch 8, bf16 (the anchor workload)
#   deep.{jsonl,md}, deep_pareto.png        deep narrow 24 x d1024, seq 4096, batch 4, bf16 (the other anchor)
#   gpt_max_batch.{jsonl,md}                largest GPT batch whose planned step fits 4 GiB (planned, then measured)
# Progress goes to stderr. Usage: benchmarks/gpu.sh OUTDIR   (PYTHON=... to pick the interpreter)
#
# Time: compiled strategies take 15-35 s each on first call (cold caches), so each sweep has
# a soft limit (--time-limit: no new strategy starts after it; the rest are recorded as
# skipped) and a hard one (timeout; what finished is still written). Strategies are ordered
# so the reference and ours come first. The hard limits and their 20 s grace add up to 585 s.
# The deep sweep plans one budget: planning 24 layers takes minutes (docs/benchmarks.md).
set -uo pipefail

OUT=${1:?usage: benchmarks/gpu.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
. benchmarks/device_setup.sh  # the checkout installed, cold caches, bench LOG LIMIT ARGS...

"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" >&2 || exit 1

bench /dev/stderr 225 --model gpt --device cuda --out "$OUT" --steps 8 --warmup 2 --time-limit 170 \
    --budgets 0.25,0.5,0.75,2GiB --torch-budgets 0.5,0.0 \
    --strategies compile,ours,eager,eager_ckpt,torch_budget,torch_sac_offload,eager_ckpt_save_on_cpu,eager_save_on_cpu

bench /dev/stderr 225 --model deep --device cuda --out "$OUT" --steps 6 --warmup 2 --time-limit 170 \
    --budgets 3GiB --torch-budgets 0.5 \
    --strategies compile,ours,eager,eager_ckpt,torch_budget,torch_sac_offload,eager_ckpt_save_on_cpu,eager_save_on_cpu

# Named profile: explain plans meta tensors, which do not say which GPU they stand for.
bench /dev/stderr 75 --model gpt --device cuda --out "$OUT" --find-max-batch --budgets 4GiB --device-profile h100

ls -l "$OUT" >&2
