"""The session server as claude-code and opencode use it: Anthropic Messages and OpenAI chat, streamed, with tool
calls parsed from the generated text and sent back as history, per-session tokens, and a cut-off turn that ends
the episode. Driven by the real `anthropic` and `openai` clients against a scripted engine (exact tokens)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from grpoflow.rollout.sessions.segments import segment_samples
from grpoflow.rollout.sessions.tool_calls import parse_reply
from grpoflow.samples import Sample
from tests.integration.sessions.conftest import Out

TOOLS_ANTHROPIC = [
    {
        "name": "Bash",
        "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    }
]
TOOLS_OPENAI = [
    {
        "type": "function",
        "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
    }
    for t in TOOLS_ANTHROPIC
]
CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls /app"}}\n</tool_call>'


def _trial(rid: str) -> Sample:
    from tests.integration.sessions.test_session_server import _trial as trial

    return trial(rollout_id=rid)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def _trained(sample: Sample) -> list[int]:
    return [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]


def test_our_parser_names_are_sglangs_or_vllms_for_the_same_format():
    from grpoflow.config import TOOL_CALL_PARSERS
    from tests.fakes.sglang_fields import SGLANG_TOOL_CALL_PARSERS

    assert set(TOOL_CALL_PARSERS) - SGLANG_TOOL_CALL_PARSERS == {"hermes"}  # vLLM's name for qwen25's format


def test_parser_reads_qwen25_calls_and_leaves_broken_ones_as_text():
    p = parse_reply("I will look." + CALL, "hermes")
    assert p.content == "I will look." and [(c.name, c.arguments) for c in p.tool_calls] == [
        ("Bash", {"command": "ls /app"})
    ]
    broken = "x<tool_call>\n{not json}\n</tool_call>"
    assert parse_reply(broken, "qwen25").tool_calls == [] and parse_reply(broken, "qwen25").content == broken
    assert parse_reply(CALL, None).tool_calls == []
    with pytest.raises(ValueError, match="known parsers"):
        parse_reply(CALL, "nope")


def test_claude_code_shape_streamed_tool_use_round_trip_is_token_exact(scripted, tok):
    """Anthropic Messages, streamed: the reply's call comes back as a tool_use block; the next request sends it
    back with a tool_result, which continues the turn's exact tokens; only generated tokens train."""
    out1, out2 = _ids(tok, "Looking." + CALL), _ids(tok, "There is one file.")
    engine, server = scripted(
        lambda ids, i: Out([out1, out2][i]), harness={"name": "claude-code", "tool_call_parser": "qwen25"}
    )
    client = anthropic.Anthropic(
        base_url=server.session_url("cc-0").removesuffix("/v1"), api_key=server.session_token("cc-0"), max_retries=0
    )
    system = [{"type": "text", "text": "You are a coding agent."}, {"type": "text", "text": "Be brief."}]
    history = [{"role": "user", "content": [{"type": "text", "text": "What is in /app?"}]}]
    with client.messages.stream(
        model="policy", max_tokens=64, system=system, messages=history, tools=TOOLS_ANTHROPIC
    ) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    assert first.content[0].type == "text" and first.content[0].text == "Looking."
    use = first.content[1]
    assert use.type == "tool_use" and use.name == "Bash" and use.input == {"command": "ls /app"}
    history += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "notes.txt"}]},
    ]
    second = client.messages.create(
        model="policy", max_tokens=64, system=system, messages=history, tools=TOOLS_ANTHROPIC
    )
    assert second.stop_reason == "end_turn" and second.content[0].text == "There is one file."

    tree = server.pop_session("cc-0")
    assert [t.extends for t in tree.turns] == [None, 0]
    # the second prompt is the first prompt + its exact output + the tool result's template text
    p1 = engine.calls[0].input_ids
    assert engine.calls[1].input_ids[: len(p1) + len(out1)] == p1 + out1
    assert "notes.txt" in tok.decode(engine.calls[1].input_ids[len(p1) + len(out1) :])
    [sample] = segment_samples(_trial("cc-0"), tree)
    assert _trained(sample) == out1 + out2  # the tool output (and the template around it) never trains


