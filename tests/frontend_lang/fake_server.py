"""A fake radixgen server for frontend unit tests: protocol-exact shapes, canned deterministic content.

One character is one token (token id = ord(char)); there is no BOS. Token logprobs come from
`logprob_fn(context, char)`; generated text from `script(prompt, sampling_params)`, cut to max_new_tokens
characters and at the first stop string. `cached_tokens` is the longest prefix shared with any earlier
prompt+output, like a radix cache that never evicts. Every request body is recorded in `requests`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL_PATH = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"


class FakeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def default_logprob(context: str, ch: str) -> float:
    return -((ord(ch) % 13) + 1) / 10.0


def default_script(prompt: str, params: dict) -> str:
    if params.get("json_schema"):
        return '{"name": "Ann", "age": 7}'
    regex = params.get("regex")
    if regex is not None and regex.startswith(r"[-+]?[0-9]+") and "." not in regex:  # frontend_lang's REGEX_INT
        return "42"
    if regex == r"(True|False)":
        return "True"
    if regex:
        return "555-123-4567"
    return "abc def ghi jkl mno pqr stu vwx yz " * 4


class FakeServer:
    def __init__(self, model_path: str = MODEL_PATH) -> None:
        self.model_path = model_path
        self.logprob_fn: Callable[[str, str], float] = default_logprob
        self.script: Callable[[str, dict], str] = default_script
        self.requests: list[tuple[str, Any]] = []
        self.seen: list[str] = []
        self.delay = 0.0
        self.refuse_batch: set[str] = set()  # "text"/"input_ids": a list of prompts there is a 422, as sglang-router
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def bodies(self, path: str) -> list[Any]:
        return [b for p, b in self.requests if p == path]

    # ------------------------------------------------------------------ native /generate
    def _cached(self, text: str) -> int:
        best = 0
        for old in self.seen:
            n = 0
            for a, b in zip(old, text, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, max(len(text) - 1, 0))

    def _triples(self, context: str, text: str, start: int, with_text: bool) -> list[list[Any]]:
        out = []
        for i in range(start, len(text)):
            lp = None if i == 0 and not context else self.logprob_fn(context + text[:i], text[i])
            out.append([lp, ord(text[i]), text[i] if with_text else None])
        return out

    def generate_one(self, prompt: str, params: dict, body: dict) -> dict:
        max_new = params.get("max_new_tokens")
        max_new = 128 if max_new is None else max_new
        out = self.script(prompt, params)[:max_new]
        finish: dict = {"type": "length", "length": max_new}
        for stop in params.get("stop") or []:
            idx = out.find(stop)
            if idx >= 0:
                out, finish = out[:idx], {"type": "stop", "matched": stop}
        if len(out) < max_new and finish["type"] == "length":
            finish = {"type": "stop", "matched": 2}
        with self.lock:
            cached = self._cached(prompt)
            self.seen.append(prompt + out)
        meta: dict[str, Any] = {"id": f"fake-{len(self.requests)}", "finish_reason": finish,
                                "prompt_tokens": len(prompt), "completion_tokens": len(out), "cached_tokens": cached}
        if body.get("return_logprob"):
            start = body.get("logprob_start_len")
            start = len(prompt) if start is None or start < 0 else start
            with_text = bool(body.get("return_text_in_logprobs"))
            meta["input_token_logprobs"] = self._triples("", prompt, start, with_text)
            meta["output_token_logprobs"] = self._triples(prompt, out, 0, with_text)
        return {"text": out, "output_ids": [ord(c) for c in out], "meta_info": meta}

    def generate(self, body: dict) -> Any:
        for key in self.refuse_batch:
            value = body.get(key)
            if isinstance(value, list) and (key == "text" or (value and isinstance(value[0], list))):
                raise FakeError(422, f"Failed to deserialize the JSON body into the target type: {key}: "
                                     "invalid type: sequence, expected a string")
        if "text" in body:
            prompts = body["text"]
        else:
            ids = body["input_ids"]
            prompts = ["".join(map(chr, x)) for x in ids] if ids and isinstance(ids[0], list) else "".join(map(chr, ids))
        params = body.get("sampling_params") or {}
        if isinstance(prompts, list):
            plist = params if isinstance(params, list) else [params] * len(prompts)
            return [self.generate_one(p, sp, body) for p, sp in zip(prompts, plist, strict=True)]
        return self.generate_one(prompts, params, body)

    # ------------------------------------------------------------------ OpenAI
    def chat(self, body: dict) -> dict:
        prompt = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"]) + "<assistant>"
        params = {"max_new_tokens": body.get("max_tokens"), "stop": body.get("stop"), "regex": body.get("regex")}
        if body.get("response_format", {}).get("type") == "json_schema":
            params["json_schema"] = json.dumps(body["response_format"]["json_schema"]["schema"])
        res = self.generate_one(prompt, params, {})
        return {"id": "chatcmpl-fake", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": res["text"]},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(res["text"]),
                          "total_tokens": len(prompt) + len(res["text"]),
                          "prompt_tokens_details": {"cached_tokens": res["meta_info"]["cached_tokens"]}}}

    def completion(self, body: dict) -> dict:
        prompt = body["prompt"]
        if isinstance(prompt, list):
            prompt = "".join(map(chr, prompt))
        bias = body.get("logit_bias")
        if bias:
            allowed = [chr(int(t)) for t, b in bias.items() if b > 0]
            text = max(allowed, key=lambda c: self.logprob_fn(prompt, c))
        else:
            text = self.generate_one(prompt, {"max_new_tokens": body.get("max_tokens", 16),
                                              "stop": body.get("stop")}, {})["text"]
        return {"id": "cmpl-fake", "object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(text),
                          "total_tokens": len(prompt) + len(text)}}


def _make_handler(server: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _sse(self, events: list[Any]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for ev in events:
                self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.02)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

        def do_GET(self) -> None:
            server.requests.append((self.path, None))
            if self.path == "/get_model_info":
                self._send(200, {"model_path": server.model_path, "tokenizer_path": server.model_path,
                                 "is_generation": True, "max_context_length": 8192})
            elif self.path in ("/get_server_info", "/server_info"):
                self._send(200, {"model_path": server.model_path, "internal_states": [{}]})
            elif self.path == "/health":
                self._send(200, {})
            else:
                self._send(404, {"error": {"message": "not found", "type": "not_found", "param": None,
                                           "code": 404}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            server.requests.append((self.path, body))
            if server.delay:
                time.sleep(server.delay)
            try:
                if self.path == "/generate":
                    res = server.generate(body)
                    if body.get("stream"):
                        text, events = res["text"], []
                        for i in range(1, len(text) + 1, 2):
                            events.append({**res, "text": text[:i]})
                        events.append(res)
                        self._sse(events)
                        return
                    self._send(200, res)
                elif self.path == "/flush_cache":
                    server.seen.clear()
                    self._send(200, {})
                elif self.path == "/v1/chat/completions":
                    res = server.chat(body)
                    if body.get("stream"):
                        text = res["choices"][0]["message"]["content"]
                        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
                        events += [{"choices": [{"index": 0, "delta": {"content": text[i:i + 3]}}]}
                                   for i in range(0, len(text), 3)]
                        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                        self._sse(events)
                        return
                    self._send(200, res)
                elif self.path == "/v1/completions":
                    self._send(200, server.completion(body))
                else:
                    self._send(404, {"error": {"message": "not found", "type": "not_found", "param": None,
                                               "code": 404}})
            except FakeError as e:
                self._send(e.status, {"error": {"message": e.message, "type": "invalid_request_error",
                                                "param": None, "code": e.status}})

    return Handler


def main() -> None:
    """`python fake_server.py --port P [ignored server flags]`: serve until SIGTERM (for Runtime tests)."""
    import argparse
    import signal
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model-path", default=MODEL_PATH)
    args, _ = parser.parse_known_args()
    fake = FakeServer(args.model_path or MODEL_PATH)
    fake.close()  # rebind on the requested port
    fake.httpd = ThreadingHTTPServer((args.host, args.port), _make_handler(fake))
    fake.httpd.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"radixgen ready on http://{args.host}:{args.port}", flush=True)
    fake.httpd.serve_forever()


if __name__ == "__main__":
    main()
