"""Tool calls in a policy's reply: parsed out of the generated text by the model family's format, never generated
apart from it, so the trained tokens stay exactly the generated ones.

A parser is named as SGLang's `--tool-call-parser` names it: `qwen25` (or `qwen`; vLLM's `hermes` is the same
format, which Hermes-2-Pro, Qwen2.5, Qwen3 and SmolLM3 templates write):

    some text<tool_call>
    {"name": "Bash", "arguments": {"command": "ls"}}
    </tool_call>

The text before the first call is the message's content. A call whose JSON does not parse, or that names no
function, is left in the content as text (the harness then sees what the model wrote, and no action runs). A reply
cut off at the token limit is never parsed: its last call may be cut, and the cut action must not run.

`reply_key` is how a reply is recognised when a harness sends it back as history, whatever the API: the OpenAI
shape (`tool_calls` with JSON-string `arguments`) and Anthropic's (`tool_use` blocks with an `input` object) give
the same key, and so do re-serialised arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from grpoflow.config import TOOL_CALL_PARSERS

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str  # what the harness names the call by (OpenAI `call_...`, Anthropic `toolu_...`)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.json()}}

    def anthropic(self) -> dict[str, Any]:
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": self.arguments}

    def json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ParsedReply:
    content: str  # the reply's text outside its tool calls
    tool_calls: list[ToolCall]


def parse_reply(text: str, parser: str | None, *, id_prefix: str = "call_") -> ParsedReply:
    """The reply's content and tool calls under `parser` (None: no tool calls, the whole text is content)."""
    if parser is None:
        return ParsedReply(text, [])
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool-call parser {parser!r}: known parsers are {', '.join(TOOL_CALL_PARSERS)}")
    calls: list[ToolCall] = []
    kept: list[str] = []  # text outside the parsed calls (a call that does not parse stays as text)
    pos = 0
    for m in _HERMES.finditer(text):
        call = _hermes_call(m.group(1), id_prefix)
        if call is None:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    if not calls:
        return ParsedReply(text, [])
    kept.append(text[pos:])
    return ParsedReply("".join(kept).strip(), calls)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json.loads takes NaN/Infinity, which no client could read back


def loads(text: str) -> Any:
    """Strict JSON (no NaN or Infinity)."""
    return json.loads(text, parse_constant=_no_constants)


def _hermes_call(body: str, id_prefix: str) -> ToolCall | None:
    try:
        obj = loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            args = loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args, f"{id_prefix}{uuid.uuid4().hex[:24]}")


def reply_key(content: Any, calls: list[tuple[str, Any]]) -> tuple:
    """The key of an assistant message: its text (trimmed: harnesses trim) and its calls as (name, arguments)
    with the arguments parsed and re-serialised with sorted keys."""
    text = content.strip() if isinstance(content, str) else ""
    return ("assistant", text, tuple((name, _canonical_args(args)) for name, args in calls))


def _canonical_args(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = loads(args)
        except ValueError:
            return args
    return json.dumps(_integral(args), sort_keys=True, ensure_ascii=False)


def _integral(v: Any) -> Any:
    """Whole floats as ints: a JavaScript client sends back 10.0 as 10."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, dict):
        return {k: _integral(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_integral(x) for x in v]
    return v


def parsed_key(reply: ParsedReply) -> tuple:
    return reply_key(reply.content, [(c.name, c.arguments) for c in reply.tool_calls])


def message_key(m: dict[str, Any]) -> tuple | None:
    """The reply key of an OpenAI-shaped assistant message (None for other roles)."""
    if m.get("role") != "assistant":
        return None
    calls = []
    for c in m.get("tool_calls") or []:
        fn = (c.get("function") or {}) if isinstance(c, dict) else {}
        calls.append((fn.get("name"), fn.get("arguments")))
    return reply_key(m.get("content"), calls)
