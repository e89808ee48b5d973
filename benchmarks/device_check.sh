#!/usr/bin/env bash
# The checks a session with a borrowed GPU runs, sized for a 15-minute lease in two calls
# (learned on an H200, 2026-11-26: a call's start costs ~30 s, Triton compiles on cold caches
# make each compiled strategy 10-60 s, and at most 8 files come back from a call).
#
#   benchmarks/device_check.sh OUTDIR first    # <= 590 s: CUDA tests, then the GPT and deep sweeps
#   benchmarks/device_check.sh OUTDIR second   # <= 250 s: the budget contract's CUDA path, model by model
#
# "first" writes 7 files (env.txt, cuda_tests.log, bench.log, gpt.md, gpt.jsonl, deep.md,
# deep.jsonl; the plots are dropped to stay under 8), "second" 3 (contract_cuda.md, its
# stderr, and live_at_peak.txt: the allocations alive at each measured peak and the lines
# that made them, and the storages the plan holds at its own peak). Each step has a hard
# limit, and what finished is written even when a later step runs out of time. The whole suite with every strategy is benchmarks/gpu.sh (one
# full call of its own). PYTHON=... picks the interpreter.
set -uo pipefail

OUT=${1:?usage: benchmarks/device_check.sh OUTDIR first|second}
PART=${2:?usage: benchmarks/device_check.sh OUTDIR first|second}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
say() { echo "[device_check +$(( $(date +%s) - T0 ))s] $*" >&2; }

. benchmarks/device_setup.sh  # the checkout installed, cold caches, bench LOG LIMIT ARGS...

case "$PART" in
first)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      "$PY" -c "import sys, torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(), 'Python', sys.version.split()[0])"
      git rev-parse --short HEAD 2>/dev/null
      # Which attention SDPA takes for bf16 here (torch >= 2.11 bundles cuDNN >= 9.15.1, which
      # makes it prefer cuDNN attention on sm90/sm100), and what that backward holds above its
      # three gradients: op_workspace.py counts FlashAttention-2's and the cutlass kernel's
      # workspaces, not cuDNN's (GPT-8's attention shape; docs/design.md, "Not followed").
      timeout 60 "$PY" - <<'PY'
import torch
import torch.nn.functional as F
q, k, v = (torch.randn(8, 16, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
backend = torch._fused_sdp_choice(q, k, v, None, 0.0, True)
out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
grad = torch.randn_like(out)
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_allocated()
out.backward(grad)
torch.cuda.synchronize()
above = torch.cuda.max_memory_allocated() - before - 3 * q.numel() * q.element_size()
print("sdpa bf16 causal 8x16x2048x128: backend", torch.nn.attention.SDPBackend(backend).name,
      "| backward holds", above, "bytes above its three gradients")
PY
      } >"$OUT/env.txt" 2>&1
    cat "$OUT/env.txt" >&2
    # 120 CUDA tests took 190 s in all on an H200 with cold caches, 125 took 146 s on the
    # fourth lease, and the fifth stopped at 190 s with 123 run: per-test limit, hard stop.
    per_test=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=90")  # where pytest-timeout is there
    timeout -s INT -k 10 205 "$PY" -m pytest -m cuda -q -p no:cacheprovider $per_test -rfEs --durations=10 \
        >"$OUT/cuda_tests.log" 2>&1
    say "CUDA tests: exit $? ($(tail -1 "$OUT/cuda_tests.log"))"
    # Eager checkpointing and SAC offload measured the same in three leases (1.31-1.33x and
    # 1.02x, peaks to the MiB) and did not start within the fifth's 140 s: left to gpu.sh.
    bench "$OUT/bench.log" 175 --model gpt --device cuda --out "$OUT" --steps 8 --warmup 2 --time-limit 140 \
        --budgets 0.5,0.25,2GiB --torch-budgets 0.5 --strategies compile,ours,torch_budget
    # The fourth lease's deep sweep reached its 100 s limit (compile 40 s, ours 66 s) before
    # torch's budget (34 s to its first call on the third lease): 135 s lets all three run.
    bench "$OUT/bench.log" 180 --model deep --device cuda --out "$OUT" --steps 6 --warmup 2 --time-limit 135 \
        --budgets 3GiB --torch-budgets 0.5 --strategies compile,ours,torch_budget
    rm -f "$OUT"/*.png  # 7 files: the plots would make 9
    ;;
second)
    # Slots from the third H200 lease (2026-11-27, cold caches): transformer 30 s, mixer 34 s,
    # conv+BN 24 s, Llama 51 s, GPT-2 57 s; a little more for the snapshots. The two families
    # whose measured peaks exceed every model (conv+BN, GPT-2) go first, so their
    # live_at_peak.txt comes back even when time runs out. 245 s in all.
    for slot in conv_bn:35 hf_gpt2:68 transformer:40 mlp_mixer:42 hf_llama:60; do
        model=${slot%%:*}
        timeout -s INT -k 5 "${slot##*:}" "$PY" -m compile_offload.benchmarks.budget_contract --device cuda \
            --models "$model" --snapshot "$OUT/live_at_peak.txt" >>"$OUT/contract_cuda.md" 2>>"$OUT/contract_cuda.err"
        say "contract $model: exit $?"
    done
    ;;
*)
    echo "device_check.sh: unknown part '$PART' (first or second)" >&2
    exit 2
    ;;
esac
ls -l "$OUT" >&2
