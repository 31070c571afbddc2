"""`ChatClient`: the SGLang client with OpenAI's chat route, which the pipeline never calls (the shell agent sends
tokens to `/generate`, the other harnesses reach the policy through the session server) but the tests call to hold
our engines' `/v1/chat/completions` to SGLang's, through the client's own retries and response checks."""

from __future__ import annotations

from typing import Any

from grpoflow.engine.client import SglangClient
from grpoflow.engine.protocol import ChatCompletionResponse


class ChatClient(SglangClient):
    def chat_completions(self, messages: list[dict], **params: Any) -> ChatCompletionResponse:
        """OpenAI chat completion; `params` go into the body as given (max_tokens, temperature, seed, ...)."""
        return self._call("POST", "/v1/chat/completions", {"messages": messages, **params}, ChatCompletionResponse)
