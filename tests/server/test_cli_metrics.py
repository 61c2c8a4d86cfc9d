"""Fast unit tests: CLI flags generated from the config dataclasses, metrics text, stop-string holdback."""

from __future__ import annotations

import asyncio
import dataclasses
import re

from runtime.config import SECTIONS
from runtime.sampling.params import SamplingParams
from runtime.tokenizer.generate_input import GenerateRequest
from runtime.tokenizer.manager import ReqState
from server.cli import build_parser, config_from_args, field_docs
from server.metrics import Metrics

SGLANG_FLAGS = ["--model-path", "--host", "--port", "--served-model-name", "--context-length", "--max-running-requests", "--max-total-tokens", "--chunked-prefill-size", "--max-prefill-tokens", "--schedule-policy", "--disable-radix-cache", "--grammar-backend", "--api-key", "--chat-template", "--stream-interval", "--random-seed", "--log-level", "--attention-backend", "--dtype", "--enable-metrics", "--enable-cache-report"]


def _serve_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["serve"]


def test_every_config_field_is_a_flag_with_its_docstring_as_help():
    serve = _serve_parser()
    by_flag = {s: a for a in serve._actions for s in a.option_strings}
    for cls in SECTIONS.values():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            action = by_flag["--" + f.name.replace("_", "-")]
            assert docs[f.name] and action.help == docs[f.name], f.name
    for flag in SGLANG_FLAGS:
        assert flag in by_flag, flag


def test_flags_parse_into_the_frozen_config():
    ns = build_parser().parse_args(["serve", "--port", "1234", "--max-total-tokens", "512", "--disable-radix-cache",
                                    "--no-enable-metrics", "--schedule-policy", "fcfs", "--shutdown-timeout", "2.5"])
    cfg = config_from_args(ns)
    assert cfg.server.port == 1234 and cfg.cache.max_total_tokens == 512 and cfg.cache.disable_radix_cache
    assert cfg.server.enable_metrics is False and cfg.scheduler.schedule_policy == "fcfs"
    assert cfg.server.shutdown_timeout == 2.5 and cfg.model.model_path is None


def test_metrics_text_format_and_cumulative_buckets():
    m = Metrics()
    m.on_first_token(0.03)
    m.on_first_token(3.0)
    m.on_tokens(0.1, 2)
    m.on_finish(1.2, 10, 5, 4, "length")
    m.on_http("/generate", 200)
    text = m.render("radixgen", "smol", {"num_running_reqs": 2, "max_total_num_tokens": 100, "kv_free_slots": 60,
                                          "kv_evictable_slots": 20, "stall_steps_retraction": 3})
    line = re.compile(r'^radixgen:[a-z0-9_]+\{[^}]*\} -?[0-9.e+-]+$|^# (HELP|TYPE) radixgen:[a-z0-9_]+ .+$')
    assert all(line.match(x) for x in text.strip().splitlines()), [x for x in text.splitlines() if not line.match(x)]
    assert 'radixgen:num_running_reqs{model_name="smol"} 2' in text
    assert 'radixgen:token_usage{model_name="smol"} 0.2' in text
    assert 'radixgen:time_to_first_token_seconds_bucket{model_name="smol",le="0.05"} 1' in text
    assert 'radixgen:time_to_first_token_seconds_bucket{model_name="smol",le="+Inf"} 2' in text
    assert 'radixgen:inter_token_latency_seconds_count{model_name="smol"} 2' in text
    assert 'radixgen:generation_tokens_total{model_name="smol"} 5' in text
    assert 'radixgen:num_stall_steps_total{model_name="smol",reason="retraction"} 3' in text
    assert m.render("sglang:", "smol", None).count("sglang:num_queue_reqs{") == 1
    assert "swa_" not in text  # no sliding-window pool: no family
    swa = m.render("radixgen", "g", {"max_total_num_tokens": 100, "swa_total_slots": 80, "swa_free_slots": 50,
                                     "swa_evictable_slots": 10})
    assert 'radixgen:swa_num_used_tokens{model_name="g"} 20' in swa
    assert 'radixgen:swa_token_usage{model_name="g"} 0.25' in swa


def test_streamed_text_holds_back_a_possible_stop_string_start():
    async def run():
        req = GenerateRequest(text="x", stream=True)
        st = ReqState("r", 0, asyncio.Queue(), req, SamplingParams(stop=["\n\nUser:"]), 1)
        seen = []
        for piece in ["Hello", "\n", "\nUs", "e", "r", "!"]:
            st.text += piece
            seen.append(st.visible_text())
        return seen

    seen = asyncio.run(run())
    assert seen == ["Hello", "Hello", "Hello", "Hello", "Hello", "Hello\n\nUser!"]
