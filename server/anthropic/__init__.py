"""Anthropic's Messages API (docs/protocol.md): POST /v1/messages (whole or streamed) and
/v1/messages/count_tokens, on the OpenAI routes' validators, chat template rendering, tool plans and chat
stream (server/openai/).

Modules: `params` (top-level parameters, what is refused), `messages` (system and content blocks -> chat
messages), `tools` (tools and tool_choice -> a chat ToolPlan; calls -> tool_use blocks), `response` (the message
object, stop_reason, usage), `streaming` (the event sequence), `routes`. Errors are `RequestError`s, which the
server's handlers render in Anthropic's envelope on these paths (server/errors.py).
"""

from __future__ import annotations

from server.anthropic.routes import router

__all__ = ["router"]
