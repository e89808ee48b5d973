# Sourced by gpu.sh and device_check.sh from the repository root, with PY set. The checkout
# installed (offline: no build isolation, no dependencies; compile_offload.passes and
# compile_offload.benchmarks exist only as installed names), and cold Inductor caches, so
# first-call times are compile times (as in the anchors).
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e . >&2 || exit 1
CACHE=$(mktemp -d)
trap 'rm -rf "$CACHE"' EXIT
export TORCHINDUCTOR_CACHE_DIR="$CACHE"

bench() {  # bench LOG HARD_LIMIT_S ARGS...: one `compile_offload bench` run, its output appended to LOG
    local log=$1 limit=$2
    shift 2
    timeout --signal=INT --kill-after=20 "$limit" "$PY" -c "from compile_offload.tools.bench import main; main()" "$@" \
        >>"$log" 2>&1
    echo "bench $*: exit $?" >&2
}
