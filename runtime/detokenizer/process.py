"""The detokenizer process: its entry point and its loop.

`run_detokenizer_process(spec)` is the spawn target (runtime/launch.py). The loop receives each step's
`BatchTokenOut` from the scheduler, turns token ids into text deltas (runtime/detokenizer/state.py) and
pushes a `BatchTextOut` to the TokenizerManager.
"""

from __future__ import annotations

from typing import Any

import zmq

from runtime.child import start_child
from runtime.config import Config
from runtime.ipc import Endpoints, Receiver, Sender
from runtime.messages import BatchTokenOut, ShutdownReq, ToDetokenizer, ToTokenizer


def run_detokenizer_process(spec: dict) -> None:
    start_child(spec, "detokenizer", _build_detokenizer_loop)


class DetokenizerLoop:
    """receive BatchTokenOut -> text deltas -> send BatchTextOut, until ShutdownReq."""

    model = None  # nothing to report in the ReadyMsg

    def __init__(self, detok: Any, ctx: zmq.Context, ep: Endpoints) -> None:
        self.detok = detok
        self._recv = Receiver(ctx, ep.detokenizer, ToDetokenizer)
        self._send = Sender(ctx, ep.tokenizer, ToTokenizer)

    def run(self) -> None:
        while True:
            msg = self._recv.recv()
            if isinstance(msg, BatchTokenOut):
                self._send.send(self.detok.process_batch(msg))
            elif isinstance(msg, ShutdownReq):
                return


def _build_detokenizer_loop(cfg: Config, ctx: zmq.Context, spec: dict) -> DetokenizerLoop:
    from runtime.detokenizer.state import Detokenizer
    from runtime.tokenizer.load import load_tokenizer

    path = cfg.model.tokenizer_path or cfg.model.model_path
    assert path is not None  # the launcher resolves model_path before children start
    tok = load_tokenizer(path)
    detok = Detokenizer(tok.decode, spec.get("detokenizer_max_states", 65536))
    return DetokenizerLoop(detok, ctx, Endpoints(**spec["endpoints"]))