def test_opencode_shape_streamed_tool_calls_with_reserialised_arguments(scripted, tok):
    """OpenAI chat, streamed with usage: tool_calls deltas; the harness sends the call back with its arguments
    re-serialised (other spacing) and the turn is still recognised."""
    out1, out2 = _ids(tok, CALL), _ids(tok, "done")
    engine, server = scripted(
        lambda ids, i: Out([out1, out2][i]), harness={"name": "opencode", "tool_call_parser": "qwen25"}
    )
    client = openai.OpenAI(base_url=server.session_url("oc-0"), api_key=server.session_token("oc-0"), max_retries=0)
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "list /app"}]
    chunks = list(
        client.chat.completions.create(
            model="policy", messages=msgs, tools=TOOLS_OPENAI, stream=True, stream_options={"include_usage": True}
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["Bash"] and json.loads(calls[0].function.arguments) == {
        "command": "ls /app"
    }
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(out1)
    echoed = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": {"name": "Bash", "arguments": '{"command":"ls /app"}'}}
        ],
    }
    msgs += [echoed, {"role": "tool", "tool_call_id": calls[0].id, "content": "notes.txt"}]
    r = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS_OPENAI)
    assert r.choices[0].message.content == "done" and r.choices[0].finish_reason == "stop"
    tree = server.pop_session("oc-0")
    assert [t.extends for t in tree.turns] == [None, 0] and tree.stats()["retokenize_mismatches"] == 0
    [sample] = segment_samples(_trial("oc-0"), tree)
    assert _trained(sample) == out1 + out2


def test_every_session_route_takes_its_own_token_only(scripted, tok):
    engine, server = scripted(lambda ids, i: Out(_ids(tok, "ok")))
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    url = server.session_url("a-0")
    for headers in ({}, {"Authorization": f"Bearer {server.session_token('b-0')}"}, {"x-api-key": "guess"}):
        r = httpx.post(f"{url}/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{url}/messages", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{url}/models", headers=headers).status_code == 401
    assert engine.calls == []  # nothing refused reached the engine
    ok = httpx.post(f"{url}/messages", json=body, headers={"x-api-key": server.session_token("a-0")})
    assert ok.status_code == 200 and ok.json()["content"][0]["text"] == "ok"
    ok = httpx.post(
        f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {server.session_token('a-0')}"}
    )
    assert ok.status_code == 200


def test_a_request_without_tools_gets_the_reply_as_written(scripted, tok):
    """terminus-2 sends no tools: a reply that happens to hold a call's markup is its text, not a call."""
    engine, server = scripted(
        lambda ids, i: Out(_ids(tok, CALL)), harness={"name": "claude-code", "tool_call_parser": "qwen25"}
    )
    client = openai.OpenAI(base_url=server.session_url("t-0"), api_key=server.session_token("t-0"), max_retries=0)
    r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "go"}])
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_a_cut_off_turn_ends_the_episode_without_its_action(scripted, tok, api):
    """With truncation_ends_episode (a CLI harness in the sandbox, early_truncation_exit on), a reply cut at the token limit (here mid tool call) is answered as a final
    text reply: no call is parsed, so the cut action cannot run; the turn is recorded truncated and the trial
    becomes TRUNCATED."""
    cut = tok.encode(
        'Let me run it.<tool_call>\n{"name": "Bash", "arguments": {"command": "rm -rf', add_special_tokens=False
    )
    engine, server = scripted(
        lambda ids, i: Out(cut, finish="length"), harness={"name": "claude-code", "tool_call_parser": "qwen25"}
    )
    sid, token = f"{api}-cut", server.session_token(f"{api}-cut")
    msgs = [{"role": "user", "content": "clean up"}]
    if api == "anthropic":
        client = anthropic.Anthropic(base_url=server.session_url(sid).removesuffix("/v1"), api_key=token, max_retries=0)
        r = client.messages.create(model="policy", max_tokens=64, messages=msgs, tools=TOOLS_ANTHROPIC)
        assert r.stop_reason == "end_turn" and [b.type for b in r.content] == ["text"]
    else:
        client = openai.OpenAI(base_url=server.session_url(sid), api_key=token, max_retries=0)
        r = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS_OPENAI)
        assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    tree = server.pop_session(sid)
    assert [t.truncated for t in tree.turns] == [True]
    [sample] = segment_samples(_trial(sid), tree)
    assert sample.status == "TRUNCATED" and _trained(sample) == cut


