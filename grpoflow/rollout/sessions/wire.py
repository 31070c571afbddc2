"""The two chat APIs the session server speaks, mapped onto one internal turn: OpenAI chat completions and
Anthropic Messages, each as a whole response or as server-sent events (the replies are generated whole, then
sent as the events a streaming client expects).

Internally a conversation is OpenAI-shaped messages (`role`, `content` text, `tool_calls`, `tool_call_id`), which
is what chat templates render; `anthropic_messages` maps a Messages request onto it:

    system (text or text blocks)          -> {"role": "system"}
    user text blocks                      -> {"role": "user"}
    system messages (claude-code's notes) -> {"role": "system"}
    user tool_result blocks               -> {"role": "tool", "tool_call_id": ...}, before the user's text
    assistant text + tool_use blocks      -> {"role": "assistant", "content": ..., "tool_calls": [...]}
    tools [{name, description, input_schema}] -> [{"type": "function", "function": {..., "parameters"}}]

Thinking blocks are dropped (the policy's reply never has one); images and documents are refused.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from grpoflow.rollout.sessions.tool_calls import ParsedReply


class WireError(ValueError):
    """A request this server cannot map (answered 400, naming the field)."""


def content_text(content: Any, where: str) -> str:
    """Text of a content field: a string, or a list of text blocks (OpenAI's parts and Anthropic's blocks alike)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise WireError(f"{where}: only text blocks are supported here, got {kind!r}")
            parts.append(block["text"])
        return "".join(parts)
    raise WireError(f"{where}: must be a string or a list of blocks, got {type(content).__name__}")


def anthropic_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Messages request's system and messages as internal (OpenAI-shaped) messages."""
    out: list[dict[str, Any]] = []
    if system:
        if isinstance(system, list):  # text blocks, each its own paragraph of the system prompt
            out.append({"role": "system", "content": "\n\n".join(content_text([b], "system") for b in system)})
        else:
            out.append({"role": "system", "content": content_text(system, "system")})
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        where = f"messages.{i}.content"
        if role == "system":  # claude-code sends mid-conversation system notes as messages of their own
            out.append({"role": "system", "content": content_text(content, where)})
            continue
        if role not in ("user", "assistant"):
            raise WireError(f"messages.{i}.role: must be user, assistant or system, got {role!r}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise WireError(f"{where}: must be a string or a list of blocks")
        if role == "assistant":
            texts, calls = [], []
            for block in blocks:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text":
                    texts.append(block.get("text") or "")
                elif kind == "tool_use":
                    calls.append(
                        {
                            "id": block.get("id"),
                            "type": "function",
                            "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))},
                        }
                    )
                elif kind in ("thinking", "redacted_thinking"):
                    continue
                else:
                    raise WireError(f"{where}: block type {kind!r} is not supported in an assistant message")
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        texts = []
        for block in blocks:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_result":
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id"),
                        "content": content_text(block.get("content"), f"{where}.tool_result"),
                    }
                )
            elif kind == "text":
                texts.append(block.get("text") or "")
            else:
                raise WireError(f"{where}: block type {kind!r} is not supported (text and tool_result only)")
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def anthropic_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions as the OpenAI function tools chat templates render (server tools dropped)."""
    if not tools:
        return None
    out = []
    for t in tools:
        if "input_schema" not in t:  # a server tool (web search...): nothing the policy can call here
            continue
        out.append(
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description", ""),
                    "parameters": t["input_schema"],
                },
            }
        )
    return out or None


# ---- Anthropic responses --------------------------------------------------------------------------------------


def anthropic_stop_reason(reply: ParsedReply, finish_reason: str) -> str:
    if finish_reason == "length":
        return "max_tokens"
    return "tool_use" if reply.tool_calls else "end_turn"


def anthropic_message(
    reply: ParsedReply, stop_reason: str, model: str, prompt_tokens: int, output_tokens: int
) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if reply.content or not reply.tool_calls:
        content.append({"type": "text", "text": reply.content})
    content += [c.anthropic() for c in reply.tool_calls]
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": output_tokens},
    }


def anthropic_events(message: dict[str, Any]) -> Iterator[str]:
    """A whole Messages response as the server-sent events of a streamed one."""
    start = {**message, "content": [], "stop_reason": None, "usage": {**message["usage"], "output_tokens": 0}}
    yield _event("message_start", {"type": "message_start", "message": start})
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield _event(
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": {**block, "text": ""}},
            )
            if block["text"]:
                delta = {"type": "text_delta", "text": block["text"]}
                yield _event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta})
        else:
            yield _event(
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}},
            )
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            yield _event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta})
        yield _event("content_block_stop", {"type": "content_block_stop", "index": i})
    yield _event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": message["usage"]["output_tokens"]},
        },
    )
    yield _event("message_stop", {"type": "message_stop"})


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---- OpenAI chat completions ----------------------------------------------------------------------------------


def openai_finish_reason(reply: ParsedReply, finish_reason: str) -> str:
    if finish_reason == "length":
        return "length"
    return "tool_calls" if reply.tool_calls else "stop"


def openai_chunks(body: dict[str, Any], include_usage: bool) -> Iterator[str]:
    """A whole chat completion as the `chat.completion.chunk` events of a streamed one, `[DONE]` last."""
    choice = body["choices"][0]
    msg = choice["message"]
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
        return f"data: {json.dumps({**base, 'choices': [c]}, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": msg.get("content") or ""}, logprobs=choice.get("logprobs"))
    for i, call in enumerate(msg.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': body['usage']})}\n\n"
    yield "data: [DONE]\n\n"
