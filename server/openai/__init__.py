"""The OpenAI-compatible API (docs/protocol.md): /v1/chat/completions, /v1/completions, /v1/models,
/v1/responses, /v1/embeddings (embedding mode), SGLang's /v1/score (generative mode), and SGLang's /encode,
/tokenize and /detokenize (the last two also under /v1/).

Modules: `params` (body validation and the OpenAI -> sampling-params mapping), `tools` (tool prompts,
tool_choice constraints, parsing calls), `logprobs` (OpenAI's logprob shapes), `common` (model check,
result collection, usage), `streaming` (SSE framing and the chat chunk sequence), `responses_input`/`responses_output` (the
Responses API translated onto the chat pieces, and its output items and events), and one module per route
group. Everything reaches the runtime through `TokenizerManager.submit`; errors are `RequestError`s, which
the server's handlers render as the OpenAI envelope.
"""

from __future__ import annotations

from fastapi import APIRouter

from server.openai.chat import router as _chat
from server.openai.completions import router as _completions
from server.openai.embeddings import router as _embeddings
from server.openai.models import router as _models
from server.openai.responses import router as _responses
from server.openai.score import router as _score
from server.openai.tokenize import router as _tokenize

router = APIRouter()
router.include_router(_chat)
router.include_router(_completions)
router.include_router(_models)
router.include_router(_responses)
router.include_router(_embeddings)
router.include_router(_score)
router.include_router(_tokenize)

__all__ = ["router"]
