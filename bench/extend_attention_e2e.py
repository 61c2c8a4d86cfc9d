"""RAG end to end through the real Scheduler in-process: reference vs fast extend attention, alternating.

    python bench/extend_attention_e2e.py bfloat16|float32     (figures: bench/results/extend_attention.md)
"""
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench", "peers"))
# ruff: noqa: E402
import workloads as W

from kernels import ref, torch_backend, torch_extend
from runtime.config import make_config
from runtime.executor.model_runner import create_model_runner
from runtime.messages import TokenizedGenerateReq
from runtime.models.registry import default_model_path
from runtime.sampling.params import SamplingParams
from runtime.scheduler import Scheduler
from runtime.tokenizer.load import load_tokenizer

dtype = sys.argv[1]
path = default_model_path()
tok = load_tokenizer(path)
cfg = make_config(model_path=path, dtype=dtype, max_total_tokens=60000, max_running_requests=64)
r = create_model_runner(cfg, progress=False)
s = Scheduler(r, r.allocator, r.req_to_token, cfg, r.eos_token_ids, tok.decode)
reqs = W.rag(5, 16)
def go(tag):
    s.flush_cache()
    for i, q in enumerate(reqs):
        ids = tok.encode_chat(q.messages)
        s.handle(TokenizedGenerateReq(rid=f"{tag}{i}", input_ids=ids, sampling_params=SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)))
    t0 = time.perf_counter()
    while s.has_work():
        s.step()
    return time.perf_counter() - t0
impl = {"ref": ref.extend_attention, "fast": torch_extend.extend_attention}
res = {"ref": [], "fast": []}
for rnd in range(3):
    for name in ("ref", "fast"):
        torch_backend.torch_extend.extend_attention = impl[name]  # the backend calls torch_extend.extend_attention
        res[name].append(go(f"{name}{rnd}-"))
torch_backend.torch_extend.extend_attention = impl["fast"]
m = {k: statistics.median(v) for k, v in res.items()}
print(dtype, {k: [round(x, 2) for x in v] for k, v in res.items()}, "median s", m, "speedup", round(m["ref"] / m["fast"], 2), "out tok/s", {k: round(16 * 32 / v, 1) for k, v in m.items()})