def test_without_the_switch_a_cut_turn_reports_its_length_finish(scripted, tok):
    cut = tok.encode("partial", add_special_tokens=False)
    engine, server = scripted(lambda ids, i: Out(cut, finish="length"))
    client = anthropic.Anthropic(
        base_url=server.session_url("m-0").removesuffix("/v1"), api_key=server.session_token("m-0"), max_retries=0
    )
    r = client.messages.create(model="policy", max_tokens=64, messages=[{"role": "user", "content": "go"}])
    assert r.stop_reason == "max_tokens"
    bad = client.messages.with_raw_response.create  # an image block: refused, naming the field
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.0\.content"):
        bad(
            model="policy",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}],
        )


def test_count_tokens_is_the_prompt_the_policy_would_get(scripted, tok):
    engine, server = scripted(lambda ids, i: Out(_ids(tok, "ok")))
    client = anthropic.Anthropic(
        base_url=server.session_url("n-0").removesuffix("/v1"), api_key=server.session_token("n-0"), max_retries=0
    )
    msgs = [{"role": "user", "content": "hello there"}]
    counted = client.messages.count_tokens(model="policy", messages=msgs, system="be brief").input_tokens
    client.messages.create(model="policy", max_tokens=8, messages=msgs, system="be brief")
    assert counted == len(engine.calls[0].input_ids)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=client.base_url, api_key="guess", max_retries=0).messages.count_tokens(
            model="policy", messages=msgs
        )


def test_a_turn_offered_other_tools_is_not_extended_from_the_turn_before(scripted, tok):
    """When a harness changes its tool list mid-session, the next prompt is rendered afresh (the tools sit in the
    system turn): extending the earlier turn's tokens would hide the new tools from the policy."""
    engine, server = scripted(lambda ids, i: Out(_ids(tok, f"reply {i}")))
    client = openai.OpenAI(base_url=server.session_url("tl-0"), api_key=server.session_token("tl-0"), max_retries=0)
    more = TOOLS_OPENAI + [{"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS_OPENAI)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "go"}]
    client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS_OPENAI)
    msgs += [{"role": "assistant", "content": "reply 1"}, {"role": "user", "content": "again"}]
    client.chat.completions.create(model="policy", messages=msgs, tools=more)
    tree = server.pop_session("tl-0")
    assert [t.extends for t in tree.turns] == [None, 0, None]  # the same tools: extended; other tools: afresh


def test_a_side_request_with_its_own_small_limit_neither_trains_nor_truncates_the_trial(scripted, tok):
    """opencode asks for a title beside the episode, with a `max_tokens` of its own far below the run's: cut at
    that limit it is answered `length` as asked, but the trial is not over-long, and its reply never trains."""
    title = tok.encode("Fix the app", add_special_tokens=False)[:3]

    def script(ids, i):
        return Out(title, finish="length") if i == 1 else Out(_ids(tok, f"step {i}"))

    engine, server = scripted(script, sampling={"max_new_tokens": 64})
    client = openai.OpenAI(base_url=server.session_url("sd-0"), api_key=server.session_token("sd-0"), max_retries=0)
    msgs = [{"role": "user", "content": "fix it"}]
    first = client.chat.completions.create(model="policy", messages=msgs)
    side = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "title for: fix it"}], max_tokens=len(title)
    )
    assert side.choices[0].finish_reason == "length"  # the harness hears what it asked for
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "ok"}]
    client.chat.completions.create(model="policy", messages=msgs)
    tree = server.pop_session("sd-0")
    assert tree.side_requests() == {1} and tree.stats()["truncated_turns"] == 0
    samples = segment_samples(_trial("sd-0"), tree)
    assert [s.status for s in samples] == ["COMPLETED"]  # one segment: the episode; the title is not trained
    assert _trained(samples[0]) == _ids(tok, "step 0") + _ids(tok, "step 2")
